"""``pyperm bench lap --pipelines``: the assignment calls of detection and tracking pipelines.

- detr: a detector's matcher (DETR and its family): 64 images of 300 queries and 0-50 targets,
  a padded ``(64, 300, 50)`` float32 cost with the sizes, solved by pyperm in one call against
  scipy's loop over ``costs[i, :, :len_i]``, the loop such matchers run today. With
  ``--device cuda``, also the same stack solved on the GPU in one launch, against the host.
- tracker: a tracker's association step (ByteTrack, BoT-SORT, OC-SORT): 1 - IoU between 30
  tracks and 40 detections with a cost limit, ``pyperm.lap.lapjv`` against
  ``lap.lapjv(cost, extend_cost=True, cost_limit=...)`` per call.

Every answer is checked against the reference's objective before anything is timed.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import pyperm
from pyperm._ext import core
from pyperm._tables import text_table
from pyperm.benchmarks._report import kernels, time_calls
from pyperm.lap import lapjv
from pyperm.testing import iou_cost, limited_objective

# (case, goal of pyperm's time over the reference's)
GOALS = {"detr": 0.3, "tracker": 0.5}
DEVICE_ROW = "pyperm.cuda (padded + sizes)"  # --device cuda: one launch on the GPU, against the host's row
TRACKER_LIMIT = 0.8  # ByteTrack's first association threshold
TRACKER_FRAMES = 50  # distinct frames per timed sample; times are per call


def detr_problem(rng: np.random.Generator, images: int = 64, queries: int = 300, max_targets: int = 50):
    """A padded (images, queries, max_targets) float32 cost, like DETR's class + L1 + GIoU
    cost (a random mixture here), and the (queries, targets_i) size of each image."""
    costs = rng.random((images, queries, max_targets), dtype=np.float32)
    costs += rng.standard_normal((images, queries, max_targets)).astype(np.float32)
    targets = rng.integers(0, max_targets + 1, images)
    sizes = np.stack([np.full(images, queries), targets], axis=1)
    return costs, sizes


def _detr_rows(rng: np.random.Generator, repeat: int, threads: int | None, device: str = "cpu") -> list[list]:
    from scipy.optimize import linear_sum_assignment as scipy_lsa

    costs, sizes = detr_problem(rng)
    blocks = [costs[b, :n, :m] for b, (n, m) in enumerate(sizes)]

    def scipy_loop():
        return [scipy_lsa(c) for c in blocks]

    solvers = {
        "pyperm (padded + sizes)": lambda: pyperm.batch_linear_sum_assignment(costs, sizes=sizes, threads=threads),
        "pyperm (list of views)": lambda: pyperm.batch_linear_sum_assignment(blocks, threads=threads),
        "scipy (loop)": scipy_loop,
    }
    if device == "cuda":
        import torch

        on_device = torch.from_numpy(costs).cuda()
        # The device's answers are read back inside the timed call: a matcher uses them on the host.
        solvers[DEVICE_ROW] = lambda: [(r.cpu().numpy(), c.cpu().numpy()) for r, c in
                                       pyperm.batch_linear_sum_assignment(on_device, sizes=sizes)]
    reference = [float(c[r, k].astype(np.float64).sum()) for c, (r, k) in zip(blocks, scipy_loop())]
    for name, solve in solvers.items():
        got = [float(c[r, k].astype(np.float64).sum()) for c, (r, k) in zip(blocks, solve())]
        if not np.allclose(got, reference, rtol=1e-5, atol=1e-4):
            raise AssertionError(f"detr: {name} disagrees with scipy's optimum")
    times = time_calls(solvers, repeat)
    base = times["scipy (loop)"].median
    return [["detr", name, 1e3 * t.median, t.median / base] for name, t in ((n, times[n]) for n in solvers)]


def _tracker_rows(rng: np.random.Generator, repeat: int) -> list[list] | None:
    try:
        import lap
    except ImportError:
        return None
    frames = [iou_cost(30, 40, rng) for _ in range(TRACKER_FRAMES)]
    for cost in frames:
        _, x, _ = lapjv(cost, extend_cost=True, cost_limit=TRACKER_LIMIT)
        _, ref_x, _ = lap.lapjv(cost, extend_cost=True, cost_limit=TRACKER_LIMIT)
        got, want = ([np.flatnonzero(v >= 0), v[v >= 0]] for v in (x, ref_x))
        if not np.isclose(limited_objective(cost, *got, TRACKER_LIMIT), limited_objective(cost, *want, TRACKER_LIMIT),
                          rtol=1e-9, atol=1e-9):  # fmt: skip
            raise AssertionError("tracker: pyperm.lap.lapjv disagrees with lap.lapjv's optimum")
    solvers = {
        "pyperm.lap.lapjv": lambda: [lapjv(c, extend_cost=True, cost_limit=TRACKER_LIMIT) for c in frames],
        "lap.lapjv": lambda: [lap.lapjv(c, extend_cost=True, cost_limit=TRACKER_LIMIT) for c in frames],
    }
    times = time_calls(solvers, repeat)
    base = times["lap.lapjv"].median
    return [["tracker", name, 1e3 * t.median / TRACKER_FRAMES, t.median / base] for name, t in times.items()]


def run(args: argparse.Namespace) -> int:
    """Prints the pipelines table (medians per call) and each case's ratio against its goal."""
    repeat = args.repeat
    device = getattr(args, "device", "cpu")
    if device == "cuda" and not pyperm.cuda_available():
        print(f"--device cuda: {pyperm.cuda_unavailable_reason()}", file=sys.stderr)
        return 2
    print(f"pyperm {pyperm.__version__}, kernels: {kernels()}, threads: {args.threads or core.hardware_threads()}, "
          f"medians of {repeat}; tracker: per call, 30 x 40, cost_limit={TRACKER_LIMIT}")
    rng = np.random.default_rng(args.seed)
    rows = _detr_rows(rng, repeat, args.threads, device)
    tracker = _tracker_rows(rng, repeat)
    if tracker is None:
        print("tracker: lap (lapx) is not installed; pip install lapx")
    else:
        rows += tracker
    print(text_table(["case", "solver", "median ms", "/ reference"], rows))
    print()
    host_rows = [row for row in rows if row[1].startswith("pyperm") and "list" not in row[1] and row[1] != DEVICE_ROW]
    summary = [[case, ratio, GOALS[case], "yes" if ratio <= GOALS[case] else "no"] for case, _, _, ratio in host_rows]
    print(text_table(["case", "pyperm / reference", "goal", "met"], summary))
    times = {name: ms for case, name, ms, _ in rows if case == "detr"}
    if DEVICE_ROW in times:
        ratio = times[DEVICE_ROW] / times["pyperm (padded + sizes)"]
        print(f"\ndetr on the device (one launch, answers read back): {ratio:.2f}x the host's pyperm "
              f"(goal < 1: {'met' if ratio < 1 else 'not met'})")
    return 0
