"""MergeMany's restarts from the identity: time and merged test loss beside the loops around them (issue 54, item 4).

    python bench/merge_many_restarts.py --data mnist:DIR --cache DIR [--epochs 100] [--models 5] [--seeds 0,1,2,3]

The models are the endpoints of ``pyperm reproduce rebasin --scale paper`` (MLP 784-512x3-10, Adam
at 1e-3, batches of 500, training seeds 1 to ``--models``), trained once and kept in ``--cache``
(``--epochs`` sets how long; the paper trains 100). Each merge seed merges them five ways:

- ``merge_many``: pyperm's, rounds of warm starts, with restarts from the identity only in a round
  that follows one that gained nothing worth a round (no change, or at most
  :data:`~pyperm.nn.align.merge.GAIN_TOLERANCE` of the objective), and such a round of restarts the last
  (or, once a round of restarts has kept none, the next such round of warm starts);
- ``warm only``: the rounds before the restarts were added (the parent of commit f12e3f9): every
  matching from the model's current permutations, a model's first from the identity, no stall check;
- ``restart every round``: the rounds from f12e3f9 until the restarts waited for a round's end:
  every matching from non-identity permutations is followed by one from the identity (with the stall
  check), kept when higher by more than 1e-6 (relative);
- ``restart at a standstill``: the rounds from ea48746 until the gain tolerance: restarts (kept when
  higher by more than 1e-6) only in a round after one that changed no permutation, and only such a
  round of restarts that changes nothing the last;
- ``Algorithm 3``: the paper's loop, every matching from the identity (no warm start, no stall check).

The four loops besides ``merge_many`` are written here, with pyperm's matcher, as
:func:`pyperm.nn.align.merge.align_many` runs its rounds. Printed per seed and way: wall and CPU
seconds (this process, ``--threads`` threads), rounds, matchings, and the merged model's test loss
and accuracy; then the ratios of each way's time to ``warm only``'s.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from pyperm.nn import Permutations, merge_many
from pyperm.nn.align._starts import _same_seed, unstalled
from pyperm.nn.align.weight import WeightMatcher
from pyperm.nn.models import create_model
from pyperm.nn.permutations import permute_entry
from pyperm.reproduce._data import load_data
from pyperm.reproduce._train import evaluate
from pyperm.reproduce.rebasin._experiments import train_endpoint

MODEL = "mlp:784,512,512,512,10"
# How much higher the identity start had to be to replace the warm start, in the restart-every-round code.
OLD_START_TOLERANCE = 1e-6


def endpoints(data: dict, cache: Path, models: int, epochs: int) -> list[dict]:
    """The paper's MNIST MLPs from training seeds 1 to ``models``, trained unless ``cache`` holds them."""
    cache.mkdir(parents=True, exist_ok=True)
    states = []
    for seed in range(1, models + 1):
        path = cache / f"mlp_seed{seed}_epochs{epochs}.pt"
        if not path.exists():
            _, state = train_endpoint(MODEL, data, "adam", 500, epochs, seed, "cpu")
            torch.save(state, path)
        states.append(torch.load(path))
    return states


