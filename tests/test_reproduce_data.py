"""``pyperm reproduce rebasin|curves|robust --data ... --scale ...`` on tiny MNIST and CIFAR files the tests write.

Nothing is downloaded. The CIFAR settings run on the CPU here and on a GPU (``--device cuda``)
where there is one (the ``device`` fixture). The paper-scale settings are run with their architectures and recipes
but a handful of epochs (the tests patch the numbers, not the code paths), so each check
takes seconds; the numbers of the findings are not asserted.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from pyperm.cli import main
from pyperm.reproduce import load_report
from pyperm.testing import one_thread
from test_datasets import _write_cifar, _write_mnist, write_cifar100


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def _mnist(root, n_train=96, n_test=48):
    root.mkdir()
    _write_mnist(root, gz=True, n_train=n_train, n_test=n_test)
    return root


def _run(args, capsys):
    code = main(["reproduce", *args, "--no-progress"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_rebasin_on_mnist_files(tmp_path, capsys):
    data = _mnist(tmp_path / "mnist")
    out = tmp_path / "out"
    code, stdout, err = _run(["rebasin", "--smoke", "--data", f"mnist:{data}", "--out", str(out)], capsys)
    assert code == 0, err
    body = json.loads((out / "report.json").read_text())
    assert body["settings"]["data"] == "mnist" and body["settings"]["model"] == "mlp:784,32,32,10"
    assert len(body["table2"]["rows"]) == 3 + 2  # three models, the naive average, MergeMany
    assert [r["epoch"] for r in body["figure3"]] == [1, 5, 10]
    md = (out / "report.md").read_text()
    assert "# Git Re-Basin on mnist" in md and "MNIST, 28x28 grey images, 96 training / 48 test" in md


def test_rebasin_paper_scale_on_cifar_files(tmp_path, capsys, monkeypatch, device):
    """At --scale paper on CIFAR, Fig. 4 uses the paper's conv models; each setting is beside the paper's line."""
    folder = tmp_path / "cifar"
    folder.mkdir()
    _write_cifar(folder, batches=(1, 2), n=8)
    report = load_report("rebasin")
    tiny = dict(report.SETTINGS["paper"], width=8, epochs=2, marks=[1, 2], ste_epochs=1, ste_batch=8, points=3,
                width_epochs=1, models=3, eval_batch=8, batch=8, conv_widths={"resnet20": [1]}, split_points=3,
                split_conv={"width": 1, "recipe": "resnet_sgd", "batch": 8, "epochs": 1})  # fmt: skip
    monkeypatch.setitem(report.SETTINGS, "paper", tiny)
    out = tmp_path / "out"
    args = ["rebasin", "--scale", "paper", "--data", f"cifar10:{folder}", "--out", str(out), "--device", device]
    code, stdout, err = _run(args, capsys)
    assert code == 0, err
    assert "expected time on this machine" in err  # said before the run
    body = json.loads((out / "report.json").read_text())
    assert [r["model"] for r in body["figure4"]] == ["resnet20:1,num_classes=10"]
    assert body["settings"]["model"] == "mlp:3072,8,8,8,10"
    md = (out / "report.md").read_text()
    assert '*paper:* "MLP (3 layers, 512 width)"' in md and "config.batch_size = 500" in md
    # Sec. 5.4 trains the paper's ResNet20 on CIFAR (git re-basin's split experiment)
    assert body["split_data"]["model"] == "resnet20:1,num_classes=10" and "labels 0-4" in md
    assert "## Sec. 5.4: merging models trained on different data" in md and "width multiplier 32" in md


def test_curves_paper_scale_on_cifar100_files(tmp_path, capsys, monkeypatch, device):
    folder = tmp_path / "cifar100"
    folder.mkdir()
    write_cifar100(folder, n_train=16, n_test=8)
    report = load_report("curves")
    tiny = dict(report.SETTINGS["paper"], epochs=1, curve_epochs=1, perm_steps=2, points=3, pairs=1, batch=8)
    monkeypatch.setitem(report.SETTINGS, "paper", tiny)
    out = tmp_path / "out"
    args = ["curves", "--scale", "paper", "--data", f"cifar100:{folder}", "--out", str(out), "--device", device]
    code, stdout, err = _run(args, capsys)
    assert code == 0, err
    body = json.loads((out / "report.json").read_text())
    assert [p["architecture"] for p in body["pairs"]] == ["tinyten", "resnet32"]
    sources = {f["source"] for f in body["findings"]}
    assert any(s.endswith("(tinyten)") for s in sources) and any(s.endswith("(resnet32)") for s in sources)
    md = (out / "report.md").read_text()
    assert "## Tables 1-2 for resnet32" in md and "For CIFAR100 curves ... 1E-1" in md
    assert "SGD lr 0.1 momentum 0.9" in md  # CIFAR-100's curve rate


def test_robust_paper_scale_on_cifar_files(tmp_path, capsys, monkeypatch, device):
    folder = tmp_path / "cifar"
    folder.mkdir()
    _write_cifar(folder, batches=(1,), n=8)
    report = load_report("robust")
    tiny = dict(report.SETTINGS["paper"], epochs=1, curve_epochs=1, train_steps=1, eval_steps=1, points=3,
                test_samples=4, batch=8)  # fmt: skip
    monkeypatch.setitem(report.SETTINGS, "paper", tiny)
    out = tmp_path / "out"
    args = ["robust", "--scale", "paper", "--data", f"cifar10:{folder}", "--out", str(out), "--device", device]
    code, stdout, err = _run(args, capsys)
    assert code == 0, err
    body = json.loads((out / "report.json").read_text())
    assert body["settings"]["arch"] == "tinyten" and np.isclose(body["settings"]["eps"], 8 / 255)


def test_the_command_says_when_the_scale_is_out_of_reach(tmp_path, capsys, monkeypatch):
    data = _mnist(tmp_path / "mnist")
    report = load_report("rebasin")
    monkeypatch.setattr(report, "estimate_seconds", lambda scale, data, device: 3 * 86400.0)
    tiny = dict(report.SETTINGS["smoke"])
    monkeypatch.setitem(report.SETTINGS, "full", tiny)  # the default scale, made tiny: only the message matters
    code, stdout, err = _run(["rebasin", "--data", f"mnist:{data}", "--out", str(tmp_path / "out")], capsys)
    assert code == 0, err
    assert "expected time on this machine (cpu): about 3.0 days" in err
    assert "cannot run rebasin at --scale full in reasonable time" in err and "--device cuda" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["rebasin", "--data", "mnist:{tmp}/absent"], "absent: not a directory"),
        (["rebasin", "--data", "mnist"], "mnist needs the directory of its files"),
        (["rebasin", "--data", "imagenet:{tmp}"], "expected one of digits, mnist:DIR"),
        (["teacher-student", "--data", "mnist:{tmp}"], "--data: the teacher-student report takes no data option"),
    ],
)
def test_bad_data_is_one_line_naming_it(tmp_path, capsys, args, message):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    code, stdout, err = _run([*args, "--smoke", "--out", str(tmp_path / "out")], capsys)
    assert code == 1 and message in err and "Traceback" not in err


def test_malformed_idx_file_is_named(tmp_path, capsys):
    data = _mnist(tmp_path / "mnist")
    (data / "train-labels-idx1-ubyte.gz").unlink()
    (data / "train-labels-idx1-ubyte").write_bytes(b"\x00\x00\x08\x01\x00\x00\x00\x09short")
    code, stdout, err = _run(["rebasin", "--smoke", "--data", f"mnist:{data}", "--out", str(tmp_path / "o")], capsys)
    assert code == 1 and "train-labels-idx1-ubyte: idx header says shape (9,)" in err


def test_estimates_are_positive_and_grow_with_scale():
    for name in ("rebasin", "curves", "robust"):
        report = load_report(name)
        quick = report.estimate_seconds("smoke", "digits", "cpu")
        full = report.estimate_seconds("full", "digits", "cpu")
        assert 0 < quick < full, name
