"""Guards around Triton's CPU interpreter.

* bf16 in the interpreter: its bf16 ``tl.dot`` returns wrong numbers, not an error, so every Triton entry point
  refuses bf16 there (:func:`~lora_lab.kernels.triton_helpers.check_interpreter_dtype`) and still runs fp32.
* ``TRITON_INTERPRET=1`` set after ``lora_lab.kernels`` was imported: the kernels were built for a GPU driver; the
  ops and ``patch_model`` name the fix instead of failing inside Triton with "0 active drivers" (subprocess tests).
* ``fused_dora_linear`` (named in the README) is exported from ``lora_lab.kernels``.
* The interpreter's integer overflow checks, which it computes and then drops, are not computed once the kernels are
  imported; an overflowing kernel gives the same result either way.
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import lora_lab
from lora_lab.experiments.fused_moe import make_moe_problem
from lora_lab.kernels import KernelConfig, UnsupportedLoRAError, fused_lora_linear, patch_model
from lora_lab.kernels.lora.dora import dora_row_norm, dora_row_norm_reference
from lora_lab.kernels.lora.gemm import lora_gemm
from lora_lab.kernels.lora.rank_ops import q_and_db, rank_projection, rank_reduction
from lora_lab.kernels.lora.shared_input import fused_shared_input_lora
from lora_lab.kernels.moe.down_backward import down_backward_silu
from lora_lab.kernels.moe.expert_weight_grad import expert_weight_grad
from lora_lab.kernels.moe.experts import fused_moe_experts, moe_experts_reference
from lora_lab.kernels.moe.gate_up_silu import gate_up_silu
from lora_lab.kernels.moe.grouped_gemm import grouped_rows_gemm
from lora_lab.kernels.moe.routing import route_experts
from lora_lab.kernels.triton_helpers import InterpreterDtypeError, kernels_interpreted, skip_dropped_overflow_checks

interpreter = pytest.mark.skipif(not kernels_interpreted(), reason="runs the kernels in Triton's CPU interpreter")
REPO = Path(__file__).resolve().parents[2]
TRITON = KernelConfig(dispatch="triton", autotune=False)


def _rnd(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# Each case: a function of a dtype that calls one entry point on small inputs of that dtype and returns
# (got, want) in fp32 (want: plain torch), so the fp32 run is checked, not only run.
def _lora_linear(dt):
    x, w, a, b = _rnd(5, 24, seed=1), _rnd(20, 24, seed=2), _rnd(4, 24, seed=3), _rnd(20, 4, seed=4)
    got = fused_lora_linear(x.to(dt), w.to(dt), None, a.to(dt), b.to(dt), 0.5, config=TRITON)
    return got.float(), x @ w.t() + 0.5 * (x @ a.t()) @ b.t()


def _shared_input(dt):
    x, w, a0, b0 = _rnd(6, 16, seed=1), _rnd(24, 16, seed=2), _rnd(2, 16, seed=3), _rnd(8, 2, seed=4)
    y0, y1 = fused_shared_input_lora(x.to(dt), w.to(dt), None, [8, 16], [a0.to(dt), None], [b0.to(dt), None],
                                     [2.0, 1.0], config=TRITON)
    want = torch.cat([x @ w[:8].t() + 2.0 * (x @ a0.t()) @ b0.t(), x @ w[8:].t()], 1)
    return torch.cat([y0, y1], 1).float(), want


def _dora_row_norm(dt):
    w, a, b = _rnd(19, 33, seed=1), _rnd(3, 33, seed=2), _rnd(19, 3, seed=3)
    return dora_row_norm(w.to(dt), a.to(dt), b.to(dt), 0.7), dora_row_norm_reference(w, a, b, 0.7)


def _fused_dora(dt):
    from lora_lab.kernels import fused_dora_linear

    x, w, a, b = _rnd(5, 24, seed=1), _rnd(20, 24, seed=2), _rnd(4, 24, seed=3), _rnd(20, 4, seed=4)
    m = _rnd(20, seed=5).abs() + 0.5
    got = fused_dora_linear(x.to(dt), w.to(dt), None, a.to(dt), b.to(dt), 0.5, m.to(dt), config=TRITON)
    full = w + 0.5 * b @ a
    return got.float(), (m / full.norm(dim=1)) * (x @ full.t())


def _lora_gemm(dt):
    x, w = _rnd(9, 40, seed=1), _rnd(17, 40, seed=2)
    out = torch.empty(9, 17, dtype=dt)
    lora_gemm(out, [(x.to(dt), w.to(dt).t())], config=TRITON)
    return out.float(), x @ w.t()


def _rank_projection(dt):
    x, a = _rnd(9, 40, seed=1), _rnd(40, 3, seed=2)
    return rank_projection(x.to(dt), a.to(dt), 2.0, tune=False).float(), 2.0 * x @ a


def _rank_reduction(dt):
    q, x = _rnd(9, 3, seed=1), _rnd(9, 40, seed=2)
    return rank_reduction(q.to(dt), x.to(dt), tune=False).float(), q.t() @ x


def _q_and_db(dt):
    dy, b, p = _rnd(9, 20, seed=1), _rnd(20, 3, seed=2), _rnd(9, 3, seed=3)
    q, dbt = q_and_db(dy.to(dt), b.to(dt), p.to(dt), 0.5, tune=False)
    want = torch.cat([(0.5 * dy @ b).flatten(), (p.t() @ dy).flatten()])
    return torch.cat([q.float().flatten(), dbt.flatten()]), want


def _moe_problem(dt, rank=0):
    x, index, weights, w1, w2, lora = make_moe_problem(7, 16, 8, 4, 2, rank=rank, seed=3)
    return x.to(dt), index, weights.to(dt), w1.to(dt), w2.to(dt), lora, route_experts(index, 4, 16)


def _moe_experts(dt):
    x, index, weights, w1, w2, _, _ = _moe_problem(dt)
    got = fused_moe_experts(x, index, weights, w1, w2, config=TRITON)
    return got.float(), moe_experts_reference(x.float(), index, weights.float(), w1.float(), w2.float(), None)


def _grouped_rows_gemm(dt):
    x, index, _, w1, _, _, routing = _moe_problem(dt)
    got = grouped_rows_gemm(x, w1.transpose(1, 2), routing, gather_rows=True, config=TRITON)
    rows = routing.sorted_token.long()
    experts = index.reshape(-1)[routing.sorted_slot.long()]
    want = torch.einsum("sk,snk->sn", x.float()[rows], w1.float()[experts])
    return got.float(), want


def _gate_up_silu(dt):
    x, index, _, w1, _, _, routing = _moe_problem(dt)
    gu, _ = gate_up_silu(x, w1, routing, config=TRITON)
    rows = routing.sorted_token.long()
    experts = index.reshape(-1)[routing.sorted_slot.long()]
    return gu.float(), torch.einsum("sk,snk->sn", x.float()[rows], w1.float()[experts])


def _down_backward_silu(dt):
    x, index, weights, w1, w2, _, routing = _moe_problem(dt)
    gu = torch.randn(routing.num_assignments, w1.shape[1], generator=torch.Generator().manual_seed(1)).to(dt)
    dgu, _ = down_backward_silu(x, w2, gu, weights.reshape(-1)[routing.sorted_slot.long()].contiguous(), routing,
                                compute_router_grad=False, config=TRITON)
    return dgu.float().isfinite().all().float().reshape(1), torch.ones(1)


def _expert_weight_grad(dt):
    x, index, _, _, _, _, routing = _moe_problem(dt)
    g = torch.randn(routing.num_assignments, 5, generator=torch.Generator().manual_seed(1)).to(dt)
    got = expert_weight_grad(g, x, routing, gather_a=False, gather_b=True, config=TRITON)
    rows = routing.sorted_token.long()
    experts = index.reshape(-1)[routing.sorted_slot.long()]
    want = torch.zeros(4, 5, x.shape[1])
    want.index_add_(0, experts, g.float()[:, :, None] * x.float()[rows][:, None, :])
    return got.float(), want


ENTRY_POINTS = {
    "fused_lora_linear": _lora_linear,
    "fused_shared_input_lora": _shared_input,
    "dora_row_norm": _dora_row_norm,
    "fused_dora_linear": _fused_dora,
    "lora_gemm": _lora_gemm,
    "rank_projection": _rank_projection,
    "rank_reduction": _rank_reduction,
    "q_and_db": _q_and_db,
    "fused_moe_experts": _moe_experts,
    "grouped_rows_gemm": _grouped_rows_gemm,
    "gate_up_silu": _gate_up_silu,
    "down_backward_silu": _down_backward_silu,
    "expert_weight_grad": _expert_weight_grad,
}


@interpreter
@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_each_entry_point_refuses_bf16_in_the_interpreter_and_runs_fp32(name):
    case = ENTRY_POINTS[name]
    got, want = case(torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(InterpreterDtypeError, match=rf"{name}: bf16 .*interpreter.*fp16 or fp32"):
        case(torch.bfloat16)
    assert issubclass(InterpreterDtypeError, TypeError)


@interpreter
def test_fp16_still_runs_in_the_interpreter():
    got, want = _lora_linear(torch.float16)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def _peft_tiny(dtype, targets=("q_proj", "k_proj", "v_proj", "o_proj")):
    from peft import LoraConfig, get_peft_model

    base = lora_lab.load_model("random:tiny-qwen2", dtype=dtype, device="cpu")
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets)),
                           autocast_adapter_dtype=False)
    lora_lab.fill_lora_B(model, 0.02, generator=torch.Generator().manual_seed(0))
    return model


@interpreter
def test_patch_model_refuses_bf16_models_in_the_interpreter():
    model = _peft_tiny(torch.bfloat16)
    with pytest.raises(UnsupportedLoRAError, match="bf16 is not supported in Triton's CPU interpreter"):
        patch_model(model)
    assert "forward" not in model.base_model.model.model.layers[0].self_attn.q_proj.__dict__  # nothing patched
    dora = lora_lab.add_lora(lora_lab.load_model("random:tiny-qwen2", dtype=torch.bfloat16), targets=["q_proj"],
                             use_dora=True)
    with pytest.raises(UnsupportedLoRAError, match="bf16"):
        patch_model(dora)
    # strict=False: those layers keep their own (correct) forward
    summary = patch_model(_peft_tiny(torch.bfloat16), strict=False)
    assert summary["lora_layers"] == 0 and len(summary["skipped"]) == 8


@interpreter
def test_a_patched_fp32_model_cast_to_bf16_refuses_in_the_interpreter(monkeypatch):
    monkeypatch.setenv("LORA_LAB_DISPATCH", "triton")
    model = _peft_tiny(torch.float32)
    patch_model(model)
    ids = torch.randint(0, 512, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids)  # fp32 runs
        model.to(torch.bfloat16)
        with pytest.raises(InterpreterDtypeError, match="bf16"):
            model(input_ids=ids)


@interpreter
def test_moe_patch_refuses_bf16_experts_in_the_interpreter():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from lora_lab.kernels.moe.patch import patch_moe_experts

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, intermediate_size=64, moe_intermediate_size=24,
                            num_experts=4, num_experts_per_tok=2, experts_implementation="eager")
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    with pytest.raises(NotImplementedError, match="bf16 is not supported in Triton's CPU interpreter"):
        patch_moe_experts(model)


@interpreter
def test_loss_recomputing_kernels_refuse_bf16_in_the_interpreter_and_the_fwdgrad_path_runs():
    """The loss's recomputing kernels are tl.dot tiles (wrong in bf16 here); its gradients-in-forward path has its
    GEMMs in torch and a dot-free Triton pass, so bf16 runs there."""
    from lora_lab.kernels.loss import LossKernelConfig, linear_cross_entropy

    h = _rnd(40, 32, seed=1).bfloat16().requires_grad_()
    w = (0.1 * _rnd(100, 32, seed=2)).bfloat16()
    y = torch.randint(0, 100, (40,), generator=torch.Generator().manual_seed(3))
    with pytest.raises(InterpreterDtypeError, match="recomputing kernels.*bf16"):
        linear_cross_entropy(h, w, y, config=LossKernelConfig(impl="recompute"))
    with pytest.raises(InterpreterDtypeError):
        linear_cross_entropy(h, w, y, reduction="none")  # reduction 'none' always recomputes
    loss = linear_cross_entropy(h, w, y, config=LossKernelConfig(impl="fwdgrad"))
    ref = torch.nn.functional.cross_entropy((h.float() @ w.float().T), y)
    assert abs(float(loss) - float(ref)) <= 1e-2 * abs(float(ref))
    linear_cross_entropy(h.float(), w.float(), y, config=LossKernelConfig(impl="recompute"))  # fp32 still runs


def test_fused_dora_linear_is_exported():
    import lora_lab.kernels as k
    from lora_lab.kernels.lora.dora import fused_dora_linear

    assert k.fused_dora_linear is fused_dora_linear and "fused_dora_linear" in k.__all__
    assert k.dora_row_norm is dora_row_norm and "dora_row_norm" in k.__all__


@interpreter
def test_exported_fused_dora_linear_forward_and_gradients_match_torch():
    from lora_lab.kernels import fused_dora_linear

    x, w, a, b = _rnd(2, 7, 48, seed=1), _rnd(33, 48, seed=2), _rnd(5, 48, seed=3), _rnd(33, 5, seed=4)
    m, bias = _rnd(33, seed=5).abs() + 0.5, _rnd(33, seed=6)
    leaves = [t.clone().requires_grad_() for t in (x, a, b, m)]
    mine = fused_dora_linear(leaves[0], w, bias, leaves[1], leaves[2], 0.5, leaves[3], config=TRITON)
    ref_leaves = [t.clone().requires_grad_() for t in (x, a, b, m)]
    xr, ar, br, mr = ref_leaves
    norm = (w + 0.5 * br @ ar).norm(dim=1).detach()  # DoRA's norm is a constant (no gradient)
    want = (mr / norm) * (xr @ w.t() + 0.5 * (xr @ ar.t()) @ br.t()) + bias
    torch.testing.assert_close(mine, want, rtol=1e-5, atol=1e-5)
    g = _rnd(*want.shape, seed=7)
    got_grads = torch.autograd.grad(mine, leaves, g)
    want_grads = torch.autograd.grad(want, ref_leaves, g)
    for name, gg, gw in zip(["dx", "dA", "dB", "dm"], got_grads, want_grads):
        torch.testing.assert_close(gg, gw, rtol=1e-4, atol=1e-5, msg=name)


# ----------------------------------------------------------------------------------------------
# TRITON_INTERPRET=1 set after the import: a subprocess (the interpreter state is fixed per process).
# ----------------------------------------------------------------------------------------------
_LATE_INTERPRETER = textwrap.dedent("""
    import os
    import torch
    import lora_lab
    import lora_lab.kernels as k
    from lora_lab.kernels.triton_helpers import kernels_interpreted
    assert not kernels_interpreted()
    os.environ["TRITON_INTERPRET"] = "1"          # too late: the kernels were built for a GPU driver
    x, w, a, b = torch.randn(4, 16), torch.randn(8, 16), torch.randn(2, 16), torch.randn(8, 2)
    try:
        k.fused_lora_linear(x, w, None, a, b, 1.0, config=k.KernelConfig(dispatch="triton"))
        print("OP: no error")
    except RuntimeError as err:
        print("OP:", err)
    model = lora_lab.add_lora(lora_lab.load_model("random:tiny-qwen2"), targets=["q_proj"])
    try:
        k.patch_model(model)
        print("PATCH: no error")
    except k.UnsupportedLoRAError as err:
        print("PATCH:", err)
