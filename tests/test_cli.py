"""``pyperm align|barrier|merge`` end to end on tiny MLPs trained here, in every checkpoint layout.

The commands run in-process through ``pyperm.cli.main`` (a subprocess would pay torch's import
again for every case); one test runs the installed console script to check the entry point.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
pytest.importorskip("matplotlib")

import pyperm
from pyperm.checkpoints import load_checkpoint
from pyperm.cli import BENCHMARKS, main
from pyperm.datasets import load_digits
from pyperm.nn._training import train_classifier
from pyperm.nn.models import MLP, TinyTen

WIDTHS = [64, 24, 24, 10]
MODEL = "mlp:" + ",".join(map(str, WIDTHS))
NO_BARS = ["--no-progress"]


@functools.cache
def _trained(seed: int) -> dict:
    ds = load_digits()
    x, y = torch.from_numpy(ds.x_train), torch.from_numpy(ds.y_train)
    # Trained enough for wide margins in the asserts.
    return train_classifier(MLP(WIDTHS), (x, y), batch_size=64, epochs=8, lr=0.05, seed=seed, optimizer="sgd",
                            schedule="cosine")  # fmt: skip


def _write(path, state, layout):
    """``state`` at ``path`` in one of the layouts people have (returns what to pass on the command line)."""
    if layout == "pt":
        torch.save(state, path.with_suffix(".pt"))
        return path.with_suffix(".pt")
    if layout == "wrapped":
        torch.save({"state_dict": state, "optimizer": {"lr": 0.1}}, path.with_suffix(".pth"))
        return path.with_suffix(".pth")
    if layout == "safetensors":
        safetensors_torch.save_file(state, str(path.with_suffix(".safetensors")))
        return path.with_suffix(".safetensors")
    folder = path.parent / (path.name + "_sharded")
    folder.mkdir()
    keys = sorted(state)
    weight_map = {k: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, k in enumerate(keys)}
    for shard in set(weight_map.values()):
        safetensors_torch.save_file({k: state[k] for k in keys if weight_map[k] == shard}, str(folder / shard))
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


def _outputs(model, state, x):
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("layout", ["pt", "wrapped", "safetensors", "sharded"])
def test_align_weight_writes_b_permuted_in_its_own_format(tmp_path, layout, capsys):
    a = _write(tmp_path / "a", _trained(1), layout)
    b = _write(tmp_path / "b", _trained(2), layout)
    out = tmp_path / "out"
    assert main(["align", str(a), str(b), "--model", MODEL, "--out", str(out), *NO_BARS]) == 0
    report = json.loads((out / "report.json").read_text())
    written = [p for p in report["outputs"]]
    assert len(written) == (3 if layout == "sharded" else 1)
    permuted = load_checkpoint(written[0])
    original = load_checkpoint(b)
    assert permuted.format == original.format and permuted.wrapper_key == original.wrapper_key
    # The permuted checkpoint computes B's function, and is not B itself.
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    model = MLP(WIDTHS)
    torch.testing.assert_close(
        _outputs(model, permuted.state, x), _outputs(model, original.state, x), rtol=1e-5, atol=1e-5
    )
    assert not torch.equal(permuted.state["layers.0.weight"], original.state["layers.0.weight"])
    assert report["matching"]["objective"] > report["matching"]["identity_objective"]
    assert [g["name"] for g in report["groups"]] == ["hidden1", "hidden2"]
    perms = json.loads((out / "permutations.json").read_text())
    assert sorted(perms["hidden1"]) == list(range(24))
    assert "## Objective per sweep" in (out / "report.md").read_text()
    assert "B permuted into A's basin" in capsys.readouterr().out


def test_align_activation_with_data_reports_barriers(tmp_path):
    a = _write(tmp_path / "a", _trained(1), "pt")
    b = _write(tmp_path / "b", _trained(2), "pt")
    out = tmp_path / "out"
    args = [
        "align",
        str(a),
        str(b),
        "--model",
        MODEL,
        "--method",
        "activation",
        "--data",
        "digits",
        "--num-points",
        "3",
        "--out",
        str(out),
    ]
    assert main(args + NO_BARS) == 0
    report = json.loads((out / "report.json").read_text())
    assert set(report["barriers"]) == {"naive", "activation"}
    assert report["barriers"]["activation"]["loss_barrier"] < report["barriers"]["naive"]["loss_barrier"]
    assert (out / "barrier.png").read_bytes()[:4] == b"\x89PNG"
    assert report["max_output_change_of_b"] < 1e-4


def test_barrier_naive_and_matched(tmp_path):
    a = _write(tmp_path / "a", _trained(1), "safetensors")
    b = _write(tmp_path / "b", _trained(2), "safetensors")
    out = tmp_path / "out"
    args = ["barrier", str(a), str(b), "--model", MODEL, "--data", "digits", "--align", "weight", "--align", "ste"]
    args += ["--num-points", "3", "--max-batches", "2", "--max-samples", "400", "--out", str(out)]
    assert main(args + NO_BARS) == 0
    report = json.loads((out / "report.json").read_text())
    assert set(report["paths"]) == {"naive", "weight", "ste"}
    assert report["paths"]["naive"]["ts"] == [0.0, 0.5, 1.0]
    assert report["paths"]["weight"]["loss_barrier"] < report["paths"]["naive"]["loss_barrier"]
    assert (out / "barrier.png").exists() and "| naive |" in (out / "report.md").read_text()


def test_merge_three_checkpoints(tmp_path):
    paths = [_write(tmp_path / f"m{i}", _trained(i), "pt") for i in (1, 2, 3)]
    out = tmp_path / "out"
    assert main(["merge", *map(str, paths), "--model", MODEL, "--data", "digits", "--out", str(out), *NO_BARS]) == 0
    report = json.loads((out / "report.json").read_text())
    merged = load_checkpoint(out / "merged.pt").state
    assert merged.keys() == _trained(1).keys()
    ev = report["evaluation"]
    assert ev["merged"]["loss"] < ev["plain average (no alignment)"]["loss"]
    assert report["peak_rss_bytes"][0] > 0
    assert "peak resident memory, GB (the process)" in (out / "report.md").read_text()


def test_merge_keeps_the_stored_dtype(tmp_path, monkeypatch):
    """bfloat16 checkpoints are merged as bfloat16 (no float32 copy of any model): the file holds merge_many's
    answer on the stored tensors, to the bit."""
    from pyperm.nn import merge_many

    half = [{k: v.to(torch.bfloat16) for k, v in _trained(i).items()} for i in (1, 2, 3)]
    paths = [_write(tmp_path / f"h{i}", s, "safetensors") for i, s in enumerate(half)]
    seen = []
    real = merge_many

    def recording(spec, states, **kwargs):
        seen.append({v.dtype for s in states for v in s.values()})
        return real(spec, states, **kwargs)

    monkeypatch.setattr(pyperm.nn, "merge_many", recording)
    out = tmp_path / "out"
    assert main(["merge", *map(str, paths), "--model", MODEL, "--out", str(out), *NO_BARS]) == 0
    assert seen == [{torch.bfloat16}]
    merged = load_checkpoint(out / "merged.safetensors").state
    want = real(MLP(WIDTHS).permutation_spec(), half).merged
    assert all(merged[k].dtype == torch.bfloat16 and torch.equal(merged[k], want[k]) for k in want)


def test_user_model_file_is_traced(tmp_path):
    (tmp_path / "net.py").write_text(
        "import torch\n"
        "class Net(torch.nn.Sequential):\n"
        "    def __init__(self):\n"
        "        super().__init__(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import net  # noqa: F401 (the file must be importable on its own)
    finally:
        sys.path.remove(str(tmp_path))
    states = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        states.append(torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3)).state_dict())
    for i, s in enumerate(states):
        torch.save(s, tmp_path / f"{i}.pt")
    spec = f"{tmp_path / 'net.py'}:Net"
    out = tmp_path / "out"
    base = ["align", str(tmp_path / "0.pt"), str(tmp_path / "1.pt"), "--model", spec, "--out", str(out), *NO_BARS]
    assert main(base) == 1  # no --example-input-shape
    assert main(base + ["--example-input-shape", "2,4"]) == 0
    assert json.loads((out / "report.json").read_text())["max_output_change_of_b"] < 1e-5


def _error(capsys, argv) -> str:
    assert main(argv) == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


def test_bad_input_is_one_line_and_nonzero(tmp_path, capsys):
    a = _write(tmp_path / "a", _trained(1), "pt")
    b = _write(tmp_path / "b", _trained(2), "pt")
    out = str(tmp_path / "out")
    (tmp_path / "corrupt.pt").write_bytes(b"\x00" * 64)
    line = _error(capsys, ["align", str(a), str(tmp_path / "corrupt.pt"), "--model", MODEL, "--out", out])
    assert line.startswith("pyperm align: error:") and "corrupt.pt: not a readable PyTorch checkpoint" in line
    line = _error(capsys, ["align", str(a), str(b), "--model", "mlp:64,32,24,10", "--out", out])
    assert "a.pt: key 'layers.0.weight' has shape (24, 64), model mlp:64,32,24,10 expects (32, 64)" in line
    other = dict(_trained(2), **{"layers.2.bias": torch.zeros(10, dtype=torch.float64)})
    torch.save(other, tmp_path / "c.pt")
    line = _error(capsys, ["align", str(a), str(tmp_path / "c.pt"), "--model", MODEL, "--out", out])
    assert "c.pt: key 'layers.2.bias' has dtype torch.float64" in line
    assert "needs --data" in _error(
        capsys, ["align", str(a), str(b), "--model", MODEL, "--method", "ste", "--out", out]
    )
    assert "unknown dataset 'imagenet'" in _error(
        capsys, ["barrier", str(a), str(b), "--model", MODEL, "--data", "imagenet", "--out", out]
    )
    assert "cuda:9" in _error(capsys, ["align", str(a), str(b), "--model", MODEL, "--out", out, "--device", "cuda:9"])
    assert "at least two checkpoints" in _error(capsys, ["merge", str(a), "--model", MODEL, "--out", out])
    small = MLP([10, 4, 3]).state_dict()
    torch.save(small, tmp_path / "small.pt")
    line = _error(
        capsys,
        [
            "barrier",
            str(tmp_path / "small.pt"),
            str(tmp_path / "small.pt"),
            "--model",
            "mlp:10,4,3",
            "--data",
            "digits",
            "--out",
            out,
        ],
    )
    assert "--model mlp:10,4,3 cannot run on --data digits (inputs of shape (1, 8, 8))" in line
    assert "--mean needs 1 or 1 values for digits" in _error(
        capsys, ["barrier", str(a), str(b), "--model", MODEL, "--data", "digits", "--mean", "0.1,0.2", "--out", out]
    )


def _usage_error(capsys, argv) -> str:
    """A bad option value is argparse's usage error: exit status 2, the option named, before any work."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "model, message",
    [
        ("mlp:64,,10", "model 'mlp:64,,10': option 2 is empty"),  # not an MLP with one hidden layer fewer
        ("resnet20:x", "'x' is not an integer or key=integer"),
        ("resnet99", "unknown architecture 'resnet99'; expected mlp:IN,HIDDEN...,OUT"),
        ("mlp:64,0,10", "'0' must be positive"),
    ],
)
def test_malformed_model_name_exits_2(tmp_path, capsys, model, message):
    line = _usage_error(capsys, ["align", "a.pt", "b.pt", "--model", model, "--out", str(tmp_path)])
    assert line.startswith("pyperm align: error: argument --model:") and message in line
    assert not any(tmp_path.iterdir())  # refused before any work


