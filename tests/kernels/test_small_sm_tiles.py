"""The MoE and loss kernels' tile tables per GPU class: tiles whose shared memory overflows the class's budget are
pruned, 99 KiB classes get small tiles of their own, and Hopper's lists stay as they were."""
import pytest
import torch

from lora_lab import gpu_arch
from lora_lab.kernels.loss import linear_ce
from lora_lab.kernels.moe import launch

CUDA = torch.device("cuda", 0)  # a device object only: nothing runs on it
SMALL_SM_BUDGET = 88 * 1024
# (BLOCK_M, N, K, rows per expert): fine and coarse experts, narrow and wide layers
SHAPES = [(64, 768, 2048, 100), (64, 1408, 2048, 300), (128, 4096, 4096, 1000), (128, 14336, 4096, 2000),
          (128, 2048, 7168, 600)]


class Operand:
    """What the pruner reads of a launch's GEMM operand: its device and element size."""

    def __init__(self, size=2):
        self.device, self.size = CUDA, size

    def element_size(self):
        return self.size


@pytest.fixture
def gpu_class(monkeypatch):
    """Set the GPU class cuda:0 reports (no override); the MoE table as on a GPU, not the interpreter's."""
    monkeypatch.setattr(launch, "running_in_interpreter", lambda: False)
    monkeypatch.setenv(gpu_arch.ARCH_ENV, "")

    def set_class(cap):
        monkeypatch.setattr(gpu_arch, "_device_capability", lambda device: cap)
    return set_class


def _launch(kind, block_m, n, k, rows, size=2):
    nargs = {"a_ptr" if kind in ("rows", "weight_grad") else "x_ptr": Operand(size), "N": n, "I": n, "K": k,
             "num_experts": 8, "num_tiles": int(rows * 8 / block_m) + 8}
    return nargs, {"BLOCK_M": block_m}


def _metas(configs):
    return [dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages) for c in configs]


@pytest.mark.parametrize("kind", launch.KINDS)
def test_hopper_keeps_the_moe_table_as_it_was(gpu_class, kind):
    gpu_class((9, 0))
    small = [launch._meta_key(m) for m in launch.SMALL_SM_METAS[kind]]
    for block_m, n, k, rows in SHAPES:
        nargs, kwargs = _launch(kind, block_m, n, k, rows)
        kept = _metas(launch.prune_configs(kind)(launch.autotune_configs(kind), nargs, **kwargs))
        shape = dict(block_m=128, n_dim=n, k_dim=0, rows_per_expert=launch.COARSE_ROWS_PER_EXPERT) \
            if kind == "weight_grad" else dict(block_m=block_m, n_dim=n, k_dim=k, rows_per_expert=rows)
        assert kept == launch.shape_candidates(kind, **shape)  # the table's pick and its neighbours, none pruned
        assert not any(launch._meta_key(m) in small for m in kept)


