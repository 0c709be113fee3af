"""The run profiles: where a run computes, with what shapes, under what GPU memory cap, on which GPU class's path.

``cpu`` and ``gpu`` are the two shape sets the notebooks know (their code asks ``run.profile == "gpu"``). The other
profiles are the ``gpu`` profile with one thing forced, each with its own folder ``outputs/<name>/``: ``gpu-sm80``
takes the Ampere code path (``$LORA_LAB_ARCH``, :mod:`lora_lab.gpu_arch`). The capped
profiles are the ``gpu`` profile on a smaller card: the same shapes and device, the caching allocator capped at
``memory_cap_gib`` in the notebook's kernel and every process it starts (``$LORA_LAB_MEMORY_CAP_GIB``, see
:mod:`lora_lab.memory.budget`), and their own folder ``outputs/<name>/``. Their caps are the smallest card of the
class less about half a GiB for the CUDA context: 24 GB cards report about 22.5 (L4, A10) to 24 GiB (RTX 4090), the
40 GB A100 about 39.6 GiB. Predictions registered for ``gpu`` apply to them too (:func:`profile_applies`).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Profile", "PROFILE_TABLE", "PROFILES", "get_profile", "base_profile", "profile_applies"]


@dataclass(frozen=True)
class Profile:
    name: str
    base: str  # "cpu" or "gpu": the shapes and device the notebooks compute with
    memory_cap_gib: float | None = None  # what PyTorch's allocator may hold per GPU (None: the whole card)
    about: str = ""
    arch: str | None = None  # the GPU class's path the kernels take ($LORA_LAB_ARCH; None: the device's own)


PROFILE_TABLE: dict[str, Profile] = {
    "cpu": Profile("cpu", "cpu", None, "any laptop or CI: tiny shapes in Triton's interpreter"),
    "gpu": Profile("gpu", "gpu", None, "one CUDA GPU, real shapes (published runs: H200)"),
    "gpu-24g": Profile("gpu-24g", "gpu", 22.0, "the gpu profile capped as a 24 GB card (RTX 4090, L4, A10)"),
    "gpu-40g": Profile("gpu-40g", "gpu", 39.0, "the gpu profile capped as a 40 GB card (A100 40GB)"),
    "gpu-sm80": Profile("gpu-sm80", "gpu", None, "the gpu profile on the Ampere code path (no TMA, no CUTLASS "
                        "grouped GEMM)", arch="sm80"),
}
PROFILES = tuple(PROFILE_TABLE)


def get_profile(name: str) -> Profile:
    """The profile called ``name``; a ValueError naming the known ones for anything else."""
    if name not in PROFILE_TABLE:
        raise ValueError(f"unknown profile {name!r}: expected one of {', '.join(PROFILES)}")
    return PROFILE_TABLE[name]


def base_profile(name: str) -> str:
    """'cpu' or 'gpu': the shape set of profile ``name``."""
    return get_profile(name).base


def profile_applies(listed, profile: str) -> bool:
    """Whether something registered for the profiles ``listed`` applies to a run on ``profile``: listed by name, or
    (a capped profile) its base ``gpu`` is listed."""
    if profile in listed:
        return True
    return profile in PROFILE_TABLE and PROFILE_TABLE[profile].base != profile and base_profile(profile) in listed
