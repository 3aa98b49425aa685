"""reset_bn_stats: exact statistics over all samples, modes and momenta restored, bad input."""

import pytest
import torch
from torch import nn

from pyperm.nn.eval.batchnorm import reset_bn_stats, resolve_bn_data

SIZES = (7, 23, 3, 31)  # unequal batches, a short one among them


def _split(x):
    out, start = [], 0
    for n in SIZES:
        out.append(x[start : start + n])
        start += n
    return out


def _assert_stats(bn, samples):
    """``samples`` (N, C): the module's running mean and unbiased variance must be theirs."""
    samples = samples.double()
    torch.testing.assert_close(bn.running_mean.double(), samples.mean(0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bn.running_var.double(), samples.var(0, unbiased=True), rtol=1e-5, atol=1e-6)


def test_batchnorm1d_stats_over_unequal_batches():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))
    x = 3.0 + 2.0 * torch.randn(sum(SIZES), 5)
    batches = [(xb, torch.zeros(len(xb), dtype=torch.long)) for xb in _split(x)]
    assert reset_bn_stats(model, batches) is model
    with torch.no_grad():
        _assert_stats(model[1], model[0](x))
    assert int(model[1].num_batches_tracked) == len(SIZES)


def test_deeper_batchnorm_sees_its_input_as_train_mode_computes_it():
    torch.manual_seed(1)
    lin1, bn1, lin2, bn2 = nn.Linear(3, 6), nn.BatchNorm1d(6), nn.Linear(6, 4), nn.BatchNorm1d(4)
    with torch.no_grad():
        bn1.weight.uniform_(0.5, 2.0)
        bn1.bias.normal_()
    model = nn.Sequential(lin1, bn1, nn.ReLU(), lin2, bn2)
    batches = _split(torch.randn(sum(SIZES), 3))
    reset_bn_stats(model, batches)
    # By hand: in each batch, bn1 normalises with the batch's own (biased) statistics.
    inputs2 = []
    with torch.no_grad():
        for xb in batches:
            h = lin1(xb)
            z = (h - h.mean(0)) / (h.var(0, unbiased=False) + bn1.eps).sqrt() * bn1.weight + bn1.bias
            inputs2.append(lin2(z.relu()))
        _assert_stats(bn1, torch.cat([lin1(xb) for xb in batches]))
    _assert_stats(bn2, torch.cat(inputs2))


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_convolutional_batchnorms_count_every_position(dims):
    torch.manual_seed(2)
    conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1](2, 3, 3)
    bn = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)[dims - 1](3)
    model = nn.Sequential(conv, bn)
    x = torch.randn((sum(SIZES), 2) + (5,) * dims) + 1.0
    reset_bn_stats(model, _split(x))
    with torch.no_grad():
        y = conv(x)
    _assert_stats(bn, y.movedim(1, -1).reshape(-1, 3))


def test_max_batches_reads_only_the_first_batches():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    batches = _split(torch.randn(sum(SIZES), 2))
    reset_bn_stats(model, batches, max_batches=2)
    with torch.no_grad():
        _assert_stats(model[1], model[0](torch.cat(batches[:2])))
    assert int(model[1].num_batches_tracked) == 2


def test_modes_momenta_and_parameters_are_restored():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3, momentum=None), nn.Dropout(0.5), nn.BatchNorm1d(3))
    model.train()
    model[3].eval()
    model[3].momentum = 0.3
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    reset_bn_stats(model, [torch.randn(8, 2), torch.randn(5, 2)])
    assert [m.training for m in model.modules()] == [True, True, True, True, False]
    assert model[1].momentum is None and model[3].momentum == 0.3
    assert all(torch.equal(p.detach(), params[k]) and p.grad is None for k, p in model.named_parameters())
    # Dropout was off while the statistics were read: bn3's input is bn1's train-mode output, without dropout noise.
    x = torch.randn(40, 2)
    reset_bn_stats(model, [x])
    with torch.no_grad():
        h = model[0](x)
        z = nn.functional.batch_norm(h, None, None, model[1].weight, model[1].bias, training=True, eps=model[1].eps)
    _assert_stats(model[3], z)


def test_model_without_batchnorm_is_returned_untouched():
    class Unreadable:
        def __iter__(self):
            raise AssertionError("data must not be read")

    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert reset_bn_stats(model, Unreadable()) is model
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_batchnorm_without_running_stats_is_skipped():
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3, track_running_stats=False))
    assert reset_bn_stats(model, [torch.randn(4, 2)]) is model


def test_failure_leaves_the_buffers_and_momenta_as_they_were():
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3, momentum=0.2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError):
        reset_bn_stats(model, [torch.randn(4, 2), torch.randn(4, 5)])
    assert model[1].momentum == 0.2
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_bad_arguments():
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        reset_bn_stats("model", [torch.randn(4, 2)])
    with pytest.raises(TypeError, match="data must be an iterable"):
        reset_bn_stats(model, torch.randn(4, 2))
    with pytest.raises(ValueError, match="data yielded no batches"):
        reset_bn_stats(model, [])
    with pytest.raises(ValueError, match="max_batches must be at least 1"):
        reset_bn_stats(model, [torch.randn(4, 2)], max_batches=0)
    with pytest.raises(TypeError, match=r"data\[0\] must be a tensor"):
        reset_bn_stats(model, [["x"]])
    with pytest.raises(ValueError):  # a single sample per channel: no variance
        reset_bn_stats(model, [torch.randn(1, 2)])


def test_resolve_bn_data_reads_bn_data_one_way():
    """The one reading of bn_data= for barriers, curves and planes: batches, None or False."""
    with_bn = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    without = nn.Linear(3, 4)
    batches = [torch.randn(5, 3)]
    assert resolve_bn_data(with_bn, batches) is batches
    assert resolve_bn_data(with_bn, False) is None  # the point's own statistics, knowingly
    assert resolve_bn_data(without, batches) is None and resolve_bn_data(without, None) is None
    with pytest.raises(ValueError, match=r"BatchNorm layers \('1'\).*pass bn_data=.*bn_data=False"):
        resolve_bn_data(with_bn, None)
    with pytest.raises(TypeError, match="bn_data must be an iterable of batches, False or None, not True"):
        resolve_bn_data(with_bn, True)
    with pytest.raises(TypeError, match="bn_data is read several times"):
        resolve_bn_data(without, iter(batches))  # checked even where no reset is needed