@pytest.mark.parametrize("cap", [(8, 6), (8, 9), (12, 0)])
@pytest.mark.parametrize("kind", launch.KINDS)
def test_a_99_kib_class_keeps_only_tiles_that_fit_and_gets_small_ones(gpu_class, cap, kind):
    gpu_class(cap)
    assert gpu_arch.tile_shared_memory_budget(CUDA) == SMALL_SM_BUDGET
    small = [launch._meta_key(m) for m in launch.SMALL_SM_METAS[kind]]
    for block_m, n, k, rows in SHAPES:
        nargs, kwargs = _launch(kind, block_m, n, k, rows)
        kept = _metas(launch.prune_configs(kind)(launch.autotune_configs(kind), nargs, **kwargs))
        assert kept
        for meta in kept:
            assert launch.shared_memory_bytes(kind, meta, block_m=block_m) <= SMALL_SM_BUDGET, meta
        assert all(key in [launch._meta_key(m) for m in kept] for key in small)
    # the coarse table's wide tiles are the ones pruned here
    nargs, kwargs = _launch("rows", 128, 14336, 4096, 2000)
    kept = _metas(launch.prune_configs("rows")(launch.autotune_configs("rows"), nargs, **kwargs))
    assert {"BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3} not in kept


def test_ampere_prunes_by_its_own_budget(gpu_class):
    gpu_class((8, 0))
    budget = gpu_arch.tile_shared_memory_budget(CUDA)
    for kind in launch.KINDS:
        for block_m, n, k, rows in SHAPES:
            for size in (2, 4):
                nargs, kwargs = _launch(kind, block_m, n, k, rows, size)
                kept = _metas(launch.prune_configs(kind)(launch.autotune_configs(kind), nargs, **kwargs))
                fitting = [m for m in kept if launch.shared_memory_bytes(kind, m, block_m=block_m,
                                                                         element_size=size) <= budget]
                if len(kept) == 1 and size == 4:  # fp32 where none of the table fits: the smallest tile, any
                    continue
                assert kept == fitting  # nothing that overflows
                assert not any(launch._meta_key(m) in {launch._meta_key(s) for s in launch.SMALL_SM_METAS[kind]}
                               for m in kept)


def test_nothing_fits_falls_back_to_the_smallest_tile(gpu_class, monkeypatch):
    gpu_class((8, 9))
    monkeypatch.setattr(gpu_arch, "tile_shared_memory_budget", lambda device: 1024)
    nargs, kwargs = _launch("rows", 128, 4096, 4096, 1000)
    configs = launch.autotune_configs("rows")
    kept = launch.prune_configs("rows")(configs, nargs, **kwargs)
    smallest = min(launch.shared_memory_bytes("rows", m, block_m=128) for m in _metas(configs))
    assert len(kept) == 1 and launch.shared_memory_bytes("rows", _metas(kept)[0], block_m=128) == smallest


def test_the_moe_estimate_counts_both_weight_tiles_of_gate_up():
    meta = {"BLOCK_N": 128, "BLOCK_K": 64, "num_stages": 3}
    assert launch.shared_memory_bytes("rows", meta, block_m=128) == (128 * 64 + 64 * 128) * 2 * 3
    assert launch.shared_memory_bytes("gate_up", meta, block_m=128) == (128 * 64 + 2 * 64 * 128) * 2 * 3
    with pytest.raises(ValueError, match="unknown MoE kernel kind 'dense'"):
        launch.shared_memory_bytes("dense", meta, block_m=128)


@pytest.mark.parametrize("cap", [(9, 0), (8, 0)])
def test_the_loss_default_tiles_stay_on_hopper_and_ampere(gpu_class, cap):
    gpu_class(cap)
    assert linear_ce.default_configs(torch.bfloat16, CUDA) == [linear_ce.LossKernelConfig()]
    assert linear_ce.default_configs(torch.float32, CUDA) == [linear_ce._FP32_CONFIG]


@pytest.mark.parametrize("cap", [(8, 6), (8, 9), (12, 0)])
def test_the_loss_takes_small_tiles_on_a_99_kib_class(gpu_class, cap, monkeypatch):
    gpu_class(cap)
    monkeypatch.setattr(linear_ce, "running_in_interpreter", lambda: False)
    chosen = linear_ce._config(None, torch.bfloat16, CUDA)
    assert chosen == linear_ce._SMALL_SM_CONFIG
    assert linear_ce.tile_shared_memory_bytes(linear_ce.LossKernelConfig(), 2) > SMALL_SM_BUDGET  # why
    assert linear_ce.tile_shared_memory_bytes(chosen, 2) <= SMALL_SM_BUDGET
    assert linear_ce._config(None, torch.float32, CUDA) == linear_ce._FP32_CONFIG  # fp32's tiles fit there already
    given = linear_ce.LossKernelConfig(fwd_block_v=512)
    assert linear_ce._config(given, torch.bfloat16, CUDA) is given  # a config the caller gives is used as given
