"""The MoE kernels' launch decisions: the shape-aware tile table, pruned autotuning, the disk cache
options, and the kernels run with the table's GPU tiles in the interpreter (fp32 against the reference)."""

from __future__ import annotations

import inspect

import pytest
import triton

from lora_lab.kernels.config import KernelConfig
from lora_lab.kernels.moe import launch as lc
from lora_lab.kernels.triton_helpers import running_in_interpreter

interpreter = pytest.mark.skipif(not running_in_interpreter(), reason="kernels run in TRITON_INTERPRET=1")

# (name, tokens, hidden, experts, top_k, intermediate): the two layers of notebook 06's table
MIXTRAL = dict(tokens=8192, hidden=4096, experts=8, top_k=2, inter=14336)
QWEN3_30B = dict(tokens=8192, hidden=2048, experts=128, top_k=8, inter=768)


def launches(layer):
    """(kind, block_m, N, K, rows per expert) of every big launch of one fwd + bwd of the full layer."""
    rows = layer["tokens"] * layer["top_k"]
    per_expert = rows / layer["experts"]
    block_m = 128 if per_expert >= 192 else 64
    h, i = layer["hidden"], layer["inter"]
    return [
        ("gate_up", block_m, i, h, per_expert),          # [g|u] = X W1ᵀ
        ("rows", block_m, h, i, per_expert),             # Out += w · h W2ᵀ
        ("down_backward", block_m, i, h, per_expert),    # D = dOut W2
        ("rows", block_m, h, 2 * i, per_expert),         # dX += dGU W1
        ("weight_grad", 128, h, rows, per_expert),       # dW1 (2I x H), dW2 (H x I)
    ]


