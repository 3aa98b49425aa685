"""torchvision, timm and transformers for the tests, or a skip when they are not installed
(see :func:`pyperm.testing.import_torchvision` for torchvision over the CPU torch)."""

from __future__ import annotations

import types

import pytest

from pyperm.testing import import_torchvision as _import_torchvision


def import_torchvision() -> types.ModuleType:
    """torchvision, or skip the calling test."""
    try:
        return _import_torchvision()
    except ModuleNotFoundError:
        pytest.skip("torchvision is not installed")


def import_timm() -> types.ModuleType:
    """timm (which imports torchvision), or skip the calling test."""
    import_torchvision()
    return pytest.importorskip("timm")


def import_transformers() -> types.ModuleType:
    """transformers, or skip the calling test (or module). transformers imports torchvision when it is
    installed, which needs patching over the CPU torch first; without torchvision it imports on its own."""
    try:
        _import_torchvision()
    except ModuleNotFoundError:
        pass
    return pytest.importorskip("transformers")
