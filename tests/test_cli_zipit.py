"""``pyperm merge A B --method zipit``: a full zip and a partial one of two MLPs trained here on the two halves
of the digits' labels, what they write, and the errors."""

from __future__ import annotations

import functools
import json

import pytest

torch = pytest.importorskip("torch")

from pyperm.checkpoints import load_checkpoint
from pyperm.cli import main
from pyperm.datasets import load_dataset, load_digits, to_batches
from pyperm.nn._training import train_classifier
from pyperm.nn import zipit
from pyperm.nn.models import MLP

WIDTHS = [64, 24, 24, 10]
MODEL = "mlp:" + ",".join(map(str, WIDTHS))


@functools.cache
def _task_model(task: int) -> dict:
    ds = load_digits()
    x, y = torch.from_numpy(ds.x_train), torch.from_numpy(ds.y_train)
    keep = (y < 5) if task == 0 else (y >= 5)
    return train_classifier(MLP(WIDTHS), (x[keep], y[keep]), batch_size=64, epochs=6, lr=0.05, seed=task,
                            optimizer="sgd", schedule="cosine")  # fmt: skip


def _paths(tmp_path):
    paths = []
    for task in (0, 1):
        path = tmp_path / f"task{task}.pt"
        torch.save(_task_model(task), path)
        paths.append(str(path))
    return paths


def _merge(paths, out, *extra):
    return main(["merge", *paths, "--model", MODEL, "--method", "zipit", "--data", "digits", "--out", str(out),
                 "--no-progress", *extra])  # fmt: skip


def test_full_zip(tmp_path):
    paths = _paths(tmp_path)
    out = tmp_path / "full"
    assert _merge(paths, out, "--beta", "0.25") == 0
    report = json.loads((out / "report.json").read_text())
    zipped = load_checkpoint(out / "zipped.pt").state
    assert zipped.keys() == _task_model(0).keys()
    assert report["stops"] == ["hidden1", "hidden2"] and report["beta"] == 0.25 and report["stop"] is None
    assert any(a + b > 0 for a, b in report["same_model_merges"].values())
    ev = report["evaluation"]
    assert set(ev) == {*paths, "ensemble of the inputs", "zipped"}
    assert "| zipped |" in (out / "report.md").read_text()
    # The zipped checkpoint is what pyperm.nn.zipit builds of the two models on the training split.
    ds = load_dataset("digits", seed=0)
    models = []
    for task in (0, 1):
        models.append(MLP(WIDTHS))
        models[-1].load_state_dict(_task_model(task))
    want = zipit(*models, models[0].permutation_spec(), to_batches(ds.x_train, ds.y_train, 256), beta=0.25).state
    assert all(torch.allclose(zipped[k], want[k], atol=1e-6) for k in want)


def test_partial_zip_writes_two_heads_sharing_the_trunk(tmp_path):
    paths = _paths(tmp_path)
    out = tmp_path / "partial"
    assert _merge(paths, out, "--stop", "hidden1") == 0
    head_a = load_checkpoint(out / "zipped_a.pt").state
    head_b = load_checkpoint(out / "zipped_b.pt").state
    trunk = [k for k in head_a if k.startswith("layers.0.")]
    assert trunk and all(torch.equal(head_a[k], head_b[k]) for k in trunk)
    assert not torch.equal(head_a["layers.2.weight"], head_b["layers.2.weight"])
    report = json.loads((out / "report.json").read_text())
    assert report["zipped_groups"] == ["hidden1"]
    ev = report["evaluation"]
    assert ev["zipped (both heads)"]["accuracy"] > max(ev[p]["accuracy"] for p in paths)


@pytest.mark.parametrize(
    "extra,message",
    [(["--stop", "nope"], "--stop nope"), (["--beta", "2"], "beta"), (["--weights", "0.5,0.5"], "--weights")],
)
def test_errors(tmp_path, capsys, extra, message):
    paths = _paths(tmp_path)
    assert _merge(paths, tmp_path / "bad", *extra) != 0
    assert message in capsys.readouterr().err


def test_needs_two_checkpoints_and_data(tmp_path, capsys):
    paths = _paths(tmp_path)
    assert main(["merge", *paths, paths[0], "--model", MODEL, "--method", "zipit", "--data", "digits", "--out",
                 str(tmp_path / "o")]) != 0  # fmt: skip
    assert "two checkpoints" in capsys.readouterr().err
    assert main(["merge", *paths, "--model", MODEL, "--method", "zipit", "--out", str(tmp_path / "o2")]) != 0
    assert "needs --data" in capsys.readouterr().err
