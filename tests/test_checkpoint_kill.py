"""A writer killed (SIGKILL) after each of its filesystem steps leaves the output loadable, through pyperm and through
the safetensors library, as exactly the old result or exactly the new one; the next write removes what it left.

The child process counts the steps pyperm's staging module takes (creating a staging file, fsyncing it,
renaming it into place, removing an old shard, fsyncing the folder) and kills itself right after step k, for
every k. A single file and a sharded checkpoint are written over an earlier result with ``force=True``, as
``pyperm merge ... --force`` does (issue 34, item 1: the old writer removed the old index first).
"""

from __future__ import annotations

import json
import signal
import subprocess
import tempfile
import sys

import pytest

torch = pytest.importorskip("torch")
safetensors = pytest.importorskip("safetensors")
pytest.importorskip("safetensors.torch")

from pyperm._staging import SUFFIX
from pyperm.checkpoints import load_checkpoint, save_checkpoint

from _checkpoint_layouts import LAYOUTS, write_layout

# The child: writes the new result over the old one, killing itself after filesystem step KILL_AT (never with 0),
# and prints how many steps the whole write took.
CHILD = r"""
import os, signal, sys
import torch
import pyperm._staging as staging
from pyperm.checkpoints import LazyState, load_checkpoint, save_checkpoint

source, target, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
copies = list(zip(sys.argv[4::2], sys.argv[5::2]))  # files copied beside the weights (an HF folder's config)
STEPS = {"open", "fsync", "replace", "unlink"}
count = 0


class Counting:
    def __getattr__(self, name):
        real = getattr(os, name)
        if name not in STEPS:
            return real

        def step(*args, **kwargs):
            global count
            out = real(*args, **kwargs)
            count += 1
            if count == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        return step


staging.os = Counting()
like = load_checkpoint(source)
save_checkpoint(like, LazyState(like.state, lambda key, t: -2 * t), target, force=True, copies=copies)
print(count)
"""


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(4, 3, generator=gen) for i in range(3)} | {
        "layers.0.bias": torch.randn(4, generator=gen).half()
    }


def _source(folder, layout: str):
    """The input checkpoint (whose layout is written) in ``folder``."""
    return write_layout(folder, layout, _state())


def _through_the_library(path) -> dict[str, torch.Tensor]:
    """The checkpoint at ``path`` read without pyperm: the index json by hand, every file by the library."""
    if path.name.endswith(".index.json"):
        weight_map = json.loads(path.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = [path.name]
    out: dict[str, torch.Tensor] = {}
    for name in files:
        if name.endswith(".safetensors"):
            with safetensors.safe_open(str(path.parent / name), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
        else:
            out.update(torch.load(path.parent / name, weights_only=True))
    return out


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _run_child(source, target, kill_at: int, copies=()) -> subprocess.CompletedProcess:
    # From a neutral folder: ``python -c`` puts the working directory first on the path, and a source
    # checkout there (CI tests the installed wheel) would shadow the installed package.
    pairs = [str(p) for pair in copies for p in pair]
    return subprocess.run([sys.executable, "-c", CHILD, str(source), str(target), str(kill_at), *pairs],
                          capture_output=True, text=True, timeout=300, cwd=tempfile.gettempdir())  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_write_killed_after_any_step_leaves_the_old_or_the_new_result(tmp_path, layout):
    source = _source(tmp_path / "in", layout)
    like = load_checkpoint(source)
    old = {k: v + 1 for k, v in like.state.items()}
    new = {k: -2 * v for k, v in like.state.items()}
    name = {"sharded": "out.safetensors.index.json", "safetensors": "out.safetensors", "torch": "out.pt"}[layout]

    # Unkilled, the child writes the new result and tells how many steps that took.
    (tmp_path / "free").mkdir()
    save_checkpoint(like, old, tmp_path / "free" / name)
    done = _run_child(source, tmp_path / "free" / name, 0)
    assert done.returncode == 0, done.stderr
    steps = int(done.stdout)
    assert steps >= (10 if layout == "sharded" else 4)
    assert _equal(load_checkpoint(tmp_path / "free" / name).state, new)

    seen = set()
    for kill_at in range(1, steps + 1):
        out = tmp_path / f"killed_{kill_at}"
        out.mkdir()
        save_checkpoint(like, old, out / name)
        killed = _run_child(source, out / name, kill_at)
        assert killed.returncode == -signal.SIGKILL, (kill_at, killed.stdout, killed.stderr)
        state = load_checkpoint(out / name).state
        which = "old" if _equal(state, old) else "new" if _equal(state, new) else "a mix"
        assert which != "a mix", f"killed after step {kill_at} of {steps}: the output is neither result"
        assert _equal(_through_the_library(out / name), old if which == "old" else new), kill_at
        seen.add(which)
        # The next write removes the killed one's staging files, and leaves exactly the new checkpoint's files.
        save_checkpoint(like, new, out / name, force=True)
        files = {p.name for p in out.iterdir()}
        ckpt = load_checkpoint(out / name)
        assert files == {name} | set(ckpt.weight_map.values()), (kill_at, files)
        assert not any(f.endswith(SUFFIX) for f in files)
        assert _equal(ckpt.state, new)
    assert seen == {"old", "new"}, "some kill points fall before the switch, some after"


HF_FILES = ["config.json", "generation_config.json", "tokenizer.json"]


@pytest.mark.parametrize("layout", ["sharded", "safetensors"])  # the switch: an index, or the one file
def test_a_folder_killed_after_any_step_never_holds_new_weights_beside_old_files(tmp_path, layout):
    """An HF output folder: the config and tokenizer are staged with the weights and in place before the switch,
    so a kill never leaves the new weights beside an old (or missing, or partial) config."""
    source = _source(tmp_path / "in", layout)
    for name in HF_FILES:
        (source.parent / name).write_text(f"new {name}\n")
    like = load_checkpoint(source)
    old = {k: v + 1 for k, v in like.state.items()}
    new = {k: -2 * v for k, v in like.state.items()}
    name = {"sharded": "out.safetensors.index.json", "safetensors": "out.safetensors", "torch": "out.pt"}[layout]

    def folder(out):
        save_checkpoint(like, old, out / name)
        for file in HF_FILES:
            (out / file).write_text(f"old {file}\n")
        return [(source.parent / file, out / file) for file in HF_FILES]

    (tmp_path / "free").mkdir()
    done = _run_child(source, tmp_path / "free" / name, 0, folder(tmp_path / "free"))
    assert done.returncode == 0, done.stderr
    steps = int(done.stdout)
    seen = set()
    for kill_at in range(1, steps + 1):
        out = tmp_path / f"killed_{kill_at}"
        out.mkdir()
        killed = _run_child(source, out / name, kill_at, folder(out))
        assert killed.returncode == -signal.SIGKILL, (kill_at, killed.stdout, killed.stderr)
        weights = "old" if _equal(load_checkpoint(out / name).state, old) else "new"
        assert _equal(load_checkpoint(out / name).state, old if weights == "old" else new), kill_at
        files = {file: (out / file).read_text() for file in HF_FILES}
        assert all(text in (f"old {f}\n", f"new {f}\n") for f, text in files.items()), (kill_at, files)
        if weights == "new":
            assert all(text == f"new {f}\n" for f, text in files.items()), (kill_at, files)
        seen.add(weights)
    assert seen == {"old", "new"}
