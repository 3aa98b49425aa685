"""
pyperm's assignment solver against scipy
========================================

:func:`pyperm.linear_sum_assignment` takes the arguments of
:func:`scipy.optimize.linear_sum_assignment` and returns the same optimum. Here both
solve the same random matrices of growing size; every answer is checked against scipy's
before it is timed, as ``pyperm bench lap`` does (which also times lapx and lapjv).
"""

# %%
# Same answers
# ------------
import time

import matplotlib.pyplot as plt
import numpy as np
from scipy.optimize import linear_sum_assignment as scipy_lsa

import pyperm

rng = np.random.default_rng(0)
sizes = [128, 256, 512, 1024, 2048]
costs = {n: rng.random((n, n)) for n in sizes}
for n, cost in costs.items():
    r1, c1 = scipy_lsa(cost)
    r2, c2 = pyperm.linear_sum_assignment(cost)
    assert np.isclose(cost[r1, c1].sum(), cost[r2, c2].sum())
print("same optimum on every matrix")

# %%
# Timing
# ------
# The median of a few calls of each, on uniform random costs in [0, 1).


def median_seconds(solve, cost, repeat=3):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        solve(cost)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


t_scipy = [median_seconds(scipy_lsa, costs[n]) for n in sizes]
t_pyperm = [median_seconds(pyperm.linear_sum_assignment, costs[n]) for n in sizes]
for n, a, b in zip(sizes, t_scipy, t_pyperm):
    print(f"n = {n:5d}: scipy {1e3 * a:8.2f} ms, pyperm {1e3 * b:8.2f} ms ({b / a:.2f}x)")

fig, ax = plt.subplots(figsize=(6, 4))
ax.loglog(sizes, t_scipy, "o-", label="scipy.optimize.linear_sum_assignment")
ax.loglog(sizes, t_pyperm, "s-", label="pyperm.linear_sum_assignment")
ax.set_xlabel("n (n x n uniform costs)")
ax.set_ylabel("seconds (median of 3)")
ax.set_title("One assignment problem")
ax.grid(alpha=0.3, which="both")
ax.legend()
fig.tight_layout()

# %%
# A batch of problems
# -------------------
# :func:`pyperm.batch_linear_sum_assignment` solves a stack on every core, with the GIL
# released; each answer equals the single solver's.
stack = rng.random((256, 128, 128))
start = time.perf_counter()
rows, cols = pyperm.batch_linear_sum_assignment(stack)
batch = time.perf_counter() - start
start = time.perf_counter()
loop = [scipy_lsa(c)[1] for c in stack]
looped = time.perf_counter() - start
assert all((c == l).all() or np.isclose(s[np.arange(128), c].sum(), s[np.arange(128), l].sum())
           for s, c, l in zip(stack, cols, loop))
print(f"256 problems of 128 x 128: pyperm batch {1e3 * batch:.1f} ms, scipy loop {1e3 * looped:.1f} ms")
