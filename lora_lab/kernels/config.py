"""How the fused kernels run: one small, frozen settings object passed to ``patch_model`` and to every op.

    cfg = KernelConfig(dispatch="triton", autotune=False)     # every shape on the Triton kernels, one tile config
    patch_model(model, config=cfg)
    fused_lora_linear(x, w, b, A, B, scaling, config=cfg)

Fields left out take their value from an environment variable when it is set (``KernelConfig.from_env``, what
``KernelConfig()`` does), else the shipped default. Environment variables only seed defaults; nothing in the
package writes them.

=================  ======================  ==============================================================
field              variable                meaning
=================  ======================  ==============================================================
``dispatch``       ``LORA_LAB_DISPATCH``   ``auto``: cuBLAS calls for GEMMs below a volume M·K·N, Triton
                                           above (see :mod:`lora_lab.kernels.lora.dispatch`);
                                           ``triton`` / ``cublas``: always that engine
``base_gemm``      ``LORA_LAB_BASE_GEMM``  who runs the big GEMM on the Triton engine: ``triton`` (one
                                           GEMM, rank-r term in its loop), ``cublas`` (Triton writes the
                                           rank-r term, cuBLAS adds the GEMM with β = 1; with
                                           ``rank_ops="torch"`` cuBLAS writes the rank-r term too: no
                                           Triton launch), ``quack`` (the LoRA linear:
                                           QuACK's Hopper GEMM with the rank-r term in its
                                           epilogue, :mod:`lora_lab.kernels.lora.quack_gemm`;
                                           where it cannot run, the Triton route with a warning
                                           naming why; the shared-input op (q/k/v,
                                           gate/up groups) takes its default), ``wide``
                                           (the LoRA linear: one cuBLAS GEMM over a
                                           widened reduction, [X | P] · [W | B]ᵀ, the
                                           widened operand written by the pass that
                                           computes P, :mod:`lora_lab.kernels.lora.widened`;
                                           no dropout), ``merged`` (the LoRA linear and the
                                           shared-input op: the frozen layer's cuBLAS GEMMs
                                           on W + s·B A, merged per call and never kept,
                                           :mod:`lora_lab.kernels.lora.merged`; no
                                           dropout), ``stacked`` (the LoRA linear: the
                                           merged route with P and Q as r more output
                                           columns of its two GEMMs, s·A stacked under
                                           W + s·B A and s·B beside it,
                                           :mod:`lora_lab.kernels.lora.stacked`; no
                                           dropout; the shared-input op takes its
                                           default), ``auto``: each op's default
``overlap``        ``LORA_LAB_OVERLAP``    dA/dB on a side CUDA stream next to the dX GEMM (on the
                                           merged route also P next to the forward GEMM, Q beside dX's):
                                           ``on``, ``off``, ``auto`` (each op's default)
``gemm_loads``     ``LORA_LAB_GEMM``       how the Triton GEMM reads its operands: ``tma``, ``pointer``,
                                           ``auto`` (TMA when the layout allows it); ``persistent``: TMA
                                           in a persistent kernel (one program per SM walking the tiles;
                                           inputs TMA cannot read are copied, or run on ``auto``)
``fuse_q_db``      ``LORA_LAB_FUSE_QDB``   Q and dB in one pass over dY (fp32 atomics: dB's summation
                                           order is then not deterministic)
``fold_projection`` ``LORA_LAB_FOLD_P``    with ``gemm_loads="persistent"``: P = s·X Aᵀ computed inside the
                                           forward GEMM's K loop and Q = s·dY B inside dX's (r <= 64, no
                                           dropout), instead of separate passes over X and dY
``rank_ops``       ``LORA_LAB_RANK_OPS``   the LoRA linear's four memory-bound rank-r products on the Triton
                                           engine (P = s·X Aᵀ, Q = s·dY B, dA, dB): ``triton`` (its own
                                           kernels), or ``torch`` (cuBLAS calls: each launch costs the host
                                           a C++ call instead of Triton's Python launch path; the big GEMMs
                                           stay as ``base_gemm`` says; dropout keeps
                                           ``triton``, whose kernels regenerate the mask); ``auto`` (the
                                           default): ``triton``, except where the LoRA linear's other
                                           settings are on their defaults too and the measured rule of
                                           :func:`lora_lab.kernels.lora.dispatch.linear_route` runs every
                                           product of the call on cuBLAS
``autotune``       ``LORA_LAB_AUTOTUNE``   LoRA kernels: time a few tile configs per shape (off: the first
                                           one that fits, for quick test runs)
``moe_autotune``   ``LORA_LAB_MOE_AUTOTUNE``  the same for the MoE kernels
``moe_block_m``    ``LORA_LAB_MOE_BLOCK_M``   rows per MoE row tile (power of two >= 16); None: by load
``moe_loads``      ``LORA_LAB_MOE_LOADS``     the MoE kernels (gate/up + SiLU, down, dX, down backward, weight
                                           gradients): ``pointer`` (one program per tile, pointer loads), or
                                           ``persistent``: one program per SM walking the tiles in grouped
                                           order, expert weights and sorted rows read through TMA
                                           descriptors where aligned (token rows are still gathered by
                                           pointer)
``moe_weight_grad`` ``LORA_LAB_MOE_WEIGHT_GRAD``  the MoE expert weight gradients (dW1, dW2, the LoRA factors'):
                                           ``auto`` (the default: ``per_tile``, the rule of
                                           :func:`lora_lab.kernels.moe.expert_weight_grad.weight_grad_engine`,
                                           measured in notebook 06; except dW1 of full fine-tuning where
                                           ``moe_scatter`` runs on ``grouped_mm``: one K-grouped
                                           ``torch._grouped_mm`` over X gathered by token), ``per_tile``
                                           (one program per (expert, dW tile), its own pipelined loop over
                                           the expert's rows), or
                                           ``kgrouped``
                                           (opt-in: one program per SM, one loop over the rows of all its
                                           (expert, tile) items, not software-pipelined by Triton 3.6/3.9;
                                           see :mod:`lora_lab.kernels.moe.kgrouped_weight_grad`), or
                                           ``grouped_mm`` (dW1 and dW2 of full fine-tuning as one
                                           ``torch._grouped_mm`` each, K split at the expert offsets, rows
                                           gathered before it; the LoRA factors' and unaligned shapes stay
                                           ``per_tile``)
``moe_engine``     ``LORA_LAB_MOE_ENGINE``    who runs the MoE expert GEMMs: ``auto`` (the rule of
                                           :func:`lora_lab.kernels.moe.engine.choose_engine`: CUTLASS's
                                           grouped GEMM on coarse experts and on every layer with LoRA
                                           on its experts, bf16, Hopper; the Triton kernels elsewhere),
                                           ``triton``, ``grouped_mm``
``moe_scatter``    ``LORA_LAB_MOE_SCATTER``   the Triton engine's two GEMMs whose rows go back to tokens (down
                                           forward, dX) in full fine-tuning: ``auto`` (``grouped_mm`` for
                                           bf16 on Hopper where torch has it, else ``triton``; the rule of
                                           :func:`lora_lab.kernels.moe.experts.scatter_engine`), ``triton``
                                           (our grouped GEMM adds each row into an fp32 (T, H) buffer with
                                           atomics), or ``grouped_mm`` (``torch._grouped_mm`` writes the
                                           expert-sorted rows, one Triton pass sums each token's K rows);
                                           layers with LoRA on the Triton engine keep ``triton``
``moe_down_backward`` ``LORA_LAB_MOE_DOWN_BACKWARD``  the Triton engine's down-projection backward in full
                                           fine-tuning: ``auto`` (``grouped_mm`` for bf16 on Hopper where torch
                                           has it, no LoRA, else ``triton``: the rule of
                                           :func:`lora_lab.kernels.moe.experts.down_backward_engine`), ``triton`` (one
                                           fused kernel: dOut gathered in its loader, SiLU·up backward and the
                                           router gradient in its epilogue), or ``grouped_mm`` (dOut gathered
                                           into expert order once, D on ``torch._grouped_mm``, the SiLU·up
                                           backward pass, and with ``moe_weight_grad='auto'`` dW2 as one
                                           K-grouped ``_grouped_mm`` over the same gathered rows)
=================  ======================  ==============================================================

The warp-specialised persistent forms (``persistent_ws`` for ``gemm_loads`` and ``moe_loads``) were removed: on the
H200 their build failed to compile (``PassManager::run failed``); asking for them is an error naming the values
that exist.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["KernelConfig", "ENV_VARIABLES", "resolve_config"]

CHOICES = {
    "dispatch": ("auto", "triton", "cublas"),
    "base_gemm": ("auto", "triton", "cublas", "quack", "wide", "merged", "stacked"),
    "overlap": ("auto", "on", "off"),
    "gemm_loads": ("auto", "tma", "pointer", "persistent"),
    "moe_loads": ("pointer", "persistent"),
    "moe_weight_grad": ("auto", "per_tile", "kgrouped", "grouped_mm"),
    "moe_engine": ("auto", "triton", "grouped_mm"),
    "moe_scatter": ("auto", "triton", "grouped_mm"),
    "moe_down_backward": ("auto", "triton", "grouped_mm"),
    "rank_ops": ("auto", "triton", "torch"),
}
# values that existed once, and why they are gone (named in the error)
REMOVED = {
    "persistent_ws": "the warp-specialised persistent form was removed (its build failed to compile on the H200); "
                     "use 'persistent'",
}


def _removed_note(value) -> str:
    return f" ({REMOVED[value]})" if isinstance(value, str) and value in REMOVED else ""

ENV_VARIABLES = {
    "dispatch": "LORA_LAB_DISPATCH",
    "base_gemm": "LORA_LAB_BASE_GEMM",
    "overlap": "LORA_LAB_OVERLAP",
    "gemm_loads": "LORA_LAB_GEMM",
    "fuse_q_db": "LORA_LAB_FUSE_QDB",
    "fold_projection": "LORA_LAB_FOLD_P",
    "autotune": "LORA_LAB_AUTOTUNE",
    "moe_autotune": "LORA_LAB_MOE_AUTOTUNE",
    "moe_block_m": "LORA_LAB_MOE_BLOCK_M",
    "moe_loads": "LORA_LAB_MOE_LOADS",
    "moe_weight_grad": "LORA_LAB_MOE_WEIGHT_GRAD",
    "moe_engine": "LORA_LAB_MOE_ENGINE",
    "moe_scatter": "LORA_LAB_MOE_SCATTER",
    "moe_down_backward": "LORA_LAB_MOE_DOWN_BACKWARD",
    "rank_ops": "LORA_LAB_RANK_OPS",
}
_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def _parse_env(field: str, text: str):
    variable = ENV_VARIABLES[field]
    value = text.strip().lower()
    if field in CHOICES:
        value = {"1": "on", "0": "off"}.get(value, value) if field == "overlap" else value
        if value not in CHOICES[field]:
            allowed = ", ".join(CHOICES[field])
            raise ValueError(f"{variable}={text!r}: expected one of {allowed}{_removed_note(value)}")
        return value
    if field == "moe_block_m":
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{variable}={text!r}: expected a power of two >= 16") from None
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{variable}={text!r}: expected 1 or 0")


class _FromEnvironment:
    """The default of every KernelConfig field: the field's ``LORA_LAB_*`` variable when set, else ``SHIPPED``."""

    def __repr__(self) -> str:
        return "<LORA_LAB_* variable or shipped default>"