def rounds(spec, states: list[dict], seed: int, way: str, max_iter: int = 100) -> tuple[list, int, int]:
    """One of the loops besides merge_many (``way``: "warm only", "restart every round", "restart at a
    standstill", "Algorithm 3"): the merged state, the rounds and the matchings run."""
    gen = torch.Generator().manual_seed(seed)
    n = len(states)
    identity = Permutations.identity(spec)
    matchers = [WeightMatcher(spec, s) for s in states]
    perms = [identity] * n
    permuted = [dict(s) for s in states]
    total = {k: sum(s[k].double() for s in states) for k in states[0]}
    count = 0

    def match(i: int, others: dict, init: Permutations, g: torch.Generator):
        nonlocal count
        count += 1
        try:
            if way == "Algorithm 3":
                return matchers[i].match(others, init=None, seed=g)
            if way == "warm only" or not init.is_identity():
                return matchers[i].match(others, init=init, seed=g)
            again = _same_seed(g)
            first = matchers[i].match(others, init=None, seed=g)
            return unstalled(matchers[i], first, spec, others, states[i], again, None)
        finally:
            matchers[i].release_a()

    done, restart = 0, True
    for _ in range(max_iter):
        done += 1
        changed = 0
        for i in torch.randperm(n, generator=gen).tolist():
            others = {k: ((v - permuted[i][k].double()) / (n - 1)).to(states[i][k].dtype) for k, v in total.items()}
            at_start = gen.get_state()
            result = match(i, others, perms[i], gen)
            restarts = way == "restart every round" or (way == "restart at a standstill" and restart)
            if restarts and perms[i] != identity:
                gen.set_state(at_start)
                plain = match(i, others, identity, gen)
                if plain.objective[-1] > result.objective[-1] + OLD_START_TOLERANCE * abs(result.objective[-1]):
                    result = plain
            if result.perms == perms[i]:
                continue
            changed += 1
            perms[i] = result.perms
            new = {k: permute_entry(spec, perms[i], k, t) for k, t in states[i].items()}
            for k in total:
                total[k] += new[k].double() - permuted[i][k].double()
            permuted[i] = new
        if changed == 0 and (restart or way != "restart at a standstill"):
            break
        restart = changed == 0
    merged = {k: (v / n).to(states[0][k].dtype) for k, v in total.items()}
    return merged, done, count


def run(way: str, spec, states: list[dict], seed: int) -> dict:
    wall, cpu = time.perf_counter(), time.process_time()
    if way == "merge_many":
        result = merge_many(spec, states, seed=seed)
        merged, done, count = result.merged, result.iterations, None
    else:
        merged, done, count = rounds(spec, states, seed, way)
    return {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu, "rounds": done,
            "matchings": count, "merged": merged}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="mnist:DIR (the idx files)")
    parser.add_argument("--cache", type=Path, required=True, help="where the trained models are kept")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--models", type=int, default=5)
    parser.add_argument("--seeds", default="0,1,2,3", help="merge seeds")
    parser.add_argument(
        "--ways", default="merge_many,warm only,restart every round,restart at a standstill,Algorithm 3"
    )
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = load_data(args.data, "cpu", 10_000)
    states = endpoints(data, args.cache, args.models, args.epochs)
    model = create_model(MODEL)
    spec = model.permutation_spec()

    def test_loss(state: dict) -> tuple[float, float]:
        model.load_state_dict(state)
        return evaluate(model, data["test"])

    for i, s in enumerate(states):
        print(f"model {i + 1}: test loss {test_loss(s)[0]:.4f}", flush=True)
    ways = args.ways.split(",")
    rows: dict[str, list[dict]] = {w: [] for w in ways}
    print(f"{'seed':>4}  {'way':<23} {'wall s':>7} {'cpu s':>7} {'rounds':>6} {'matchings':>9} {'test loss':>9} "
          f"{'accuracy':>8}", flush=True)  # fmt: skip
    for seed in map(int, args.seeds.split(",")):
        for way in ways:
            row = run(way, spec, states, seed)
            row["loss"], row["accuracy"] = test_loss(row.pop("merged"))
            rows[way].append(row)
            print(f"{seed:>4}  {way:<23} {row['wall']:>7.1f} {row['cpu']:>7.1f} {row['rounds']:>6} "
                  f"{row['matchings'] if row['matchings'] is not None else '-':>9} {row['loss']:>9.5f} "
                  f"{row['accuracy']:>8.4f}", flush=True)  # fmt: skip
    for way, got in rows.items():
        print(f"{way:<23} mean wall {statistics.mean(r['wall'] for r in got):.1f} s, "
              f"cpu {statistics.mean(r['cpu'] for r in got):.1f} s, test loss {[round(r['loss'], 5) for r in got]}")
    for way in rows if "warm only" in rows else ():
        for clock in ("wall", "cpu") if way != "warm only" else ():
            new, old = rows[way], rows["warm only"]
            ratios = [a[clock] / b[clock] for a, b in zip(new, old)]
            print(f"{way} / warm only, {clock} time per seed: {[round(r, 2) for r in ratios]}; "
                  f"of the sums: {sum(a[clock] for a in new) / sum(b[clock] for b in old):.2f}")


if __name__ == "__main__":
    main()
