"""``pyperm bench sinkhorn``: two models aligned by weight matching, STE and Sinkhorn re-basin (both losses).

The pair is the one ``pyperm reproduce rebasin`` trains at the same ``--scale`` and
``--data`` (its Figure 2 MLP, seeds ``1000 * seed + 1`` and ``+ 2``, its recipe). On it, in
one run:

- ``weight matching``: :func:`pyperm.nn.weight_matching` (Git Re-Basin Algorithm 1);
- ``STE``: :func:`pyperm.nn.ste_matching` as the report runs it (its ``ste_epochs`` over
  batches of ``ste_batch``, Adam at 1e-3, from weight matching's answer);
- ``Sinkhorn, distance``: :func:`pyperm.nn.sinkhorn_matching` with ``loss="distance"``
  and its defaults (100 steps from the identity);
- ``Sinkhorn, midpoint``: ``loss="midpoint"`` on the same batches for as many epochs as
  STE, from the identity (the paper's start) and, a second row, from weight matching's
  answer (STE's start);
- with ``--authors DIR`` (a checkout of fagp/sinkhorn-rebasin, and torchviz importable):
  the authors' ``RebasinNet`` on the same states, with their L2 distance loss for as many
  steps as ours and their midpoint loss for as many epochs, both with their optimiser
  (AdamW at 0.1) and their 20 Sinkhorn iterations.

Each row: the loss and accuracy barriers on the test split of A and the permuted B
(:func:`pyperm.nn.barrier`, the report's points), the weight distance
:math:`\\lVert\\Theta_A - \\pi(\\Theta_B)\\rVert^2` of the answer (the mean over the
permuted entries) and the seconds the matching took. The goals printed below the table:
the midpoint loss's barrier at or below weight matching's, its time at most STE's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from pyperm._argtypes import positive_int
from pyperm._tables import markdown_table, text_table

SCALES = ("smoke", "quick", "full", "paper")
DISTANCE_STEPS = 100  # the steps of the distance loss, ours and the authors' (sinkhorn_matching's default)
HEADERS = ["pair", "method", "test loss barrier", "test acc barrier", "distance", "steps", "seconds"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", default="digits", help="digits (default) or mnist:DIR, as pyperm reproduce rebasin")
    parser.add_argument("--scale", choices=SCALES, default="smoke",
                        help="the pair and STE's epochs of pyperm reproduce rebasin at this scale")
    parser.add_argument("--seeds", type=positive_int, default=1, help="pairs (seeds 0, 1, ...)")
    parser.add_argument("--epochs", type=positive_int, default=None,
                        help="train the pair this many epochs instead of the scale's (the scale's recipe)")
    parser.add_argument("--cache", metavar="DIR", default=None,
                        help="keep the trained pair in DIR and reuse it (one file per model)")
    parser.add_argument("--repeat", type=positive_int, default=1,
                        help="timed runs of each method (median reported; every run gives the same answer)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: the process's CPU time, every thread's (steady on a busy machine; with "
                             "--threads 1 it is the work done)")
    parser.add_argument("--device", default="cpu", help="where the models and the matchings run")
    parser.add_argument("--authors", metavar="DIR", default=None,
                        help="a checkout of fagp/sinkhorn-rebasin: add the authors' RebasinNet rows")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--write", metavar="DIR", default=None,
                        help="also write the table as DIR/bench-sinkhorn-<data>-<scale>[-epochs<N>].md (the docs "
                             "include docs/_generated/)")


def _pair(scale: str, data: str, device: Any, seed: int, epochs: int | None,
          cache: str | None) -> tuple[Any, dict, dict, dict, dict]:
    """The report's model, A's and B's trained states (``epochs`` or the scale's), its data and its settings."""
    import pathlib

    import torch

    from pyperm._staging import write_file
    from pyperm.nn.models import create_model
    from pyperm.reproduce._data import load_data
    from pyperm.reproduce.rebasin._experiments import train_endpoint
    from pyperm.reproduce.rebasin._settings import SETTINGS, mlp_name

    cfg = SETTINGS[scale]
    # The cache's names are bench merge's, so that both benches share one cache of trained models.
    trained = "" if epochs is None or epochs == cfg["epochs"] else f"-epochs{epochs}"
    epochs = cfg["epochs"] if epochs is None else epochs
    loaded = load_data(data, device, cfg["eval_batch"], ste=cfg["ste_batch"])
    name = mlp_name(loaded, cfg["width"], cfg["depth"])
    model, states = create_model(name).to(device), []
    for k in (1, 2):
        path = None
        if cache is not None:
            stem = f"{loaded['name']}-{scale}-{name.replace(':', '_')}{trained}-{1000 * seed + k}"
            path = pathlib.Path(cache) / f"{stem}.pt"
        if path is not None and path.exists():
            states.append({key: v.to(device) for key, v in torch.load(path, weights_only=True).items()})
            continue
        model, state = train_endpoint(name, loaded, cfg["recipe"], cfg["batch"], epochs, 1000 * seed + k, device)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_file(path, lambda f, state=state: torch.save({key: v.cpu() for key, v in state.items()}, f))
        states.append(state)
    return model, states[0], states[1], loaded, cfg


def _distance(spec: Any, sa: dict, pb: dict) -> float:
    """The mean squared distance between A and the permuted B over the entries a group permutes."""
    keys = [k for k, axes in spec.axes.items() if sa[k].is_floating_point() and any(e is not None for e in axes)]
    total = sum(float((sa[k].double() - pb[k].double()).square().sum()) for k in keys)
    return total / sum(sa[k].numel() for k in keys)


def _methods(model: Any, spec: Any, sa: dict, sb: dict, loaded: dict, cfg: dict, seed: int) -> dict[str, Any]:
    """Each method as a call returning ``(B permuted, steps)``."""
    from pyperm import nn as pnn

    batches, epochs = loaded["ste"], cfg["ste_epochs"]

    def weight():
        result = pnn.weight_matching(spec, sa, sb, seed=seed)
        return result.perms.apply(sb), result.iterations

    def ste():
        result = pnn.ste_matching(model, spec, sa, sb, batches, epochs=epochs, lr=1e-3, seed=seed)
        return result.perms.apply(sb), result.iterations

    def sinkhorn(**options):
        def run():
            result = pnn.sinkhorn_matching(model, spec, sa, sb, **options)
            return result.perms.apply(sb), result.iterations

        return run

    return {
        "weight matching": weight,
        "STE": ste,
        "Sinkhorn, distance": sinkhorn(loss="distance", epochs=DISTANCE_STEPS),
        "Sinkhorn, midpoint": sinkhorn(data=batches, epochs=epochs),
        "Sinkhorn, midpoint from WM": sinkhorn(data=batches, epochs=epochs, init="weight", seed=seed),
    }


def _import_authors(folder: str) -> tuple[Any, Any, Any]:
    """The authors' ``RebasinNet``, ``DistL2Loss`` and ``MidLoss`` from their checkout (never part of pyperm)."""
    import sys

    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        from rebasin import RebasinNet
        from rebasin.loss import DistL2Loss, MidLoss
    except ImportError as err:
        raise SystemExit(f"--authors {folder}: cannot import the authors' rebasin package ({err}); it needs "
                         "torchviz and graphviz on the path") from None
    return RebasinNet, DistL2Loss, MidLoss


