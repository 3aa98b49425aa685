"""weight_matching runs a match of small similarities on one torch thread, with the same answer."""

import sys

import pytest
import torch

from pyperm.nn import weight_matching
from pyperm.nn.models import ResNet20


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _models():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        a = ResNet20()
        torch.manual_seed(1)
        b = ResNet20()
    return a, b


def _match(spec, sa, sb):
    seen = []
    result = weight_matching(spec, sa, sb, seed=0, callback=lambda *_: seen.append(torch.get_num_threads()))
    return result, seen


def test_small_match_runs_on_one_thread_with_the_same_answer(two_threads, monkeypatch):
    matcher = sys.modules["pyperm.nn.align._matcher"]
    a, b = _models()
    spec = a.permutation_spec()
    sa, sb = a.state_dict(), b.state_dict()
    serial, threads_serial = _match(spec, sa, sb)
    assert set(threads_serial) == {1} and torch.get_num_threads() == 2  # restored
    monkeypatch.setattr(matcher, "SERIAL_BELOW", 0)  # every match on the caller's threads
    parallel, threads_parallel = _match(spec, sa, sb)
    assert set(threads_parallel) == {2} and torch.get_num_threads() == 2
    assert serial.iterations == parallel.iterations and serial.objective == parallel.objective
    for g in spec.sizes:
        assert torch.equal(serial.perms[g], parallel.perms[g]), g


def test_threads_are_restored_when_the_callback_raises(two_threads):
    a, b = _models()

    def fail(*_):
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        weight_matching(a.permutation_spec(), a.state_dict(), b.state_dict(), callback=fail)
    assert torch.get_num_threads() == 2
