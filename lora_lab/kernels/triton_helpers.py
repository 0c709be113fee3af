"""Small helpers every Triton kernel of the package shares (one copy each).

* :func:`running_in_interpreter` — Triton runs kernels on CPU tensors (``TRITON_INTERPRET=1``, read by Triton
  itself when it is imported): correctness runs, never speed;
* :func:`dot_precision` — fp32 GEMMs as true fp32 (``ieee``), so fp32 runs are a tight reference;
* :func:`rank_block` — the width of a LoRA-rank tile (tl.dot needs powers of two >= 16);
* :func:`row_bucket` — an autotune key for a row count that does not re-tune for every sequence length;
* :func:`check_kernel_device` — a clear error for CPU tensors outside the interpreter, and for an interpreter switched
  on (or off) after the kernels were built (:func:`kernels_interpreted`);
* :func:`check_interpreter_dtype` — bf16 refused in the interpreter, whose bf16 ``tl.dot`` is wrong (every Triton
  entry point calls it; fp16 and fp32 are right there);
* :func:`accumulate_matmul` — the K-loop of a GEMM tile through pointers (the LoRA GEMM and the loss kernels);
* :func:`tile_coords`, :func:`num_sms` — the persistent GEMM core's
  schedule (the LoRA GEMM's and the MoE row kernels' persistent forms walk their tiles in the same grouped order);
* :func:`skip_dropped_overflow_checks` — run on import: the interpreter stops computing the integer overflow checks
  it throws away.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["running_in_interpreter", "kernels_interpreted", "dot_precision", "rank_block", "row_bucket",
           "check_kernel_device", "check_interpreter_dtype", "InterpreterDtypeError", "interpreter_reason",
           "accumulate_matmul", "tile_coords", "num_sms", "cdiv", "next_power_of_2", "autotune_cache_kwargs",
           "skip_dropped_overflow_checks"]


def running_in_interpreter() -> bool:
    """True when Triton's interpreter is on now (``TRITON_INTERPRET=1``, or ``triton.knobs`` set in code); the
    kernels already built keep the state they were built in (:func:`kernels_interpreted`)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false", "no", "off")


def dot_precision(dtype: torch.dtype) -> str:
    """``ieee`` for fp32 operands (like torch.matmul with TF32 off); 16-bit types ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host-side grids and sizes. ``triton.cdiv`` is a constexpr function whose host call costs
    microseconds (argument unwrapping); a LoRA linear's forward + backward computes a couple of dozen of these."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0, as ``triton.next_power_of_2``), on the host (see :func:`cdiv`)."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


def rank_block(rank: int, cap: int | None = None) -> int:
    """Width of a rank tile: a power of two, at least 16 (the smallest tl.dot), at most ``cap`` if given.

    With a cap, a kernel covers larger ranks with several tiles (a grid axis or a loop); without one the
    whole rank is one tile.
    """
    width = max(16, next_power_of_2(max(int(rank), 1)))
    return min(width, cap) if cap is not None else width


def row_bucket(rows: int) -> int:
    """Autotune key for a row count: its power-of-two bucket."""
    return 1 << max(0, (max(rows, 1) - 1).bit_length())


def kernels_interpreted() -> bool:
    """True when this package's kernels were built for Triton's interpreter.

    ``triton.jit`` reads ``TRITON_INTERPRET`` once, when it decorates a kernel (at import of ``lora_lab.kernels``):
    changing the variable later changes :func:`running_in_interpreter` but not the kernels already built.
    """
    return _BUILT_FOR_INTERPRETER


def check_kernel_device(t: torch.Tensor, what: str) -> None:
    """A clear error before a launch that cannot work: CPU tensors without the interpreter, or an interpreter
    state that changed after the kernels were built (Triton would fail with "0 active drivers")."""
    built_for_interpreter = kernels_interpreted()
    if built_for_interpreter != running_in_interpreter():
        now = os.environ.get("TRITON_INTERPRET")
        raise RuntimeError(
            f"TRITON_INTERPRET is now {now!r} but lora_lab.kernels was imported with the interpreter "
            f"{'on' if built_for_interpreter else 'off'}: Triton builds its kernels at import time, so they still "
            f"run {'in the CPU interpreter' if built_for_interpreter else 'on a GPU driver'}. Set "
            "TRITON_INTERPRET=1 (CPU) or leave it unset (GPU) before importing lora_lab.kernels or triton, e.g. "
            "in the shell or at the top of the script, and start a fresh process"
        )
    if t.device.type != "cuda" and not built_for_interpreter:
        raise RuntimeError(
            f"the fused kernels need {what} on a CUDA device (got {t.device}); on a CPU set TRITON_INTERPRET=1 "
            "before importing lora_lab.kernels (or triton) to run them in Triton's interpreter (correctness only)"
        )


def interpreter_reason(weight: torch.Tensor, where: str) -> str | None:
    """Why a patcher cannot route a layer with this weight through the kernels (the checks of
    :func:`check_kernel_device` and :func:`check_interpreter_dtype`, as a reason string), or None."""
    for check in (lambda: check_kernel_device(weight, "the weights"),
                  lambda: check_interpreter_dtype(weight, op="patch_model")):
        try:
            check()
        except (RuntimeError, TypeError) as err:
            return f"{where}: {err}"
    return None


class InterpreterDtypeError(TypeError):
    """bf16 tensors given to a Triton kernel running in Triton's CPU interpreter."""


