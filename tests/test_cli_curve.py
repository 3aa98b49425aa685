"""``pyperm curve train|eval`` end to end on two small MLPs trained on digits here.

The sub-command runs in-process through its own ``add_arguments``/``run`` (the protocol of
``pyperm.cli``), so it is tested whether or not ``pyperm.cli`` lists it yet; when it does,
``pyperm curve --help`` is checked through the real entry point too.
"""

from __future__ import annotations

import argparse
import functools
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("matplotlib")

from pyperm.commands import curve as curve_command
from pyperm.datasets import load_digits
from pyperm.nn._training import train_classifier
from pyperm.nn.curves import load_curve
from pyperm.nn.models import MLP

WIDTHS = [64, 16, 10]
MODEL = "mlp:" + ",".join(map(str, WIDTHS))
COMMON = ["--model", MODEL, "--data", "digits", "--max-samples", "300", "--batch-size", "64", "--no-progress"]


def pyperm_curve(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pyperm curve")
    curve_command.add_arguments(parser)
    return curve_command.run(parser.parse_args(argv))


@functools.cache
def _trained(seed: int) -> dict:
    ds = load_digits()
    x, y = torch.from_numpy(ds.x_train), torch.from_numpy(ds.y_train)
    return train_classifier(MLP(WIDTHS), (x, y), batch_size=64, epochs=4, lr=0.05, seed=seed, optimizer="sgd")


@pytest.fixture
def checkpoints(tmp_path):
    paths = []
    for seed in (1, 2):
        path = tmp_path / f"{seed}.pt"
        torch.save(_trained(seed), path)
        paths.append(str(path))
    return paths


def test_train_writes_the_curve_report_and_plot_and_eval_reads_it(tmp_path, checkpoints, capsys):
    a, b = checkpoints
    out = tmp_path / "curve"
    assert pyperm_curve(["train", a, b, *COMMON, "--epochs", "3", "--num-points", "5", "--linear",
                         "--out", str(out)]) == 0
    for name in ("curve.safetensors", "report.json", "report.md", "curve.png"):
        assert (out / name).stat().st_size > 0, name
    printed = capsys.readouterr().out
    assert "test accuracy min" in printed and str(out / "curve.safetensors") in printed
    report = json.loads((out / "report.json").read_text())
    training = report["training"]
    assert training["recipe"] == "garipov" and training["point_decay"] == 5e-4
    assert training["lr_schedule"] == "garipov" and len(training["loss_per_epoch"]) == 3
    assert report["curve"] == {"kind": "bezier", "num_bends": 1, "file": str(out / "curve.safetensors")}
    assert set(report["results"]) == {"train", "test"} and set(report["linear"]) == {"train", "test"}
    assert len(report["results"]["test"]["ts"]) == 5 and report["data"]["test_samples"] == 300
    # the curve trained off the straight line, and better than it at its worst point
    assert report["results"]["train"]["max_loss"] < report["linear"]["train"]["max_loss"]
    markdown = (out / "report.md").read_text()
    assert "0.5 * 0.0005 * ||theta(t)||^2" in markdown and "| curve, test |" in markdown

    # the file is a pyperm curve between these two checkpoints
    state_a = {k: v.float() for k, v in torch.load(a).items()}
    state_b = {k: v.float() for k, v in torch.load(b).items()}
    loaded = load_curve(out / "curve.safetensors", MLP(WIDTHS), state_a, state_b)
    assert loaded.num_bends == 1

    evaluated = tmp_path / "eval"
    assert pyperm_curve(["eval", a, b, str(out / "curve.safetensors"), *COMMON, "--num-points", "5",
                         "--out", str(evaluated)]) == 0
    again = json.loads((evaluated / "report.json").read_text())
    assert again["command"] == "curve eval" and not (evaluated / "curve.safetensors").exists()
    for split in ("train", "test"):
        assert again["results"][split]["loss"] == pytest.approx(report["results"][split]["loss"], rel=1e-6)
        assert again["results"][split]["accuracy"] == report["results"][split]["accuracy"]


def test_options_reach_training(tmp_path, checkpoints):
    a, b = checkpoints
    out = tmp_path / "plain"
    assert pyperm_curve(["train", a, b, *COMMON, "--epochs", "1", "--recipe", "none", "--curve", "polychain",
                         "--num-bends", "2", "--bend-decay", "1e-4", "--num-points", "3", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["training"]["point_decay"] == 0.0 and report["training"]["lr_schedule"] == "constant"
    assert report["training"]["bend_decay"] == 1e-4 and "linear" not in report
    assert report["curve"]["kind"] == "polychain" and report["curve"]["num_bends"] == 2


def test_eval_refuses_other_endpoints_and_outputs_are_not_overwritten(tmp_path, checkpoints, capsys):
    a, b = checkpoints
    out = tmp_path / "curve"
    assert pyperm_curve(["train", a, b, *COMMON, "--epochs", "1", "--num-points", "2", "--out", str(out)]) == 0
    capsys.readouterr()
    assert pyperm_curve(["eval", b, a, str(out / "curve.safetensors"), *COMMON, "--out", str(tmp_path / "e")]) == 1
    assert "is not the endpoint the curve" in capsys.readouterr().err
    assert pyperm_curve(["train", a, b, *COMMON, "--epochs", "1", "--out", str(out)]) == 1
    assert "exists; pass --force" in capsys.readouterr().err
    assert pyperm_curve(["eval", a, b, str(tmp_path / "1.pt"), *COMMON, "--out", str(tmp_path / "e")]) == 1
    assert "not a readable safetensors file" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["train", "a.pt", "b.pt", "--model", MODEL, "--data", "digits", "--out", "o"], "--epochs"),
    (["train", "a.pt", "b.pt", "--model", MODEL, "--data", "digits", "--epochs", "1", "--point-decay", "-1",
      "--out", "o"], "argument --point-decay: expected a finite number >= 0"),
    (["train", "a.pt", "b.pt", "--model", MODEL, "--data", "digits", "--epochs", "1", "--momentum", "nan",
      "--out", "o"], "argument --momentum: expected a finite number >= 0, got 'nan'"),
    (["train", "a.pt", "b.pt", "--model", MODEL, "--data", "digits", "--epochs", "1", "--bend-decay", "inf",
      "--out", "o"], "argument --bend-decay: expected a finite number >= 0, got 'inf'"),
    (["train", "a.pt", "b.pt", "--model", MODEL, "--data", "digits", "--epochs", "1", "--recipe", "tatro",
      "--out", "o"], "argument --recipe: invalid choice"),
    (["eval", "a.pt", "b.pt", "--model", MODEL, "--data", "digits", "--out", "o"], "CURVE"),
    ([], "{train,eval}"),
])
def test_bad_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        pyperm_curve(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_registered_in_the_command_line(capsys):
    from pyperm.cli import COMMANDS, main

    assert "curve" in COMMANDS  # registered: a missing command fails here rather than skipping
    with pytest.raises(SystemExit):
        main(["curve", "train", "--help"])
    assert "--recipe" in capsys.readouterr().out
