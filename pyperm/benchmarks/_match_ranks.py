"""``pyperm bench match --scale MODELS --ranks N``: the scale table's pairs matched over N gloo ranks on this machine.

For each model and dtype, two rows, each run in a fresh Python process:

- ``1``: one process, :func:`pyperm.nn.weight_matching` with ``init="identity"`` (the start the ranks use,
  so that the two rows do the same search: the scale table's row uses the default start);
- ``N``: N processes (``torch.multiprocessing`` spawn, a file store in a temporary folder, gloo), each
  holding a contiguous share of both models' keys, cut between layers (``...h.3.`` stays whole; tied tensors
  stay with the first key that holds them) and balanced by bytes, calling
  :func:`pyperm.distributed.weight_matching` with ``init="identity"``.

Each rank builds the whole pair (the same seeds as the scale table), keeps its share and frees the rest before
its peak is restarted, so ``peak RSS`` is what the call and its share need (torch's own imports included).
The columns: the peak resident memory of the largest rank and of all ranks together, both against the one
process; the sweeps and the time per sweep (the whole call over its sweeps), against the one process; the bytes
all ranks sent per sweep (``result.bytes_per_sweep``, averaged); the planted groups found, compared with the
plant as :func:`~pyperm.benchmarks._match_scale.recovered_groups` does (each rank checks the tensors it
holds; a group is found when no rank found it wrong). Each rank uses ``cpus // N`` torch threads (at least one),
the one process all of them. Every rank ends by ``deadline`` seconds: a rank still running then is killed and
the row fails; nothing waits for ever.
"""

from __future__ import annotations

import datetime
import gc
import os
import pickle
import re
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pyperm._staging import write_file
from pyperm.benchmarks._report import run_child

HEADERS = ["model", "dtype", "processes", "threads each", "peak RSS GB (largest)", "vs 1 process",
           "peak RSS GB (all)", "vs 1 process", "sweeps", "s / sweep", "vs 1 process", "MB sent / sweep",
           "groups found"]  # fmt: skip
DEADLINE = 1800.0


def headers(device: str) -> list[str]:
    """The columns; on a GPU the peaks are device memory (``torch.cuda.max_memory_allocated``)."""
    return HEADERS if device == "cpu" else [h.replace("RSS", "device memory") for h in HEADERS]


def shares(state: dict, world: int) -> list[list[str]]:
    """The keys in ``world`` contiguous shares cut between layers (a key's layer: its name up to its first
    number, ``transformer.h.3``), balanced by bytes; keys sharing a tensor go with the first of them."""
    units: dict[str, list[str]] = {}
    first: dict[int, str] = {}
    for key, t in state.items():
        m = re.match(r"(.*?\.\d+)(\.|$)", key)
        unit = m.group(1) if m else key
        unit = first.setdefault(id(t), unit)  # a tied tensor's later keys join its first key's unit
        units.setdefault(unit, []).append(key)
    distinct = {u: {id(state[k]): state[k] for k in keys}.values() for u, keys in units.items()}
    sizes = {u: sum(t.numel() * t.element_size() for t in ts) for u, ts in distinct.items()}
    total, out, acc = sum(sizes.values()), [[] for _ in range(world)], 0
    for u, keys in units.items():
        rank = min(world - 1, int(world * (acc + sizes[u] / 2) / max(total, 1)))
        out[rank] += keys
        acc += sizes[u]
    return out


