"""The argument checks shared by pyperm's public functions.

Each raises TypeError for a value of the wrong type and ValueError for one out of range,
with a message that names the argument, and returns the value in its canonical Python
type (so that numpy integers and the like never reach the compiled core).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

__all__ = [
    "callback_stops",
    "check_bool",
    "check_callable",
    "check_choice",
    "check_finite_real",
    "check_fraction",
    "check_int",
    "check_merge_weights",
    "check_nonnegative_real",
    "check_positive_real",
    "check_positive_int",
    "check_threads",
    "numpy_generator",
    "torch_generator",
]


def check_int(value: Any, name: str, minimum: int | None = None, *, allow_none: bool = False) -> int | None:
    """An integer (bool excluded) of at least ``minimum``; None passes through when allowed."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        kind = "an int or None" if allow_none else "an int"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)


def check_positive_int(value: Any, name: str) -> int:
    """An integer of at least 1 (a dimension, a count of something that must exist)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return int(value)


def check_threads(threads: Any) -> int:
    """A ``threads=`` argument: None gives 0 (all hardware threads), else a positive int."""
    if threads is None:
        return 0
    if isinstance(threads, bool) or not isinstance(threads, numbers.Integral):
        raise TypeError(f"threads must be a positive int or None, got {type(threads).__name__}")
    return check_positive_int(threads, "threads")


def check_bool(value: Any, name: str) -> bool:
    """A Python or numpy bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def check_nonnegative_real(value: Any, name: str) -> float:
    """A finite real number >= 0 (a tolerance)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and non-negative, got {value}")
    return value


def check_positive_real(value: Any, name: str, *, upper: float | None = None) -> float:
    """A finite real number > 0 (a learning rate, a step size, a proximal weight), at most ``upper`` if given."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value <= 0 or (upper is not None and value > upper):
        bound = f" at most {upper}" if upper is not None else ""
        raise ValueError(f"{name} must be a finite positive number{bound}, got {value}")
    return value


def check_finite_real(value: Any, name: str) -> float:
    """A finite real number of either sign (an interpolation weight that may extrapolate, a clamp bound)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def check_fraction(value: Any, name: str) -> float:
    """A real number in [0, 1] (a share, a point on a path)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number in [0, 1], got {type(value).__name__}")
    value = float(value)
    if not 0.0 <= value <= 1.0:  # also refuses NaN
        raise ValueError(f"{name} must lie in [0, 1], got {value}")
    return value


def check_choice(value: Any, name: str, choices: Any) -> str:
    """One of the strings ``choices``; the message lists them."""
    choices = tuple(choices)
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {', '.join(map(repr, choices))}, got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def check_callable(value: Any, name: str, *, allow_none: bool = False) -> Any:
    """A callable (a loss function, a callback); None passes through when allowed."""
    if value is None and allow_none:
        return None
    if not callable(value):
        kind = "a callable or None" if allow_none else "a callable"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__}")
    return value


def callback_stops(value: Any, name: str = "callback") -> bool:
    """Whether a callback's return value asks to stop: ``True`` stops, ``None`` or ``False`` goes on.

    Every callback of pyperm (``weight_matching``, ``train_curve``, ...) follows this one rule; any
    other value is a TypeError, so that a callback returning, say, a logged number never stops (or
    fails to stop) a method by accident.
    """
    if value is None:
        return False
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must return True (stop), False or None, got {type(value).__name__}")


def numpy_generator(generator: Any, name: str = "generator") -> np.random.Generator:
    """A numpy Generator from a Generator (used as is), a non-negative int seed, or None (OS entropy)."""
    if generator is None:
        return np.random.default_rng()
    if isinstance(generator, np.random.Generator):
        return generator
    if isinstance(generator, numbers.Integral) and not isinstance(generator, bool):
        if generator < 0:
            raise ValueError(f"{name} seed must be non-negative, got {generator}")
        return np.random.default_rng(int(generator))
    raise TypeError(f"{name} must be a numpy Generator, an int seed or None, got {type(generator).__name__}")


def torch_generator(seed: Any, name: str = "seed") -> Any:
    """A torch Generator from a Generator (used as is) or a non-negative int seed (torch imported lazily)."""
    import torch

    if isinstance(seed, torch.Generator):
        return seed
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"{name} must be an int or a torch.Generator, got {type(seed).__name__}")
    if seed < 0:
        raise ValueError(f"{name} must be non-negative, got {seed}")
    return torch.Generator().manual_seed(int(seed))


def check_merge_weights(weights: Any, count: int, name: str = "weights") -> list[float] | None:
    """One positive, finite weight per model, summing to 1 within ``1e-6`` (None stays None: equal weights)."""
    if weights is None:
        return None
    if isinstance(weights, (str, bytes)) or not hasattr(weights, "__len__") or not hasattr(weights, "__iter__"):
        raise TypeError(f"{name} must be a sequence of real numbers, got {type(weights).__name__}")
    values = [check_positive_real(w, f"{name}[{i}]") for i, w in enumerate(weights)]
    if len(values) != count:
        raise ValueError(f"{name} must hold one weight per model: got {len(values)} weights for {count} models")
    total = math.fsum(values)
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"{name} must sum to 1 (within 1e-6), got {values} summing to {total!r}")
    return values

