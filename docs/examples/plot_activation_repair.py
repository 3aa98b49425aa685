"""
Activation matching and REPAIR
==============================

Activation matching (Tatro et al., "Optimizing Mode Connectivity via Neuron Alignment",
2020, Algorithm 1) pairs the units of two networks by the correlation of their
activations on the same inputs. Even so, the units of the interpolated network lose
variance; REPAIR (Jordan et al., 2023) renormalises them, layer by layer, to the
interpolation of the endpoints' statistics.
"""

# %%
# Two deeper MLPs
# ---------------
import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F

from pyperm.datasets import load_digits, to_batches
from pyperm.nn import activation_matching, apply_permutation, interpolate, repair
from pyperm.nn.models import MLP

digits = load_digits()
train = to_batches(digits.x_train, digits.y_train, 128)
test = to_batches(digits.x_test, digits.y_test, 512)


def train_mlp(seed, epochs=20):
    torch.manual_seed(seed)
    model = MLP([64, 128, 128, 128, 128, 10])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(epochs):
        for x, y in train:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return model.eval()


model_a, model_b = train_mlp(1), train_mlp(2)
state_a, state_b = model_a.state_dict(), model_b.state_dict()
spec = model_a.permutation_spec()

# %%
# Matching by activations
# -----------------------
result = activation_matching(model_a, model_b, spec, train)
for group in spec.sizes:
    print(f"{group}: mean correlation of paired units {result.identity_similarity[group]:.3f} "
          f"-> {result.similarity[group]:.3f}")
aligned_b = apply_permutation(spec, result.perms, state_b)

# %%
# Three paths
# -----------
# The test loss along the straight line to B, to aligned B, and to aligned B with every
# point repaired (the repaired state dict is a plain one of the same architecture).
probe = MLP([64, 128, 128, 128, 128, 10]).eval()


def test_loss(state):
    probe.load_state_dict(state)
    with torch.no_grad():
        total = sum(F.cross_entropy(probe(x), y, reduction="sum").item() for x, y in test)
    return total / sum(len(y) for _, y in test)


ts = np.linspace(0, 1, 11)
paths = {
    "naive": [test_loss(interpolate(state_a, state_b, t)) for t in ts],
    "activation matching": [test_loss(interpolate(state_a, aligned_b, t)) for t in ts],
    "activation matching + REPAIR": [test_loss(repair(model_a, spec, state_a, aligned_b, train, t=t))
                                     for t in ts],
}
for name, losses in paths.items():
    chord = (1 - ts) * losses[0] + ts * losses[-1]
    print(f"{name:>29}: loss barrier {max(np.array(losses) - chord):.3f}")

fig, ax = plt.subplots(figsize=(6, 4))
for name, losses in paths.items():
    ax.plot(ts, losses, marker="o", markersize=3, label=name)
ax.set_xlabel("t (0: model A, 1: model B)")
ax.set_ylabel("test loss")
ax.set_title("Interpolating two digits MLPs (4 hidden layers of 128)")
ax.grid(alpha=0.3)
ax.legend()
fig.tight_layout()
