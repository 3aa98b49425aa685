"""Where the GPU assignment solver spends its time (issue 38's missed LAP targets), on a CUDA machine.

    python bench/gpu/lap_probe.py

For the two cases the issue sets targets on (a batch of 1024 problems of 128 x 128 and one uniform
n = 4096, float32), times every launch configuration of the solver (strategy, threads per block,
staging, the bidding rounds' patience) with CUDA events, medians of 5 after a warm-up, and prints
the solver's own statistics (rounds, rows left to the shortest paths) beside pyperm's CPU time on
the same input. Uniform n = 512 and 2048 (the weight matcher's sizes) are measured too.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

import pyperm
from pyperm.lap import _cuda as lap_cuda


def _gpu_ms(fn, repeat: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _cpu_ms(fn, repeat: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def probe(title: str, cost: torch.Tensor, configs: list[dict]) -> None:
    batched = cost.dim() == 3
    solve = lap_cuda.batch_linear_sum_assignment if batched else lap_cuda.linear_sum_assignment
    host = cost.cpu().numpy()
    cpu_solve = pyperm.batch_linear_sum_assignment if batched else pyperm.linear_sum_assignment
    cpu = _cpu_ms(lambda: cpu_solve(host))
    print(f"\n{title}: pyperm CPU {cpu:.3f} ms ({torch.get_num_threads()} threads)", flush=True)
    ref = None
    for cfg in configs:
        try:
            _, cols, stats = solve(cost, return_stats=True, **cfg)
            ms = _gpu_ms(lambda: solve(cost, **cfg))  # noqa: B023
        except Exception as exc:  # a configuration the device refuses: say so, go on
            print(f"  {cfg}: {type(exc).__name__}: {exc}")
            continue
        obj = float(torch.gather(cost, -1, cols.unsqueeze(-1)).sum()) if batched else float(
            cost[torch.arange(cost.shape[0], device=cost.device), cols].sum())
        ref = obj if ref is None else ref
        flag = "" if abs(obj - ref) <= 1e-3 * max(1.0, abs(ref)) else f"  OBJECTIVE DIFFERS {obj} vs {ref}"
        print(f"  {cfg}: {ms:.3f} ms = {ms / cpu:.2f}x CPU; stats {stats}{flag}", flush=True)


def main() -> int:
    print(pyperm.show_config() or "", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    batch = torch.rand((1024, 128, 128), device="cuda", generator=gen)
    probe("batch 1024 x 128x128 float32", batch,
          [{}] + [{"method": "block", "threads": t, "stage": s} for t in (32, 64, 128) for s in (0, 1)]
          + [{"method": "device"}])  # fmt: skip
    for n in (512, 2048, 4096):
        cost = torch.rand((n, n), device="cuda", generator=gen)
        configs = [{}, {"method": "block", "threads": 1024}, {"method": "block", "threads": 256}]
        configs += [{"method": "device", "patience": p} for p in (16, 128, 1024)]
        configs += [{"method": "device", "threads": t} for t in (256, 512)]
        probe(f"uniform {n} float32", cost, configs)
    # The integer-like case: many ties.
    cost = torch.randint(0, 100, (2048, 2048), device="cuda", generator=gen).float()
    probe("integers 0..99, 2048 float32", cost, [{}, {"method": "block", "threads": 1024}, {"method": "device"}])
    np.random.seed(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
