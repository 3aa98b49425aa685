"""``pyperm bench match --scale MODEL --ranks N --checkpoints DIR``: the command line over ranks on a scale pair.

The pair is written once into ``DIR`` as two Hugging Face folders of sharded safetensors (``DIR/a`` and
``DIR/b``: ``config.json``, shards of at most ``SHARD_BYTES``, the index) with the planted permutations
beside them (``DIR/planted.json``), and reused while ``DIR/pair.json`` names the same model, dtype and seed.
Each tensor is drawn from its own generator (the seed and the key), so the writer holds one tensor at a time
and a 3B pair is written with a few GB of memory.

Then two runs, each a fresh process tree:

- ``1``: ``pyperm align DIR/a DIR/b --model hf`` in one process (the default start, as the ranks);
- ``N``: ``torchrun --nproc-per-node N -m pyperm align ...`` (gloo), each rank mapping only its shards.

Both write their report (``report.json``: sweeps, seconds, bytes per sweep, and each process's peak resident
memory, read from ``/proc/self/status`` at the end); the rows read it. The planted groups are checked
against each run's ``permutations.json`` one tensor of B at a time (mapped, not loaded). The one-process
run includes its check that permuted B computes B's function (a forward pass of the whole model); the ranks
do not run it. Peaks count the mapped pages each process touched.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pyperm import testing
from pyperm._staging import write_text

# Shards of at most 1 GiB, and at least MIN_SHARDS of them: "shard i of n goes to rank i * N // n", so
# fewer shards than ranks would leave ranks without work.
SHARD_BYTES = 1 << 30
MIN_SHARDS = 8


def _tensor(shape: Any, key: str, seed: int, norm_scale: bool) -> Any:
    import torch

    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    t = torch.randn(tuple(shape), generator=gen)
    return 1 + 0.02 * t if norm_scale else 0.02 * t


def _write_folder(folder: Path, config: Any, tensors: Callable[[], Any], shard_bytes: int) -> None:
    """A Hugging Face folder: config.json, shards of at most ``shard_bytes``, the index (written last)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    shard: dict[str, Any] = {}
    names: list[list[str]] = []
    total = size = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            names.append(list(shard))
            save_file(shard, str(folder / f"part-{len(names):05d}.safetensors"), metadata={"format": "pt"})
            shard, size = {}, 0

    for key, t in tensors():
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > shard_bytes:
            flush()
        shard[key] = t.contiguous()
        size += nbytes
        total += nbytes
    flush()
    count = len(names)
    weight_map = {}
    for i, keys in enumerate(names, start=1):
        final = f"model-{i:05d}-of-{count:05d}.safetensors"
        os.replace(folder / f"part-{i:05d}.safetensors", folder / final)
        weight_map.update(dict.fromkeys(keys, final))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_text(folder / "model.safetensors.index.json", json.dumps(index, indent=2))


def write_pair(name: str, dtype_name: str, folder: str | Path, seed: int = 0) -> Path:
    """The scale pair ``name`` as two sharded Hugging Face folders in ``folder`` (reused when already there)."""
    import torch

    from pyperm.benchmarks._match_scale import _HF_CONFIGS, NOISE, _spec_and_shapes
    from pyperm.nn import Permutations
    from pyperm.nn.permutations import permute_entry
    from pyperm.nn.state import shared_tensors
    from pyperm.testing import random_permutations

    if name not in _HF_CONFIGS:
        raise ValueError(f"--checkpoints needs a Hugging Face scale model ({', '.join(_HF_CONFIGS)}), got {name!r}")
    folder = Path(folder)
    marker = {"model": name, "dtype": dtype_name, "seed": seed, "shard_bytes": SHARD_BYTES, "min_shards": MIN_SHARDS}
    if pair_is_written(folder, marker):
        return folder
    from pyperm.benchmarks._hf_models import _transformers

    transformers = _transformers()
    model_cls, config_cls, kwargs = _HF_CONFIGS[name]
    config = getattr(transformers, config_cls)(**kwargs, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                               torch_dtype=dtype_name, architectures=[model_cls])  # fmt: skip
    spec, shapes, _ = _spec_and_shapes(name)
    dtype = getattr(torch, dtype_name)
    tied = {key for keys in shared_tensors(shapes) for key in keys[1:]}  # saved once, as Hugging Face does
    keys = [k for k in shapes if k not in tied]
    planted = Permutations(spec, random_permutations(spec, seed + 1))
    total = sum(shapes[k].numel() for k in keys) * dtype.itemsize
    shard_bytes = min(SHARD_BYTES, -(-total // MIN_SHARDS))

    def a_tensor(key: str) -> Any:
        t = shapes[key]
        return _tensor(t.shape, key, seed, t.ndim == 1 and key.endswith("weight")).to(dtype)

    def b_tensors():
        for key in keys:
            b = permute_entry(spec, planted, key, a_tensor(key)).float()
            noise = _tensor(b.shape, key + "/noise", seed, False) / 0.02
            yield key, (b + noise * (NOISE * float(b.std()) if b.numel() > 1 else 0.0)).to(dtype)

    _write_folder(folder / "a", config, lambda: ((k, a_tensor(k)) for k in keys), shard_bytes)
    _write_folder(folder / "b", config, b_tensors, shard_bytes)
    write_text(folder / "planted.json", json.dumps(planted.to_dict()))
    write_text(folder / "pair.json", json.dumps(marker))
    return folder


def pair_is_written(folder: Path, marker: dict[str, Any]) -> bool:
    """Whether ``folder`` holds a whole pair written for ``marker`` (its ``pair.json``, written last);
    if not, whatever part of a pair is there is removed, to be written anew."""
    done = folder / "pair.json"
    if done.exists() and json.loads(done.read_text()) == marker:
        return True
    for part in ("a", "b"):
        shutil.rmtree(folder / part, ignore_errors=True)
    done.unlink(missing_ok=True)
    return False


def _run(cmd: list[str], timeout: float) -> float:
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tempfile.gettempdir(), timeout=timeout)
    if proc.returncode != 0:
        # torchrun ends with ~25 lines of its own summary: the ranks' own last words come before it.
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-40:])
        raise RuntimeError(f"{' '.join(cmd[:6])} ... exited {proc.returncode}: {tail}")
    return time.perf_counter() - started


