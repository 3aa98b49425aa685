"""
Weight matching and the loss barrier
====================================

Two MLPs trained on the digits from different seeds sit in different basins: the straight
line between them climbs a loss barrier. Weight matching (Ainsworth et al., "Git
Re-Basin", 2023, Algorithm 1) permutes the second network's hidden units, without changing
its function, so that the line between them stays low.
"""

# %%
# Two networks
# ------------
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from pyperm.datasets import load_digits, to_batches
from pyperm.nn import apply_permutation, barrier, weight_matching
from pyperm.nn.models import MLP

digits = load_digits()
train = to_batches(digits.x_train, digits.y_train, 128)
test = to_batches(digits.x_test, digits.y_test, 512)


def train_mlp(seed, epochs=20):
    torch.manual_seed(seed)
    model = MLP([64, 128, 128, 10])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(epochs):
        for x, y in train:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return model.eval()


model_a, model_b = train_mlp(1), train_mlp(2)
state_a, state_b = model_a.state_dict(), model_b.state_dict()

# %%
# Matching
# --------
spec = model_a.permutation_spec()
result = weight_matching(spec, state_a, state_b, seed=0)
print(f"{result.iterations} sweeps, converged: {result.converged}")
aligned_b = apply_permutation(spec, result.perms, state_b)

# %%
# The barriers
# ------------
naive = barrier(model_a, state_a, state_b, test, num_points=21)
matched = barrier(model_a, state_a, aligned_b, test, num_points=21)
print(f"loss barrier: naive {naive.loss_barrier:.3f}, weight matching {matched.loss_barrier:.3f}")
print(f"accuracy barrier: naive {100 * naive.accuracy_barrier:.1f} pp, "
      f"weight matching {100 * matched.accuracy_barrier:.1f} pp")

fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(9, 3.6))
for name, res in [("naive", naive), ("weight matching", matched)]:
    ax_loss.plot(res.ts, res.loss, marker="o", markersize=3, label=name)
    ax_acc.plot(res.ts, 100 * res.accuracy, marker="o", markersize=3, label=name)
ax_loss.set_xlabel("t (0: model A, 1: model B)")
ax_loss.set_ylabel("test loss")
ax_acc.set_xlabel("t (0: model A, 1: model B)")
ax_acc.set_ylabel("test accuracy (%)")
for ax in (ax_loss, ax_acc):
    ax.grid(alpha=0.3)
    ax.legend()
fig.suptitle("The linear path between two digits MLPs")
fig.tight_layout()

# %%
# ``barrier`` returned :class:`~pyperm.nn.BarrierResult` objects; ``to_markdown()`` gives the
# numbers behind the plot, and :func:`pyperm.nn.plot_paths` draws the same figure to a PNG
# without pyplot.
print(matched.to_markdown())
