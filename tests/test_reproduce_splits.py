"""The label-half splits and the calibration measures of the different-data reproductions."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pyperm.reproduce._calibration import calibration, logits_and_labels
from pyperm.reproduce._splits import accuracy_by_half, split_data, split_indices


def _labels(per_class=(30, 20, 40, 10, 50, 25, 35, 45, 15, 5)):
    y = np.concatenate([np.full(n, c) for c, n in enumerate(per_class)])
    return np.random.default_rng(3).permutation(y)


def test_the_paper_split_shares_each_half_20_80():
    y = _labels()
    a, b = split_indices(y, 10, (0.2, 0.8), seed=1)
    assert len(np.intersect1d(a, b)) == 0 and np.array_equal(np.sort(np.concatenate([a, b])), np.arange(len(y)))
    first = y < 5  # 150 examples of 0-4, 125 of 5-9
    assert first[a].sum() == 30 and (~first[a]).sum() == 100  # 20% of 150, 80% of 125
    assert first[b].sum() == 120 and (~first[b]).sum() == 25


def test_a_split_is_drawn_from_the_seed_and_fractions_are_options():
    y = _labels()
    a1, _ = split_indices(y, 10, seed=1)
    a2, _ = split_indices(y, 10, seed=1)
    a3, _ = split_indices(y, 10, seed=2)
    assert np.array_equal(a1, a2) and not np.array_equal(a1, a3)
    a, b = split_indices(y, 10, (1.0, 0.0))  # disjoint tasks
    assert set(y[a]) == {0, 1, 2, 3, 4} and set(y[b]) == {5, 6, 7, 8, 9}
    a, b = split_indices(np.arange(100) % 100, 100, (0.5, 0.5))
    assert len(a) == len(b) == 50


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        (((0.2,),), TypeError, "fractions must be a pair"),
        (("ab",), TypeError, "fractions must be a pair"),
        (((0.2, 1.5),), ValueError, r"fractions\[1\] must lie in \[0, 1\]"),
        (((0.0, 0.0),), ValueError, "leave model A without training examples"),
        (((1.0, 1.0),), ValueError, "leave model B without training examples"),
    ],
)
def test_bad_fractions_are_named(args, error, message):
    with pytest.raises(error, match=message):
        split_indices(_labels(), 10, *args)


def test_bad_labels_are_named():
    with pytest.raises(ValueError, match="labels must lie in 0..9"):
        split_indices(np.array([0, 10]), 10)
    with pytest.raises(TypeError, match="labels must be a 1-D array of class indices"):
        split_indices(np.zeros((2, 2), dtype=int), 10)
    with pytest.raises(ValueError, match="num_classes"):
        split_indices(np.array([0, 0]), 1)


def test_split_data_takes_the_rows_of_its_indices():
    y = torch.from_numpy(_labels())
    x = torch.arange(len(y), dtype=torch.float32)[:, None]  # each row says its own index
    a, b = split_data({"x_train": x, "y_train": y, "num_classes": 10}, (0.2, 0.8), seed=0)
    for part in (a, b):
        assert torch.equal(part["x_train"][:, 0].long(), torch.from_numpy(part["indices"]))
        assert torch.equal(part["y_train"], y[torch.from_numpy(part["indices"])])
        assert sum(part["halves"]) == part["num_train"] == len(part["indices"])
    assert a["halves"] == (30, 100) and b["halves"] == (120, 25)


def test_accuracy_by_half():
    labels = torch.tensor([0, 1, 5, 6])
    logits = torch.nn.functional.one_hot(torch.tensor([0, 2, 5, 5]), 10).float()
    assert accuracy_by_half(logits, labels, 10) == (0.5, 0.5)
    first, second = accuracy_by_half(logits[:2], labels[:2], 10)
    assert first == 0.5 and np.isnan(second)


def _with_confidence(p, predicted, classes=4):
    """Logits whose softmax gives ``p`` to class ``predicted`` and shares the rest evenly."""
    rest = (1 - p) / (classes - 1)
    probs = torch.full((classes,), rest, dtype=torch.float64)
    probs[predicted] = p
    return probs.log()


def test_ece_of_an_overconfident_and_a_calibrated_model():
    # 10 predictions at confidence 0.9, half of them right: one bin, gap 0.4.
    logits = torch.stack([_with_confidence(0.9, 0)] * 10)
    labels = torch.tensor([0] * 5 + [1] * 5)
    result = calibration(logits, labels)
    assert result["ece"] == pytest.approx(0.4)
    full = [r for r in result["bins"] if r["count"]]
    assert len(full) == 1 and full[0]["lower"] == pytest.approx(13 / 15) and full[0]["accuracy"] == 0.5
    # Right 3 of 4 times at 0.75 and 1 of 2 at 0.5 (on a bin's upper edge: 0.5 = 7.5/15 lies inside bin 7):
    # calibrated, ECE 0.
    logits = torch.stack([_with_confidence(0.75, 0)] * 4 + [_with_confidence(0.5, 2)] * 2)
    labels = torch.tensor([0, 0, 0, 3, 2, 1])
    result = calibration(logits, labels)
    assert result["ece"] == pytest.approx(0.0, abs=1e-12)
    assert sum(r["count"] for r in result["bins"]) == 6 and len(result["bins"]) == 15


def test_ece_weights_bins_by_their_share():
    # 3 at 0.95 all right (gap 0.05), 1 at 0.4 wrong (gap 0.4): (3 * 0.05 + 0.4) / 4.
    logits = torch.stack([_with_confidence(0.95, 0)] * 3 + [_with_confidence(0.4, 1)])
    labels = torch.tensor([0, 0, 0, 0])
    assert calibration(logits, labels)["ece"] == pytest.approx((3 * 0.05 + 0.4) / 4)
    assert calibration(logits, labels, bins=1)["ece"] == pytest.approx(abs(0.75 - (3 * 0.95 + 0.4) / 4))


def test_calibration_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="logits must be"):
        calibration(torch.zeros(3, 2), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="bins"):
        calibration(torch.zeros(3, 2), torch.zeros(3, dtype=torch.long), bins=0)


def test_logits_and_labels_concatenates_the_batches():
    model = torch.nn.Linear(3, 2)
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])
    logits, labels = logits_and_labels(model, [(x[:2], y[:2]), (x[2:], y[2:])])
    assert torch.allclose(logits, model(x).detach()) and torch.equal(labels, y)
