"""Imports of the optional libraries that need care: torchvision over a torch it was not built for.

The registry's torchvision wheels are built against the CUDA build of torch. Over the CPU build
their compiled detection operators (``nms``, ``roi_align``, ...) do not load, and importing
torchvision fails while it registers shapes for those operators. transformers and diffusers
import torchvision whenever it is installed, so a user's ``pyperm align --model hf`` failed there
on models that use none of those operators. The command line, the benchmarks and the tests all
import through here, so they behave alike in a fresh process.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import types
from typing import Any

__all__ = ["import_torchvision", "prepare_hf_import"]

_log = logging.getLogger(__name__)


def import_torchvision() -> Any:
    """torchvision (ModuleNotFoundError when it is not installed).

    When its compiled operators do not load, the one module that registers their shapes is
    replaced by an empty one and the import tried again: the models and transforms work, the
    detection operators do not. Any other failure is raised as it is.
    """
    try:
        import torchvision
    except RuntimeError as exc:  # a torchvision built against another torch: its operators did not load
        if "torchvision::" not in str(exc):
            raise
        _log.info("torchvision's compiled operators do not load with this torch (%s); imported without them", exc)
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
        import torchvision
    return torchvision


def prepare_hf_import() -> None:
    """Makes torchvision importable, if it is installed, before transformers or diffusers is imported
    (they import it themselves and would fail on the error above)."""
    with contextlib.suppress(ModuleNotFoundError):  # not installed: transformers and diffusers do without it
        import_torchvision()