def _authors_methods(folder: str, model: Any, sa: dict, sb: dict, loaded: dict, cfg: dict, distance_steps: int):
    """The authors' RebasinNet on the same states: B re-based onto A (their code permutes the model it wraps)."""
    import copy

    import torch

    RebasinNet, DistL2Loss, MidLoss = _import_authors(folder)

    def build():
        model_a, model_b = copy.deepcopy(model), copy.deepcopy(model)
        model_a.load_state_dict(sa)
        model_b.load_state_dict(sb)
        shape = (1, *next(iter(loaded["ste"]))[0].shape[1:])
        net = RebasinNet(model_b, input_shape=shape)
        net.identity_init()
        net.to(next(model.parameters()).device)
        return net, model_a

    def permuted(net):
        net.eval()
        return {k: v.detach().clone() for k, v in net().state_dict().items()}, None

    def distance():
        net, model_a = build()
        loss = DistL2Loss(model_a)
        optimizer = torch.optim.AdamW(net.p.parameters(), lr=0.1)
        net.train()
        for _ in range(distance_steps):
            value = loss(net())
            optimizer.zero_grad()
            value.backward()
            optimizer.step()
        return permuted(net)[0], distance_steps

    def midpoint():
        net, model_a = build()
        loss = MidLoss(model_a, criterion=torch.nn.CrossEntropyLoss())
        optimizer = torch.optim.AdamW(net.p.parameters(), lr=0.1)
        steps = 0
        for _ in range(cfg["ste_epochs"]):
            net.train()
            for x, y in loaded["ste"]:
                value = loss(net(), x, y)
                optimizer.zero_grad()
                value.backward()
                optimizer.step()
                steps += 1
        return permuted(net)[0], steps

    return {"authors' Sinkhorn, distance": distance, "authors' Sinkhorn, midpoint": midpoint}