""")


def _run_clean(code: str) -> subprocess.CompletedProcess:
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case: no GPU driver for the compiled kernels")
def test_interpreter_switched_on_after_import_is_named_with_its_fix():
    done = _run_clean(_LATE_INTERPRETER)
    assert done.returncode == 0, done.stderr[-3000:]
    op, patch = done.stdout.split("PATCH:")
    for said in (op, patch):
        assert "imported with the interpreter off" in said, done.stdout
        assert "before importing lora_lab.kernels" in said, done.stdout
    assert "0 active drivers" not in done.stdout + done.stderr


def test_autotune_picks_are_cached_on_disk_unless_turned_off(monkeypatch):
    import inspect

    import triton

    from lora_lab.kernels.triton_helpers import autotune_cache_kwargs

    supported = "cache_results" in inspect.signature(triton.autotune).parameters
    monkeypatch.delenv("LORA_LAB_AUTOTUNE_CACHE", raising=False)
    assert autotune_cache_kwargs() == ({"cache_results": True} if supported else {})
    monkeypatch.setenv("LORA_LAB_AUTOTUNE_CACHE", "0")
    assert autotune_cache_kwargs() == {}
    # the LoRA kernels' autotune wrapper passes it on (Triton itself ignores it in the interpreter)
    from lora_lab.kernels.lora import tuning

    seen = {}

    def fake_autotune(configs, key, prune_configs_by=None, reset_to_zero=None, do_bench=None, cache_results=False):
        seen.update(cache_results=cache_results)

    monkeypatch.setattr(tuning.triton, "autotune", fake_autotune)
    monkeypatch.delenv("LORA_LAB_AUTOTUNE_CACHE")
    tuning.autotune(tuning.gemm_configs(), key=["N"])
    assert seen == {"cache_results": True}
    monkeypatch.setenv("LORA_LAB_AUTOTUNE_CACHE", "0")
    tuning.autotune(tuning.gemm_configs(), key=["N"])
    assert seen == {"cache_results": False}


@triton.jit
def _int32_product_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets) * tl.load(y_ptr + offsets))


@interpreter
def test_the_interpreter_computes_no_overflow_check_and_would_drop_it_anyway():
    """Importing lora_lab.kernels switched the check off; with it on (Triton's default) an int32 product that
    overflows gives the same wrapped result and no error, since the interpreter drops the check: skipping it changes
    nothing (if a Triton release starts reporting it, this test fails and the skip must go)."""
    import dataclasses

    from triton.runtime.interpreter import interpreter_builder

    assert interpreter_builder.options.sanitize_overflow is False and not interpreter_builder.options.debug
    assert skip_dropped_overflow_checks() is True
    skipped = interpreter_builder.options
    results = {}
    try:
        for check in (True, False):
            interpreter_builder.options = dataclasses.replace(skipped, sanitize_overflow=check)
            x, y = torch.full((4,), 2**30, dtype=torch.int32), torch.full((4,), 4, dtype=torch.int32)
            _int32_product_kernel[(1,)](x, y, BLOCK=4)
            results[check] = x.tolist()
    finally:
        interpreter_builder.options = skipped
    assert results == {True: [0, 0, 0, 0], False: [0, 0, 0, 0]}
