"""benchmarks/peers.py against fake peer modules put into ``sys.modules``: each adapter calls the peer's function
with the arguments and shapes its signature takes and maps the outputs back; a missing or failing peer is a skip
record with the exact error text. None of these needs a peer installed."""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def peers(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import peers as module

    return module


@pytest.fixture
def fake(monkeypatch):
    """``fake("a.b.c", name=value, ...)`` puts a module ``a.b.c`` (and empty parents) into ``sys.modules``."""

    def install(path: str, **attributes):
        parts = path.split(".")
        for i in range(1, len(parts)):
            monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        module = types.ModuleType(path)
        for name, value in attributes.items():
            setattr(module, name, value)
        monkeypatch.setitem(sys.modules, path, module)
        return module

    return install


def test_axolotl_linear_gets_a_holder_with_o_proj_and_a_3d_input(peers, fake):
    calls = []

    def apply_lora_o(self, X):
        calls.append((self, X))
        return torch.ones(*X.shape[:-1], 24)

    fake("axolotl.kernels.lora", apply_lora_o=apply_lora_o)
    op = peers.load("axolotl", "lora_linear", check_device=False)
    assert isinstance(op, peers.PeerOp) and op.source == "axolotl.kernels.lora.apply_lora_o"
    proj, x = nn.Linear(16, 24), torch.randn(8, 16)
    y = op.fn(proj, x)
    (holder, X), = calls
    assert holder.o_proj is proj and holder.training is True
    assert X.shape == (1, 8, 16) and torch.equal(X[0], x)
    assert y.shape == (8, 24)


def test_unsloth_qkv_and_mlp_map_outputs_back_to_2d(peers, fake):
    seen = {}

    def apply_lora_qkv(self, X):
        seen["qkv"] = (self, X.shape)
        return X[..., :4] * 1, X[..., :2] * 2, X[..., :2] * 3

    def apply_lora_mlp_swiglu(self, X):
        seen["mlp"] = (self, X.shape)
        return X * 5

    fake("unsloth.kernels.fast_lora", apply_lora_qkv=apply_lora_qkv, apply_lora_mlp_swiglu=apply_lora_mlp_swiglu)
    x, attn = torch.randn(6, 8), object()
    q, k, v = peers.load("unsloth", "lora_qkv", check_device=False).fn(attn, x)
    assert seen["qkv"] == (attn, (1, 6, 8))
    assert [t.shape for t in (q, k, v)] == [(6, 4), (6, 2), (6, 2)] and torch.equal(v, x[:, :2] * 3)
    y = peers.load("unsloth", "lora_mlp", check_device=False).fn(attn, x)
    assert seen["mlp"] == (attn, (1, 6, 8)) and torch.equal(y, x * 5)


def _moe_inputs(T=5, H=8, I=6, E=4, k=2):
    x = torch.randn(T, H, dtype=torch.float64)
    index = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    weights = torch.rand(T, k)
    return x, index, weights, torch.randn(E, 2 * I, H), torch.randn(E, H, I)


def test_llamafactory_moe_argument_order(peers, fake):
    got = []

    class TritonFusedMoeFunction:
        @staticmethod
        def apply(*args):
            got.append(args)
            return args[3] + 1

    fake("llamafactory.v1.plugins.model_plugins.kernels.ops.mlp.cuda_fused_moe",
         TritonFusedMoeFunction=TritonFusedMoeFunction)
    x, index, weights, gate_up, down = _moe_inputs()
    y = peers.load("llamafactory", "moe_full", check_device=False).fn(x, index, weights, gate_up, down)
    (E, w, idx, hidden, fc1, fc2), = got
    assert E == 4 and w.dtype == x.dtype and torch.equal(w, weights.double())
    assert idx is index and hidden is x and fc1 is gate_up and fc2 is down
    assert torch.equal(y, x + 1)
    skip = peers.load("llamafactory", "moe_lora", check_device=False)
    assert isinstance(skip, peers.PeerSkip) and "no moe_lora op" in skip.error


def test_unsloth_moe_composes_its_grouped_gemms_as_its_qwen3_block(peers, fake):
    """A stand-in grouped GEMM with the semantics its docstring gives (X gathered by ``gather_indices // topk`` with
    permute_x, rows scattered back to token-major order with permute_y, W as [E, N, K]): the adapter's layer then
    equals the plain MoE (SiLU(gate)·up, routing weights, top-k sum)."""
    calls = []

    def get_routing_indices(selected, num_experts):
        return torch.bincount(selected.reshape(-1), minlength=num_experts), torch.argsort(selected.reshape(-1),
                                                                                         stable=True)

    def grouped_gemm(X, W, m_sizes, topk, gather_indices=None, permute_x=False, permute_y=False, autotune=False,
                     is_first_gemm=True, **kwargs):
        calls.append((permute_x, permute_y, autotune, is_first_gemm, tuple(W.shape)))
        rows = X[gather_indices // topk] if permute_x else X
        experts = torch.repeat_interleave(torch.arange(W.shape[0]), m_sizes)
        out = torch.einsum("mk,mnk->mn", rows, W[experts])
        if permute_y:
            out = torch.empty_like(out).index_copy_(0, gather_indices, out)
        return out

    fake("unsloth.kernels.moe.grouped_gemm.interface", grouped_gemm=grouped_gemm)
    fake("unsloth.kernels.moe.grouped_gemm.reference.moe_ops", get_routing_indices=get_routing_indices)
    x, index, weights, gate_up, down = _moe_inputs(T=5, H=8, I=6, E=4, k=2)
    gate_up, down = gate_up.double(), down.double()
    y = peers.load("unsloth", "moe_full", check_device=False).fn(x, index, weights, gate_up, down)
    want = torch.zeros_like(x)
    for t in range(5):
        for j in range(2):
            e = index[t, j]
            h = gate_up[e] @ x[t]
            want[t] += weights[t, j].double() * (down[e] @ (torch.nn.functional.silu(h[:6]) * h[6:]))
    torch.testing.assert_close(y, want)
    assert calls == [(True, False, True, True, (4, 12, 8)), (False, True, True, False, (4, 8, 6))]
    skip = peers.load("unsloth", "moe_lora", check_device=False)
    assert isinstance(skip, peers.PeerSkip) and skip.error == "unsloth has no moe_lora op"


def test_veomni_full_and_lora_argument_order(peers, fake):
    got = {}

    def group_gemm_fused_moe_forward(*args, **kwargs):
        got["full"] = (args, kwargs)
        return args[3] * 2

    def group_gemm_fused_independent_lora_moe_forward(*args):
        got["lora"] = args
        return args[3] * 3

    fake("veomni.ops.kernels.moe.group_gemm", group_gemm_fused_moe_forward=group_gemm_fused_moe_forward)
    fake("veomni.lora.ops.moe_group_gemm",
         group_gemm_fused_independent_lora_moe_forward=group_gemm_fused_independent_lora_moe_forward)
    x, index, weights, gate_up, down = _moe_inputs()
    y = peers.load("veomni", "moe_full", check_device=False).fn(x, index, weights, gate_up, down)
    args, kwargs = got["full"]
    assert args[0] == 4 and args[2] is index and args[3] is x and args[4:6] == (None, None) and args[6] is down
    assert kwargs == {"fc1_1_2_weight": gate_up} and torch.equal(y, x * 2)
    lora = peers.ExpertLoRAFactors.random(4, 8, 6, 3, "cpu", torch.float64)
    assert [tuple(t.shape) for t in lora.parameters()] == [(4, 3, 8), (4, 6, 3), (4, 3, 8), (4, 6, 3), (4, 3, 6),
                                                          (4, 8, 3)]
    y = peers.load("veomni", "moe_lora", check_device=False).fn(x, index, weights, gate_up, down, lora)
    args = got["lora"]
    assert args[0] == 4 and args[3] is x and args[4] is gate_up and args[5] is down
    assert all(a is b for a, b in zip(args[6:12], lora.parameters())) and args[12:] == (2.0, 2.0, 2.0)
    assert torch.equal(y, x * 3)


def test_sonicmoe_gets_flat_sorted_assignments_and_expert_last_weights(peers, fake):
    got = {}

    def moe_general_routing_inputs(*args, **kwargs):
        got["args"], got["kwargs"] = args, kwargs
        return args[0] - 1, torch.zeros(4)

    fake("sonicmoe.enums", ActivationType=types.SimpleNamespace(SWIGLU="swiglu-marker"))
    fake("sonicmoe", moe_general_routing_inputs=moe_general_routing_inputs)
    x, index, weights, gate_up, down = _moe_inputs(T=3, k=2)
    y = peers.load("sonicmoe", "moe_full", check_device=False).fn(x, index, weights, gate_up, down)
    a = got["args"]
    assert a[0] is x and torch.equal(a[1], weights.reshape(-1))
    assert a[2].tolist() == [0, 0, 1, 1, 2, 2] and a[2].dtype == torch.int32
    assert torch.equal(a[3], index.reshape(-1).int()) and a[3].dtype == torch.int32
    assert a[4].shape == (12, 8, 4) and torch.equal(a[4][:, :, 1], gate_up[1])  # w1 [2I, H, E]
    assert a[6].shape == (8, 6, 4) and torch.equal(a[6][:, :, 2], down[2])  # w2 [H, I, E]
    assert a[5] is None and a[7] is None and a[8] == 4 and a[10] == "swiglu-marker" and a[11] is False
    assert got["kwargs"] == {"concat_layout": True} and torch.equal(y, x - 1)


def test_quack_loss_and_liger_loss_argument_order(peers, fake):
    got = {}

    def chunked_linear_cross_entropy(*args, **kwargs):
        got["quack"] = (args, kwargs)
        return torch.tensor(1.5)

    class LigerFusedLinearCrossEntropyLoss:
        def __init__(self, **kwargs):
            got["liger_init"] = kwargs

        def __call__(self, *args):
            got["liger"] = args
            return torch.tensor(2.5)

    fake("quack.linear_cross_entropy", chunked_linear_cross_entropy=chunked_linear_cross_entropy)
    fake("liger_kernel.transformers", LigerFusedLinearCrossEntropyLoss=LigerFusedLinearCrossEntropyLoss)
    h, w, y = torch.randn(4, 8), torch.randn(10, 8), torch.tensor([1, 2, -100, 3])
    assert peers.load("quack", "loss", check_device=False).fn(h, w, y) == 1.5
    assert got["quack"] == ((h, w, y), {"chunk_size": 4096, "ignore_index": -100, "reduction": "mean"})
    assert peers.load("liger", "loss", check_device=False).fn(h, w, y) == 2.5
    assert got["liger"] == (w, h, y) and got["liger_init"] == {"ignore_index": -100}


def test_axolotl_model_patch_binds_the_rewritten_attention_to_this_model_only(peers, fake):
    """axolotl's class-level rewrite of the attention forward is bound to the patched model's attention modules;
    the class keeps its forward (and loses axolotl's "already patched" mark), so another model stays plain."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaAttention

    got = {}

    class DictDefault(dict):
        pass

    def rewritten(self, *args, **kwargs):
        return "rewritten"

    def get_attention_cls_from_config(cfg):
        got["config_json"] = (Path(cfg["base_model"]) / "config.json").is_file()
        return LlamaAttention

    def patch_self_attn_lora(cfg):
        LlamaAttention._original_forward = "source"
        LlamaAttention.forward = rewritten

    def apply_lora_kernel_patches(model, cfg):
        got["cfg"] = dict(cfg)
        return model

    fake("axolotl.monkeypatch.lora_kernels", apply_lora_kernel_patches=apply_lora_kernel_patches,
         patch_self_attn_lora=patch_self_attn_lora, get_attention_cls_from_config=get_attention_cls_from_config)
    fake("axolotl.utils.dict", DictDefault=DictDefault)
    original = LlamaAttention.forward
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                         num_hidden_layers=2, vocab_size=32)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert peers.load("axolotl", "model", check_device=False).fn(model) is model
    assert got["config_json"] and got["cfg"]["model_config_type"] == "llama"
    assert {k: got["cfg"][k] for k in ("lora_qkv_kernel", "lora_o_kernel", "lora_mlp_kernel")} == {
        "lora_qkv_kernel": True, "lora_o_kernel": True, "lora_mlp_kernel": True}
    assert LlamaAttention.forward is original and not hasattr(LlamaAttention, "_original_forward")
    attention = [m for m in model.modules() if isinstance(m, LlamaAttention)]
    assert len(attention) == 2 and all(m.forward() == "rewritten" for m in attention)
    other = LlamaForCausalLM(config)
    assert all("forward" not in vars(m) for m in other.modules() if isinstance(m, LlamaAttention))


def test_a_missing_peer_is_a_skip_with_the_import_error_text(peers, monkeypatch):
    monkeypatch.setitem(sys.modules, "axolotl", None)  # import of axolotl fails whether or not it is installed
    skip = peers.load("axolotl", "lora_qkv", check_device=False)
    assert isinstance(skip, peers.PeerSkip)
    assert skip.error.startswith("ModuleNotFoundError: ") and "axolotl" in skip.error
    assert any(step.startswith("import for lora_qkv: ModuleNotFoundError") for step in skip.tried)
    assert any("pip install --no-deps 'axolotl==0.21.0'" in step for step in skip.tried)
    if sys.version_info < (3, 12):
        assert "axolotl==0.21.0 requires Python >= 3.12" in skip.tried
    row = skip.row()
    assert row["status"] == "skipped" and row["impl"] == "axolotl" and row["error"] == skip.error


def test_a_peer_whose_import_raises_is_a_skip_with_that_text(peers, monkeypatch):
    class Refusing(types.ModuleType):
        def __getattr__(self, name):
            raise RuntimeError("Unsloth cannot find any torch accelerator")

    for name in ("unsloth", "unsloth.kernels"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "unsloth.kernels.fast_lora", Refusing("unsloth.kernels.fast_lora"))
    skip = peers.load("unsloth", "lora_mlp", check_device=False)
    assert isinstance(skip, peers.PeerSkip)
    assert skip.error == "RuntimeError: Unsloth cannot find any torch accelerator"


def test_an_imported_peer_still_skips_without_cuda_or_on_an_older_gpu(peers, fake, monkeypatch):
    fake("quack.linear_cross_entropy", chunked_linear_cross_entropy=lambda *a, **k: None)
    skip = peers.load("quack", "loss", torch.device("cpu"))
    assert isinstance(skip, peers.PeerSkip) and "runs CUDA kernels only" in skip.error
    assert "imported quack.linear_cross_entropy.chunked_linear_cross_entropy(chunk_size=4096)" in skip.tried
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    skip = peers.load("quack", "loss", torch.device("cuda"))
    assert skip.error == "quack targets compute capability >= 9.0; this GPU is 8.0"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert isinstance(peers.load("quack", "loss", torch.device("cuda")), peers.PeerOp)


def test_peft_ops_are_the_holders_own_forward(peers):
    from peft import LoraConfig, get_peft_model

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 12), nn.Linear(8, 12), nn.Linear(12, 8)
            self.act_fn = nn.SiLU()

    model = get_peft_model(MLP(), LoraConfig(r=2, target_modules=["gate_proj", "up_proj", "down_proj"]))
    mlp, x = model.base_model.model, torch.randn(5, 8)
    op = peers.load("peft", "lora_mlp", torch.device("cpu"))
    assert isinstance(op, peers.PeerOp)
    expected = mlp.down_proj(nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert torch.equal(op.fn(mlp, x), expected)


def test_unknown_names_are_refused_and_missing_ops_are_skips(peers):
    with pytest.raises(ValueError, match="unknown peer 'axolotll'"):
        peers.load("axolotll", "lora_linear")
    with pytest.raises(ValueError, match="unknown op 'lora_gemm'"):
        peers.load("axolotl", "lora_gemm")
    skip = peers.load("quack", "lora_linear")
    assert isinstance(skip, peers.PeerSkip) and skip.error == "quack has no lora_linear op"
    assert set(peers.load_all("moe_full", check_device=False)) == {"liger", "llamafactory", "veomni", "sonicmoe",
                                                                   "unsloth"}


def test_the_peer_extras_pin_what_the_loader_expects_and_ci_installs_none(peers):
    """pyproject's peers-* extras pin exactly the versions peers.PEERS names (the skip records quote them); no
    install line of the Makefile or environment.yml names a peers extra."""
    import re

    import tomllib
    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pinned = {}
    for name, reqs in extras.items():
        if name.startswith("peers-"):
            for req in map(Requirement, reqs):
                (spec,) = req.specifier
                assert spec.operator == "==", f"{req} in extra {name} is not pinned"
                pinned[req.name] = (spec.version, name)
    for peer in peers.PEERS.values():
        if peer.version:
            assert pinned.get(peer.distribution) == (peer.version, peer.extra), peer
    for path in ("Makefile", "environment.yml"):
        installs = [line for line in (ROOT / path).read_text().splitlines() if re.search(r"\.\[[^\]]*\]", line)]
        assert installs and not any("peers" in line for line in installs), (path, installs)


def test_a_peer_that_needs_hopper_is_skipped_on_a_forced_older_class(peers, monkeypatch):
    from lora_lab import gpu_arch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_arch, "_device_capability", lambda device: (9, 0))
    quack, cuda = peers.PEERS["quack"], torch.device("cuda", 0)
    monkeypatch.setenv(gpu_arch.ARCH_ENV, "")
    assert peers.device_problem(quack, cuda) is None
    monkeypatch.setenv(gpu_arch.ARCH_ENV, "sm80")
    assert peers.device_problem(quack, cuda) == ("quack targets compute capability >= 9.0; this GPU is 8.0 "
                                                 "($LORA_LAB_ARCH forces it)")
