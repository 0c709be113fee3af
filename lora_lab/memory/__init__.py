"""Where training memory goes, three ways: measured on CUDA (:mod:`.cuda_peak`), counted from the tensors on any
device (:mod:`.accounting`), and predicted from shapes alone (:mod:`.byte_model`)."""
from .accounting import (
    GIB,
    FixedMemory,
    SavedActivationReport,
    SavedTensorAccounting,
    default_module_labels,
    dtype_of,
    fixed_memory_by_category,
    saved_activation_bytes,
    saved_bytes_excluding,
)
from .byte_model import ATTENTION_KERNELS, LINEARS, AnalyticMemory, ModelShape, TrainingSetup, analytic_memory
from .cuda_peak import SDPA_OPS, PeakMemory, peak_memory, sdpa_kernels_used

__all__ = [
    "ATTENTION_KERNELS",
    "GIB",
    "LINEARS",
    "SDPA_OPS",
    "AnalyticMemory",
    "FixedMemory",
    "ModelShape",
    "PeakMemory",
    "SavedActivationReport",
    "SavedTensorAccounting",
    "TrainingSetup",
    "analytic_memory",
    "default_module_labels",
    "dtype_of",
    "fixed_memory_by_category",
    "peak_memory",
    "saved_activation_bytes",
    "saved_bytes_excluding",
    "sdpa_kernels_used",
]
