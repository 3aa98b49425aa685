"""Weight matching over ranks against one process: time per sweep and bytes per sweep.

Run: ``python -m pyperm.benchmarks.distributed --ranks 2 --model mlp2048`` (gloo ranks on this
machine, started with torch.multiprocessing and a file store; one intra-op thread per rank, and
the one-process run with as many threads as ranks). Each rank holds a contiguous range of the
state dict's keys (as layers split over machines). Every run's permutations are checked against
the one-process run's before any time is printed.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from pyperm._staging import write_file


def _pair(name: str):
    from pyperm.benchmarks.match import build_model

    a, b = build_model(name, 1), build_model(name, 2)
    return a.permutation_spec(), a.state_dict(), b.state_dict()


def _rank(rank: int, world: int, store: str, name: str, concurrent: bool, out: str) -> None:
    import torch.distributed as dist

    import pyperm.distributed as pd
    from pyperm._comm import init_process_group

    torch.set_num_threads(1)
    init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    spec, a, b = _pair(name)
    keys = list(spec.axes)
    mine = [k for i, k in enumerate(keys) if i * world // len(keys) == rank]
    dist.barrier()
    started = time.perf_counter()
    result = pd.weight_matching(spec, {k: a[k] for k in mine}, {k: b[k] for k in mine}, seed=0,
                                concurrent=concurrent)  # fmt: skip
    seconds = time.perf_counter() - started
    if rank == 0:
        found = {"perms": dict(result.perms.items()), "seconds": seconds, "sweeps": result.iterations,
                 "bytes": result.bytes_per_sweep}  # fmt: skip
        write_file(Path(out), lambda f: torch.save(found, f))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    from pyperm.nn import weight_matching

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--model", default="mlp2048")
    args = parser.parse_args(argv)
    spec, a, b = _pair(args.model)
    torch.set_num_threads(args.ranks)
    started = time.perf_counter()
    one = weight_matching(spec, a, b, seed=0, init="identity")
    one_seconds = time.perf_counter() - started
    print(f"{args.model}: one process ({args.ranks} threads): {one.iterations} sweeps, "
          f"{one_seconds / one.iterations:.3f} s/sweep")  # fmt: skip
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for concurrent in (False, True):
            store, out = os.path.join(tmp, f"store{concurrent}"), os.path.join(tmp, f"out{concurrent}.pt")
            mp.start_processes(_rank, args=(args.ranks, store, args.model, concurrent, out), nprocs=args.ranks,
                               start_method="spawn" if torch.cuda.is_available() else "fork")  # fmt: skip
            r = torch.load(out)
            same = all(torch.equal(r["perms"][g], one.perms[g]) for g in spec.sizes)
            if not same:
                raise SystemExit(f"concurrent={concurrent}: the permutations differ from one process's")
            rows[concurrent] = r
            mode = "concurrent" if concurrent else "default"
            print(f"{args.ranks} ranks, {mode:>10}: {r['sweeps']} sweeps, {r['seconds'] / r['sweeps']:.3f} s/sweep "
                  f"({one_seconds / r['seconds']:.2f}x one process), bytes per sweep: first {r['bytes'][0] / 2**20:.2f} MiB, "
                  f"mean {sum(r['bytes']) / len(r['bytes']) / 2**20:.2f} MiB, most {max(r['bytes']) / 2**20:.2f} MiB")  # fmt: skip
    print(f"concurrent against default: {rows[False]['seconds'] / rows[True]['seconds']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
