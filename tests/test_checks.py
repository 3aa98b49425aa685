"""pyperm._checks: the shared argument checks name the argument and pick TypeError or ValueError."""

import numpy as np
import pytest

from pyperm._checks import (
    check_bool,
    check_int,
    check_nonnegative_real,
    check_positive_int,
    check_threads,
    numpy_generator,
)


def test_check_int():
    assert check_int(np.int32(3), "k") == 3 and type(check_int(np.int32(3), "k")) is int
    assert check_int(None, "k", allow_none=True) is None
    assert check_int(-5, "k") == -5
    with pytest.raises(TypeError, match="k must be an int or None, got float"):
        check_int(1.0, "k", allow_none=True)
    with pytest.raises(TypeError, match="k must be an int, got bool"):
        check_int(True, "k")
    with pytest.raises(ValueError, match="k must be at least 1, got 0"):
        check_int(0, "k", 1)


def test_check_positive_int_and_threads():
    assert check_positive_int(2, "dim") == 2
    with pytest.raises(ValueError, match="dim must be at least 1, got 0"):
        check_positive_int(0, "dim")
    with pytest.raises(TypeError, match="dim must be a positive int, got str"):
        check_positive_int("2", "dim")
    assert check_threads(None) == 0 and check_threads(np.int64(4)) == 4
    with pytest.raises(TypeError, match="threads must be a positive int or None, got float"):
        check_threads(1.5)
    with pytest.raises(ValueError, match="threads must be at least 1, got 0"):
        check_threads(0)


def test_check_bool_and_real():
    assert check_bool(np.bool_(True), "maximize") is True
    with pytest.raises(TypeError, match="maximize must be a bool, got str"):
        check_bool("yes", "maximize")
    assert check_nonnegative_real(np.float32(0.5), "tol") == 0.5
    with pytest.raises(ValueError, match="tol must be finite and non-negative, got -1.0"):
        check_nonnegative_real(-1, "tol")
    with pytest.raises(ValueError, match="tol must be finite"):
        check_nonnegative_real(float("nan"), "tol")
    with pytest.raises(TypeError, match="tol must be a real number, got NoneType"):
        check_nonnegative_real(None, "tol")


def test_numpy_generator():
    assert numpy_generator(7).integers(1000) == np.random.default_rng(7).integers(1000)
    rng = np.random.default_rng(0)
    assert numpy_generator(rng) is rng
    assert isinstance(numpy_generator(None), np.random.Generator)
    with pytest.raises(ValueError, match="generator seed must be non-negative, got -1"):
        numpy_generator(-1)
    with pytest.raises(TypeError, match="seed must be a numpy Generator, an int seed or None, got float"):
        numpy_generator(1.0, "seed")


def test_check_positive_real():
    from pyperm._checks import check_positive_real

    assert check_positive_real(2, "lr") == 2.0 and isinstance(check_positive_real(2, "lr"), float)
    assert check_positive_real(1.0, "anneal", upper=1.0) == 1.0
    with pytest.raises(TypeError, match="lr must be a real number, got str"):
        check_positive_real("0.1", "lr")
    with pytest.raises(TypeError, match="lr must be a real number, got bool"):
        check_positive_real(True, "lr")
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="lr must be a finite positive number"):
            check_positive_real(bad, "lr")
    with pytest.raises(ValueError, match="anneal must be a finite positive number at most 1.0, got 1.5"):
        check_positive_real(1.5, "anneal", upper=1.0)