@pytest.mark.parametrize(
    "argv, message",
    [
        (["align", "a", "b", "--model", MODEL, "--num-points", "1"], "argument --num-points: expected an integer >= 2"),
        (["barrier", "a", "b", "--model", MODEL, "--data", "digits", "--batch-size", "0"], "argument --batch-size"),
        (["merge", "a", "b", "--model", MODEL, "--max-iter", "0"], "argument --max-iter"),
        (["align", "a", "b", "--model", MODEL, "--max-batches", "-1"], "argument --max-batches"),
        (["align", "a", "b", "--model", MODEL, "--ste-lr", "nan"], "argument --ste-lr: expected a finite positive"),
        (["align", "a", "b", "--model", MODEL, "--example-input-shape", "2,0"], "argument --example-input-shape"),
        (["bench", "lap", "--repeat", "0"], "argument --repeat: expected an integer >= 1, got '0'"),
        (["bench", "match", "--models", "mlp512,nope"], "argument --models: choose from mlp512,"),
    ],
)
def test_bad_option_values_exit_2(tmp_path, capsys, argv, message):
    assert message in _usage_error(capsys, argv + (["--out", str(tmp_path)] if argv[0] != "bench" else []))


@pytest.mark.parametrize("argv", [["bench", "lap", "--device", "cuda"], ["bench", "xcorr", "--device", "cuda"],
                                  ["bench", "bvn", "--device", "cuda"], ["bench", "match", "--device", "cuda"]])
