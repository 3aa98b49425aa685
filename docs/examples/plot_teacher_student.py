"""
The barrier against the width, modulo permutation
=================================================

In the two-layer ReLU teacher-student setting of Zhan, Li and Wu ("Analyzing the Role of
Permutation Invariance in Linear Mode Connectivity", 2025) the population loss has a
closed form, so barriers are exact. Two students sampled uniformly on the manifold of
global minima are joined by a straight line; its barrier is measured directly and after
matching the students' neurons, by type (the paper's Algorithm 1) or by an optimal
assignment. A small version of the paper's width sweep (K = 3 teacher neurons):
"""

import matplotlib.pyplot as plt

from pyperm import teacher_student as ts

sweep = ts.width_sweep(3, [3, 4, 5, 6, 8, 12, 16, 24, 32], source="uniform", pairs=12, seed=0)
print(sweep.to_markdown())

fig, ax = plt.subplots(figsize=(6, 4))
labels = {"direct": "direct", "type": "type matching", "lap": "assignment"}
for method, label in labels.items():
    ax.errorbar(sweep.widths, sweep.mean(method), yerr=sweep.sem(method), marker="o", markersize=4,
                capsize=2, label=label)
ax.set_xscale("log")
ax.set_xlabel("student width m")
ax.set_ylabel("loss barrier")
ax.set_title("Barrier against width, K = 3 (uniform minima)")
ax.grid(alpha=0.3, which="both")
ax.legend()
fig.tight_layout()

# %%
# The permuted barrier is 0 at m = K (every student is the teacher, up to order), rises to
# a peak and decays as the width grows, while the direct barrier does not.
