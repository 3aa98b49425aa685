"""``pyperm reproduce zipit``: the accuracies as the paper counts them, the findings' criteria, and the CIFAR-10 5+5 and
CIFAR-100 50+50 settings on tiny written files (the digits smoke run is tests/test_reproduce.py's)."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from test_datasets import write_cifar100

from pyperm.reproduce import zipit as report
from pyperm.testing import one_thread


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one torch thread is fastest, and far faster on a shared machine."""
    with one_thread():
        yield


def test_joint_and_task_accuracy():
    # 4 classes: task A is 0-1, task B 2-3.
    y = torch.tensor([0, 1, 2, 3])
    p = torch.tensor([[0.1, 0.0, 0.9, 0.0],   # joint wrong (2), task A right (0 over 1)
                      [0.0, 0.6, 0.4, 0.0],   # both right
                      [0.0, 0.0, 0.2, 0.8],   # joint wrong, task B wrong
                      [0.5, 0.0, 0.1, 0.4]])  # joint wrong, task B right  # fmt: skip
    scores = report._scores(lambda x: p, [(None, y)], 4)
    assert scores == {"joint": 0.25, "task_a": 1.0, "task_b": 0.5}


def _rows(full, permute, ensemble, beta0, partial):
    rows = {"ZipIt! full zip": {"joint": full}, "permute (weight matching)": {"joint": permute},
            "permute (activation matching)": {"joint": permute - 0.05}, "ensemble": {"joint": ensemble},
            "ZipIt! full zip, beta = 0": {"joint": beta0}}  # fmt: skip
    return rows, [(g, f"g{g}", {"joint": j}) for g, j in partial]


def test_the_findings_follow_their_criteria():
    rows, partial = _rows(0.6, 0.45, 0.9, 0.5, [(1, 0.85), (2, 0.7), (3, 0.62)])
    assert [f.agrees for f in report._findings(rows, partial, 3)] == [True, True, True]
    rows, partial = _rows(0.5, 0.45, 0.9, 0.55, [(1, 0.6), (2, 0.7)])
    assert [f.agrees for f in report._findings(rows, partial, 2)] == [False, False, False]


def test_paper_settings_name_the_papers_resnets():
    cifar10 = {"name": "cifar10", "num_classes": 10, "input_shape": (3, 32, 32)}
    cifar100 = {"name": "cifar100", "num_classes": 100, "input_shape": (3, 32, 32)}
    assert report._model_name("paper", cifar10)[0] == "resnet20:4,num_classes=10"
    assert report._model_name("paper", cifar100)[0] == "resnet20:8,num_classes=100"
    mnist = {"name": "mnist", "num_classes": 10, "input_shape": (1, 28, 28)}
    assert report._model_name("paper", mnist)[0] == "mlp:784,512,512,512,10"


def _write_cifar10(folder, n_train: int, n_test: int) -> None:
    rng = np.random.default_rng(0)
    for name, n in [*((f"data_batch_{i}", n_train // 5) for i in range(1, 6)), ("test_batch", n_test)]:
        labels = [int(v) for v in rng.integers(0, 10, n)]
        with open(folder / name, "wb") as f:
            pickle.dump({b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"labels": labels}, f)


@pytest.mark.parametrize("dataset", ["cifar10", "cifar100"])
def test_smoke_on_tiny_cifar_files(tmp_path, dataset, monkeypatch):
    folder = tmp_path / dataset
    folder.mkdir()
    if dataset == "cifar10":
        _write_cifar10(folder, 40, 12)
    else:
        write_cifar100(folder, n_train=40, n_test=12)
    monkeypatch.setitem(report.SETTINGS["smoke"], "zip_samples", 16)
    out = tmp_path / "out"
    out.mkdir()
    report.run(out, "smoke", data=f"{dataset}:{folder}", progress=False)
    body = json.loads((out / "report.json").read_text())
    assert body["settings"]["model"].startswith("resnet20:1,num_classes=")
    assert body["partial"] and "ZipIt! full zip" in body["accuracy"] and (out / "zip_layers.png").exists()
    assert len(body["findings"]) == 3