def _threads(world: int) -> int:
    return max(1, (os.cpu_count() or 1) // world)


def _prepare(name: str, dtype_name: str, device: str, keep: Callable[[dict], list[str]] | None = None) -> tuple:
    """The pair (this process's share of it, on ``device``), with the peak memory counters restarted."""
    import torch

    from pyperm._memory import release_free_memory, reset_peak_resident
    from pyperm.benchmarks._match_scale import _pair

    spec, sa, sb, planted = _pair(name, getattr(torch, dtype_name))
    if keep is not None:
        kept = set(keep(sa))
        sa = {k: t for k, t in sa.items() if k in kept}
        sb = {k: t for k, t in sb.items() if k in kept}
    if device != "cpu":
        sa = {k: t.to(device) for k, t in sa.items()}
        sb = {k: t.to(device) for k, t in sb.items()}
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    gc.collect()
    release_free_memory()
    reset_peak_resident()
    return spec, sa, sb, planted


def _peak(device: str) -> int:
    """The peak since :func:`_prepare`: resident memory on the CPU, allocated device memory on a GPU."""
    import torch

    from pyperm._memory import resident_bytes

    if device == "cpu":
        return resident_bytes("VmHWM")
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def backend_for(device: str, world: int) -> str:
    """NCCL where every rank has a GPU of its own; gloo otherwise (NCCL refuses two ranks on one GPU)."""
    import torch

    return "nccl" if device != "cpu" and torch.cuda.device_count() >= world else "gloo"


def _rank_device(device: str, rank: int) -> str:
    import torch

    return device if device == "cpu" else f"cuda:{rank % torch.cuda.device_count()}"


def measure_one(name: str, dtype_name: str, max_iter: int = 100, device: str = "cpu") -> dict[str, Any]:
    """The one-process row from the identity, in this process."""
    import torch

    from pyperm.benchmarks._match_scale import recovered_groups
    from pyperm.nn import weight_matching

    spec, sa, sb, planted = _prepare(name, dtype_name, device)
    started = time.perf_counter()
    result = weight_matching(spec, sa, sb, init="identity", max_iter=max_iter)
    seconds = time.perf_counter() - started
    peak = _peak(device)
    found = recovered_groups(spec, sb, result.perms, planted)
    return {"peaks": [peak], "sweeps": max(result.iterations, 1), "seconds": seconds, "bytes": 0.0,
            "found": found, "groups": len(spec.sizes), "threads": torch.get_num_threads()}  # fmt: skip


def _rank(rank: int, world: int, name: str, dtype_name: str, tmp: str, deadline: float, max_iter: int,
          device: str) -> None:  # fmt: skip
    import torch
    import torch.distributed as dist

    from pyperm._comm import init_process_group
    from pyperm.benchmarks._match_scale import wrong_groups
    from pyperm.distributed import weight_matching

    torch.set_num_threads(_threads(world))
    try:
        backend, device = backend_for(device, world), _rank_device(device, rank)
        if backend == "nccl":
            torch.cuda.set_device(device)
        init_process_group(backend, init_method=f"file://{tmp}/store", rank=rank, world_size=world,
                           timeout=datetime.timedelta(seconds=deadline))  # fmt: skip
        spec, sa, sb, planted = _prepare(name, dtype_name, device, lambda s: shares(s, world)[rank])
        dist.barrier()
        started = time.perf_counter()
        result = weight_matching(spec, sa, sb, init="identity", max_iter=max_iter)
        seconds = time.perf_counter() - started
        peak = _peak(device)
        sent = result.bytes_per_sweep
        wrong = sorted(wrong_groups(spec, sb, result.perms, planted))
        outcome = ("ok", {"peak": peak, "seconds": seconds, "sweeps": max(result.iterations, 1),
                          "bytes": sum(sent) / max(len(sent), 1), "wrong": wrong,
                          "groups": len(spec.sizes), "threads": torch.get_num_threads(), "keys": len(sa)})  # fmt: skip
    except BaseException as exc:  # reported by the parent, which fails the row
        outcome = ("error", f"{type(exc).__name__}: {exc}")
    write_file(Path(f"{tmp}/rank{rank}.pkl"), lambda f: pickle.dump(outcome, f))
    if outcome[0] == "ok":
        dist.destroy_process_group()
    else:
        os._exit(1)  # the other ranks' collectives fail or time out; the parent kills them at the deadline


def measure_ranks(name: str, dtype_name: str, world: int, deadline: float = DEADLINE,
                  max_iter: int = 100, device: str = "cpu") -> dict[str, Any]:  # fmt: skip
    """The N-rank row: ``world`` spawned processes, each its share; raises if a rank fails or outlives ``deadline``."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_rank, args=(world, name, dtype_name, tmp, deadline, max_iter, device), nprocs=world,
                                 join=False, start_method="spawn")  # fmt: skip
        end = time.monotonic() + deadline
        for p in ctx.processes:
            p.join(max(0.0, end - time.monotonic()))
            if p.exitcode not in (None, 0):  # one failed: give the others a moment to report, then end them
                end = min(end, time.monotonic() + 10.0)
        hung = [p for p in ctx.processes if p.is_alive()]
        for p in hung:
            p.kill()
            p.join()
        outcomes = []
        for rank, p in enumerate(ctx.processes):
            try:
                with open(f"{tmp}/rank{rank}.pkl", "rb") as f:
                    outcomes.append(pickle.load(f))
            except OSError:
                outcomes.append(("error", "killed at the deadline" if p in hung else f"exit code {p.exitcode}"))
    errors = [f"rank {r}: {o[1]}" for r, o in enumerate(outcomes) if o[0] != "ok"]
    if errors:
        raise RuntimeError("; ".join(errors))
    ranks = [o[1] for o in outcomes]
    wrong = set().union(*(r["wrong"] for r in ranks))
    return {"peaks": [r["peak"] for r in ranks], "sweeps": ranks[0]["sweeps"],
            "seconds": max(r["seconds"] for r in ranks), "bytes": ranks[0]["bytes"],
            "found": ranks[0]["groups"] - len(wrong), "groups": ranks[0]["groups"], "threads": ranks[0]["threads"],
            "keys": [r["keys"] for r in ranks]}  # fmt: skip


def rows(names: list[str], dtypes: list[str], world: int, report: Callable[[str], None],
         deadline: float = DEADLINE, max_iter: int = 100, device: str = "cpu") -> tuple[list[list[Any]], list[str]]:
    """The table's rows (one process, then ``world`` ranks, per model and dtype) and the failures
    (``max_iter``: the sweeps allowed; the tests' 0 finds no group). On a GPU (``device="cuda"``) the
    pair lives on the devices and the peaks are device memory; NCCL where each rank has a GPU, else gloo
    with the ranks sharing the devices."""
    from pyperm.benchmarks._match_scale import MODELS

    table, failures = [], []
    for name in names:
        for dtype in dtypes:
            title = MODELS.get(name, (name,))[0]
            report(f"  {title}, {dtype}, 1 process and {world} ranks ...")
            m = "import json, pyperm.benchmarks._match_ranks as m; print(json.dumps(m.measure_"
            try:
                one = run_child(f"{m}one({name!r}, {dtype!r}, {max_iter}, {device!r})))", deadline)
                many = run_child(f"{m}ranks({name!r}, {dtype!r}, {world}, {deadline}, {max_iter}, {device!r})))",
                                 deadline + 60)  # fmt: skip
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                failures.append(f"{name} {dtype} over {world} ranks: {exc}")
                continue
            table += table_rows(f"{name} {dtype}", title, dtype, one, many, failures)
    return table, failures


def table_rows(what: str, title: str, dtype: str, one: dict, many: dict, failures: list[str]) -> list[list[Any]]:
    """The two rows of one model and dtype (``one`` process, ``many`` ranks: dicts with peaks, sweeps,
    seconds, bytes, found, groups and threads); a planted group not found is added to ``failures``."""
    for r in (one, many):
        if r["found"] != r["groups"]:
            failures.append(f"{what}, {len(r['peaks'])} process(es): {r['groups'] - r['found']} planted groups not found")
    base_peak, base_sweep = one["peaks"][0], one["seconds"] / one["sweeps"]
    out = []
    for r in (one, many):
        per_sweep = r["seconds"] / r["sweeps"]
        out.append([
            title, dtype, len(r["peaks"]), r["threads"], f"{max(r['peaks']) / 1e9:.2f}",
            f"{max(r['peaks']) / base_peak:.2f}x", f"{sum(r['peaks']) / 1e9:.2f}",
            f"{sum(r['peaks']) / base_peak:.2f}x", r["sweeps"], f"{per_sweep:.3g}",
            f"{per_sweep / base_sweep:.2f}x", f"{r['bytes'] / 1e6:.3g}", f"{r['found']}/{r['groups']}",
        ])  # fmt: skip
    return out
