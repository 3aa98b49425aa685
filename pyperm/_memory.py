"""Giving freed memory back to the operating system, and reading the process's resident memory (Linux).

glibc's allocator keeps freed blocks below its mmap threshold (at most 32 MiB) in its heaps for
reuse; blocks freed in the middle of a heap are never returned, and a long loop that frees and
reallocates blocks of many sizes (weight matching's similarities and blocks of tensors) leaves
their pages resident: weight matching of a 1.1B-parameter Llama in float32 grew the process by
0.57x the model's size that way. ``malloc_trim`` returns every whole free page of the heaps (a few
milliseconds). Elsewhere than glibc this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from typing import Any

__all__ = ["release_free_memory", "reset_peak_resident", "resident_bytes"]


@functools.cache
def _malloc_trim() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_free_memory() -> None:
    """Return the allocator's free pages to the operating system (glibc; a no-op elsewhere)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def resident_bytes(field: str = "VmRSS") -> int:
    """The process's resident memory now (``"VmRSS"``) or at its peak (``"VmHWM"``), in bytes, from
    ``/proc/self/status`` (Linux; OSError elsewhere)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"field must be a memory line of /proc/self/status, got {field!r}")


_highest_read = 0  # the largest peak_resident() has returned since the last reset


def peak_resident() -> int | None:
    """The process's peak resident memory in bytes (mapped pages it touched included), or None where
    ``/proc`` cannot tell (not Linux): for reports, which say "unknown" rather than fail.

    Never less than an earlier reading: the kernel reads VmHWM as the larger of the resident memory now
    and a high-water mark it updates only at some events, so a peak read while it was the resident
    memory itself can be missing from a later reading after memory was unmapped (a pipeline's report
    then read less than one of its component's).
    """
    global _highest_read
    try:
        _highest_read = max(_highest_read, resident_bytes("VmHWM"))
    except OSError:
        return None
    return _highest_read


def reset_peak_resident() -> bool:
    """Restart the peak (``resident_bytes("VmHWM")``) from the current resident memory; False where the
    system cannot (not Linux)."""
    global _highest_read
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    _highest_read = 0
    return True
