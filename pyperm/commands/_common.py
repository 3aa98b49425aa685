"""What the checkpoint sub-commands share: options, ``--model`` specs, data, output folders, errors.

Top-level imports stay light (no torch) so that ``pyperm --help`` and ``pyperm bench`` do not
pay for importing torch; everything torch-related is imported inside the functions.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyperm._argtypes import int_at_least, model_name, positive_int, shape

__all__ = [
    "CommandError",
    "LoadedModel",
    "add_common_arguments",
    "add_data_arguments",
    "add_model_arguments",
    "build_model",
    "cli_errors",
    "load_data",
    "on_device",
    "parameters_on_meta",
    "prepare_out",
    "resolve_device",
]

# The names themselves are the registry's (pyperm.nn.models.create_model); a malformed one is
# refused with the list of them all. Listing them here would import torch for `pyperm --help`.
MODEL_HELP = (
    "a bundled model by name, as pyperm.nn.models.create_model reads it: e.g. mlp:784,512,512,10, resnet20:4, "
    "vgg16, tinyten:2,in_channels=1; path/to/file.py:ClassName (constructed without arguments); or hf: the "
    "checkpoints are Hugging Face save_pretrained folders, the architecture is their config.json's (needs "
    "transformers), and outputs are folders from_pretrained loads"
)


logger = logging.getLogger(__name__)


class CommandError(Exception):
    """A problem with the user's input, reported as one line without a traceback."""


