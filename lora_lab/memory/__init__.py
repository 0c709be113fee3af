"""Where training memory goes, three ways: measured on CUDA (:mod:`.cuda_peak`), counted from the tensors on any
device (:mod:`.accounting`), and predicted from shapes alone (:mod:`.byte_model`; on N GPUs under FSDP2:
:mod:`.fsdp_byte_model`)."""
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
from .fsdp_byte_model import FsdpMemory, fsdp_memory, unit_parameter_shapes

__all__ = [
    "ATTENTION_KERNELS",
    "GIB",
    "LINEARS",
    "SDPA_OPS",
    "AnalyticMemory",
    "FixedMemory",
    "FsdpMemory",
    "ModelShape",
    "PeakMemory",
    "SavedActivationReport",
    "SavedTensorAccounting",
    "TrainingSetup",
    "analytic_memory",
    "default_module_labels",
    "dtype_of",
    "fixed_memory_by_category",
    "fsdp_memory",
    "peak_memory",
    "saved_activation_bytes",
    "saved_bytes_excluding",
    "sdpa_kernels_used",
    "unit_parameter_shapes",
]
