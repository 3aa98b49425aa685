"""``pyperm.show_config()``: how this copy of pyperm was built and what it finds at run time.

The conventions of ``numpy.show_config()`` and ``torch.__config__.show()``: one call that a
bug report can paste, printing the version, the compilers and flags, the SIMD levels compiled
and the one chosen on this machine, and the CUDA module (built or not, its architectures and
runtime, and why CUDA is unavailable when it is). ``mode="dicts"`` returns the same as nested
dicts instead of printing.
"""

from __future__ import annotations

import json
import platform
import sys
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["show_config", "version"]

_DIST = "pyperm"
_MODES = ("stdout", "dicts")


def version() -> str:
    """pyperm's version: the installed distribution's metadata (from ``pyproject.toml``).

    A source tree imported without being installed has no metadata; the compiled core then
    tells the version CMake was given, which comes from the same ``pyproject.toml``.
    """
    try:
        return metadata.version(_DIST)
    except metadata.PackageNotFoundError:
        from pyperm._ext import core

        return str(core.build_info()["version"])


def _installation() -> dict[str, Any]:
    """Where pyperm is imported from and how it got there (a wheel's tags, or an editable build)."""
    import pyperm

    info: dict[str, Any] = {"location": str(Path(pyperm.__file__).parent)}
    try:
        dist = metadata.distribution(_DIST)
    except metadata.PackageNotFoundError:
        info["installed"] = "no (imported from a source tree)"
        return info
    wheel = dist.read_text("WHEEL") or ""
    tags = [line.split(":", 1)[1].strip() for line in wheel.splitlines() if line.startswith("Tag:")]
    direct = dist.read_text("direct_url.json")
    editable = False
    if direct:
        try:
            editable = bool(json.loads(direct).get("dir_info", {}).get("editable", False))
        except ValueError:  # a malformed record says nothing about the install
            pass
    info["installed"] = "editable (built from the source tree)" if editable else "wheel"
    info["wheel_tags"] = ", ".join(tags) if tags else "unknown"
    return info


def _simd(core) -> dict[str, Any]:
    from pyperm._ext import SIMD_CAP_VARIABLE, simd_cap, simd_cap_changed

    build = core.build_info()
    compiled = [f"{name} ({flags})" if flags else name for name, flags in build["isas"].items()]
    cap = simd_cap()
    in_force = f"{SIMD_CAP_VARIABLE}={cap}" if cap else f"none ({SIMD_CAP_VARIABLE} unset)"
    changed = simd_cap_changed()
    if changed:
        # Reported where the user looks, and warned: the environment no longer says what runs.
        warnings.warn(changed, RuntimeWarning, stacklevel=3)
        in_force = f"{in_force if cap else 'none'} (in force since import; {changed})"
    return {
        "compiled": ", ".join(compiled),
        "chosen_at_run_time": core.best_isa(),
        "cpu_supports": core.hardware_isa(),
        "cap": in_force,
        "hardware_threads": core.hardware_threads(),
    }


def _cuda(core) -> dict[str, Any]:
    from pyperm._ext import _load_cuda, cuda_unavailable_reason

    module, why_missing = _load_cuda()
    info: dict[str, Any] = {"module_built": bool(core.build_info()["cuda_built"])}
    if module is not None:
        build = module.build_info()
        info.update(
            compiler=build["compiler"],
            host_compiler=build["host_compiler"] or "the default of nvcc",
            flags=build["flags"],
            architectures=", ".join(build["architectures"].split(";")),
            toolkit=build["toolkit"],
            runtime=f"{build['runtime']} ({build['runtime_linkage']}: the module needs only a driver)",
            driver=module.driver_version() or "none found",
            devices=module.device_count(),
        )
    elif info["module_built"]:
        info["import_error"] = why_missing
    reason = cuda_unavailable_reason()
    info["available"] = reason is None
    if reason is not None:
        info["unavailable_because"] = reason
    return info


def _dependencies() -> dict[str, str]:
    """Versions from the metadata, without importing anything (torch takes seconds to import)."""
    out = {}
    for name in ("numpy", "torch", "scipy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def config() -> dict[str, dict[str, Any]]:
    """Everything :func:`show_config` prints, as nested dicts."""
    from pyperm._ext import core

    build = core.build_info()
    return {
        "pyperm": {"version": version(), **_installation()},
        "python": {
            "version": f"{platform.python_version()} ({platform.python_implementation()})",
            "executable": sys.executable,
            "platform": platform.platform(),
        },
        "build": {
            "compiler": build["compiler"],
            "cxx_flags": build["cxx_flags"],
            "build_type": build["build_type"],
            "system": build["system"],
            "cmake": build["cmake"],
            "pybind11": build["pybind11"],
        },
        "simd": _simd(core),
        "cuda": _cuda(core),
        "dependencies": _dependencies(),
    }


def _format(cfg: dict[str, dict[str, Any]]) -> str:
    lines = []
    for section, fields in cfg.items():
        lines.append(f"{section}:")
        width = max(len(k) for k in fields)
        for key, value in fields.items():
            if isinstance(value, bool):
                value = "yes" if value else "no"
            lines.append(f"  {key.replace('_', ' ') + ':':<{width + 2}}{value}")
    return "\n".join(lines)


def show_config(mode: str = "stdout") -> dict[str, dict[str, Any]] | None:
    """Show how pyperm was built and what it can use on this machine.

    Prints (or returns) the version and how pyperm was installed, the C++ compiler and its
    flags, the SIMD instruction sets the kernels were compiled for and the one chosen on
    this machine, and for the CUDA module: whether it was built, its compiler, GPU
    architectures (``-real``: machine code, ``-virtual``: PTX the driver compiles for newer
    GPUs), the CUDA runtime linked into it, the driver found, and why CUDA is unavailable
    when it is. The conventions of ``numpy.show_config`` and ``torch.__config__.show``.

    Parameters
    ----------
    mode : {"stdout", "dicts"}, default "stdout"
        ``"stdout"`` prints the report; ``"dicts"`` returns it as nested dicts (sections
        ``pyperm``, ``python``, ``build``, ``simd``, ``cuda``, ``dependencies``) instead.

    Returns
    -------
    dict or None
        The nested dicts for ``mode="dicts"``, else None.

    Examples
    --------
    >>> import pyperm
    >>> pyperm.show_config()  # doctest: +SKIP
    pyperm:
      version:    0.1.0
    ...
    >>> pyperm.show_config(mode="dicts")["simd"]["chosen_at_run_time"]  # doctest: +SKIP
    'avx2'
    """
    if not isinstance(mode, str) or mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    cfg = config()
    if mode == "dicts":
        return cfg
    print(_format(cfg))
    return None
