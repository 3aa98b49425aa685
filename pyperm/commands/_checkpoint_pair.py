"""Loading the checkpoints a sub-command names, checked against ``--model`` and each other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pyperm.commands._common import CommandError, LoadedModel

__all__ = ["function_gap", "load_for_model", "refuse_inputs"]


def load_for_model(paths: list[str], loaded: LoadedModel) -> list[Any]:
    """Each checkpoint, checked to hold ``loaded``'s keys and shapes, and all to agree with the first."""
    from pyperm.checkpoints import check_against_model, check_pair, load_checkpoint

    model_state = loaded.module.state_dict()
    ties = _ties(loaded.module)
    ckpts = []
    for path in paths:
        ckpt = load_checkpoint(path)
        _fill_tied(ckpt, ties)
        check_against_model(ckpt, model_state, loaded.name)
        if ckpts:
            check_pair(ckpts[0], ckpt)
        ckpts.append(ckpt)
    return ckpts


def _ties(model: Any) -> list[list[str]]:
    """The groups of ``state_dict`` keys that name one tensor (tied weights), each in the model's order."""
    by_storage: dict[tuple, list[str]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if tensor.numel():
            by_storage.setdefault((tensor.data_ptr(), tuple(tensor.shape)), []).append(key)
    return [keys for keys in by_storage.values() if len(keys) > 1]


def _fill_tied(ckpt: Any, ties: list[list[str]]) -> None:
    """Keys of tied weights that the file leaves out (``save_pretrained`` writes one of each), filled from the
    key of the same tie that it holds; recorded in ``ckpt.tied`` so that writing leaves them out again."""
    for keys in ties:
        present = [k for k in keys if k in ckpt.state]
        for key in keys:
            if present and key not in ckpt.state:
                ckpt.state[key] = ckpt.state[present[0]]
                ckpt.tied[key] = present[0]


def refuse_inputs(outputs: list[Path], ckpts: list[Any]) -> None:
    """Never write over an input checkpoint, not even with ``--force``."""
    from pyperm.checkpoints import output_paths

    inputs = set()
    for ckpt in ckpts:
        inputs.update(p.resolve() for p in output_paths(ckpt, ckpt.path))
    for out in outputs:
        if out.resolve() in inputs:
            raise CommandError(f"{out}: is one of the input checkpoints; choose another --out")


def function_gap(loaded: LoadedModel, state_1: dict, state_2: dict, inputs: Any) -> float:
    """Largest absolute difference of the model's outputs (eval mode) under two states on ``inputs``."""
    import copy

    import torch

    model = copy.deepcopy(loaded.module).to(inputs.device).eval()
    with torch.no_grad():
        model.load_state_dict(state_1)
        y1 = model(inputs)
        model.load_state_dict(state_2)
        y2 = model(inputs)
    return float((y1 - y2).abs().max())