# ------------------------------------------------------------------------------ options


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model`` and ``--example-input-shape``."""
    parser.add_argument("--model", required=True, metavar="SPEC", type=model_name, help=MODEL_HELP)
    parser.add_argument(
        "--example-input-shape",
        metavar="N,C,H,W",
        type=shape,
        help="shape of an input batch, for tracing a user model that has no permutation_spec() method (e.g. 1,3,32,32)",
    )


def add_data_arguments(parser: argparse.ArgumentParser, required: bool = False) -> None:
    """``--data``, ``--batch-size``, ``--max-samples``."""
    parser.add_argument(
        "--data",
        required=required,
        metavar="NAME",
        help="digits (scikit-learn's, no download), mnist:DIR (the idx files) or cifar10:DIR (the python batches); "
        "images are scaled to [0, 1]",
    )
    parser.add_argument(
        "--mean",
        metavar="M[,M...]",
        help="normalise inputs as (x - mean) / std per channel, as the checkpoints were trained "
        "(e.g. CIFAR-10's 0.4914,0.4822,0.4465)",
    )
    parser.add_argument(
        "--std", metavar="S[,S...]", help="the std of --mean's normalisation (e.g. 0.2470,0.2435,0.2616)"
    )
    parser.add_argument(
        "--batch-size", type=positive_int, default=256, help="batch size of every pass over the data (default 256)"
    )
    parser.add_argument(
        "--max-samples",
        type=positive_int,
        default=None,
        metavar="N",
        help="use the first N training and N test samples only (default: all)",
    )


def add_rank_timeout(parser: argparse.ArgumentParser) -> None:
    """``--rank-timeout`` of the commands that run over ranks under torchrun (align, merge)."""
    from pyperm._argtypes import positive_float

    parser.add_argument(
        "--rank-timeout", type=positive_float, default=60.0, metavar="SECONDS",
        help="under torchrun: seconds without a sign of life after which a rank counts as dead and every rank "
        "ends (default 60)",
    )  # fmt: skip


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """``--out``, ``--force``, ``--device``, ``--seed``, ``--no-progress``."""
    parser.add_argument("--out", required=True, metavar="DIR", help="folder for the outputs (created if missing)")
    parser.add_argument("--force", action="store_true", help="overwrite existing output files")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--seed", type=int_at_least(0), default=0, help="seed of every random choice (default 0)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


# ------------------------------------------------------------------------------ errors


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    # Errors pyperm raises for bad input already name what is wrong; anything else gets its type.
    expected = isinstance(exc, (CommandError, ValueError, TypeError, OSError, ImportError, KeyError))
    return text if expected else f"{type(exc).__name__}: {text}"


def cli_errors(name: str) -> Callable[[Callable[[argparse.Namespace], int]], Callable[[argparse.Namespace], int]]:
    """Decorate a sub-command's ``run``: any exception becomes one ``pyperm NAME: error: ...`` line and exit status 1.

    ``PYPERM_TRACEBACK=1`` in the environment re-raises instead (for bug reports).
    """

    def wrap(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        @functools.wraps(run)
        def guarded(args: argparse.Namespace) -> int:
            # The library logs its warnings (a partial CIFAR-10 copy, units left unpermuted); the
            # command line shows them as its own lines. A no-op when logging is already set up.
            logging.basicConfig(format=f"pyperm {name}: %(levelname)s: %(message)s", level=logging.WARNING)
            try:
                return int(run(args) or 0)
            except KeyboardInterrupt:
                print(f"pyperm {name}: interrupted", file=sys.stderr)
                return 130
            except Exception as exc:
                if os.environ.get("PYPERM_TRACEBACK"):
                    raise
                print(f"pyperm {name}: error: {_one_line(exc)}", file=sys.stderr)
                return 1

        return guarded

    return wrap


# ------------------------------------------------------------------------------ outputs


def checkpoint_outputs(like: Any, out: Path, stem: str, model: str) -> list[Path]:
    """The files a command writes for a checkpoint in ``like``'s layout: ``out/<stem><suffix>`` (and its
    shards), or for ``--model hf`` a folder ``out/<stem>`` with the input's file names (``from_pretrained``
    loads it; :func:`pyperm.commands._hf.folder_copies` adds the config and tokenizer)."""
    from pyperm.checkpoints import default_name, output_paths

    if model == "hf":
        return output_paths(like, out / stem / like.path.name)
    return output_paths(like, out / default_name(like, stem))


def prepare_out(out: str | Path, names: list[str], force: bool) -> Path:
    """Create the output folder and refuse, before any work, to overwrite one of ``names`` without ``--force``.

    A symlink (or a file) where an output folder of ``names`` goes (``--model hf`` writes into
    ``out/<stem>/``) is an existing output too: ``--force`` removes the link itself, so that
    nothing is written into its target.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CommandError(f"--out {out}: exists and is not a folder")
    folders = sorted({(out / name).parent for name in names} - {out})
    in_the_way = [f for f in folders if os.path.lexists(f) and (f.is_symlink() or not f.is_dir())]
    for path in in_the_way + [out / name for name in names]:
        if os.path.lexists(path) and not force:  # a dangling symlink is an existing name too
            raise CommandError(f"{path}: exists; pass --force to overwrite it")
    out.mkdir(parents=True, exist_ok=True)
    for folder in folders:
        if folder in in_the_way:
            os.unlink(folder)
        folder.mkdir(parents=True, exist_ok=True)
    return out


class Timer:
    """Wall time of a block: ``with Timer() as t: ...; t.seconds``."""

    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start


# ------------------------------------------------------------------------------ device


