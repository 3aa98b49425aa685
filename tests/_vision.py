"""torchvision and timm for the tests, or a skip when they are not installed.

The registry's torchvision wheels are built against the CUDA build of torch. Over the
CPU build (this project's CI machine) their compiled detection operators (``nms``,
``roi_align``, ...) do not load, and importing torchvision then fails while it registers
shapes for those operators. The models these tests build use none of them, so that one
registration module is replaced by an empty one and the import tried again.
"""

from __future__ import annotations

import sys
import types

import pytest


def import_torchvision() -> types.ModuleType:
    """torchvision, or skip the calling test."""
    try:
        import torchvision
    except ModuleNotFoundError:
        pytest.skip("torchvision is not installed")
    except RuntimeError as exc:  # a torchvision built against another torch: its operators did not load
        if "torchvision::" not in str(exc):
            raise
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
        import torchvision
    return torchvision


def import_timm() -> types.ModuleType:
    """timm (which imports torchvision), or skip the calling test."""
    import_torchvision()
    return pytest.importorskip("timm")