def test_table_gives_coarse_experts_big_tiles_and_fine_experts_narrow_ones():
    mix = {kind: lc.heuristic_meta(kind, block_m=bm, n_dim=n, k_dim=k, rows_per_expert=r, interpret=False)
           for kind, bm, n, k, r in launches(MIXTRAL)}
    assert mix["rows"] == {"BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
    assert mix["gate_up"]["BLOCK_N"] == 128
    assert mix["down_backward"] == {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}  # no spill
    assert mix["weight_grad"]["num_stages"] == 4
    fine = [lc.heuristic_meta(kind, block_m=bm, n_dim=n, k_dim=k, rows_per_expert=r, interpret=False)
            for kind, bm, n, k, r in launches(QWEN3_30B)]
    gate_up, down, _, dx, _ = fine
    # I = 768 < 2048: the I-wide kernels keep narrow tiles; the H-wide ones (N = 2048, 512 rows per expert) are
    # in the coarse regime
    assert gate_up["BLOCK_N"] == 64 and gate_up["num_stages"] == 4  # K = H = 2048 >= 1024: one more stage
    assert down["BLOCK_N"] == 256 and dx["BLOCK_N"] == 256
    few_rows = lc.heuristic_meta("rows", block_m=64, n_dim=4096, k_dim=512, rows_per_expert=100, interpret=False)
    assert few_rows == {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}


def test_table_is_a_pure_function_and_refuses_unknown_kinds():
    args = dict(block_m=128, n_dim=4096, k_dim=14336, rows_per_expert=2048.0, interpret=False)
    first = lc.heuristic_meta("rows", **args)
    first["BLOCK_N"] = 1  # the caller's copy: the next call is unaffected
    assert lc.heuristic_meta("rows", **args)["BLOCK_N"] == 256
    with pytest.raises(ValueError, match="unknown MoE kernel kind 'gemm'"):
        lc.heuristic_meta("gemm", **args)
    with pytest.raises(ValueError, match="unknown MoE kernel kind"):
        lc.candidate_metas("gemm")


@pytest.mark.parametrize("kind", lc.KINDS)
def test_every_table_entry_is_among_the_tuned_configs_and_pruning_keeps_it_first(kind):
    candidates = [lc._meta_key(m) for m in lc.candidate_metas(kind)]
    for block_m in (64, 128):
        for n_dim in (128, 768, 2880, 4096, 14336):
            for k_dim in (512, 2048, 16384):
                for rows in (16.0, 300.0, 512.0, 4096.0):
                    shape = dict(block_m=block_m, n_dim=n_dim, k_dim=k_dim, rows_per_expert=rows)
                    pick = lc.heuristic_meta(kind, **shape, interpret=False)
                    assert lc._meta_key(pick) in candidates, (shape, pick)
                    kept = lc.shape_candidates(kind, **shape)
                    assert kept[0] == pick and 1 <= len(kept) <= lc.MAX_TUNED_CONFIGS
                    assert len({lc._meta_key(m) for m in kept}) == len(kept)
                    width = max(64, triton.next_power_of_2(n_dim))
                    assert all(m["BLOCK_N"] <= width for m in kept)
                    if not lc.is_coarse(rows, n_dim, kind):
                        assert all(m["BLOCK_N"] < 256 for m in kept), (shape, kept)


def test_prune_reads_the_shape_from_the_launch_arguments():
    configs = [triton.Config({k: v for k, v in m.items() if not k.startswith("num_")}, num_warps=m["num_warps"],
                             num_stages=m["num_stages"]) for m in lc.candidate_metas("rows")]
    # Mixtral-like down projection: 16384 rows over 8 experts, BLOCK_M 128 → max_tiles = 128 + 8
    nargs = dict(N=4096, K=14336, num_experts=8, num_tiles=16384 // 128 + 8)
    kept = lc.prune_configs("rows")(configs, nargs, BLOCK_M=128)
    assert [lc._config_meta(c) for c in kept] == lc.shape_candidates(
        "rows", block_m=128, n_dim=4096, k_dim=14336, rows_per_expert=2048.0)
    assert lc._config_meta(kept[0])["BLOCK_N"] == 256
    narrow = lc.prune_configs("rows")(configs, dict(N=96, K=64, num_experts=4, num_tiles=6), BLOCK_M=64)
    assert all(lc._config_meta(c)["BLOCK_N"] <= 128 for c in narrow)


def test_untuned_real_shapes_use_the_specialised_kernel(monkeypatch):
    monkeypatch.setattr(lc, "running_in_interpreter", lambda: False)  # behave as on a GPU
    fixed = KernelConfig(moe_autotune=False)
    mixtral_gate_up = 16384 * 14336 * 4096
    assert lc.fixed_kernel("spec", "unspec", fixed, volume=mixtral_gate_up) == "spec"
    assert lc.fixed_kernel("spec", "unspec", fixed, volume=4000 * 136 * 264) == "unspec"  # a test shape
    assert lc.fixed_kernel("spec", "unspec", KernelConfig(), volume=10) == "spec"  # tuned: always specialised


def test_autotune_options_pass_only_what_this_triton_accepts():
    accepted = inspect.signature(triton.autotune).parameters
    options = lc.autotune_options()
    assert set(options) <= set(accepted)
    assert ("cache_results" in options) == ("cache_results" in accepted)
    assert "cache_results" not in lc.autotune_options({"LORA_LAB_MOE_TUNING_CACHE": "0"})
    assert all(c.pre_hook is None for c in lc.autotune_configs("gate_up", persistent=False))
    assert all(c.pre_hook is lc.set_expert_block_shape for c in lc.autotune_configs("gate_up", persistent=True))


@interpreter
@pytest.mark.parametrize("regime", ["coarse", "fine"])
@pytest.mark.parametrize("rank", [0, 3])
def test_kernels_match_reference_with_the_gpu_table_tiles(regime, rank, monkeypatch):
    """The tiles the table picks on a GPU (128 x 256 x 64 and the like), run by the interpreter on an odd shape
    with an expert that receives no row: output and every gradient against the fp32 reference."""
    from test_moe_kernels import assert_close_all, make_problem, run_both

    from lora_lab.kernels.moe import expert_weight_grad, tiles

    rows = 4096.0 if regime == "coarse" else 64.0
    seen = []

    def gpu_table(kind, *, block_m, n_dim, k_dim, rows_per_expert, interpret=None, lora=False):
        meta = lc.heuristic_meta(kind, block_m=block_m, n_dim=max(n_dim, lc.COARSE_N) if regime == "coarse"
                                 else n_dim, k_dim=k_dim, rows_per_expert=rows, interpret=False, lora=lora)
        seen.append((kind, meta["BLOCK_N"], meta.get("BLOCK_M"), lora))
        return meta

    monkeypatch.setattr(tiles, "heuristic_meta", gpu_table)
    monkeypatch.setattr(expert_weight_grad, "heuristic_meta", gpu_table)
    problem = make_problem(70, 40, 36, 5, 2, rank=rank, routing="random")
    index = problem[1]
    index[index == 4] = 3  # expert 4 receives no row
    got, ref = run_both(*problem, config=KernelConfig(moe_autotune=False))
    assert_close_all(got, ref)
    widths = {n for kind, n, _, lora in seen if kind == "rows" and not lora}
    assert (256 in widths) if regime == "coarse" else (widths <= {128, 16, 32, 64})
    lora_launches = {(kind, n) for kind, n, _, lora in seen if lora}
    # with LoRA, the four big row launches carry the rank term and take the table's LoRA column in either regime
    assert lora_launches == ({("gate_up", 64), ("rows", 128), ("down_backward", 64)} if rank else set())


def test_lora_launches_take_the_measured_lora_column_in_every_regime():
    """The LoRA column (module docstring: the autotuner's picks in the H200 LoRA cells): 4 warps, 3 stages, 128-wide
    tiles for the rows kernel and 64-wide for the two I-wide kernels; first in the pruned candidates; unchanged for
    full fine-tuning and for the weight gradient."""
    for layer in (MIXTRAL, QWEN3_30B):
        for kind, bm, n, k, r in launches(layer):
            full = lc.heuristic_meta(kind, block_m=bm, n_dim=n, k_dim=k, rows_per_expert=r, interpret=False)
            with_lora = lc.heuristic_meta(kind, block_m=bm, n_dim=n, k_dim=k, rows_per_expert=r, interpret=False,
                                          lora=True)
            if kind == "weight_grad":
                assert with_lora == full
                continue
            assert with_lora == {"BLOCK_N": 128 if kind == "rows" else 64, "BLOCK_K": 64, "num_warps": 4,
                                 "num_stages": 3}
            assert lc._meta_key(with_lora) in [lc._meta_key(m) for m in lc.candidate_metas(kind)]
            kept = lc.shape_candidates(kind, block_m=bm, n_dim=n, k_dim=k, rows_per_expert=r, lora=True)
            assert kept[0] == with_lora and len(kept) == lc.MAX_TUNED_CONFIGS_LORA
    # the one neighbour timed with LoRA at the 30B-A3B-like down_backward is the pick the H200 diagnostic printed there
    bm, n, k, r = launches(QWEN3_30B)[2][1:]
    assert lc.shape_candidates("down_backward", block_m=bm, n_dim=n, k_dim=k, rows_per_expert=r, lora=True)[1] == {
        "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}
    configs = [triton.Config({k: v for k, v in m.items() if not k.startswith("num_")}, num_warps=m["num_warps"],
                             num_stages=m["num_stages"]) for m in lc.candidate_metas("rows")]
    nargs = dict(N=4096, K=14336, num_experts=8, num_tiles=16384 // 128 + 8)
    kept = lc.prune_configs("rows")(configs, nargs, BLOCK_M=128, HAS_LORA=True)
    assert lc._config_meta(kept[0]) == {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}
    assert lc._config_meta(lc.prune_configs("rows")(configs, nargs, BLOCK_M=128, HAS_LORA=False)[0])["BLOCK_N"] == 256
