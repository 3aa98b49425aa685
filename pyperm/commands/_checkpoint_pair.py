"""Loading the checkpoints a sub-command names, checked against ``--model`` and each other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pyperm.commands._common import CommandError, LoadedModel

__all__ = ["function_gap", "load_for_model", "model_with", "refuse_inputs"]


def load_for_model(paths: list[str], loaded: LoadedModel, shards: list[Any] | None = None) -> list[Any]:
    """Each checkpoint (memory-mapped: :func:`pyperm.checkpoints.load_checkpoint`, with ``shards[i]`` choosing
    the shards of path ``i`` to map), checked to hold ``loaded``'s keys and shapes, and all to agree with the
    first."""
    from pyperm.checkpoints import check_against_model, check_pair, load_checkpoint
    from pyperm.nn.state import shared_tensors

    model_state = loaded.module.state_dict()
    ties = shared_tensors(model_state)
    ckpts = []
    for i, path in enumerate(paths):
        ckpt = load_checkpoint(path, shards=None if shards is None else shards[i])
        _fill_tied(ckpt, ties)
        check_against_model(ckpt, model_state, loaded.name)
        if ckpts:
            check_pair(ckpts[0], ckpt)
        ckpts.append(ckpt)
    return ckpts


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
    from pyperm.checkpoints import checkpoint_files

    inputs = set()
    for ckpt in ckpts:
        inputs.update(p.resolve() for p in checkpoint_files(ckpt))
    for out in outputs:
        if out.resolve() in inputs:
            raise CommandError(f"{out}: is one of the input checkpoints; choose another --out")


def model_with(loaded: LoadedModel, state: dict, device: Any) -> Any:
    """A copy of the model holding ``state``, on ``device``, in eval mode.

    A model built on the meta device (:func:`pyperm.commands._common.build_model` with
    ``meta=True``) is built again with its parameters on the meta device and its buffers real,
    and takes ``state``'s tensors themselves as its parameters (no copy: a memory-mapped
    checkpoint stays mapped, in its own dtype; a state of mixed floating dtypes is converted to
    float32, for a forward that expects one dtype); any other is deep-copied and loads ``state``.
    """
    import copy

    from pyperm.commands._common import float_state, parameters_on_meta

    if not loaded.on_meta:
        model = copy.deepcopy(loaded.module).to(device)
        model.load_state_dict(state)
        return model.eval()
    if len({t.dtype for t in state.values() if t.is_floating_point()}) > 1:
        state = float_state(state, "cpu")
    with parameters_on_meta():
        model = loaded.build()
    model.load_state_dict(state, assign=True)
    return model.to(device).eval()


def function_gap(loaded: LoadedModel, state_1: dict, state_2: dict, inputs: Any) -> tuple[float, str]:
    """Largest absolute difference of the model's outputs (eval mode) under two states on ``inputs``, and the
    dtype the models ran in.

    Each state runs in the model's own floating dtype (a meta-built model's is the state's:
    :func:`model_with`), floating inputs cast to it; one model exists at a time.
    """
    import torch

    outputs = []
    for state in (state_1, state_2):
        model = model_with(loaded, state, inputs.device)
        dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        x = inputs.to(dtype) if inputs.is_floating_point() else inputs
        with torch.no_grad():
            outputs.append(model(x).double())
        del model
    return float((outputs[0] - outputs[1]).abs().max()), str(dtype).removeprefix("torch.")