def wrong_groups_of_run(spec: Any, folder: Path, out: Path) -> set[str]:
    """The planted groups a run got wrong, B read one mapped tensor at a time."""
    from pyperm.benchmarks._match_scale import wrong_groups
    from pyperm.checkpoints import load_checkpoint
    from pyperm.nn import Permutations

    planted = Permutations.from_dict(spec, json.loads((folder / "planted.json").read_text()))
    found = Permutations.from_dict(spec, json.loads((out / "permutations.json").read_text()))
    state = load_checkpoint(folder / "b").state
    wrong: set[str] = set()
    for key in spec.axes:
        if key in state:
            wrong |= wrong_groups(spec, {key: state[key]}, found, planted)
    return wrong


def rows(names: list[str], dtypes: list[str], world: int, folder: str | Path, report: Callable[[str], None],
         timeout: float = 7200.0) -> tuple[list[list[Any]], list[str]]:  # fmt: skip
    """The ranks table's rows through the command line (the columns of :mod:`._match_ranks`) and the failures."""
    from pyperm.benchmarks._match_ranks import table_rows
    from pyperm.benchmarks._match_scale import MODELS

    table: list[list[Any]] = []
    failures: list[str] = []
    for name in names:
        for dtype in dtypes:
            title = MODELS.get(name, (name,))[0]
            report(f"  {title}, {dtype}: writing the pair to {folder} (once), then pyperm align in 1 process and "
                   f"over {world} ranks ...")  # fmt: skip
            try:
                one, many = measure(name, dtype, world, Path(folder) / f"{name}-{dtype}", timeout)
            except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
                failures.append(f"{name} {dtype} through the command line over {world} ranks: {exc}")
                continue
            table += table_rows(f"{name} {dtype}", title, dtype, one, many, failures)
    return table, failures


def measure(name: str, dtype_name: str, world: int, folder: str | Path, timeout: float) -> list[dict[str, Any]]:
    """The two runs (one process, then ``world`` ranks): each a dict of peaks, sweeps, seconds, bytes, found."""
    from pyperm.benchmarks._match_scale import _spec_and_shapes

    folder = write_pair(name, dtype_name, folder)
    spec = _spec_and_shapes(name)[0]  # traced once, for every run's check
    groups = len(spec.sizes)
    rows = []
    for ranks in (1, world):
        out = folder / f"out-{ranks}"
        shutil.rmtree(out, ignore_errors=True)
        align = ["align", str(folder / "a"), str(folder / "b"), "--model", "hf", "--out", str(out), "--no-progress"]
        if ranks == 1:
            cmd = [sys.executable, "-m", "pyperm", *align]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
                   "127.0.0.1", "--master-port", str(testing.free_port()), "-m", "pyperm", *align]  # fmt: skip
        wall = _run(cmd, timeout)
        report = json.loads((out / "report.json").read_text())
        info = report["matching"]
        sent = info.get("bytes_per_sweep") or [0]
        rows.append({"peaks": report["peak_rss_bytes"], "sweeps": max(info["iterations"], 1),
                     "seconds": info["seconds"], "wall": wall, "bytes": sum(sent) / len(sent),
                     "found": groups - len(wrong_groups_of_run(spec, folder, out)), "groups": groups,
                     "threads": report["torch_threads"]})  # fmt: skip
        shutil.rmtree(out, ignore_errors=True)
    return rows
