"""Floating-point dtypes by name: the spellings ``load_model``, ``merge_lora`` and the jobs accept.

One table, so that "fp32" means the same thing everywhere a dtype is an argument: a ``torch.dtype``, or one of
``fp32``/``float32``, ``bf16``/``bfloat16``, ``fp16``/``float16``, ``fp64``/``float64``.
"""
from __future__ import annotations

import torch

__all__ = ["DTYPE_NAMES", "FLOAT_DTYPES", "as_float_dtype", "addmm_fp32_out_works"]

DTYPE_NAMES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
               "fp16": torch.float16, "float16": torch.float16, "fp64": torch.float64, "float64": torch.float64}
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def as_float_dtype(dtype, what: str = "dtype") -> torch.dtype:
    """``dtype`` as a ``torch.dtype`` of :data:`FLOAT_DTYPES`; anything else (int, bool, float8, complex, an unknown
    name, a device string, ...) is a ValueError that names ``what`` and the accepted values, raised here rather than
    by a cast or a matmul later."""
    if isinstance(dtype, str) and dtype in DTYPE_NAMES:
        return DTYPE_NAMES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in FLOAT_DTYPES:
        return dtype
    raise ValueError(
        f"unsupported {what} {dtype!r}; expected one of " + ", ".join(str(d) for d in FLOAT_DTYPES)
        + f" (or by name: {', '.join(DTYPE_NAMES)})"
    )


_ADDMM_FP32_OUT: dict[tuple, bool] = {}


def addmm_fp32_out_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)`` and ``torch.mm(a, b,
    out_dtype=torch.float32, out=acc)`` run for ``dtype`` operands on ``device``: 16-bit operands accumulated into
    (or written as) an fp32 result by one cuBLAS call (CUDA builds that have ``aten::addmm.dtype_out`` and
    ``aten::mm.dtype_out``; the CPU build has neither). Probed once per device and dtype on 16 x 16 tensors."""
    key = (device.type, device.index, dtype)
    if key not in _ADDMM_FP32_OUT:
        try:
            a = torch.ones(16, 16, dtype=dtype, device=device)
            acc = torch.full((16, 16), float("nan"), dtype=torch.float32, device=device)
            torch.mm(a, a, out_dtype=torch.float32, out=acc)  # no C matrix: the NaNs must be overwritten
            torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
            _ADDMM_FP32_OUT[key] = bool(acc[0, 0].item() == 32.0)
        except (RuntimeError, TypeError, NotImplementedError):
            _ADDMM_FP32_OUT[key] = False
    return _ADDMM_FP32_OUT[key]
