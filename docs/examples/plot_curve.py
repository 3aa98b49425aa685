"""
A curve between two networks
============================

Where the straight line between two networks climbs a barrier, a trained curve goes
around it (Garipov et al., 2018). Tatro et al. ("Optimizing Mode Connectivity via Neuron
Alignment", 2020) align the networks first: the curve between A and the aligned B is
easier to train, and the networks along it are better. Here: two small CNNs with
BatchNorm on the digits, a quadratic Bezier curve between them, unaligned and aligned.
"""

# %%
# Two CNNs
# --------
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn

from pyperm.datasets import load_digits, to_batches
from pyperm.nn import PermutationSpec, connect

digits = load_digits()
train = to_batches(digits.x_train, digits.y_train, 64)
test = to_batches(digits.x_test, digits.y_test, 512)


def cnn(width=8):
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1, stride=2), nn.BatchNorm2d(2 * width), nn.ReLU(),
        nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, 10),
    )


def train_cnn(seed, epochs=4):
    torch.manual_seed(seed)
    model = cnn()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(epochs):
        for x, y in train:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return model.eval()


model_a, model_b = train_cnn(1), train_cnn(2)
state_a, state_b = model_a.state_dict(), model_b.state_dict()
spec = PermutationSpec.from_model(model_a, train[0][0])     # traced: any model works

# %%
# Curves
# ------
# :func:`pyperm.nn.connect` aligns B to A (or not), trains the curve's bend and evaluates
# the curve with the BatchNorm statistics recomputed at every point. ``linear=True`` also
# evaluates the straight line.
results = {}
for align in (None, "activation"):
    run = connect(model_a, spec, state_a, state_b, train, align=align, epochs=3, lr=0.05,
                  test_data=test, num_points=11, linear=True, seed=0)
    name = align or "unaligned"
    results[name] = run
    print(f"{name:>10}: straight line min accuracy {run.linear.min_accuracy:.3f}, "
          f"curve min accuracy {run.result.min_accuracy:.3f}")

fig, ax = plt.subplots(figsize=(6, 4))
for (name, run), colour in zip(results.items(), ("tab:blue", "tab:orange")):
    ax.plot(run.linear.ts, 100 * run.linear.accuracy, "--", color=colour, label=f"{name}, straight line")
    ax.plot(run.result.ts, 100 * run.result.accuracy, "-o", markersize=3, color=colour, label=f"{name}, curve")
ax.set_xlabel("t (0: model A, 1: model B)")
ax.set_ylabel("test accuracy (%)")
ax.set_title("Bezier curves between two digits CNNs")
ax.grid(alpha=0.3)
ax.legend()
fig.tight_layout()
