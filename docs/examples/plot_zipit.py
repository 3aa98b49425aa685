"""
ZipIt!: merging models trained on different tasks
=================================================

Model A learns the digits 0-4, model B the digits 5-9: they share few features, so
permuting B's units onto A's (Git Re-Basin) has little to pair. ZipIt! (Stoica et al.,
ICLR 2024) merges the features of both models by their correlation, within each model as
well as across the two; a partial zip merges only the first layers, into a shared trunk,
and keeps one tail per model.
"""

# %%
# Two models, two tasks
# ---------------------
# Both MLPs have all ten outputs, but each sees the images of its own five digits only.
import copy

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from pyperm.datasets import load_digits, to_batches
from pyperm.nn import average, weight_matching, zipit
from pyperm.nn.models import MLP

digits = load_digits()
low = digits.y_train < 5
x_test, y_test = torch.tensor(digits.x_test), torch.tensor(digits.y_test)


def train_mlp(rows, seed, epochs=30):
    torch.manual_seed(seed)
    model = MLP([64, 128, 128, 128, 10])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    batches = to_batches(digits.x_train[rows], digits.y_train[rows], 64)
    for _ in range(epochs):
        for x, y in batches:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return model.eval()


model_a, model_b = train_mlp(low, 1), train_mlp(~low, 2)

# %%
# Zips and a permute
# ------------------
# The zip correlates both models' features over training images of both tasks (no labels
# needed). ``zipped.model`` is the full zip, one model of the architecture;
# ``zipped.partial(stop)`` the multi-head model whose trunk is zipped up to the group
# ``stop``; it returns one output per input model.
spec = model_a.permutation_spec()
data = to_batches(digits.x_train, digits.y_train, 256)
zipped = zipit(model_a, model_b, spec, data)  # the authors' alpha = 0.3 and beta = 0.125
no_same = zipit(model_a, model_b, spec, data, beta=0.0)  # no merges within a model
for group, pairing in zipped.pairings.items():
    print(f"{group}: same-model merges A {pairing.same_model_merges[0]}, B {pairing.same_model_merges[1]}")

perms = weight_matching(spec, model_a.state_dict(), model_b.state_dict(), seed=0).perms
permuted = copy.deepcopy(model_a)
permuted.load_state_dict(average([model_a.state_dict(), perms.apply(model_b.state_dict())]))

# %%
# Joint accuracy
# --------------
# Over all ten digits; a model of several outputs (the ensemble, a partial zip's two heads)
# is scored on the mean of their softmax.


def joint(*outputs):
    p = sum(out.softmax(-1) for out in outputs) / len(outputs)
    return 100 * float((p.argmax(-1) == y_test).float().mean())


with torch.no_grad():
    scores = {
        "model A": joint(model_a(x_test)),
        "model B": joint(model_b(x_test)),
        "ensemble": joint(model_a(x_test), model_b(x_test)),
        "permute": joint(permuted(x_test)),
        "full zip,\nbeta = 0": joint(no_same.model(x_test)),
        "full zip": joint(zipped.model(x_test)),
    }
    for k, stop in enumerate(zipped.stops, 1):
        scores[f"partial zip,\n{k} of {len(spec.groups)}\ngroups"] = joint(*zipped.partial(stop)(x_test))
for name, value in scores.items():
    print(f"{name.replace(chr(10), ' ')}: {value:.1f}%")

colors = ["0.6", "0.6", "0.35", "C2", "C3", "C0"] + ["C1"] * len(zipped.stops)
fig, ax = plt.subplots(figsize=(9, 3.8))
bars = ax.bar(range(len(scores)), list(scores.values()), color=colors)
ax.bar_label(bars, fmt="%.0f", fontsize=8)
ax.set_xticks(range(len(scores)), list(scores), fontsize=8)
ax.set_ylabel("joint test accuracy (%)")
ax.set_ylim(0, 100)
ax.set_title("Digits 0-4 (A) and 5-9 (B): merges of the two models")
fig.tight_layout()

# %%
# Each model alone classifies about half the digits, its own. A merge of one model's size
# must serve both tasks with one model's units: the full zip beats the permute, and same-model
# merges help it; the fewer groups a partial zip merges, the closer it comes to the ensemble
# (two whole models).
