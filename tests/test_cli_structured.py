"""Every ``pyperm`` sub-command on user models whose traced spec is structured: a concatenation, a flatten,
a grouped convolution, attention heads and a recurrent layer, each reading the 8x8 digits.

The models are random (no training: these tests check that every command takes every spec form, keeps
B's function and writes its outputs; the methods' quality is tested on the Python API)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from pyperm.checkpoints import load_checkpoint
from pyperm.cli import main

NO_BARS = ["--no-progress"]
SHAPE = ["--example-input-shape", "2,1,8,8"]
COMMON = ["--data", "digits", "--max-samples", "200", "--batch-size", "100"]

MODELS = '''
import torch
import torch.nn.functional as F
from torch import nn


class Concatenation(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 6, 3, padding=1)
        self.convs = nn.ModuleList([nn.Conv2d(6, 4, 3, padding=1), nn.Conv2d(10, 4, 3, padding=1)])
        self.fc = nn.Linear(14, 10)

    def forward(self, x):
        h = self.stem(x)
        for conv in self.convs:
            h = torch.cat([h, F.relu(conv(F.relu(h)))], 1)
        return self.fc(h.mean((2, 3)))


class Flatten(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 6, 3, padding=1, stride=2)
        self.fc1, self.fc2 = nn.Linear(96, 16), nn.Linear(16, 10)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(F.relu(self.conv(x)).flatten(1))))


class GroupedConvolution(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(1, 8, 1)
        self.b = nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.c = nn.Conv2d(8, 6, 1)
        self.fc = nn.Linear(6, 10)

    def forward(self, x):
        return self.fc(F.relu(self.c(F.relu(self.b(F.relu(self.a(x)))))).mean((2, 3)))


class AttentionHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 12)
        self.attn = nn.MultiheadAttention(12, 4, batch_first=True)
        self.head = nn.Linear(12, 10)

    def forward(self, x):
        h = self.embed(x.flatten(1, 2))  # the rows of the image are the tokens
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(h.mean(1))


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 6)
        self.rnn = nn.GRU(6, 10, batch_first=True)
        self.head = nn.Linear(10, 10)

    def forward(self, x):
        return self.head(self.rnn(torch.tanh(self.inp(x.flatten(1, 2))))[0][:, -1])
'''

KINDS = ["Concatenation", "Flatten", "GroupedConvolution", "AttentionHeads", "Recurrent"]


@pytest.fixture(scope="module")
def models_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    (folder / "models.py").write_text(MODELS)
    return folder / "models.py"


def _model(models_file, kind: str):
    namespace: dict = {}
    exec(compile(models_file.read_text(), str(models_file), "exec"), namespace)
    return namespace[kind]()


def _checkpoints(tmp_path, models_file, kind: str, count: int = 2) -> list[str]:
    """``count`` independently initialised checkpoints of ``kind``."""
    paths = []
    for seed in range(count):
        torch.manual_seed(seed)
        path = tmp_path / f"{kind}-{seed}.pt"
        torch.save(_model(models_file, kind).state_dict(), path)
        paths.append(str(path))
    return paths


def _spec_of(models_file, kind: str):
    from pyperm.nn import PermutationSpec

    return PermutationSpec.from_model(_model(models_file, kind), torch.randn(2, 1, 8, 8))


@pytest.mark.parametrize("kind", KINDS)
def test_the_traced_specs_are_structured(models_file, kind):
    assert _spec_of(models_file, kind).structured


@pytest.mark.parametrize("method", ["weight", "activation", "ste"])
@pytest.mark.parametrize("kind", KINDS)
def test_align_keeps_bs_function(tmp_path, models_file, kind, method):
    a, b = _checkpoints(tmp_path, models_file, kind)
    out = tmp_path / "out"
    argv = ["align", a, b, "--model", f"{models_file}:{kind}", *SHAPE, "--method", method, "--out", str(out)]
    if method != "weight":
        argv += [*COMMON, "--num-points", "3"]
    assert main(argv + NO_BARS) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["max_output_change_of_b"] < 1e-4
    spec = _spec_of(models_file, kind)
    assert {g["name"] for g in report["groups"]} == set(spec.groups)
    permuted = load_checkpoint(report["outputs"][0]).state
    original = torch.load(b)
    assert permuted.keys() == original.keys() and any(not torch.equal(permuted[k], original[k]) for k in original)


@pytest.mark.parametrize("kind", KINDS)
def test_barrier_with_every_alignment(tmp_path, models_file, kind):
    a, b = _checkpoints(tmp_path, models_file, kind)
    out = tmp_path / "out"
    argv = ["barrier", a, b, "--model", f"{models_file}:{kind}", *SHAPE, *COMMON, "--num-points", "3",
            "--align", "weight", "--align", "activation", "--align", "ste", "--out", str(out)]  # fmt: skip
    assert main(argv + NO_BARS) == 0
    report = json.loads((out / "report.json").read_text())
    assert set(report["paths"]) == {"naive", "weight", "activation", "ste"}


@pytest.mark.parametrize("kind", KINDS)
def test_merge_three_checkpoints(tmp_path, models_file, kind):
    paths = _checkpoints(tmp_path, models_file, kind, count=3)
    out = tmp_path / "out"
    assert main(["merge", *paths, "--model", f"{models_file}:{kind}", *SHAPE, *COMMON, "--out", str(out)]
                + NO_BARS) == 0  # fmt: skip
    merged = load_checkpoint(out / "merged.pt").state
    assert merged.keys() == torch.load(paths[0]).keys()


@pytest.mark.parametrize("kind", KINDS)
def test_curve_between_aligned_checkpoints(tmp_path, models_file, kind):
    a, b = _checkpoints(tmp_path, models_file, kind)
    aligned = tmp_path / "aligned"
    model = ["--model", f"{models_file}:{kind}", *SHAPE]
    assert main(["align", a, b, *model, "--out", str(aligned)] + NO_BARS) == 0
    b_aligned = json.loads((aligned / "report.json").read_text())["outputs"][0]
    out = tmp_path / "curve"
    assert main(["curve", "train", a, b_aligned, *model, *COMMON, "--epochs", "1", "--num-points", "3",
                 "--out", str(out)] + NO_BARS) == 0  # fmt: skip
    assert (out / "curve.safetensors").stat().st_size > 0
    assert main(["curve", "eval", a, b_aligned, str(out / "curve.safetensors"), *model, *COMMON,
                 "--num-points", "3", "--out", str(tmp_path / "eval")] + NO_BARS) == 0  # fmt: skip
