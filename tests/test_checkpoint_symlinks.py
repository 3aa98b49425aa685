"""No write follows a symlink: a link planted at every name a writer creates is replaced (with ``force``/``--force``)
or refused (without), and the link's target is unchanged afterwards (issue 34, item 2).

The names: a checkpoint file, the shards and the index of a sharded one (both generations: the input's shard
names, and those a forced write over an earlier result takes), the reports, the plots, a curve file, and every
file each command writes (found by running it once). pyperm's staging names are random and created exclusively,
so no link can be planted at them in advance.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from pyperm.checkpoints import CheckpointError, load_checkpoint, output_paths, save_checkpoint

from _checkpoint_layouts import LAYOUTS, write_layout

VICTIM = b"the link's target: never written\n"


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"layers.0.weight": torch.randn(3, 2, generator=gen), "layers.0.bias": torch.randn(3, generator=gen),
            "layers.1.weight": torch.randn(2, 3, generator=gen), "layers.1.bias": torch.randn(2, generator=gen)}  # fmt: skip


def _source(folder, layout: str):
    """The input checkpoint (whose layout is written) in ``folder``."""
    return write_layout(folder, layout, _state())


def _plant(links, victims_folder):
    """A symlink at each of ``links``, each to its own victim file; returns {link: victim}."""
    victims_folder.mkdir(exist_ok=True)
    planted = {}
    for i, link in enumerate(links):
        victim = victims_folder / f"victim{len(list(victims_folder.iterdir()))}_{i}"
        victim.write_bytes(VICTIM)
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(victim, link)
        planted[link] = victim
    return planted


def _untouched(planted):
    for link, victim in planted.items():
        assert victim.read_bytes() == VICTIM, f"written through the link at {link}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_link_at_every_checkpoint_name_is_replaced_not_followed(tmp_path, layout):
    like = load_checkpoint(_source(tmp_path / "in", layout))
    out = tmp_path / "out"
    out.mkdir()
    target = out / {"sharded": "o.safetensors.index.json", "safetensors": "o.safetensors", "torch": "o.pt"}[layout]
    names = output_paths(like, target)
    planted = _plant(names, tmp_path / "victims")
    with pytest.raises(CheckpointError, match="exists; pass --force"):
        save_checkpoint(like, like.state, target)
    _untouched(planted)

    first = {k: v + 1 for k, v in like.state.items()}
    assert save_checkpoint(like, first, target, force=True) == names
    _untouched(planted)
    assert all(not n.is_symlink() and n.is_file() for n in names)
    assert torch.equal(load_checkpoint(target).state["layers.0.bias"], first["layers.0.bias"])

    # Over that result, a sharded write takes new shard names: links there too.
    again = output_paths(like, target)
    assert (set(again) - set(names)) or layout != "sharded"
    planted |= _plant([n for n in again if n not in names], tmp_path / "victims")
    second = {k: v + 2 for k, v in like.state.items()}
    save_checkpoint(like, second, target, force=True)
    _untouched(planted)
    got = load_checkpoint(target)
    assert all(torch.equal(got.state[k], second[k]) for k in second)
    assert not any(p.is_symlink() for p in got.path.parent.iterdir() if p.name in got.weight_map.values())


def test_reports_plots_and_curves_replace_a_link(tmp_path):
    pytest.importorskip("matplotlib")
    from pyperm._json import write_json
    from pyperm._staging import write_text
    from pyperm.nn import BezierCurve, plot_paths
    from pyperm.nn.curves import save_curve
    from pyperm.nn.eval.path import BarrierResult

    names = [tmp_path / n for n in ("report.json", "report.md", "barrier.png", "curve.safetensors")]
    planted = _plant(names, tmp_path / "victims")
    write_json(names[0], {"a": 1})
    write_text(names[1], "# report\n")
    result = BarrierResult(ts=[0.0, 0.5, 1.0], loss=[0.2, 0.9, 0.4], accuracy=[0.9, 0.6, 0.8], num_samples=7,
                           loss_barrier=0.6, accuracy_barrier=0.25)  # fmt: skip
    plot_paths({"naive": result}, names[2])
    net = torch.nn.Linear(2, 2)
    a = {k: v.detach().clone() for k, v in net.state_dict().items()}
    save_curve(BezierCurve(net, a, {k: -v for k, v in a.items()}), names[3])
    _untouched(planted)
    assert json.loads(names[0].read_text()) == {"a": 1} and names[1].read_text() == "# report\n"
    assert names[2].read_bytes()[:4] == b"\x89PNG" and not any(n.is_symlink() for n in names)


def test_the_command_line_replaces_links_with_force_and_refuses_without(tmp_path, capsys):
    from pyperm.cli import main

    inputs = []
    for seed in (1, 2):
        state = {k: v * seed for k, v in _state().items()}
        inputs.append(tmp_path / f"m{seed}.safetensors")
        safetensors_torch.save_file(state, str(inputs[-1]))
    out = tmp_path / "out"
    out.mkdir()
    names = [out / n for n in ("merged.safetensors", "report.json", "report.md")]
    planted = _plant(names, tmp_path / "victims")
    argv = ["merge", *map(str, inputs), "--model", "mlp:2,3,2", "--out", str(out), "--no-progress"]
    assert main(argv) == 1
    assert "exists; pass --force" in capsys.readouterr().err
    _untouched(planted)
    assert main(argv + ["--force"]) == 0
    _untouched(planted)
    assert all(n.is_file() and not n.is_symlink() for n in names)
    assert load_checkpoint(names[0]).state.keys() == _state().keys()


def test_a_generated_table_names_its_command_and_date_and_replaces_a_link(tmp_path, monkeypatch):
    """``pyperm bench match --write DIR``: the docs include these files instead of retyping measured numbers."""
    import datetime
    import sys

    from pyperm.benchmarks._report import write_generated

    monkeypatch.setattr(sys, "argv", ["pyperm", "bench", "match", "--write", str(tmp_path)])
    planted = _plant([tmp_path / "bench-match-flat.md"], tmp_path / "victims")
    path = write_generated(str(tmp_path), "bench-match-flat", "| a |\n|---|\n| 1 |")
    _untouched(planted)
    text = Path(path).read_text()
    assert text.startswith(f"Measured {datetime.date.today().isoformat()} by `pyperm bench match --write {tmp_path}`")
    assert text.endswith("| a |\n|---|\n| 1 |\n")


def _digits_checkpoints(folder) -> list[str]:
    from pyperm.nn.models import MLP

    paths = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        paths.append(str(folder / f"m{seed}.safetensors"))
        safetensors_torch.save_file(MLP([64, 16, 10]).state_dict(), paths[-1])
    return paths


DIGITS = ["--model", "mlp:64,16,10", "--data", "digits", "--max-samples", "200", "--batch-size", "100", "--no-progress"]
COMMANDS = {
    "align": lambda a, b: ["align", a, b, "--model", "mlp:64,16,10", "--no-progress"],
    "align --data": lambda a, b: ["align", a, b, *DIGITS, "--num-points", "3"],
    "merge": lambda a, b: ["merge", a, b, *DIGITS],
    "barrier": lambda a, b: ["barrier", a, b, *DIGITS, "--num-points", "3"],
    "curve train": lambda a, b: ["curve", "train", a, b, *DIGITS, "--epochs", "1", "--num-points", "3", "--linear"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_link_at_every_name_a_command_writes_is_replaced_not_followed(tmp_path, command):
    from pyperm.cli import main

    a, b = _digits_checkpoints(tmp_path)
    out = tmp_path / "out"
    argv = COMMANDS[command](a, b) + ["--out", str(out)]
    assert main(argv) == 0
    names = sorted(p for p in out.rglob("*") if p.is_file())
    assert len(names) >= 3, names  # the result and the two reports at least
    planted = _plant(names, tmp_path / "victims")
    assert main(argv + ["--force"]) == 0
    _untouched(planted)
    assert all(n.is_file() and not n.is_symlink() for n in names)


def test_a_reproduce_report_replaces_a_link(tmp_path):
    """``pyperm reproduce NAME --force`` writes its reports through :func:`pyperm.reproduce._report.write_report`
    (its plots through :func:`pyperm.nn.plot_paths`' staging, checked above)."""
    from pyperm.reproduce._report import write_report

    names = [tmp_path / "report.md", tmp_path / "report.json"]
    planted = _plant(names, tmp_path / "victims")
    write_report(tmp_path, "rebasin", ["# report"], [], scale="smoke", seed=0, seconds=1.0, settings={})
    _untouched(planted)
    assert names[0].read_text() == "# report\n" and not any(n.is_symlink() for n in names)


def test_leftovers_are_judged_only_where_their_process_id_means_something(tmp_path):
    import subprocess
    import sys

    from pyperm import _staging

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)  # a process id that ran here and ended
    here = _staging._host()
    left = {
        f".a.{dead}-{here}-0123456789ab{_staging.SUFFIX}": False,  # killed here: removed
        f".b.{dead}-0123456789ab-0123456789ab{_staging.SUFFIX}": True,  # another node's (shared filesystem)
        f".c.{os.getppid()}-{here}-0123456789ab{_staging.SUFFIX}": True,  # a live process here
        f".d.{dead}-0123456789ab{_staging.SUFFIX}": True,  # an older pyperm's: it did not say where it ran
    }
    for name in left:
        (tmp_path / name).write_bytes(b"partial")
    _staging.remove_leftovers(tmp_path)
    assert {name: (tmp_path / name).exists() for name in left} == left
    staged = _staging.stage(tmp_path / "x", lambda f: f.write(b"x"))  # its own name says where it runs
    assert staged.tmp.name.split(".")[-2].split("-")[1] == here
    staged.discard()


def test_every_write_of_the_package_goes_through_staging():
    """No ``write_text``/``write_bytes``, ``open`` for writing, ``savefig`` or ``torch.save`` to a path outside
    pyperm._staging (they follow a link planted at the name, and leave a partial file when killed)."""
    import re

    import pyperm

    root = Path(pyperm.__file__).parent
    direct = re.compile(r"\.write_(text|bytes)\(|\bopen\([^)]*['\"][wax]b?\+?['\"]|\.savefig\((?!f\b)|torch\.save\((?!.*, f\))")
    allowed = {("_memory.py", '"/proc/self/clear_refs"')}  # a kernel control file, not an output
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "_staging.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if direct.search(code) and not any(path.name == f and text in code for f, text in allowed):
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
