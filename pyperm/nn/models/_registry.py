"""The one registry of bundled models by name: ``create_model("resnet20:4")``.

The command line (``--model``), the benchmarks and the reproductions build the bundled
models through it, so a name means the same model everywhere and a malformed name is
refused in one place, with the same message.

A name is an architecture, optionally followed by ``:`` and comma-separated options:
positional integers first (an MLP's widths; a conv model's width multiplier), then
``key=integer`` keyword options of the model's constructor::

    mlp:784,512,512,10           MLP([784, 512, 512, 10])
    resnet20:4                   ResNet20(width_multiplier=4)
    resnet20:4,in_channels=1     ResNet20(width_multiplier=4, in_channels=1)
    vgg16, vgg11:2, tinyten      VGG16(), VGG11(width_multiplier=2), TinyTen()

The registry is open, the way timm registers its models: :func:`register_model` adds a
user's architecture under a name, and from then on the command line (``--model``), the
benchmarks and the reproductions build it by that name like a bundled one.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from pyperm.nn.models.mlp import MLP
from pyperm.nn.models.resnet import ResNet20, ResNet32
from pyperm.nn.models.tinyten import TinyTen
from pyperm.nn.models.vgg import VGG11, VGG16

__all__ = ["create_model", "input_shape", "model_names", "model_usage", "parse_model_name", "register_model"]


@dataclass(frozen=True)
class _Architecture:
    """How one architecture reads the options of its name."""

    factory: Callable[..., nn.Module]
    usage: str
    keywords: tuple[str, ...]  # the key=integer options it takes
    positional: str | None  # the constructor argument a positional option sets (None: none, or the MLP's widths)
    widths: bool = False  # the MLP: every positional option is a width
    sample_shape: tuple[int, ...] | None = None  # one input sample's shape (None: a bundled model's own rule)


_CONV_KEYWORDS = ("width_multiplier", "num_classes", "in_channels")
_ARCHITECTURES = {
    "mlp": _Architecture(MLP, "mlp:IN,HIDDEN...,OUT (e.g. mlp:784,512,512,10)", (), None, widths=True),
    "resnet20": _Architecture(ResNet20, "resnet20[:WIDTH_MULTIPLIER] (e.g. resnet20:4)", _CONV_KEYWORDS,
                              "width_multiplier"),
    "resnet32": _Architecture(ResNet32, "resnet32[:WIDTH_MULTIPLIER]", _CONV_KEYWORDS, "width_multiplier"),
    "vgg11": _Architecture(VGG11, "vgg11[:WIDTH_MULTIPLIER]", _CONV_KEYWORDS, "width_multiplier"),
    "vgg16": _Architecture(VGG16, "vgg16[:WIDTH_MULTIPLIER]", _CONV_KEYWORDS, "width_multiplier"),
    "tinyten": _Architecture(TinyTen, "tinyten[:WIDTH_MULTIPLIER]", _CONV_KEYWORDS + ("bias",), "width_multiplier"),
}  # fmt: skip


def model_names() -> list[str]:
    """The architectures :func:`create_model` knows, sorted (``["mlp", "resnet20", ...]``)."""
    return sorted(_ARCHITECTURES)


def model_usage() -> str:
    """One line describing every name :func:`create_model` accepts (for help texts and errors)."""
    usages = ", ".join(a.usage for a in _ARCHITECTURES.values())
    return f"{usages}; conv models take key=integer options after the name (resnet20:4,in_channels=1,num_classes=10)"


def parse_model_name(name: str) -> tuple[str, dict[str, Any]]:
    """The architecture and the constructor's keyword arguments that ``name`` stands for.

    Checks the name only (no model is built, so it is cheap): an unknown architecture,
    an empty option (``mlp:64,,10``), an option that is not an integer or ``key=integer``,
    a positional option after a keyword one or below 1, a keyword the architecture does
    not take, or the wrong count of positional options. The values of keyword options
    are checked by the model's constructor (:func:`create_model`).

    Raises
    ------
    TypeError
        ``name`` is not a str.
    ValueError
        Any of the above; the message names the model and the part that is wrong.
    """
    if not isinstance(name, str):
        raise TypeError(f"model name must be a str, got {type(name).__name__}")
    arch_name, colon, text = name.partition(":")
    arch_name = arch_name.strip().lower()
    arch = _ARCHITECTURES.get(arch_name)
    if arch is None:
        raise ValueError(f"model {name!r}: unknown architecture {arch_name!r}; expected {model_usage()}")
    positional, keywords = _parse_options(name, text) if colon else ([], {})
    unknown = [k for k in keywords if k not in arch.keywords]
    if unknown:
        takes = ", ".join(arch.keywords) if arch.keywords else "no key=value options"
        raise ValueError(f"model {name!r}: {arch_name} does not take {unknown[0]!r} (it takes {takes})")
    if arch.widths:  # the MLP: every positional option is a width
        if len(positional) < 2:
            raise ValueError(f"model {name!r}: expected {arch.usage}, at least an input and an output width")
        return arch_name, {"widths": positional}
    if positional and arch.positional is None:
        raise ValueError(f"model {name!r}: {arch_name} takes no positional option (expected {arch.usage})")
    if len(positional) > 1:
        raise ValueError(f"model {name!r}: takes one positional option, the {arch.positional}, got {len(positional)}")
    if positional:
        if arch.positional in keywords:
            raise ValueError(f"model {name!r}: {arch.positional} given twice")
        keywords[arch.positional] = positional[0]
    return arch_name, keywords


def _parse_options(name: str, text: str) -> tuple[list[int], dict[str, int]]:
    """``"4,in_channels=1"`` -> ``([4], {"in_channels": 1})``."""
    positional: list[int] = []
    keywords: dict[str, int] = {}
    for k, part in enumerate(text.split(",")):
        part = part.strip()
        if not part:
            # "mlp:64,,10" is a typo, not an MLP with one hidden layer fewer.
            raise ValueError(f"model {name!r}: option {k + 1} is empty")
        key, eq, value = part.partition("=")
        try:
            number = int(value if eq else key)
        except ValueError:
            raise ValueError(f"model {name!r}: {part!r} is not an integer or key=integer") from None
        if eq:
            keywords[key.strip()] = number
        elif keywords:
            raise ValueError(f"model {name!r}: positional option {part!r} after a key=value option")
        elif number < 1:
            raise ValueError(f"model {name!r}: {part!r} must be positive (a width or a width multiplier)")
        else:
            positional.append(number)
    return positional, keywords


def create_model(name: str) -> nn.Module:
    """The bundled model that ``name`` stands for, freshly initialised (torch's global RNG).

    Parameters
    ----------
    name : str
        An architecture with options: ``"mlp:784,512,512,10"``, ``"resnet20:4"``,
        ``"vgg16"``, ``"vgg11:2,num_classes=100"``, ``"tinyten:2,bias=0"``
        (:func:`model_names` lists the architectures).

    Returns
    -------
    torch.nn.Module
        The model; a bundled model's ``permutation_spec()`` gives its hand-written spec.

    Raises
    ------
    ValueError
        A malformed name (see :func:`parse_model_name`) or an option out of range
        (``mlp:64,0,10``); the message names the model.
    TypeError
        A registered factory returned something other than a module.

    Examples
    --------
    >>> from pyperm.nn.models import create_model
    >>> create_model("mlp:64,32,10").widths
    (64, 32, 10)
    >>> sorted(create_model("resnet20:2").permutation_spec().sizes)[0]
    'stage1'
    """
    arch_name, kwargs = parse_model_name(name)
    try:
        model = _ARCHITECTURES[arch_name].factory(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"model {name!r}: {exc}") from exc
    if not isinstance(model, nn.Module):  # a registered factory that returns something else
        raise TypeError(f"model {name!r}: the registered factory returned a {type(model).__name__}, not a "
                        "torch.nn.Module")  # fmt: skip
    return model


def input_shape(name: str, batch: int = 2) -> tuple[int, ...]:
    """The shape of an input batch of ``batch`` samples for model ``name``.

    An MLP takes ``(batch, IN)``; the conv models take 32x32 images with ``in_channels``
    channels (3 unless the name says otherwise).
    """
    arch_name, kwargs = parse_model_name(name)
    arch = _ARCHITECTURES[arch_name]
    if arch.sample_shape is not None:
        return (batch, *arch.sample_shape)
    if arch.widths:
        return (batch, kwargs["widths"][0])
    if arch.factory not in (ResNet20, ResNet32, VGG11, VGG16, TinyTen):
        raise ValueError(f"model {name!r}: {arch_name} was registered without input_shape, so the shape of its "
                         "inputs is not known; pass register_model(..., input_shape=...) or --example-input-shape")
    return (batch, kwargs.get("in_channels", 3), 32, 32)


_NAME = re.compile(r"^[a-z][a-z0-9_\-]*$")


def register_model(
    name: str | Callable[..., nn.Module] | None = None,
    factory: Callable[..., nn.Module] | None = None,
    *,
    keywords: Sequence[str] = (),
    positional: str | None = None,
    input_shape: Sequence[int] | None = None,
    usage: str | None = None,
    overwrite: bool = False,
) -> Any:
    """Register a user's architecture under ``name``, so that :func:`create_model` (and with it
    ``--model``, the benchmarks and the reproductions) builds it by that name.

    Use it as a call, ``register_model("mynet", MyNet)``, or as a decorator of a class or a
    function that returns the model, ``@register_model`` (registered under the lower-cased
    ``__name__``) or ``@register_model("mynet", keywords=("width",))``.

    Parameters
    ----------
    name : str, optional
        The architecture's name: lower-case letters, digits, ``_`` and ``-``, starting with
        a letter. Default: the factory's ``__name__``, lower-cased.
    factory : callable, optional
        Builds the model (a :class:`torch.nn.Module`); called with the options of the name
        as keyword arguments, integers all. Omitted when used as a decorator.
    keywords : sequence of str, default ()
        The ``key=integer`` options the name may give (``mynet:width=4``).
    positional : str, optional
        The factory argument that one positional option sets (``mynet:4`` with
        ``positional="width"``); None: the name takes no positional option.
    input_shape : sequence of int, optional
        The shape of one input sample, ``(C, H, W)`` or ``(features,)``: lets
        :func:`input_shape` (the command line's tracing of a model that has no
        ``permutation_spec()``) make an example input.
    usage : str, optional
        One line for help texts and errors; default ``NAME[:POSITIONAL][,key=...]``.
    overwrite : bool, default False
        Replace an architecture already registered under ``name`` (a bundled one included).

    Returns
    -------
    callable
        ``factory`` (unchanged, so the decorator leaves the class or function as it was).

    Raises
    ------
    TypeError
        ``factory`` is not callable, or a keyword, ``positional`` or ``input_shape`` of the wrong type.
    ValueError
        A malformed ``name``, a name already registered without ``overwrite``, a keyword
        that is not an identifier, or a non-positive dimension in ``input_shape``.

    Examples
    --------
    >>> from torch import nn
    >>> from pyperm.nn.models import create_model, register_model
    >>> @register_model("tinymlp", positional="hidden", input_shape=(4,), overwrite=True)
    ... def tinymlp(hidden=8):
    ...     return nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 3))
    >>> create_model("tinymlp:16")[0].out_features
    16
    """
    if callable(name) and factory is None:  # bare @register_model
        return register_model(None, name, keywords=keywords, positional=positional, input_shape=input_shape,
                              usage=usage, overwrite=overwrite)  # fmt: skip
    if factory is None:  # @register_model("name", ...)
        return lambda f: register_model(name, f, keywords=keywords, positional=positional, input_shape=input_shape,
                                        usage=usage, overwrite=overwrite)  # fmt: skip
    if not callable(factory):
        raise TypeError(f"factory must be callable (a class or a function returning a model), got "
                        f"{type(factory).__name__}")  # fmt: skip
    if name is None:
        name = getattr(factory, "__name__", "").lower()
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if not _NAME.match(name):
        raise ValueError(f"name {name!r}: expected lower-case letters, digits, '_' or '-', starting with a letter")
    if name in _ARCHITECTURES and not overwrite:
        raise ValueError(f"name {name!r} is already registered; pass overwrite=True to replace it")
    if isinstance(keywords, str) or not all(isinstance(k, str) for k in keywords):
        raise TypeError("keywords must be a sequence of str")
    bad = [k for k in keywords if not k.isidentifier()]
    if bad:
        raise ValueError(f"keywords: {bad[0]!r} is not an identifier")
    if positional is not None and not (isinstance(positional, str) and positional.isidentifier()):
        raise TypeError(f"positional must be an argument name (str) or None, got {positional!r}")
    shape = None
    if input_shape is not None:
        if isinstance(input_shape, (str, bytes)) or not all(isinstance(d, int) and not isinstance(d, bool)
                                                            for d in input_shape):  # fmt: skip
            raise TypeError(f"input_shape must be a sequence of int, got {input_shape!r}")
        shape = tuple(input_shape)
        if not shape or min(shape) < 1:
            raise ValueError(f"input_shape must be non-empty with positive dimensions, got {shape}")
    if usage is None:
        usage = name + (f"[:{positional.upper()}]" if positional else "") + "".join(f"[,{k}=INT]" for k in keywords)
    _ARCHITECTURES[name] = _Architecture(factory, usage, tuple(keywords), positional, sample_shape=shape)
    return factory
