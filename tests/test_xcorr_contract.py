"""One error contract for the cross-correlation accumulator on every device (the class notes): a bad batch is
never accumulated and raises no later than ``check()``; on CUDA the activation site is named, and work from two
streams is serialised. The CUDA kernels need a GPU (tests/test_cuda.py); what the Python side decides is tested
here with stand-ins for the device."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

import pyperm
from pyperm.nn.align import _activations
from pyperm.xcorr import _cuda
from pyperm.xcorr._state import CudaMoments


def test_on_the_cpu_the_update_raises_and_check_has_nothing_pending():
    acc = pyperm.CrossCorrelation(3, 2)
    assert acc.update(np.ones((4, 3)), np.zeros((4, 2))).check() is acc
    bad = np.ones((4, 3))
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match="NaN or infinity"):
        acc.update(bad, np.zeros((4, 2)))
    assert acc.check().count == 4  # the bad batch was not accumulated; nothing else is pending


class _Deferred:
    """An accumulator that, as on CUDA, finds a bad batch only when checked."""

    def __init__(self):
        self.bad = False

    def update(self, za, zb):
        self.bad |= not bool(torch.isfinite(za).all() and torch.isfinite(zb).all())

    def check(self):
        if self.bad:
            raise ValueError("xa contains NaN or infinity (update 1 of this accumulator, found on the device)")
        return self


class _Reading:
    def __init__(self, node):
        self.node, self.axis, self.first_group = node, 1, "h"

    def take(self, x, weights):
        return x


def test_a_device_error_names_the_activation_site_at_its_batch():
    readings = [_Reading("fc1"), _Reading("fc2")]
    good, bad = torch.ones(4, 3), torch.ones(4, 3)
    bad[0, 0] = float("inf")
    held = ({("fc1", 1): good, ("fc2", 1): bad}, {("fc1", 1): good, ("fc2", 1): good})
    accs = {0: _Deferred(), 1: _Deferred()}
    with pytest.raises(ValueError, match="activations of group 'h' at 'fc2' contain NaN or infinite values"):
        _activations._update(accs, readings, held, [{}, {}], on_device=True)


class _Stream:
    def __init__(self, name):
        self.name, self.waited = name, []

    def wait_stream(self, other):
        self.waited.append(other.name)


def test_work_from_another_stream_waits_for_the_stream_before(monkeypatch):
    state = _cuda.new_state(2, 2, "cpu")  # the dict only: no kernel runs here
    streams = {"s1": _Stream("s1"), "s2": _Stream("s2")}
    current = ["s1"]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams[current[0]])
    _cuda.serialise(state)
    _cuda.serialise(state)
    assert streams["s1"].waited == []  # one stream: in order by itself
    current[0] = "s2"
    _cuda.serialise(state)
    assert streams["s2"].waited == ["s1"] and state["stream"] is streams["s2"]


def test_a_device_accumulator_pickles_without_its_stream():
    moments = CudaMoments(2, 2, np.float64, "cpu")  # the dict's tensors on the CPU: no kernel runs here
    moments._acc["stream"] = lambda: None  # stands for a CUDA stream, which does not pickle
    assert pickle.loads(pickle.dumps(moments))._acc["stream"] is None


class _Recording:
    def __init__(self):
        self.seen = []

    def update(self, za, zb):
        self.seen.append((za.shape, zb.shape))

    def check(self):
        return self


def test_a_concatenated_reading_correlates_both_models_features_against_themselves():
    readings = [_Reading("fc1"), _Reading("fc2")]
    held = ({("fc1", 1): torch.ones(4, 3), ("fc2", 1): torch.ones(4, 3)},
            {("fc1", 1): torch.zeros(4, 3), ("fc2", 1): torch.zeros(4, 3)})
    accs = {0: _Recording(), 1: _Recording()}
    _activations._update(accs, readings, held, [{}, {}], on_device=True, concatenated=frozenset({1}))
    assert accs[0].seen == [(torch.Size([4, 3]), torch.Size([4, 3]))]
    assert accs[1].seen == [(torch.Size([4, 6]), torch.Size([4, 6]))]
