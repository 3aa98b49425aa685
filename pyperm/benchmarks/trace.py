"""``pyperm bench trace``: tracing real torchvision and timm models, against their targets.

Builds each model at random initialisation (seeded), traces it flat and with
``structured=True`` (median of ``--repeat`` runs each, one thread), and reports the share of
hidden units each spec permutes, the causes of units left unpermuted, and whether the
structured spec keeps the function (a random permutation of every group, in float64).
Targets (on the 2-core machine): resnet50 traces in under 1 s and densenet121 in under 2 s;
every model of the listed ones (``LISTED``) permutes at least 95% of its hidden units.

``--all`` surveys every classification model torchvision lists (and timm's
vit_tiny_patch16_224 when timm is installed), traced structured (``--flat``: flat): one row per
model with its hidden units, the share a group moves, the trace time, the largest output
change under a random permutation of every group (float64) and whether weight matching finds
a planted permutation back; models under 99% are flagged with what stays unpermuted. A model
is skipped, with the reason in its row, only when it cannot run on this machine.
``--hf`` surveys small Hugging Face transformers models the same way (:mod:`pyperm.benchmarks._hf_models`),
with the front end that traced each and its hidden units by kind. Needs torchvision (and timm for ``timm:``
models, transformers for ``--hf``).
"""

from __future__ import annotations

import argparse
import copy
import math
import re
import sys
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyperm._tables import markdown_table, text_table
from pyperm.benchmarks._report import time_call
from pyperm._argtypes import int_at_least, positive_int

DEFAULT_MODELS = (
    "resnet18", "resnet50", "vgg11_bn", "densenet121", "mobilenet_v2", "efficientnet_b0", "convnext_tiny",
    "resnext50_32x4d", "regnet_y_400mf", "squeezenet1_0", "alexnet", "shufflenet_v2_x1_0",
    "timm:vit_tiny_patch16_224",
)  # fmt: skip
# Seconds to trace (structured): the targets.
TARGETS = {"resnet50": 1.0, "densenet121": 2.0}
# The listed models: at least this share of hidden units permuted by the structured spec.
SHARE_TARGET = 0.95
LISTED = {"resnet18", "vgg11_bn", "densenet121", "mobilenet_v2", "efficientnet_b0", "convnext_tiny",
          "timm:vit_tiny_patch16_224"}  # fmt: skip
# --all: the share of hidden units a model must permute not to be flagged.
SURVEY_TARGET = 0.99
# Input sizes of the models that cannot run at the default (their feature maps shrink below a kernel,
# or their attention windows need a multiple of 224).
MIN_SIZES = {"inception_v3": 75, "maxvit_t": 224}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default=None,
                        help="comma-separated torchvision model names, or timm:<name> (default: the listed and more; "
                             "with --all: every classification model)")
    parser.add_argument("--repeat", type=positive_int, default=3,
                        help="timed traces per model and mode (median reported)")
    parser.add_argument("--size", type=positive_int, default=64, help="input height and width of the CNNs (default 64)")
    parser.add_argument("--seed", type=int_at_least(0), default=0)
    parser.add_argument("--all", action="store_true",
                        help="survey every torchvision classification model (and timm's vit_tiny_patch16_224): "
                             "share permuted, trace time, function kept, planted permutation found")
    parser.add_argument("--flat", action="store_true", help="with --all: trace flat (structured=False)")
    parser.add_argument("--markdown", action="store_true", help="with --all or --hf: print the table as markdown")
    parser.add_argument("--hf", action="store_true",
                        help="survey small Hugging Face transformers models at random init (GPT-2, BERT, Llama, T5, "
                             "ViT, CLIP, ...; --models hf:gpt2,hf:llama narrows the list): front end, share "
                             "permuted by kind, function kept, planted permutation found")


def build(name: str, size: int, seed: int):
    """The model at random initialisation, its output layer marked, and an input batch of 2."""
    import torch
    from torch import nn

    from pyperm._optional_imports import import_torchvision

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if name.startswith("timm:"):
            import_torchvision()
            import timm

            model = timm.create_model(name[5:], pretrained=False)
            cfg = model.pretrained_cfg.get("input_size", (3, 224, 224))
            x = torch.randn(2, *cfg)
        else:
            tv = import_torchvision()
            if name not in tv.models.list_models():
                raise ValueError(f"unknown torchvision model {name!r}")
            size = input_size(name, size)
            # torchvision's ViTs take any image size that their patches tile (their position embedding follows).
            extra = {"image_size": size} if name.startswith("vit_") else {}
            model = tv.models.get_model(name, weights=None, **extra)
            x = torch.randn(2, 3, size, size)
    last = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))][-1]
    last.is_head = True  # produces the model's output: not a hidden unit
    return model.eval(), x