_ENV = _FromEnvironment()

SHIPPED = {
    "dispatch": "auto", "base_gemm": "auto", "overlap": "auto", "gemm_loads": "auto", "fuse_q_db": False,
    "fold_projection": False, "autotune": True, "moe_autotune": True, "moe_block_m": None, "moe_loads": "pointer",
    "moe_weight_grad": "auto", "moe_engine": "auto", "moe_scatter": "auto", "moe_down_backward": "auto",
    "rank_ops": "auto",
}


def _seeded(environ: Mapping[str, str], fields) -> dict:
    """The value of each of ``fields``: its variable in ``environ`` when set (and not blank), else the shipped one."""
    values = {}
    for field in fields:
        text = environ.get(ENV_VARIABLES[field])
        values[field] = _parse_env(field, text) if text is not None and text.strip() else SHIPPED[field]
    return values


@dataclass(frozen=True)
class KernelConfig:
    """Settings of the fused LoRA and MoE kernels (see the module docstring for each field). A field left out takes
    its ``LORA_LAB_*`` variable's value when that is set, else the shipped default (``SHIPPED``)."""

    dispatch: str = _ENV
    base_gemm: str = _ENV
    overlap: str = _ENV
    gemm_loads: str = _ENV
    fuse_q_db: bool = _ENV
    fold_projection: bool = _ENV
    autotune: bool = _ENV
    moe_autotune: bool = _ENV
    moe_block_m: int | None = _ENV
    moe_loads: str = _ENV
    moe_weight_grad: str = _ENV
    moe_engine: str = _ENV
    moe_scatter: str = _ENV
    moe_down_backward: str = _ENV
    rank_ops: str = _ENV

    def __post_init__(self):
        left_out = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is _ENV]
        for name, value in _seeded(os.environ, left_out).items():
            object.__setattr__(self, name, value)
        for name, allowed in CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"KernelConfig.{name} must be one of {', '.join(allowed)}; got {value!r}"
                                 f"{_removed_note(value)}")
        for name in ("fuse_q_db", "fold_projection", "autotune", "moe_autotune"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"KernelConfig.{name} must be True or False; got {getattr(self, name)!r}")
        block = self.moe_block_m
        if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 16
                                  or block & (block - 1)):
            raise ValueError(f"KernelConfig.moe_block_m must be a power of two >= 16 or None; got {block!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> KernelConfig:
        """Defaults, replaced by each ``LORA_LAB_*`` variable that is set, then by ``overrides``."""
        environ = os.environ if environ is None else environ
        values = _seeded(environ, [f for f in ENV_VARIABLES if f not in overrides])
        values.update(overrides)
        return cls(**values)

    def replace(self, **changes) -> KernelConfig:
        """A copy with some fields changed (``cfg.replace(autotune=False)``)."""
        return dataclasses.replace(self, **changes)


_FROM_ENV_CACHE: dict = {}


def resolve_config(config: KernelConfig | None) -> KernelConfig:
    """``config`` itself, or (None) the defaults seeded from the environment at the time of the call (the
    ``KernelConfig`` built for the same values of the ``LORA_LAB_*`` variables is reused: an op called with
    ``config=None`` does not rebuild and re-validate it on every call)."""
    if config is None:
        key = tuple(os.environ.get(variable) for variable in ENV_VARIABLES.values())
        cached = _FROM_ENV_CACHE.get(key)
        if cached is None:
            cached = _FROM_ENV_CACHE[key] = KernelConfig.from_env()
        return cached
    if not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a lora_lab.kernels.KernelConfig or None; got {type(config).__name__}")
    return config
