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


def test_check_choice_callable_fraction():
    from pyperm._checks import check_callable, check_choice, check_fraction

    assert check_choice("sgd", "optimizer", ("adam", "sgd")) == "sgd"
    with pytest.raises(ValueError, match="optimizer must be one of 'adam', 'sgd', got 'rmsprop'"):
        check_choice("rmsprop", "optimizer", ("adam", "sgd"))
    with pytest.raises(TypeError, match="optimizer must be one of 'adam', 'sgd', got NoneType"):
        check_choice(None, "optimizer", ("adam", "sgd"))
    assert check_callable(len, "loss_fn") is len and check_callable(None, "loss_fn", allow_none=True) is None
    with pytest.raises(TypeError, match="loss_fn must be a callable or None, got str"):
        check_callable("ce", "loss_fn", allow_none=True)
    with pytest.raises(TypeError, match="loss_fn must be a callable, got NoneType"):
        check_callable(None, "loss_fn")
    assert check_fraction(np.float32(0.25), "t") == 0.25 and check_fraction(1, "t") == 1.0
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="t must lie in"):
            check_fraction(bad, "t")
    with pytest.raises(TypeError, match="t must be a real number in"):
        check_fraction(True, "t")


def test_torch_generator():
    torch = pytest.importorskip("torch")
    from pyperm._checks import torch_generator

    g = torch.Generator().manual_seed(3)
    assert torch_generator(g) is g
    assert torch.equal(torch.randperm(9, generator=torch_generator(np.int64(4))),
                       torch.randperm(9, generator=torch.Generator().manual_seed(4)))
    with pytest.raises(ValueError, match="seed must be non-negative, got -1"):
        torch_generator(-1)
    with pytest.raises(TypeError, match="seed must be an int or a torch.Generator, got float"):
        torch_generator(0.0)
