"""pyperm._gather.index_select (the compiled core's gathers along an inner axis) against torch's."""

import numpy as np
import pytest
import torch

from pyperm._ext import core
from pyperm._gather import index_select


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.uint8, torch.int64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, axis", [
    ((7, 5), 1),  # one entry a unit: a linear layer's columns
    ((6, 9, 3, 3), 1),  # a convolution's input channels: 9 entries a unit
    ((4, 3, 6, 5), 2),  # 5 entries: the overlapping moves of odd sizes
    ((3, 4, 17), 1),  # 17 entries: more than 16 bytes in every dtype
    ((2, 3, 4, 2), -2),  # a negative axis
])  # fmt: skip
def test_matches_torch(dtype, shape, axis):
    gen = torch.Generator().manual_seed(0)
    t = (torch.randn(shape, generator=gen) * 50).to(dtype)
    n = shape[axis]
    for index in (torch.randperm(n, generator=gen), torch.tensor([n - 1, 0, n - 1]), torch.arange(n)[1:]):
        expected = torch.index_select(t, axis, index)
        assert torch.equal(index_select(t, axis, index), expected)
        out = torch.full_like(expected, 3)
        assert index_select(t, axis, index, out=out) is out
        assert torch.equal(out, expected)


def test_large_tensors_on_several_threads():
    # 64 MiB of output: split over threads (a thread per MiB at most).
    t = torch.randn(2048, 1024, 8)
    index = torch.randperm(1024)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(index_select(t, 1, index), t[:, index])
    finally:
        torch.set_num_threads(threads)


def test_cases_it_leaves_to_torch_give_torch_results():
    t = torch.randn(6, 8, 3)
    index = torch.randperm(8)
    # not contiguous, the first axis, a non-contiguous out, a tensor in autograd (and an int32 index, which
    # the core takes converted)
    assert torch.equal(index_select(t.transpose(0, 2), 1, index), t.transpose(0, 2).index_select(1, index))
    assert torch.equal(index_select(t, 0, torch.tensor([5, 1])), t[[5, 1]])
    assert torch.equal(index_select(t, 1, index.int()), t[:, index])
    out = torch.empty(3, 8, 6).transpose(0, 2)
    index_select(t, 1, index, out=out)
    assert torch.equal(out, t[:, index])
    with pytest.raises(RuntimeError):  # out overlapping the input: torch's refusal, not a garbled copy
        index_select(t, 1, index, out=t)
    w = t.clone().requires_grad_()
    index_select(w, 1, index).sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))


def test_an_index_out_of_range_raises_and_writes_nothing():
    t = torch.randn(4, 5, 2)
    out = torch.zeros(4, 2, 2)
    with pytest.raises(IndexError, match="out of range"):
        index_select(t, 1, torch.tensor([0, 5]), out=out)
    with pytest.raises(IndexError, match="out of range"):
        index_select(t, 1, torch.tensor([-1, 0]), out=out)
    assert not out.any()


def test_the_core_checks_its_arrays():
    src = np.zeros((2, 3, 4), dtype=np.uint8)
    index = np.array([0, 2], dtype=np.int64)
    out = np.zeros((2, 2, 4), dtype=np.uint8)
    with pytest.raises(TypeError, match="out must be a C-contiguous"):
        core.gather_units(src, index, np.zeros((2, 4, 2), dtype=np.uint8).transpose(0, 2, 1), 1)
    with pytest.raises(TypeError, match="index must be"):
        core.gather_units(src, index.astype(np.int32), out, 1)
    with pytest.raises(ValueError, match="out must have shape"):
        core.gather_units(src, index, np.zeros((2, 3, 4), dtype=np.uint8), 1)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        core.gather_units(src, index, out, 1)