def run(args: argparse.Namespace) -> int:
    import torch

    from pyperm import nn as pnn
    from pyperm.benchmarks._report import write_generated
    from pyperm.reproduce._data import check_data

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    name = check_data(args.data, ("digits", "mnist"))
    if args.authors is not None:
        _import_authors(args.authors)  # before any training: a missing dependency fails at once
    # The process's CPU time counts the solvers' own threads too (the compiled LAP's pool), which the
    # calling thread's would miss.
    timer = time.perf_counter if args.clock == "wall" else time.process_time
    # torch's optimisers import their compiler support on first use (seconds, once per process): done here,
    # so that the first method timed does not pay it for the others.
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])
    rows, seconds, barriers = [], {}, {}
    for seed in range(args.seeds):
        model, sa, sb, loaded, cfg = _pair(args.scale, args.data, args.device, seed, args.epochs, args.cache)
        spec = model.permutation_spec()
        methods = _methods(model, spec, sa, sb, loaded, cfg, seed)
        if args.authors is not None:
            methods |= _authors_methods(args.authors, model, sa, sb, loaded, cfg, DISTANCE_STEPS)
        found = {"naive": (sb, 0, 0.0)}
        for label, call in methods.items():
            times = []
            for _ in range(args.repeat):
                start = timer()
                pb, steps = call()
                times.append(timer() - start)
            found[label] = (pb, steps, statistics.median(times))
            print(f"  pair {seed}: {label} {found[label][2]:.2f} s", flush=True)
        for label, (pb, steps, took) in found.items():
            result = pnn.barrier(model, sa, pb, loaded["test"], num_points=cfg["points"])
            rows.append([seed, label, result.loss_barrier, result.accuracy_barrier, _distance(spec, sa, pb), steps,
                         took])  # fmt: skip
            seconds.setdefault(label, []).append(took)
            barriers.setdefault(label, []).append(result.loss_barrier)
    table = markdown_table(HEADERS, rows) if args.markdown else text_table(HEADERS, rows)
    print()
    print(table)
    mean = {label: sum(v) / len(v) for label, v in barriers.items()}
    took = {label: sum(v) / len(v) for label, v in seconds.items()}
    barrier_goal = mean["Sinkhorn, midpoint"] <= mean["weight matching"]
    time_goal = took["Sinkhorn, midpoint"] <= took["STE"]
    print(f"goal: Sinkhorn (midpoint) mean test loss barrier {mean['Sinkhorn, midpoint']:.4g} <= weight matching's "
          f"{mean['weight matching']:.4g}: {'holds' if barrier_goal else 'does not hold'}; its mean time "
          f"{took['Sinkhorn, midpoint']:.3g} s <= STE's {took['STE']:.3g} s: {'holds' if time_goal else 'does not hold'}")
    if args.write is not None:
        text = markdown_table(HEADERS, rows)
        epochs = "" if args.epochs is None else f"-epochs{args.epochs}"
        path = write_generated(args.write, f"bench-sinkhorn-{name}-{args.scale}{epochs}", text)
        print(f"table written to {path}")
    return 0
