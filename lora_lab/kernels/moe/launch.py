"""Launch settings shared by the MoE kernels: a shape-aware tile table, pruned autotuning, its disk cache.

Every MoE kernel is launched either

* with the tile the table :func:`heuristic_meta` picks for its shape (``KernelConfig(moe_autotune=False)``,
  the CPU interpreter, narrow LoRA-rank GEMMs), or
* through ``triton.autotune`` over the configs that fit the shape (:func:`prune_configs`: the table's own pick
  plus at most two neighbours, so the tuned launch is never slower than the untuned one by more than timing
  noise), each timed briefly (:func:`tuning_bench`), the result kept on disk across processes where the
  installed Triton can (``cache_results``, Triton >= 3.4; :func:`make_tuned`). The pruner also drops the tiles whose
  pipelined operand tiles overflow the GPU class's shared memory (:func:`shared_memory_bytes` against
  :func:`lora_lab.gpu_arch.tile_shared_memory_budget`); on 99 KiB classes (sm86, sm89, sm120) it adds
  :data:`SMALL_SM_METAS`, which every other class drops. The untuned launch takes the table's pick as it is.

The table (a pure function of the per-expert row count and the GEMM's N and K; thresholds are reasoned Hopper
choices, not yet measured per cell):

==================  =====================================  ==========================================
kernel kind         coarse (rows/expert >= 512, N >= 2048)  otherwise
==================  =====================================  ==========================================
``rows``            128 x 256 x 64, 8 warps, 3 stages       BLOCK_N 128, BLOCK_K 64, 8 warps (4 when
                                                            BLOCK_M 64), 4 stages when K >= 1024 else 3
``gate_up``         BLOCK_N 128 (two accumulators), 64,     BLOCK_N 64, BLOCK_K 64, 8 / 4 warps,
                    8 warps, 3 stages                       4 stages when K >= 1024 else 3
``down_backward``   BLOCK_N 64, 64, 8 warps, 4 stages       BLOCK_N 64, BLOCK_K 64, 8 / 4 warps, 3 stages
                    (its epilogue holds D, g, u in fp32)
``weight_grad``     128 x 128 x 64, 8 warps, 4 stages       128 x 128 x 64, 8 warps, 3 stages
==================  =====================================  ==========================================

(``weight_grad``: "coarse" is rows/expert >= 512 there too, its K being the expert's rows.) BLOCK_M of the
row kernels comes from the routing (:func:`row_block_size`).

**LoRA on the experts** (a row kernel launched with ``HAS_LORA``: the rank-r term rides in its loop and epilogue)
takes its own column, whatever the regime: ``rows`` 128 x 64, ``gate_up`` and ``down_backward`` 64 x 64, all 4 warps
and 3 stages. Measured, not reasoned: with the table above, ``moe_autotune=False`` ran every LoRA cell of notebook
06's H200 run of 6c94d2c at 1.46-1.62x the tuned time (at most 1.12x in full fine-tuning, the same kernels without
the LoRA term), and an H200 run printing the autotuner's picks (``TRITON_PRINT_AUTOTUNING=1``, 30B-A3B-like and
Mixtral-8x7B-like LoRA cells, 8k tokens, at 6c94d2c) found
this column's tiles best in 7 of the 8 tuned launches (the other, ``down_backward`` at the 30B-A3B-like layer,
preferred 8 warps and 4 stages). The column has not been timed untuned yet.

The untuned launch on a GPU uses the *specialised* kernel (Triton knows which sizes and strides are multiples of
16 and vectorises the loads) except on tiny problems (:func:`tiny_problem`), where the unspecialised twin
(:func:`unspecialized_twin`) keeps the dozens of odd shapes of the correctness checks from compiling one
variant each.
"""

from __future__ import annotations

import inspect
import os

import triton

from lora_lab import gpu_arch
from lora_lab.kernels.config import KernelConfig
from lora_lab.kernels.triton_helpers import next_power_of_2, rank_block, running_in_interpreter

