"""Floating-point dtypes by name: the spellings ``load_model``, ``merge_lora`` and the jobs accept.

One table, so that "fp32" means the same thing everywhere a dtype is an argument: a ``torch.dtype``, or one of
``fp32``/``float32``, ``bf16``/``bfloat16``, ``fp16``/``float16``, ``fp64``/``float64``.
"""
from __future__ import annotations

import torch

__all__ = ["DTYPE_NAMES", "FLOAT_DTYPES", "as_float_dtype"]

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
