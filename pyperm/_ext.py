"""The compiled modules: ``_core`` (CPU) loaded at import, ``_cuda`` loaded on first use.

The CUDA module is a separate extension so that ``import pyperm`` never needs the CUDA
runtime or a driver; it is imported only when CUDA input arrives or someone asks whether
it is there.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

__all__ = [
    "SIMD_CAP_VARIABLE",
    "core",
    "cuda_available",
    "cuda_built",
    "cuda_module",
    "cuda_unavailable_reason",
    "simd_cap",
    "simd_cap_changed",
]

# Caps the SIMD level of the CPU kernels, as numpy's NPY_DISABLE_CPU_FEATURES: read once by
# the core at its first solve, checked here at import so that a typo fails loudly instead of
# silently measuring the widest kernels.
SIMD_CAP_VARIABLE = "PYPERM_MAX_SIMD"
_SIMD_LEVELS = ("baseline", "avx2", "avx512")


def _requested_cap() -> str | None:
    """The level ``PYPERM_MAX_SIMD`` names now (None when unset); a bad value raises ValueError."""
    value = os.environ.get(SIMD_CAP_VARIABLE, "")
    if value == "":
        return None
    if value not in _SIMD_LEVELS:
        raise ValueError(f"{SIMD_CAP_VARIABLE} must be one of {', '.join(_SIMD_LEVELS)} (or unset), got {value!r}")
    return value


_CAP_IN_FORCE = _requested_cap()
from pyperm import _core as core  # noqa: E402  (after the check: the core reads the variable)

# The core reads the variable once, at its first choice of kernels: make that choice now, so
# that the cap in force is the one read here whatever the environment says later.
core.best_isa()


def simd_cap() -> str | None:
    """The SIMD level the kernels are capped at in this process (``PYPERM_MAX_SIMD`` as it was
    when pyperm was imported), or None when uncapped."""
    return _CAP_IN_FORCE


def simd_cap_changed() -> str | None:
    """Why the cap in force differs from what ``PYPERM_MAX_SIMD`` says now, or None when it
    does not: the variable is read once, at import, so a change later takes effect only in a
    new process."""
    now = os.environ.get(SIMD_CAP_VARIABLE, "") or None
    if now == _CAP_IN_FORCE:
        return None
    return (f"{SIMD_CAP_VARIABLE} is now {now!r} but was {_CAP_IN_FORCE!r} when pyperm was imported; the "
            "kernels keep the cap read at import: set it before importing pyperm (a new process)")


@functools.lru_cache(maxsize=1)
def _load_cuda() -> tuple[ModuleType | None, str]:
    """The CUDA extension and "", or None and why it is missing (its ImportError kept, not swallowed)."""
    try:
        from pyperm import _cuda  # built only when nvcc was found
    except ModuleNotFoundError as exc:
        if exc.name != "pyperm._cuda":
            return None, f"the CUDA module failed to import: {exc}"
        return None, (
            "pyperm was built without CUDA support: reinstall with nvcc on PATH "
            "(PYPERM_CUDA=ON makes a build without it fail loudly)"
        )
    except ImportError as exc:  # built, but cannot load (a missing or mismatched shared library)
        return None, f"the CUDA module failed to import: {exc}"
    return _cuda, ""


def cuda_built() -> bool:
    """Whether this build of pyperm contains the CUDA kernels (and they load)."""
    return _load_cuda()[0] is not None


def cuda_unavailable_reason() -> str | None:
    """Why the CUDA kernels cannot be used here, or None when they can.

    Examples: built without CUDA; the module fails to import; the CUDA runtime reports
    an error (``cudaErrorInsufficientDriver``: a driver older than the CUDA 13 runtime
    pyperm links statically); no device is visible.
    """
    mod, why = _load_cuda()
    if mod is None:
        return why
    if mod.device_count() > 0:
        return None
    error = mod.device_error()
    if error:
        return f"the CUDA runtime {mod.runtime_version()} found no usable device ({error})"
    return "pyperm's CUDA kernels are built, but no CUDA device is visible"


def cuda_available() -> bool:
    """Whether the CUDA kernels are built and a CUDA device is visible
    (:func:`cuda_unavailable_reason` says why not)."""
    return cuda_unavailable_reason() is None


def cuda_module() -> ModuleType:
    """The CUDA extension, or a clear RuntimeError saying why it cannot be used."""
    why = cuda_unavailable_reason()
    if why is not None:
        raise RuntimeError(why)
    return _load_cuda()[0]  # type: ignore[return-value]