def check_interpreter_dtype(*tensors_or_dtypes, op: str) -> None:
    """Refuse bf16 in Triton's CPU interpreter (``TRITON_INTERPRET=1``): its bf16 ``tl.dot`` returns wrong values
    (not an error), so the op would silently give garbage. fp16 and fp32 are computed correctly there.

    ``op`` names the entry point in the message; None entries (absent optional tensors) are skipped. Every Triton
    entry point of the package calls this; a no-op on a GPU build.
    """
    if not _BUILT_FOR_INTERPRETER:
        return
    for t in tensors_or_dtypes:
        dtype = t.dtype if isinstance(t, torch.Tensor) else t  # None (an absent optional tensor) passes
        if dtype == torch.bfloat16:
            raise InterpreterDtypeError(
                f"{op}: bf16 is not supported in Triton's CPU interpreter (TRITON_INTERPRET=1): its bf16 tl.dot "
                "gives wrong results. Use fp16 or fp32 on the CPU (e.g. model.float()), or run bf16 on a CUDA GPU"
            )


@triton.jit
def accumulate_matmul(acc, in_ptr, stride_im, stride_ik, D, mat_ptr, stride_wk, stride_wn, rows, cols,
                      BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    # acc[m, n] += Σ_k In[rows[m], k] · Mat[k, cols[n]] over k < D; rows/cols already wrapped into range (the
    # caller masks its stores). A row-major W [N x D] is read as Mat = Wᵀ with stride_wk = 1, stride_wn = D.
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = in_ptr + rows.to(tl.int64)[:, None] * stride_im + ks[None, :] * stride_ik
    b_ptrs = mat_ptr + ks[:, None] * stride_wk + cols.to(tl.int64)[None, :] * stride_wn
    for k0 in range(0, tl.cdiv(D, BLOCK_K)):
        k_left = D - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=ks[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=ks[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ik
        b_ptrs += BLOCK_K * stride_wk
    return acc


@triton.jit
def tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of output tile ``tile_id`` in grouped order: GROUP_M row blocks share each column block
    while it sits in L2 (every GEMM kernel here, persistent or not)."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile_id % num_pid_in_group) % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


def num_sms(device: torch.device) -> int:
    """Programs of a persistent kernel: one per SM; in the interpreter (programs run one after another) a few,
    so that each walks several tiles."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


# fixed once this module's kernels exist (a jit-decorated function is an InterpretedFunction when Triton's
# interpreter was on at decoration time)
_BUILT_FOR_INTERPRETER = type(accumulate_matmul).__name__ == "InterpretedFunction"


def autotune_cache_kwargs() -> dict:
    """``{"cache_results": True}`` where this Triton's ``triton.autotune`` can keep its picks on disk (Triton's cache
    directory, keyed by the kernel's source, the tuning key and the configs), else ``{}``: a second process at a
    shape already tuned — the next training run, a benchmark's second session — reuses the pick instead of timing
    every config again. ``LORA_LAB_AUTOTUNE_CACHE=0`` turns it off (each process tunes afresh)."""
    import inspect
    import os

    import triton

    if os.environ.get("LORA_LAB_AUTOTUNE_CACHE", "1").strip() == "0":
        return {}
    return {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}


def skip_dropped_overflow_checks() -> bool:
    """In Triton's interpreter without debug, stop computing the int32 overflow check of every integer add, sub and
    mul: the interpreter computes it, then drops it (``device_assert`` does nothing unless the options ask for
    debug, which the interpreter's never do), so every result and error stays the same and interpreted kernels run
    a fifth to a third faster. Returns whether the check is off now; compiled kernels and debug runs are left
    alone."""
    import dataclasses

    if not running_in_interpreter():
        return False
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if not dataclasses.is_dataclass(options) or getattr(options, "debug", True) \
            or not hasattr(options, "sanitize_overflow"):
        return False
    if options.sanitize_overflow:
        builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True


skip_dropped_overflow_checks()