KINDS = ("rows", "gate_up", "down_backward", "weight_grad")
COARSE_ROWS_PER_EXPERT = 512  # rows per expert from which the big tiles pay (placeholder until measured)
COARSE_N = 2048
TINY_VOLUME = 1 << 30  # rows · N · K below which the untuned launch uses the unspecialised twin
MAX_TUNED_CONFIGS = 3  # configs timed per shape: the table's pick and at most two neighbours
# with LoRA: the LoRA column's pick and one neighbour. In the H200 diagnostic that printed the picks (module docstring)
# the tuner chose the column in 7 of 8 LoRA launches and the first neighbour in the eighth, never a third config; each
# config timed is one more compile in the first call (15.5 s at the 30B-A3B-like LoRA cell; the target: <= 15)
MAX_TUNED_CONFIGS_LORA = 2


def autotune_enabled(config: KernelConfig) -> bool:
    """Autotune on a real GPU unless ``config.moe_autotune`` is off; never in the interpreter."""
    return config.moe_autotune and not running_in_interpreter()


def unspecialized_twin(kernel):
    """The same ``@triton.jit`` kernel without value specialisation of its integer arguments.

    Triton compiles one variant per pattern of "int == 1" / "int % 16 == 0" over all sizes and
    strides; the correctness checks sweep many small odd shapes, and each shape would compile every
    kernel again. The twin (sizes and strides not specialised, pointers still are) compiles once per
    set of constexprs. Launched only for tiny problems with tuning off on a GPU (``fixed_kernel``): without
    the divisibility hints Triton cannot vectorise the loads, which costs little on a tiny problem and up to
    an order of magnitude on a real layer.
    """
    names = [
        name for name, param in inspect.signature(kernel.fn).parameters.items()
        if not name.endswith("_ptr") and "constexpr" not in str(param.annotation)
    ]
    return triton.jit(kernel.fn, do_not_specialize=names)


def tiny_problem(volume: int) -> bool:
    """Whether a GEMM of ``volume`` = rows · N · K multiply-adds is small enough for the unspecialised twin."""
    return volume < TINY_VOLUME


def fixed_kernel(specialized, unspecialized, config: KernelConfig, volume: int = 0):
    """Kernel for a fixed-config launch: the unspecialised twin only for a tiny problem with tuning off on a GPU."""
    if running_in_interpreter() or autotune_enabled(config) or not tiny_problem(volume):
        return specialized
    return unspecialized


def narrow_block_size(size: int, config: KernelConfig, volume: int = 0) -> int:
    """Tile side for a GEMM dimension <= 128 (LoRA rank, tiny test shapes): one tile covers it.

    A power of two >= 16 (tl.dot's minimum). Where the launch takes the unspecialised twin (:func:`fixed_kernel`:
    a tiny problem of ``volume`` multiply-adds, tuning off, on a GPU) the side is at least 64, so the many small
    shapes of the correctness checks share compiled variants. A real layer's narrow GEMMs (the LoRA rank's side)
    get the same tile tuned or not: before, tuning off padded every rank-16 side to 64, four times the tile,
    and notebook 06's H200 run of bec6a1b measured the untuned layer at 1.57-1.63x the tuned one in every LoRA
    cell (1.01-1.10x in full fine-tuning, where no narrow GEMM runs). That was not the cause: after this change an H200
    diagnostic still measured 13.95 ms untuned against 8.71 ms tuned at the 30B-A3B-like LoRA cell, 8k tokens
    (the ledger's moe rows of commit eecd7de). The tiles of the LoRA-carrying launches were (the
    table's LoRA column, module docstring)."""
    twin = not running_in_interpreter() and not autotune_enabled(config) and tiny_problem(volume)
    return max(64 if twin else 16, next_power_of_2(size))


def row_block_size(num_assignments: int, num_experts: int, config: KernelConfig) -> int:
    """BLOCK_M for the row tiles: the routing is built for it, so every row-tiled kernel shares it.

    Small in the interpreter (fast CPU tests); on a GPU 128 when an expert gets >= 192 rows on
    average, else 64 (less padding waste on the last, partial tile of each expert).
    ``config.moe_block_m`` overrides it (power of two, >= 16) for tuning experiments.
    """
    if running_in_interpreter():
        return 16
    if config.moe_block_m is not None:
        return config.moe_block_m
    rows_per_expert = num_assignments / max(num_experts, 1)
    return 128 if rows_per_expert >= 192 else 64


MAX_RANK = 128  # the whole LoRA rank is one tile in the MoE kernels


