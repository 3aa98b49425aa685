"""The compiled modules: ``_core`` (CPU) loaded at import, ``_cuda`` loaded on first use.

The CUDA module is a separate extension so that ``import pyperm`` never needs the CUDA
runtime or a driver; it is imported only when CUDA input arrives or someone asks whether
it is there.
"""

from __future__ import annotations

import functools
from types import ModuleType

from pyperm import _core as core

__all__ = ["core", "cuda_available", "cuda_built", "cuda_module"]


@functools.lru_cache(maxsize=1)
def _load_cuda() -> ModuleType | None:
    try:
        from pyperm import _cuda  # built only when nvcc was found
    except ImportError:
        return None
    return _cuda


def cuda_built() -> bool:
    """Whether this build of pyperm contains the CUDA kernels."""
    return _load_cuda() is not None


def cuda_available() -> bool:
    """Whether the CUDA kernels are built and a CUDA device is visible."""
    mod = _load_cuda()
    return mod is not None and mod.device_count() > 0


def cuda_module() -> ModuleType:
    """The CUDA extension, or a clear RuntimeError saying why it cannot be used."""
    mod = _load_cuda()
    if mod is None:
        raise RuntimeError(
            "pyperm was built without CUDA support: reinstall with nvcc on PATH "
            "(PYPERM_CUDA=ON makes a build without it fail loudly)"
        )
    if mod.device_count() == 0:
        raise RuntimeError("pyperm's CUDA kernels are built, but no CUDA device is visible")
    return mod
