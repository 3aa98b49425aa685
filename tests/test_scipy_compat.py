"""scipy's own tests of ``linear_sum_assignment``, run unchanged with pyperm's in its place.

The test functions are imported from the installed scipy (never copied here) and collected
as this module's, with their parametrisations; an autouse fixture swaps the solver they
call for :func:`pyperm.linear_sum_assignment`. So the drop-in promise of the README is
checked against scipy's exception types and messages, whatever scipy version is installed.
"""

import pytest

import pyperm

scipy_tests = pytest.importorskip("scipy.optimize.tests.test_linear_assignment")


@pytest.fixture(autouse=True)
def pyperm_in_scipys_place(monkeypatch):
    monkeypatch.setattr(scipy_tests, "linear_sum_assignment", pyperm.linear_sum_assignment)


def test_the_swap_takes_effect():
    assert scipy_tests.linear_sum_assignment is pyperm.linear_sum_assignment


# pytest collects every test_* function in this module's namespace, imported ones included.
globals().update({name: fn for name, fn in vars(scipy_tests).items() if name.startswith("test_") and callable(fn)})