def rank_block_size(rank: int) -> int:
    """Padded LoRA rank, one tile wide (:func:`~lora_lab.kernels.triton_helpers.rank_block` without a cap)."""
    if rank > MAX_RANK:
        raise ValueError(f"LoRA rank {rank} > {MAX_RANK} is not supported by the fused MoE kernels")
    return rank_block(rank)


def is_coarse(rows_per_expert: float, n_dim: int, kind: str) -> bool:
    """Coarse experts: many rows per expert (and, for the row kernels, a wide output) — the big-tile regime."""
    if rows_per_expert < COARSE_ROWS_PER_EXPERT:
        return False
    return kind == "weight_grad" or n_dim >= COARSE_N


def heuristic_meta(kind: str, *, block_m: int, n_dim: int, k_dim: int, rows_per_expert: float,
                   interpret: bool | None = None, lora: bool = False) -> dict:
    """The tile the table picks (module docstring) for one launch: BLOCK_N, BLOCK_K (BLOCK_M for weight_grad),
    num_warps, num_stages. A pure function of its arguments; ``interpret`` None: whether the interpreter runs;
    ``lora``: a row kernel launched with its LoRA term (``HAS_LORA``), which takes the table's LoRA column."""
    if kind not in KINDS:
        raise ValueError(f"unknown MoE kernel kind {kind!r}; expected one of {', '.join(KINDS)}")
    if interpret if interpret is not None else running_in_interpreter():
        return {"BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1} | (
            {"BLOCK_M": 32} if kind == "weight_grad" else {}
        )
    if lora and kind != "weight_grad":
        return {"BLOCK_N": 128 if kind == "rows" else 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}
    coarse = is_coarse(rows_per_expert, n_dim, kind)
    warps = 8 if block_m >= 128 else 4
    deep = 4 if k_dim >= 1024 else 3
    if kind == "weight_grad":
        return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4 if coarse else 3}
    if kind == "rows":
        if coarse:
            return {"BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
        return {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": warps, "num_stages": deep}
    if kind == "down_backward":  # its epilogue holds D, g and u tiles in fp32: a 128-wide tile would spill
        return {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8 if coarse else warps, "num_stages": 4 if coarse else 3}
    if coarse:  # gate_up keeps two accumulators side by side
        return {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": warps, "num_stages": deep}


def set_expert_block_shape(nargs: dict) -> None:
    """Autotune pre-hook (persistent form): each TMA descriptor gets the block shape of the config being run.

    A 3-D descriptor is an expert matrix ((E, N, K) when MAT_NK, else (E, K, N)); a 2-D one is a sorted row
    operand of the weight-gradient kernel, read BLOCK_K rows at a time (``a_ptr``: BLOCK_M columns, ``b_ptr``:
    BLOCK_N).
    """
    for name, value in nargs.items():
        if type(value).__name__ != "TensorDescriptor":
            continue
        bk, bn = nargs["BLOCK_K"], nargs["BLOCK_N"]
        if len(value.shape) == 3:
            value.block_shape = [1, bn, bk] if nargs["MAT_NK"] else [1, bk, bn]
        else:
            value.block_shape = [bk, nargs["BLOCK_M"] if name == "a_ptr" else bn]


def _meta_key(meta: dict) -> tuple:
    return tuple(sorted(meta.items()))


def candidate_metas(kind: str) -> list[dict]:
    """Every tile the autotuner may time for ``kind``: each entry the table can pick, plus neighbours."""
    if kind not in KINDS:
        raise ValueError(f"unknown MoE kernel kind {kind!r}; expected one of {', '.join(KINDS)}")
    metas = []
    for block_m in (64, 128):
        for n_dim in (512, 4096):
            for k_dim in (512, 4096):
                for rows in (64, 4096):
                    metas.append(heuristic_meta(kind, block_m=block_m, n_dim=n_dim, k_dim=k_dim,
                                                rows_per_expert=rows, interpret=False))
    if kind == "rows":
        metas += [{"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4},
                  {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}]
    elif kind in ("gate_up", "down_backward"):
        metas += [{"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
                  {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}]
    else:
        metas += [{"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
                  {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}]
    unique = {}
    for meta in metas:
        unique.setdefault(_meta_key(meta), meta)
    return list(unique.values())


# Tiles for GPUs with about 99 KiB of shared memory per block (sm86, sm89, sm120; :mod:`lora_lab.gpu_arch`), where the
# table's wide tiles overflow: the pruner offers them only where the class's budget is below SMALL_SM_BELOW (untimed
# guesses, not a tuned table); every other class drops them
SMALL_SM_METAS = {
    "rows": ({"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
             {"BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3}),
    "gate_up": ({"BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3},
                {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}),
    "down_backward": ({"BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3},
                      {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}),
    "weight_grad": ({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3},
                    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 8, "num_stages": 2}),
}
SMALL_SM_BELOW = 100 * 1024
_OPERANDS = ("a_ptr", "x_ptr", "dout_ptr", "w_ptr", "b_ptr")  # the GEMM operand whose element size the tiles take


def shared_memory_bytes(kind: str, meta: dict, *, block_m: int, element_size: int = 2) -> int:
    """Bytes of shared memory the pipelined operand tiles of one program take with tile ``meta`` (an estimate: the
    epilogue's buffers are not counted): per stage a BLOCK_M x BLOCK_K row tile (``block_m`` for the row kernels; a
    BLOCK_K x BLOCK_M one for weight_grad) and a BLOCK_K x BLOCK_N weight tile (two for gate_up: gate and up)."""
    if kind not in KINDS:
        raise ValueError(f"unknown MoE kernel kind {kind!r}; expected one of {', '.join(KINDS)}")
    bm = meta["BLOCK_M"] if kind == "weight_grad" else block_m
    weights = 2 if kind == "gate_up" else 1
    tile = bm * meta["BLOCK_K"] + weights * meta["BLOCK_K"] * meta["BLOCK_N"]
    return tile * element_size * max(int(meta.get("num_stages", 1)), 1)


def _budget_and_element_size(nargs: dict) -> tuple[int, int]:
    """(bytes of shared memory the GPU class lets a program take, the GEMM operand's element size) of a launch."""
    operand = next((nargs[name] for name in _OPERANDS if name in nargs), None)
    operand = getattr(operand, "base", operand)  # a TMA descriptor: the tensor under it
    device = getattr(operand, "device", None)
    budget = gpu_arch.tile_shared_memory_budget(device) if device is not None else \
        gpu_arch.tile_shared_memory_budget("cpu")
    size = operand.element_size() if hasattr(operand, "element_size") else 2
    return budget, size


def shape_candidates(kind: str, *, block_m: int, n_dim: int, k_dim: int, rows_per_expert: float,
                     lora: bool = False) -> list[dict]:
    """The tiles worth timing at one shape, best guess first: the table's pick, then up to two neighbours (one with
    ``lora``: ``MAX_TUNED_CONFIGS_LORA``) that fit (no BLOCK_N above the output width rounded up to a power of two,
    no 256-wide tile off the coarse regime). Pure function; what :func:`prune_configs` keeps."""
    first = heuristic_meta(kind, block_m=block_m, n_dim=n_dim, k_dim=k_dim, rows_per_expert=rows_per_expert,
                           interpret=False, lora=lora)
    limit = MAX_TUNED_CONFIGS_LORA if lora and kind != "weight_grad" else MAX_TUNED_CONFIGS
    width = max(64, next_power_of_2(n_dim))
    coarse = is_coarse(rows_per_expert, n_dim, kind)
    keep = [first]
    for meta in candidate_metas(kind):
        if len(keep) >= limit:
            break
        if _meta_key(meta) == _meta_key(first) or meta["BLOCK_N"] > width:
            continue
        if meta["BLOCK_N"] >= 256 and not coarse:
            continue
        keep.append(meta)
    return keep


def _config_meta(config) -> dict:
    return dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)


def _rows_per_expert(nargs: dict, kwargs: dict) -> float:
    """Rows per expert recovered from a row kernel's launch arguments (num_tiles ≈ S / BLOCK_M + E)."""
    experts = max(int(nargs.get("num_experts", 1)), 1)
    tiles = int(nargs.get("num_tiles", 0))
    block_m = int(kwargs.get("BLOCK_M", nargs.get("BLOCK_M", 64)))
    return max(tiles - experts, 0) * block_m / experts


def prune_configs(kind: str):
    """``early_config_prune`` for ``triton.autotune``: keep the configs of :func:`shape_candidates`."""
    def prune(configs, nargs, **kwargs):
        if kind == "weight_grad":  # K is the expert's row count, not in the launch arguments: time both depths
            shape = dict(block_m=128, n_dim=int(nargs["N"]), k_dim=0, rows_per_expert=COARSE_ROWS_PER_EXPERT)
        else:
            n_name = "N" if "N" in nargs else "I"
            shape = dict(block_m=int(kwargs.get("BLOCK_M", 64)), n_dim=int(nargs[n_name]), k_dim=int(nargs["K"]),
                         rows_per_expert=_rows_per_expert(nargs, kwargs),
                         lora=bool(kwargs.get("HAS_LORA", nargs.get("HAS_LORA", False))))
        budget, size = _budget_and_element_size(nargs)
        block_m = int(shape["block_m"])

        def fits(meta):
            return shared_memory_bytes(kind, meta, block_m=block_m, element_size=size) <= budget

        metas = [m for m in shape_candidates(kind, **shape) if fits(m)]
        if budget < SMALL_SM_BELOW:  # a small-SM class: its own tiles join (or replace) the table's that fit
            metas += [m for m in SMALL_SM_METAS[kind] if fits(m)]
        by_key = {_meta_key(_config_meta(c)): c for c in configs}
        kept = [by_key[key] for key in dict.fromkeys(_meta_key(m) for m in metas) if key in by_key]
        if kept:
            return kept
        return [min(configs, key=lambda c: shared_memory_bytes(kind, _config_meta(c), block_m=block_m,
                                                               element_size=size))]
    return prune


def tuning_bench(kernel_call, quantiles):
    """Short timing of one config while autotuning (a few ms per config: the first call stays quick)."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


def autotune_options(environ=None) -> dict:
    """The ``triton.autotune`` keyword arguments this Triton accepts among ``cache_results`` (tuning results
    kept on disk across processes, Triton >= 3.4) and ``do_bench`` (our short timing). ``LORA_LAB_MOE_TUNING_CACHE=0``
    (read when lora_lab.kernels is imported) leaves the disk cache off."""
    environ = os.environ if environ is None else environ
    accepted = inspect.signature(triton.autotune).parameters
    wanted = {"do_bench": tuning_bench}
    if environ.get("LORA_LAB_MOE_TUNING_CACHE", "1").strip().lower() not in ("0", "false", "off", "no"):
        wanted["cache_results"] = True
    return {name: value for name, value in wanted.items() if name in accepted}


def autotune_configs(kind: str, *, persistent: bool = False) -> list:
    """The configs of :func:`candidate_metas` and :data:`SMALL_SM_METAS` (pruned per shape and GPU class at launch).
    Only the persistent form's carry the TMA pre-hook: Triton's disk cache refuses configs with a pre-hook, so the
    pointer form's have none."""
    hook = set_expert_block_shape if persistent else None
    if running_in_interpreter():
        meta = heuristic_meta(kind, block_m=16, n_dim=0, k_dim=0, rows_per_expert=0)
        warps, stages = meta.pop("num_warps"), meta.pop("num_stages")
        return [triton.Config(meta, num_warps=warps, num_stages=stages, pre_hook=hook)]
    configs = []
    known = {_meta_key(m) for m in candidate_metas(kind)}
    for meta in [*candidate_metas(kind), *(m for m in SMALL_SM_METAS[kind] if _meta_key(m) not in known)]:
        meta = dict(meta)
        warps, stages = meta.pop("num_warps"), meta.pop("num_stages")
        configs.append(triton.Config(meta, num_warps=warps, num_stages=stages, pre_hook=hook))
    return configs


def make_tuned(kernel, kind: str, key: list[str], **options) -> dict:
    """{persistent: autotuned kernel}: the pointer form (False) with Triton's disk cache where it exists, the
    persistent form (True) with the TMA pre-hook (tuned per process). Both prune by shape."""
    tuned = {}
    for persistent in (False, True):
        extra = autotune_options()
        if persistent:
            extra.pop("cache_results", None)
        tuned[persistent] = triton.autotune(
            configs=autotune_configs(kind, persistent=persistent), key=key,
            prune_configs_by={"early_config_prune": prune_configs(kind)}, **extra, **options,
        )(kernel)
    return tuned