@pytest.mark.skipif(pyperm.cuda_available(), reason="checks the message where no GPU can be used")
def test_benchmarks_on_cuda_without_a_gpu_say_why(capsys, argv):
    """--device cuda where pyperm cannot use a GPU: exit 2 and the reason, before anything is timed."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("--device cuda: ") and pyperm.cuda_unavailable_reason().split(" (")[0] in err


def test_bench_match_refuses_a_device_torch_does_not_know(capsys):
    assert main(["bench", "match", "--device", "tpu:x", "--models", "mlp512"]) == 2
    assert "--device: not a torch device: 'tpu:x'" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_benchmarks_spell_repeat(name):
    """One spelling for the number of timed runs: ``--repeat`` (pam times one iteration after a warm-up)."""
    import argparse
    import importlib

    parser = argparse.ArgumentParser()
    importlib.import_module(BENCHMARKS[name][0]).add_arguments(parser)
    options = parser._option_string_actions
    assert "--repeats" not in options
    assert ("--repeat" in options) == (name != "pam")


def test_existing_outputs_are_refused_without_force(tmp_path, capsys):
    a = _write(tmp_path / "a", _trained(1), "pt")
    b = _write(tmp_path / "b", _trained(2), "pt")
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("mine")
    argv = ["align", str(a), str(b), "--model", MODEL, "--out", str(out), *NO_BARS]
    assert "report.md: exists; pass --force" in _error(capsys, argv)
    assert (out / "report.md").read_text() == "mine" and not (out / "b_permuted.pt").exists()
    assert main(argv + ["--force"]) == 0
    assert (out / "report.md").read_text() != "mine"
    # Never over an input, even with --force: A here is where B permuted would go.
    shutil.copy(a, out / "b_permuted.pt")
    line = _error(capsys, ["align", str(out / "b_permuted.pt"), str(b), "--model", MODEL, "--out", str(out), "--force"])
    assert "b_permuted.pt: is one of the input checkpoints" in line


@pytest.mark.parametrize("command", ["align", "barrier", "merge", "reproduce"])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0 and "--out" in capsys.readouterr().out


def test_console_script_runs(tmp_path):
    exe = shutil.which("pyperm")
    if exe is None:
        pytest.skip("the pyperm console script is not installed")
    result = subprocess.run([exe, "align", "--help"], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0 and "--method" in result.stdout


def test_barrier_on_mnist_and_cifar_files(tmp_path):
    """``--data mnist:DIR`` and ``cifar10:DIR`` read the user's files (tiny ones written here), normalised on request."""
    from test_datasets import _write_cifar, _write_mnist

    (tmp_path / "mnist").mkdir()
    _write_mnist(tmp_path / "mnist", gz=True, n_train=20, n_test=10)
    (tmp_path / "cifar").mkdir()
    _write_cifar(tmp_path / "cifar", batches=(1,), n=12)
    cases = [
        ("mnist", "mnist", [784, 8, 10], []),
        ("cifar10", "cifar", [3072, 8, 10], ["--mean", "0.49,0.48,0.45", "--std", "0.25,0.24,0.26"]),
    ]
    for name, folder, widths, extra in cases:
        spec = "mlp:" + ",".join(map(str, widths))
        paths = []
        for seed in (0, 1):
            torch.manual_seed(seed)
            paths.append(tmp_path / f"{name}{seed}.pt")
            torch.save(MLP(widths).state_dict(), paths[-1])
        out = tmp_path / f"out_{name}"
        argv = [
            "barrier",
            *map(str, paths),
            "--model",
            spec,
            "--data",
            f"{name}:{tmp_path / folder}",
            "--align",
            "activation",
        ]
        assert main(argv + ["--num-points", "3", "--out", str(out), *extra, *NO_BARS]) == 0, name
        report = json.loads((out / "report.json").read_text())
        assert report["data"]["test_samples"] == (10 if name == "mnist" else 12)
        assert set(report["paths"]) == {"naive", "activation"}


