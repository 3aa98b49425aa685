"""
Assignment in pipelines: a detector's matcher and a tracker's association
=========================================================================

A detector's matcher solves one small problem per image; a tracker one per frame, with a
threshold above which a pair stays unmatched. Here pyperm takes a DETR-shaped padded batch
in one call, and a tracker's cost through :func:`pyperm.lap.lapjv`, against scipy's
per-image loop; every answer is checked against scipy's first. ``pyperm bench lap
--pipelines --small`` prints the full tables.
"""

# %%
# A detector's matcher: one call for the whole batch
# ---------------------------------------------------
# 64 images, 300 queries, 0 to 50 targets each, padded to a (64, 300, 50) float32 cost.
import time

import matplotlib.pyplot as plt
import numpy as np
from scipy.optimize import linear_sum_assignment as scipy_lsa

import pyperm
from pyperm.lap import lapjv
from pyperm.testing import iou_cost

rng = np.random.default_rng(0)
images, queries, max_targets = 64, 300, 50
costs = rng.random((images, queries, max_targets), dtype=np.float32)
targets = rng.integers(0, max_targets + 1, images)
sizes = np.stack([np.full(images, queries), targets], axis=1)

matches = pyperm.batch_linear_sum_assignment(costs, sizes=sizes)
for b, (rows, cols) in enumerate(matches):
    block = costs[b, :, : targets[b]]
    r, c = scipy_lsa(block)
    assert np.isclose(block[rows, cols].sum(dtype=np.float64), block[r, c].sum(dtype=np.float64), rtol=1e-5)
print(f"{images} images matched, same optima as scipy; {int(targets.sum())} targets in all")


def median_ms(fn, repeat=7):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


detr = {
    "scipy, loop over images": median_ms(lambda: [scipy_lsa(costs[b, :, : targets[b]]) for b in range(images)]),
    "pyperm, one call": median_ms(lambda: pyperm.batch_linear_sum_assignment(costs, sizes=sizes)),
}

# %%
# A tracker's association step: lap's lapjv, with a cost limit
# ------------------------------------------------------------
# 1 - IoU between 30 tracks and 40 detections; pairs costing more than 0.8 stay unmatched.
frames = [iou_cost(30, 40, rng) for _ in range(200)]
total, x, y = lapjv(frames[0], extend_cost=True, cost_limit=0.8)
print(f"frame 0: {int((x >= 0).sum())} of 30 tracks matched, total {total:.3f}")
tracker = {"pyperm.lap.lapjv, 200 frames": median_ms(lambda: [lapjv(c, extend_cost=True, cost_limit=0.8)
                                                              for c in frames])}

fig, ax = plt.subplots(figsize=(7, 3), layout="constrained")
labels = list(detr) + list(tracker)
values = list(detr.values()) + list(tracker.values())
ax.barh(labels, values, color=["#999999", "#1f77b4", "#1f77b4"])
ax.set_xlabel("median time (ms)")
ax.set_title("DETR-shaped batch (64 x 300 x 0-50) and a tracker's frames")
for label, value in zip(labels, values):
    print(f"{label}: {value:.2f} ms")
plt.show()
