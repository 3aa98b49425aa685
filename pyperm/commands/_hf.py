"""``--model hf``: Hugging Face ``save_pretrained`` folders in the checkpoint sub-commands.

A diffusers model folder (``config.json`` with ``_class_name``) goes to :mod:`pyperm.commands._diffusers`;
the rest of this module reads transformers folders.

The architecture comes from the folder's ``config.json`` (its ``architectures`` entry, built by
``transformers`` at random initialisation; the weights come from the checkpoints as for any
model). The model is given a forward that takes one tensor and returns one (the logits, or the
last hidden state of a model without a head), so that tracing, barriers and the function check
treat it as any other model; its ``state_dict`` keys stay the folder's. An output is a folder
that ``from_pretrained`` loads: the weights in the input's layout (one file, or the same shards
and index) and every other file of the input folder (config, generation config, tokenizer)
copied beside them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from pyperm.commands._common import CommandError, LoadedModel

__all__ = ["copy_files", "folder_copies", "folder_of", "hf_model", "is_weights"]

def folder_of(path: str | Path) -> Path:
    """The ``save_pretrained`` folder a checkpoint argument names (the folder itself, or a file in it)."""
    path = Path(path)
    return path if path.is_dir() else path.parent


def _transformers() -> Any:
    from pyperm._optional_imports import prepare_hf_import

    prepare_hf_import()
    try:
        import transformers
    except ImportError as exc:
        raise CommandError(f"--model hf needs transformers: pip install 'pyperm[hf]' ({exc})") from exc
    return transformers


def _example_shape(config: Any) -> tuple[int, ...]:
    """An input batch's shape: images (``image_size``, ``num_channels``) or 8 token ids."""
    image = getattr(config, "image_size", None)
    if image is not None:
        size = image if isinstance(image, int) else image[0]
        return (2, getattr(config, "num_channels", 3), size, size)
    return (2, 8)


def hf_model(checkpoint: str | Path, shape: tuple[int, ...] | None, *, meta: bool = False) -> LoadedModel:
    """The model of the ``save_pretrained`` folder holding ``checkpoint``, and its traced spec.

    With ``meta=True`` the model is built and traced on the meta device (the spec is the same; a
    1.1B-parameter model then costs nothing instead of 4.4 GB of randomly initialised weights).
    """
    import torch

    from pyperm.nn import PermutationSpec
    from pyperm.nn.models import single_output

    from pyperm.commands._diffusers import diffusers_class_name, diffusers_model

    folder = folder_of(checkpoint)
    diffusers_class = diffusers_class_name(folder)
    if diffusers_class is not None:  # a diffusers model folder (a UNet, a VAE)
        return diffusers_model(folder, diffusers_class, shape, meta=meta)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CommandError(f"--model hf: {folder} has no config.json (a save_pretrained folder has one)")
    transformers = _transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(str(folder))
    except Exception as exc:
        raise CommandError(f"--model hf: {config_file} cannot be read by transformers ({exc})") from exc
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    if cls is None:
        raise CommandError(f"--model hf: {config_file} names no architecture transformers has ({names or 'none'})")

    def build() -> Any:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return single_output(cls(config)).eval()

    with torch.device("meta") if meta else contextlib.nullcontext():
        model = build()
    shape = shape or _example_shape(config)
    vocab = getattr(config, "vocab_size", None)
    generator = torch.Generator().manual_seed(0)
    if len(shape) == 2 and vocab:  # token ids
        example = torch.randint(0, vocab, shape, generator=generator)
    else:
        example = torch.randn(shape, generator=generator)
    spec = PermutationSpec.from_model(model, example.to("meta") if meta else example)
    return LoadedModel(f"hf ({names[0]})", model, spec, tuple(shape), example, build=build)


def is_weights(path: Path) -> bool:
    """A file of weights (any checkpoint suffix pyperm reads, or an index): written by the command, never copied."""
    from pyperm.checkpoints import TORCH_SUFFIXES

    return path.suffix in TORCH_SUFFIXES + (".safetensors",) or path.name.endswith(".index.json")


def copy_files(copies: list[tuple[Path, Path]]) -> list[Path]:
    """Copy every (source, destination) pair, each staged beside its destination and renamed
    into place (:mod:`pyperm._staging`), in the order given; returns the destinations. For the
    files of a pipeline folder that no component writes (align and merge of one model stage
    theirs with the weights instead: ``save_checkpoint(copies=...)``)."""
    import shutil

    from pyperm._staging import write_file

    for src, dst in copies:
        with open(src, "rb") as source:
            write_file(dst, lambda f, s=source: shutil.copyfileobj(s, f))
    return [dst for _, dst in copies]


def folder_copies(source: Any, written: list[Path]) -> list[tuple[Path, Path]]:
    """The files of ``source``'s folder that are not weights (config, generation config, tokenizer), each with
    its destination in the folder of ``written`` (the weights the command writes), which they never replace."""
    from pyperm._staging import SUFFIX

    folder = folder_of(source.path)
    taken = {p.name for p in written}
    return [(p, written[0].parent / p.name) for p in sorted(folder.iterdir())
            if p.is_file() and not is_weights(p) and p.name not in taken
            and not p.name.endswith(SUFFIX)]  # fmt: skip