def input_size(name: str, size: int) -> int:
    """The input height and width to build torchvision model ``name`` at: ``size``, raised to what the
    model needs (``MIN_SIZES``), and for a ViT rounded up to a multiple of its patch."""
    size = max(size, MIN_SIZES.get(name, 0))
    patch = re.fullmatch(r"vit_\w_(\d+)", name)
    return -(-size // int(patch.group(1))) * int(patch.group(1)) if patch else size


def load_permuted(model, state: dict) -> None:
    """``model.load_state_dict(state)`` with the model's own state-dict metadata (the versions some modules,
    such as MNASNet's, check while loading)."""
    metadata = getattr(model.state_dict(), "_metadata", None)
    if metadata is not None:
        state = OrderedDict(state)
        state._metadata = metadata  # type: ignore[attr-defined]
    model.load_state_dict(state)


def same_function(model, spec, x, seed: int) -> bool:
    """Whether a random permutation of every group leaves the outputs unchanged (float64)."""
    import torch

    from pyperm.nn import apply_permutation
    from pyperm.testing import random_permutations

    a = copy.deepcopy(model).double()
    b = copy.deepcopy(a)
    load_permuted(b, apply_permutation(spec, random_permutations(spec, torch.Generator().manual_seed(seed)),
                                       a.state_dict()))  # fmt: skip
    with torch.no_grad():
        return bool(torch.allclose(a(x.double()), b(x.double()), rtol=1e-9, atol=1e-9))


def run(args: argparse.Namespace) -> int:
    import torch

    from pyperm.nn import trace_model
    from pyperm.testing import permutable_share

    torch.set_num_threads(1)  # the command owns its process; library calls never do this
    if args.all:
        return run_survey(args)
    if getattr(args, "hf", False) or any(name.startswith("hf:") for name in model_names(args.models or "")):
        from pyperm.benchmarks._hf_models import run_hf_survey  # imports transformers: only when asked

        return run_hf_survey(args)
    rows, failures = [], []
    for name in model_names(args.models or ",".join(DEFAULT_MODELS)):
        try:
            model, x = build(name, args.size, args.seed)
        except ModuleNotFoundError as exc:
            print(f"{name}: skipped ({exc})", file=sys.stderr)
            continue
        except (ValueError, RuntimeError) as exc:  # an unknown name (timm raises RuntimeError for one)
            print(f"{name}: {exc}", file=sys.stderr)
            return 2
        cells = [name, f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M"]
        for structured in (False, True):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the causes are counted below
                timing = time_call(lambda s=structured: trace_model(model, x, composite="fix", structured=s),
                                   args.repeat)  # fmt: skip
            result = timing.result
            share = permutable_share(model, result.spec)
            cells += [f"{share:.1%}", len(result.composites), f"{timing.median:.2f}"]
        kept = same_function(model, result.spec, x, args.seed)
        target = TARGETS.get(name)
        cells += ["yes" if kept else "NO", f"{timing.median / target:.2f}" if target else ""]
        rows.append(cells)
        if not kept:
            failures.append(f"{name}: the structured spec changes the function")
        if target and timing.median > target:
            failures.append(f"{name}: traced in {timing.median:.2f} s, over the {target:g} s target")
        if name in LISTED and share < SHARE_TARGET:
            failures.append(f"{name}: {share:.1%} of hidden units permutable, under {SHARE_TARGET:.0%}")
        print(f"{name} done", file=sys.stderr, flush=True)
    headers = ["model", "params", "flat", "causes", "s", "structured", "causes", "s", "function kept",
               "time/target"]  # fmt: skip
    print(f"torch {torch.__version__}, one thread, median of {args.repeat}; shares of hidden units permuted")
    print(text_table(headers, rows))
    for line in failures:
        print(f"FAILED: {line}")
    return 1 if failures else 0


def model_names(text: str) -> list[str]:
    """The model names of a ``--models`` value."""
    return [m.strip() for m in text.split(",") if m.strip()]


# --------------------------------------------------------------------------- --all: every classification model


@dataclass
class SurveyRow:
    """One model of the survey (``--all``)."""

    name: str
    size: int = 0  #: input height and width
    params: int = 0
    hidden: int = 0  #: hidden units: outputs of the layers the input reaches, the output layer excepted
    permuted: int = 0  #: of those, the units a group of the spec moves
    seconds: float = math.nan  #: trace time (median)
    max_diff: float = math.nan  #: largest output change under a random permutation of every group (float64)
    kept: bool = False  #: whether that change is within rounding (allclose, rtol = atol = 1e-9)
    recovered: str = ""  #: weight matching on a planted permutation: "yes", "aligned" (ties), "NO" or "n/a"
    match_seconds: float = math.nan
    skipped: str = ""  #: why the model was not surveyed ("" when it was)
    error: str = ""  #: a trace that failed
    causes: tuple[str, ...] = ()  #: the trace's causes of units left unpermuted
    unpermuted: list[tuple[str, int]] = field(default_factory=list)  #: (layer, its units no group moves), most first
    constant: int = 0  #: units of layers computed from parameters alone (not counted in ``hidden``)

    @property
    def share(self) -> float:
        return self.permuted / self.hidden if self.hidden else math.nan

    def failures(self) -> list[str]:
        """What went wrong beyond a low share: a failed trace, a changed function, a planted permutation missed."""
        if self.skipped:
            return []
        if self.error:
            return [f"{self.name}: {self.error}"]
        changed = [] if self.kept else [f"{self.name}: a random permutation changes the outputs by {self.max_diff:.1e}"]
        return changed + ([f"{self.name}: weight matching missed the planted permutation"] if self.recovered == "NO"
                          else [])  # fmt: skip


def survey_names() -> list[str]:
    """Every classification model torchvision lists, and timm's vit_tiny_patch16_224 when timm is installed."""
    from pyperm._optional_imports import import_torchvision

    tv = import_torchvision()
    names = sorted(tv.models.list_models(module=tv.models))
    try:
        import timm  # noqa: F401
    except ModuleNotFoundError:
        return names
    return names + ["timm:vit_tiny_patch16_224"]


def survey_model(name: str, *, size: int = 64, seed: int = 0, structured: bool = True, repeat: int = 1) -> SurveyRow:
    """Trace one model and measure what the survey reports (see :class:`SurveyRow`)."""
    from pyperm.nn import TraceError, trace_model

    row = SurveyRow(name)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # googlenet and inception_v3 warn about their initialisation
            model, x = build(name, size, seed)
    except ModuleNotFoundError as exc:
        row.skipped = f"skipped: {exc}"
        return row
    row.size, row.params = x.shape[-1], sum(p.numel() for p in model.parameters())
    need, free = 16 * row.params, _available_bytes()  # float64 weights and a permuted float64 copy
    if free is not None and need > free:
        row.skipped = f"skipped: needs {need / 2**30:.0f} GB for the float64 check, {free / 2**30:.0f} GB available"
        return row
    try:
        ran = _layers_run(model, x)
    except RuntimeError as exc:
        row.skipped = f"skipped: cannot run at {row.size}x{row.size}: {str(exc).splitlines()[0][:80]}"
        return row
    try:
        timing = time_call(lambda: trace_model(model, x, composite="fix", structured=structured), repeat)
    except TraceError as exc:
        row.error = f"trace failed: {str(exc).splitlines()[0][:120]}"
        return row
    spec = timing.result.spec
    row.seconds, row.causes = timing.median, timing.result.composites
    # Layers whose weights a function reads without calling them (Swin's attention) are used too.
    params = [str(node.target) for node in timing.result.graph_module.graph.nodes if node.op == "get_attr"]
    used = {**{target.rpartition(".")[0]: True for target in params}, **ran}
    _count_units(row, model, spec, used)
    for step, measure in (("weight matching", _match_planted), ("the float64 check", _check_function)):
        try:  # the float64 check last: it leaves the model in float64, permuted
            measure(row, model, spec, x, seed)
        except Exception as exc:  # one model's failure is its row's, not the survey's
            row.error = f"{step} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
            return row
    return row


def _available_bytes() -> int | None:
    """The memory this machine can still give (Linux's MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _layers_run(model, x) -> dict[str, bool]:
    """The paths of the modules one forward pass calls (auxiliary classifiers of eval-mode models are not), each
    with whether its output depends on the input (a layer computed from parameters alone, such as Swin V2's
    position bias MLP, does not): the input alone requires gradients."""
    import torch

    ran: dict[str, bool] = {}

    def record(name: str, out: Any) -> None:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        ran[name] = ran.get(name, False) or any(isinstance(t, torch.Tensor) and t.requires_grad for t in outs)

    params = [p for p in model.parameters() if p.requires_grad]
    handles = [m.register_forward_hook(lambda _, __, out, name=name: record(name, out))
               for name, m in model.named_modules()]  # fmt: skip
    try:
        for p in params:
            p.requires_grad_(False)
        with torch.enable_grad():
            model(x.detach().requires_grad_(True))
    finally:
        for h in handles:
            h.remove()
        for p in params:
            p.requires_grad_(True)
    return ran


def _hidden_axes(model, used: dict[str, bool]) -> list[tuple[str, str, int, bool]]:
    """``(layer, state_dict key, axis, input-dependent)`` of every producer of hidden units the model uses: the
    outputs of every Linear, convolution, embedding, recurrent and attention layer but the model's output layer."""
    from torch import nn

    axes = []
    for name, m in model.named_modules():
        if name not in used or getattr(m, "is_head", False):
            continue
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            axes.append((name, f"{name}.weight", 0, used[name]))
        elif isinstance(m, (nn.Embedding, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
            axes.append((name, f"{name}.weight", 1, used[name]))
        elif isinstance(m, (nn.LSTM, nn.GRU, nn.RNN)):
            axes.append((name, f"{name}.weight_hh_l0", 1, used[name]))
        elif isinstance(m, nn.MultiheadAttention):  # its out_proj runs inside it, as a function
            axes += [(name, f"{name}.in_proj_weight", 0, used[name]),
                     (f"{name}.out_proj", f"{name}.out_proj.weight", 0, used[name])]  # fmt: skip
    return axes


def _moved(spec, entry: Any) -> int:
    """How many entries of an axis some group moves (fixed parts of a concatenation, one-unit groups: none)."""
    from pyperm.nn.spec import Interleaved, Segments, Tiled

    if entry is None:
        return 0
    if isinstance(entry, (Segments, Interleaved)):
        return sum(_moved(spec, part) for part in entry.parts if not isinstance(part, int))
    if isinstance(entry, str):
        groups = [entry]
    elif isinstance(entry, Tiled):
        groups = list(entry.groups())
    else:  # Blocks: its inner group moves units within blocks of more than one
        blocks = spec.sizes[entry.outer] if isinstance(entry.outer, str) else entry.outer
        groups = ([entry.outer] if isinstance(entry.outer, str) else []) + ([entry.inner] * (spec.sizes[entry.inner]
                                                                                              > blocks))  # fmt: skip
    return spec.entry_length(entry) if any(spec.sizes[g] > 1 for g in groups) else 0


def _count_units(row: SurveyRow, model, spec, used: dict[str, bool]) -> None:
    """The hidden units, those a group moves, and the layers whose units stay. Units computed from parameters
    alone are no activations (the tracer makes groups of activations' units only): counted apart."""
    sd = model.state_dict()
    for layer, key, axis, depends in _hidden_axes(model, used):
        n, moved = sd[key].shape[axis], _moved(spec, spec.axes[key][axis])
        if not depends:
            row.constant += n
            continue
        row.hidden, row.permuted = row.hidden + n, row.permuted + moved
        if moved < n:
            row.unpermuted.append((layer, n - moved))
    row.unpermuted.sort(key=lambda item: -item[1])


def _match_planted(row: SurveyRow, model, spec, x, seed: int) -> None:
    """Weight matching between the model and a copy permuted by a random (planted) permutation: found back?"""
    import torch

    from pyperm.nn import Permutations, apply_permutation, weight_matching
    from pyperm.testing import random_permutations

    if not spec.sizes:
        row.recovered = "n/a"
        return
    gen = torch.Generator().manual_seed(seed + 1)
    # Random-init norm layers and biases are constants (ties between units): spread these small tensors.
    sa = {k: t + 0.1 * torch.randn(t.shape, generator=gen, dtype=t.dtype) if t.is_floating_point() and t.ndim <= 1
          else t for k, t in model.state_dict().items()}  # fmt: skip
    planted = Permutations(spec, random_permutations(spec, gen))
    sb = apply_permutation(spec, planted, sa)
    start = time.perf_counter()
    found = weight_matching(spec, sa, sb, seed=seed)
    row.match_seconds = time.perf_counter() - start
    if found.perms == planted.inverse():
        row.recovered = "yes"
        return
    aligned = apply_permutation(spec, found.perms, sb)  # units equal in every tensor may be matched either way
    row.recovered = "aligned" if all(torch.equal(aligned[k], t) for k, t in sa.items()) else "NO"


def _check_function(row: SurveyRow, model, spec, x, seed: int) -> None:
    """The largest output change, in float64, when every group is permuted at random (in place: no copy of a
    big model)."""
    import torch

    from pyperm.nn import apply_permutation
    from pyperm.testing import random_permutations

    model.double()
    with torch.no_grad():
        before = model(x.double())
        load_permuted(model, apply_permutation(spec, random_permutations(spec, seed), model.state_dict()))
        after = model(x.double())
    row.max_diff = float((before - after).abs().max())
    row.kept = bool(torch.allclose(before, after, rtol=1e-9, atol=1e-9))


SURVEY_HEADERS = ["model", "input", "params", "hidden units", "permuted", "trace s", "max abs out change",
                  "function kept", "planted found", "match s", "note"]  # fmt: skip


def survey_table(rows: Sequence[SurveyRow], markdown: bool = False) -> str:
    """The survey as one table, one row per model (a skip's reason in its note; a failure's below the table)."""
    return (markdown_table if markdown else text_table)(SURVEY_HEADERS, [_survey_cells(r) for r in rows])


def _survey_cells(r: SurveyRow) -> list[Any]:
    """One model's cells: what was measured, "-" for what was not."""
    head = [r.name, r.size or "-", f"{r.params / 1e6:.1f}M" if r.params else "-"]
    if r.skipped or not r.hidden:
        return head + ["-"] * 7 + [r.skipped or "FAILED (below)"]
    notes = ["FAILED (below)" if r.failures() else "",
             f"BELOW {SURVEY_TARGET:.0%} (below)" if r.share < SURVEY_TARGET else "",
             f"+{r.constant} units from parameters alone, unpermuted" if r.constant else ""]
    note = "; ".join(filter(None, notes))
    measured = not math.isnan(r.max_diff)
    return head + [r.hidden, f"{r.share:.1%}", f"{r.seconds:.2f}", f"{r.max_diff:.1e}" if measured else "-",
                   ("yes" if r.kept else "NO") if measured else "-", r.recovered or "-",
                   "-" if math.isnan(r.match_seconds) else f"{r.match_seconds:.1f}", note]  # fmt: skip


def survey_flags(rows: Sequence[SurveyRow], causes: int = 8) -> list[str]:
    """A paragraph per model under the target: its share, the layers whose units stay and the trace's causes."""
    lines = []
    for r in rows:
        if r.skipped or r.error or r.share >= SURVEY_TARGET:
            continue
        layers = ", ".join(f"{layer} ({n})" for layer, n in r.unpermuted[:6])
        more = f" and {len(r.unpermuted) - 6} more layers" if len(r.unpermuted) > 6 else ""
        lines.append(f"BELOW {SURVEY_TARGET:.0%}: {r.name} permutes {r.share:.1%} ({r.permuted} of {r.hidden} hidden "
                     f"units); unpermuted: {layers}{more}")  # fmt: skip
        lines += [f"  cause: {c}" for c in r.causes[:causes]]
        if len(r.causes) > causes:
            lines.append(f"  ... and {len(r.causes) - causes} more causes")
    return lines


def survey(names: Sequence[str], *, size: int = 64, seed: int = 0, structured: bool = True, repeat: int = 1,
           progress: Callable[[str], None] | None = None) -> list[SurveyRow]:  # fmt: skip
    """:func:`survey_model` of every model of ``names`` (``progress(name)`` after each)."""
    rows = []
    for name in names:
        rows.append(survey_model(name, size=size, seed=seed, structured=structured, repeat=repeat))
        if progress is not None:
            progress(name)
    return rows


def run_survey(args: argparse.Namespace) -> int:
    """``--all``: the survey's table and flags; exit status 1 when a trace failed, a function changed or a planted
    permutation was missed (a share under the target is flagged, not failed)."""
    import torch

    names = model_names(args.models) if args.models else survey_names()
    rows = survey(names, size=args.size, seed=args.seed, structured=not args.flat, repeat=args.repeat,
                  progress=lambda name: print(f"{name} done", file=sys.stderr, flush=True))  # fmt: skip
    print(f"torch {torch.__version__}, one thread, {'flat' if args.flat else 'structured'} traces of {len(rows)} "
          f"models at {args.size}x{args.size} (unless the row says otherwise), trace time: median of {args.repeat}; "
          "permuted: the hidden units a group moves; max abs out change: float64 outputs under a random permutation "
          "of every group")  # fmt: skip
    return print_survey(rows, survey_table(rows, args.markdown), survey_flags(rows))


def print_survey(rows: Sequence[Any], table: str, flags: Sequence[str]) -> int:
    """Print a survey's table, its flags and its failures (``row.failures()``); 1 when any, else 0."""
    print(table)
    for line in flags:
        print(line)
    failures = [f for r in rows for f in r.failures()]
    for line in failures:
        print(f"FAILED: {line}")
    return 1 if failures else 0