def test_batchnorm_conv_model_on_cifar_files(tmp_path):
    """A bundled conv model with BatchNorm: align keeps its function (running statistics permuted too);
    the barrier and merge recompute the statistics on the training batches."""
    from test_datasets import _write_cifar

    (tmp_path / "cifar").mkdir()
    _write_cifar(tmp_path / "cifar", batches=(1,), n=8)
    paths = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = TinyTen()
        with torch.no_grad():  # non-trivial running statistics, so permuting them matters
            for name, buf in model.named_buffers():
                if name.endswith("running_mean"):
                    buf.normal_()
                elif name.endswith("running_var"):
                    buf.uniform_(0.5, 2.0)
        paths.append(tmp_path / f"t{seed}.safetensors")
        safetensors_torch.save_file(model.state_dict(), str(paths[-1]))
    data = ["--data", f"cifar10:{tmp_path / 'cifar'}", "--num-points", "3"]
    assert main(["align", *map(str, paths), "--model", "tinyten", *data, "--out", str(tmp_path / "a"), *NO_BARS]) == 0
    report = json.loads((tmp_path / "a" / "report.json").read_text())
    assert report["max_output_change_of_b"] < 1e-4
    assert report["barriers"]["weight"]["bn_reset"] is True
    data = data[:2]
    assert main(["merge", *map(str, paths), "--model", "tinyten", *data, "--out", str(tmp_path / "m"), *NO_BARS]) == 0
    assert load_checkpoint(tmp_path / "m" / "merged.safetensors").format == "safetensors"