def resolve_device(name: str) -> Any:
    """``--device`` as a torch.device; a CUDA device that is not there is an error, not a fallback."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise CommandError(f"--device {name!r}: not a device ({exc})") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CommandError(f"--device {name}: torch sees no CUDA device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise CommandError(f"--device {name}: only {torch.cuda.device_count()} CUDA devices")
    elif device.type != "cpu":
        raise CommandError(f"--device {name!r}: expected cpu, cuda or cuda:N")
    return device


# ------------------------------------------------------------------------------ models


@dataclass
class LoadedModel:
    """A model built from ``--model``, its permutation spec and an input batch shape (None when unknown).

    ``module`` is on the meta device (shapes, no values) when the command only needs the spec and
    the state dict's keys and shapes (:func:`build_model` with ``meta=True``); ``build`` makes
    the module again, to run a copy that holds a checkpoint's tensors
    (:func:`pyperm.commands._checkpoint_pair.model_with`).
    """

    name: str
    module: Any
    spec: Any
    input_shape: tuple[int, ...] | None
    example: Any = None  # an input batch of the model's own kind (token ids), when random floats are not
    build: Callable[[], Any] | None = None

    @property
    def on_meta(self) -> bool:
        """Whether the module was built on the meta device (its tensors hold no values)."""
        return any(t.is_meta for t in self.module.state_dict().values())

    def example_input(self, device: Any = "cpu") -> Any:
        """The example batch, else a seeded random one, or None when the input shape is unknown."""
        import torch

        if self.example is not None:
            return self.example.to(device)
        if self.input_shape is None:
            return None
        return torch.randn(self.input_shape, generator=torch.Generator().manual_seed(0)).to(device)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build modules with their parameters on the meta device and their buffers real.

    Non-persistent buffers (the rotary frequencies of a Llama, attention masks) are computed by
    the module's constructor and are in no checkpoint; built this way they are real, while the
    parameters cost nothing and are replaced by a checkpoint's tensors with
    ``load_state_dict(..., assign=True)``. As ``accelerate.init_empty_weights(include_buffers=False)``
    does, ``torch.nn.Module.register_parameter`` is patched while the block runs (not thread-safe;
    the command line builds one model at a time).
    """
    import torch

    register = torch.nn.Module.register_parameter

    def register_on_meta(module: Any, name: str, param: Any) -> None:
        register(module, name, param)
        if param is not None:
            # Allocated with torch.empty and never written: moving it to meta frees it untouched.
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _user_model(spec_text: str, shape: tuple[int, ...] | None, meta: bool) -> LoadedModel:
    file_name, _, class_name = spec_text.rpartition(":")
    path = Path(file_name)
    if not path.is_file():
        raise CommandError(f"--model {spec_text}: file {path} does not exist")
    module_spec = importlib.util.spec_from_file_location(f"_pyperm_user_model_{path.stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise CommandError(f"--model {spec_text}: {path} cannot be imported")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        raise CommandError(f"--model {spec_text}: importing {path} failed ({type(exc).__name__}: {exc})") from exc
    cls = getattr(module, class_name, None)
    if cls is None:
        raise CommandError(f"--model {spec_text}: {path} defines no {class_name!r}")
    import torch

    if meta:
        try:
            with torch.device("meta"):
                return _user_spec(spec_text, cls, cls(), shape)
        except CommandError:
            raise
        except Exception as exc:  # whatever the user's code raises on tensors without values
            logger.debug("--model %s: not built on the meta device (%s); building it for real", spec_text, exc)
    try:
        model = cls()
    except Exception as exc:
        raise CommandError(f"--model {spec_text}: {class_name}() failed ({type(exc).__name__}: {exc})") from exc
    return _user_spec(spec_text, cls, model, shape)


def _user_spec(spec_text: str, cls: Any, model: Any, shape: tuple[int, ...] | None) -> LoadedModel:
    """``model`` (built by ``cls()``) and its spec: its own ``permutation_spec()``, else traced on a zero input
    of ``shape`` (made on the default device: the meta device while a meta model is built)."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise CommandError(
            f"--model {spec_text}: {cls.__name__}() is a {type(model).__name__}, not a torch.nn.Module"
        )
    if callable(getattr(model, "permutation_spec", None)):
        # Its own spec needs no tracing; the shape (if given) only feeds the function check of align.
        return LoadedModel(spec_text, model, model.permutation_spec(), shape, build=cls)
    if shape is None:
        raise CommandError(
            f"--model {spec_text}: {cls.__name__} has no permutation_spec(); pass --example-input-shape to trace it"
        )
    from pyperm.nn import PermutationSpec

    return LoadedModel(spec_text, model, PermutationSpec.from_model(model, torch.zeros(shape)), shape, build=cls)


def _bundled_model(spec_text: str, shape: tuple[int, ...] | None, meta: bool) -> LoadedModel:
    import torch

    from pyperm.nn.models import create_model, input_shape

    try:
        # The bundled models are built on the meta device as anywhere else (tested).
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = create_model(spec_text)
    except ValueError as exc:
        raise CommandError(f"--model: {exc}") from exc
    shape = shape or input_shape(spec_text)
    if hasattr(model, "permutation_spec"):
        spec = model.permutation_spec()
    else:  # a user's architecture from register_model: traced, as a model file's
        from pyperm.nn import PermutationSpec

        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        spec = PermutationSpec.from_model(model, torch.zeros(shape, device=device))
    return LoadedModel(spec_text, model, spec, shape, build=functools.partial(create_model, spec_text))


def build_model(
    spec_text: str, shape: tuple[int, ...] | None = None, checkpoint: str | None = None, *, meta: bool = False
) -> LoadedModel:
    """The model named by ``--model`` and its permutation spec; ``shape`` is ``--example-input-shape``;
    ``checkpoint`` the first checkpoint argument (``--model hf`` reads the architecture beside it).

    With ``meta=True`` the model is built (and traced) on the meta device: it has shapes but no
    values and costs no memory, for commands that need only the spec and the state dict's keys
    and shapes (weight matching without ``--data``: a 1.1B-parameter model would otherwise cost
    4.4 GB of float32 weights that are never used). A user model that cannot be built or traced
    there (its constructor or forward needs values) is built for real instead.

    Raises
    ------
    CommandError
        A model name whose options are out of range, or a user model file that cannot be used.
    """
    if ".py:" in spec_text:
        return _user_model(spec_text, shape, meta)
    if spec_text == "hf":
        from pyperm.commands._hf import hf_model

        return hf_model(checkpoint or ".", shape, meta=meta)
    return _bundled_model(spec_text, shape, meta)


# ------------------------------------------------------------------------------ data


@dataclass
class Data:
    """Batches of the training and test splits of ``--data``, on the device."""

    name: str
    train: list
    test: list
    num_train: int
    num_test: int


def load_data(args: argparse.Namespace, device: Any) -> Data | None:
    """The ``--data`` option's batches, or None when it was not given."""
    if not getattr(args, "data", None):
        return None
    from pyperm.datasets import load_dataset, to_batches

    ds = load_dataset(args.data, seed=args.seed).subset(args.max_samples, args.max_samples)
    if args.mean is not None or args.std is not None:
        ds = ds.normalized(_floats(args.mean or "0", "--mean"), _floats(args.std or "1", "--std"))
    return Data(
        args.data,
        to_batches(ds.x_train, ds.y_train, args.batch_size, device=device),
        to_batches(ds.x_test, ds.y_test, args.batch_size, device=device),
        len(ds.y_train),
        len(ds.y_test),
    )


def _floats(text: str, option: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise CommandError(f"{option} {text!r}: expected comma-separated numbers") from None


def check_inputs(loaded: LoadedModel, data: Data | None, device: Any) -> None:
    """Run the model once on a test batch, so a model/data mismatch is one clear error before any work."""
    if data is None:
        return
    import copy

    import torch

    x = data.test[0][0][:2]
    model = copy.deepcopy(loaded.module).to(device).eval()
    try:
        with torch.no_grad():
            model(x)
    except Exception as exc:
        detail = " ".join(str(exc).split())
        raise CommandError(
            f"--model {loaded.name} cannot run on --data {data.name} (inputs of shape {tuple(x.shape[1:])}): {detail}"
        ) from exc


def has_batchnorm(model: Any) -> bool:
    """Whether the model has BatchNorm layers (its statistics need recomputing off the endpoints)."""
    import torch

    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def float_state(state: dict, device: Any) -> dict:
    """The state with floating tensors in float32 on ``device`` (the methods compute in float32)."""
    return {k: (v.float() if v.is_floating_point() else v).to(device) for k, v in state.items()}


def on_device(state: dict, device: Any) -> dict:
    """The state on ``device`` in its own dtypes (on the CPU: the tensors themselves, no copy)."""
    return {k: v.to(device) for k, v in state.items()}


def peak_memory_lines(peaks: list[int | None]) -> list[str]:
    """report.md's line of peak resident memory: the process's, or one per rank (none when unknown)."""
    known = [p for p in peaks if p is not None]
    if not known:
        return []
    each = ", ".join(f"{p / 1e9:.2f}" for p in known)
    return [f"- peak resident memory, GB ({'per rank' if len(known) > 1 else 'the process'}): {each}"]
