"""The three ways ``pyperm align`` and ``pyperm barrier`` match B to A, behind one call."""

from __future__ import annotations

import argparse
from typing import Any

from pyperm._argtypes import nonnegative_int, positive_float, positive_int
from pyperm.commands._common import CommandError, Data, LoadedModel, Timer

__all__ = ["METHODS", "add_matching_arguments", "match"]

METHODS = ("weight", "activation", "ste")


def add_matching_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the matching methods (each ignored by the methods it does not concern)."""
    parser.add_argument(
        "--max-iter",
        type=nonnegative_int,
        default=100,
        help="weight matching: most sweeps over the groups (default 100; 0: the start as it is)",
    )
    parser.add_argument(
        "--init",
        choices=("best", "identity", "signatures"),
        default=None,
        help="weight matching: where the search starts; 'best' runs from the identity and from the units' "
        "signatures and keeps the better (the default, in one process and over ranks under torchrun), 'identity' is "
        "Algorithm 1 as published (half the time)",
    )
    parser.add_argument(
        "--max-batches",
        type=positive_int,
        default=None,
        help="activation/STE matching: most training batches to read (default: all)",
    )
    parser.add_argument(
        "--ste-epochs", type=positive_int, default=1, help="STE matching: passes over the training data (default 1)"
    )
    parser.add_argument(
        "--ste-lr", type=positive_float, default=1e-3, help="STE matching: Adam's learning rate (default 1e-3)"
    )


def match(
    method: str,
    loaded: LoadedModel,
    state_a: dict,
    state_b: dict,
    data: Data | None,
    args: argparse.Namespace,
    device: Any,
) -> tuple[Any, dict[str, Any]]:
    """Permutations of B's groups into A's basin by ``method``, and what to report about the search.

    Parameters
    ----------
    method : {"weight", "activation", "ste"}
        Git Re-Basin's weight matching (Algorithm 1), activation matching (eq. 1, Pearson
        correlation of post-activations, as Tatro et al.) or STE matching (Algorithm 2).
    loaded : LoadedModel
        The model and its spec.
    state_a, state_b : dict of str to torch.Tensor
        Float32 states on ``device``.
    data : Data or None
        Needed by activation and STE matching (their training batches).
    args : argparse.Namespace
        The options of :func:`add_matching_arguments`, ``seed`` and ``progress``.
    device : torch.device
        Where to compute.

    Returns
    -------
    perms : pyperm.nn.Permutations
        One permutation per group of the spec.
    info : dict
        ``method``, ``seconds`` and the method's own record (objective per sweep, similarities, losses).
    """
    from pyperm import nn as pnn

    if method not in METHODS:
        raise CommandError(f"--method {method!r}: expected one of {', '.join(METHODS)}")
    if method != "weight" and data is None:
        raise CommandError(f"--method {method} reads activations: it needs --data")
    info: dict[str, Any] = {"method": method}
    with Timer() as timer:
        if method == "weight":
            result = pnn.weight_matching(
                loaded.spec, state_a, state_b, max_iter=args.max_iter, seed=args.seed, init=args.init or "best",
                progress=args.progress,
            )
            info.update(
                objective_per_sweep=list(result.objective), iterations=result.iterations, converged=result.converged
            )
        elif method == "activation":
            model_a = _model_with(loaded, state_a, device)
            model_b = _model_with(loaded, state_b, device)
            result = pnn.activation_matching(
                model_a, model_b, loaded.spec, data.train, max_batches=args.max_batches, progress=args.progress
            )
            info.update(
                similarity=dict(result.similarity),
                identity_similarity=dict(result.identity_similarity),
                num_batches=result.num_batches,
            )
        else:
            model = _model_with(loaded, state_a, device)
            result = pnn.ste_matching(
                model,
                loaded.spec,
                state_a,
                state_b,
                data.train,
                epochs=args.ste_epochs,
                lr=args.ste_lr,
                seed=args.seed,
                max_batches=args.max_batches,
                progress=args.progress,
            )
            info.update(midpoint_loss_per_step=list(result.loss), best_step=result.best_step)
    info["seconds"] = timer.seconds
    info["objective"] = pnn.matching_objective(loaded.spec, state_a, state_b, result.perms)
    info["identity_objective"] = pnn.matching_objective(loaded.spec, state_a, state_b)
    return result.perms, info


def _model_with(loaded: LoadedModel, state: dict, device: Any) -> Any:
    """A copy of the model holding ``state`` on ``device``."""
    import copy

    model = copy.deepcopy(loaded.module).to(device)
    model.load_state_dict(state)
    return model.eval()
