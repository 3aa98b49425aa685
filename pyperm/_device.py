"""Access to the optional CUDA extension, loaded only when CUDA input arrives."""

from __future__ import annotations

import functools
from types import ModuleType


@functools.lru_cache(maxsize=1)
def _load() -> ModuleType | None:
    try:
        from pyperm import _cuda  # noqa: F401  (built only when nvcc was found)
    except ImportError:
        return None
    return _cuda


def cuda_built() -> bool:
    """Whether this build of pyperm contains the CUDA kernels."""
    return _load() is not None


def cuda_available() -> bool:
    """Whether the CUDA kernels are built and a CUDA device is visible."""
    mod = _load()
    return mod is not None and mod.device_count() > 0


def cuda_module() -> ModuleType:
    """The CUDA extension, or a clear RuntimeError saying why it cannot be used."""
    mod = _load()
    if mod is None:
        raise RuntimeError(
            "pyperm was built without CUDA support: reinstall with nvcc on PATH "
            "(PYPERM_CUDA=ON makes a build without it fail loudly)"
        )
    if mod.device_count() == 0:
        raise RuntimeError("pyperm's CUDA kernels are built, but no CUDA device is visible")
    return mod
