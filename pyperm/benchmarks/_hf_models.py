"""``pyperm bench trace --hf``: small Hugging Face transformers models at random initialisation, traced.

Every model is a small configuration (2 layers, width 64, 4 heads, MLP 128, vocabulary 128, 8 tokens or
32x32 images) that runs in a fraction of a second on one CPU thread, built by name (``hf:gpt2``) with
:func:`build_hf`: the model, its example input (token ids, pixels, Whisper's log-mel features, or a tuple
of token ids and pixels for CLIP) and the layers that produce its outputs marked ``is_head``. A model's
outputs are never permuted, so every model returns its logits alone (:func:`pyperm.nn.models.single_output`,
or a small wrapper where the forward takes more than one input).

:func:`survey_hf_model` measures what ``--all`` measures for torchvision models (see
:mod:`pyperm.benchmarks.trace`), and adds the front end that traced the model, the hidden units broken down
by kind (residual stream, MLP intermediate or a CNN's inner channels, and the attention projections'
units, whose heads and head dims move apart) and the float32 operators a float64 model still runs
(Hugging Face upcasts some norms): a permutation changes those models' outputs by float32 rounding, which
the row reports as measured.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from pyperm._tables import markdown_table, text_table
from pyperm.benchmarks.trace import SURVEY_TARGET, SurveyRow, print_survey, survey_flags

__all__ = ["HF_MODELS", "HFSurveyRow", "build_hf", "hf_flags", "hf_names", "hf_table", "run_hf_survey", "survey_hf",
           "survey_hf_model"]  # fmt: skip

# The sizes every configuration shares: small enough that a model traces in about a second.
WIDTH, LAYERS, HEADS, KV_HEADS, MLP, VOCAB, TOKENS, IMAGE = 64, 2, 4, 2, 128, 128, 8, 32
# The function check's goal for --hf (issue 24): the largest output change, in float64.
FUNCTION_GOAL = 1e-10
# The text models' vocabulary and special ids (inside the vocabulary: transformers warns otherwise).
_TEXT = {"vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}


def _transformers() -> Any:
    """``transformers``, imported after torchvision's import is patched over this torch build."""
    from pyperm._optional_imports import import_torchvision

    try:
        import_torchvision()  # transformers imports torchvision when it is installed
    except ModuleNotFoundError:
        pass
    import transformers

    return transformers


def _wrap(module: Any, forward: Callable[..., Any]) -> Any:
    """A module holding ``module`` as ``m`` whose forward is ``forward(m, *inputs)``: the state-dict keys gain
    the prefix ``m.``, which no count depends on."""
    from torch import nn

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = module

        def forward(self, *inputs: Any) -> Any:
            return forward(self.m, *inputs)

    return Logits()


def _ids(seed: int, batch: int = 2) -> Any:
    import torch

    return torch.randint(1, VOCAB, (batch, TOKENS), generator=torch.Generator().manual_seed(seed))


def _pixels(seed: int, batch: int = 2) -> Any:
    import torch

    return torch.randn(batch, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(seed))


def _decoder(cls: str, config: str, **extra: Any) -> Callable[[int], tuple[Any, Any]]:
    """A builder of a causal language model (Llama-like configuration keys) on token ids."""

    def build(seed: int) -> tuple[Any, Any]:
        t = _transformers()
        sizes = {"hidden_size": WIDTH, "intermediate_size": MLP, "num_hidden_layers": LAYERS,
                 "num_attention_heads": HEADS, "max_position_embeddings": 4 * TOKENS}  # fmt: skip
        cfg = getattr(t, config)(**sizes, **_TEXT, **extra)
        return _single(getattr(t, cls)(cfg), "lm_head"), _ids(seed)

    return build


def _single(model: Any, *heads: str) -> Any:
    """``model`` with a one-tensor forward returning its logits, and its output layers marked."""
    from pyperm.nn.models import single_output

    return _mark(single_output(model), *heads)


def _mark(model: Any, *heads: str) -> Any:
    """Mark the layers at the paths ``heads``: they produce the model's outputs, not hidden units."""
    for path in heads:
        model.get_submodule(path).is_head = True
    return model


def _gpt2(seed: int) -> tuple[Any, Any]:
    t = _transformers()
    cfg = t.GPT2Config(n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS, n_inner=MLP, n_positions=4 * TOKENS, **_TEXT)
    return _single(t.GPT2LMHeadModel(cfg), "lm_head"), _ids(seed)


def _encoder_kwargs() -> dict[str, Any]:
    """BERT-like encoder keys (BERT, RoBERTa, ViT)."""
    return {"hidden_size": WIDTH, "intermediate_size": MLP, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS}  # fmt: skip


def _bert(seed: int) -> tuple[Any, Any]:
    # The masked-LM head ends in logits; BertModel would return the residual stream, which outputs fix.
    t = _transformers()
    cfg = t.BertConfig(max_position_embeddings=4 * TOKENS, **_encoder_kwargs(), **_TEXT)
    return _single(t.BertForMaskedLM(cfg), "cls.predictions.decoder"), _ids(seed)


def _roberta(seed: int) -> tuple[Any, Any]:
    t = _transformers()
    # RoBERTa's positions start after the padding id: pad + 1 + 8 tokens fit in the 32 positions.
    cfg = t.RobertaConfig(max_position_embeddings=4 * TOKENS, **_encoder_kwargs(), **_TEXT)
    return _single(t.RobertaForMaskedLM(cfg), "lm_head.decoder"), _ids(seed)


def _t5(seed: int) -> tuple[Any, Any]:
    # Encoder-decoder: the ids are both the encoder's input and the decoder's.
    t = _transformers()
    cfg = t.T5Config(d_model=WIDTH, d_kv=WIDTH // HEADS, d_ff=MLP, num_layers=LAYERS, num_heads=HEADS,
                     relative_attention_num_buckets=8, **_TEXT)  # fmt: skip
    model = t.T5ForConditionalGeneration(cfg)
    wrapped = _wrap(model, lambda m, ids: m(input_ids=ids, decoder_input_ids=ids).logits)
    return _mark(wrapped, "m.lm_head"), _ids(seed)


def _vit(seed: int) -> tuple[Any, Any]:
    t = _transformers()
    cfg = t.ViTConfig(image_size=IMAGE, patch_size=8, num_labels=10, **_encoder_kwargs())
    return _single(t.ViTForImageClassification(cfg), "classifier"), _pixels(seed)


def _clip(seed: int) -> tuple[Any, Any]:
    # Both towers: logits_per_image contracts the two projections' units, so no layer is an output layer.
    t = _transformers()
    text = {"max_position_embeddings": 4 * TOKENS, **_encoder_kwargs(), **_TEXT}
    vision = {"image_size": IMAGE, "patch_size": 8, **_encoder_kwargs()}
    model = t.CLIPModel(t.CLIPConfig(text_config=text, vision_config=vision, projection_dim=WIDTH))
    wrapped = _wrap(model, lambda m, ids, pixels: m(input_ids=ids, pixel_values=pixels).logits_per_image)
    return wrapped, (_ids(seed), _pixels(seed))


def _whisper(seed: int) -> tuple[Any, Any]:
    # The encoder with a classification head; its input is 2 x max_source_positions log-mel frames.
    import torch

    t = _transformers()
    cfg = t.WhisperConfig(d_model=WIDTH, encoder_layers=LAYERS, encoder_attention_heads=HEADS, encoder_ffn_dim=MLP,
                          decoder_layers=LAYERS, decoder_attention_heads=HEADS, decoder_ffn_dim=MLP, num_mel_bins=16,
                          max_source_positions=TOKENS, classifier_proj_size=WIDTH, num_labels=10,
                          decoder_start_token_id=0, **_TEXT)  # fmt: skip
    features = torch.randn(2, 16, 2 * TOKENS, generator=torch.Generator().manual_seed(seed))
    return _single(t.WhisperForAudioClassification(cfg), "classifier"), features


def _resnet(seed: int) -> tuple[Any, Any]:
    t = _transformers()
    cfg = t.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 64], depths=[1, 1, 1, 1], layer_type="basic",
                         num_labels=10)  # fmt: skip
    return _single(t.ResNetForImageClassification(cfg), "classifier.1"), _pixels(seed)


def _convnext(seed: int) -> tuple[Any, Any]:
    t = _transformers()
    cfg = t.ConvNextConfig(hidden_sizes=[16, 32, 64, 64], depths=[1, 1, 1, 1], num_labels=10, image_size=IMAGE)
    return _single(t.ConvNextForImageClassification(cfg), "classifier"), _pixels(seed)


#: name -> builder of (model, example input) at random initialisation (seeded by the caller).
HF_MODELS: dict[str, Callable[[int], tuple[Any, Any]]] = {
    "gpt2": _gpt2,
    "bert": _bert,
    "roberta": _roberta,
    "llama": _decoder("LlamaForCausalLM", "LlamaConfig", num_key_value_heads=KV_HEADS),
    "mistral": _decoder("MistralForCausalLM", "MistralConfig", num_key_value_heads=KV_HEADS),
    "qwen2": _decoder("Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=KV_HEADS),
    "phi": _decoder("PhiForCausalLM", "PhiConfig"),
    "t5": _t5,
    "vit": _vit,
    "clip": _clip,
    "whisper": _whisper,
    "resnet": _resnet,
    "convnext": _convnext,
}


def hf_names() -> list[str]:
    """Every model of the --hf survey, as ``hf:<name>``."""
    return [f"hf:{name}" for name in HF_MODELS]


def build_hf(name: str, seed: int = 0) -> tuple[Any, Any]:
    """The model ``hf:<name>`` (or ``<name>``) at random initialisation, in eval mode, and its example input.

    Raises ValueError for a name :data:`HF_MODELS` lacks, ModuleNotFoundError without transformers.
    """
    import torch

    key = name[3:] if name.startswith("hf:") else name
    if key not in HF_MODELS:
        raise ValueError(f"unknown Hugging Face model {name!r} (known: {', '.join(hf_names())})")
    with torch.random.fork_rng(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # configurations warn about ids and sizes no check here reads
        torch.manual_seed(seed)
        model, x = HF_MODELS[key](seed)
    return model.eval(), x


# --------------------------------------------------------------------------- the survey of these models


@dataclass
class HFSurveyRow(SurveyRow):
    """One model of ``--hf``: what ``--all`` measures (:class:`~pyperm.benchmarks.trace.SurveyRow`), and more.

    ``max_diff`` is the outputs' change under a random permutation of every group as transformers computes them
    (in float64, but for the operators it runs in float32); ``exact_diff`` the change with those float32 casts
    kept in float64, which tells a spec error from float32 rounding. ``kept`` says the spec keeps the function:
    ``exact_diff`` within :data:`FUNCTION_GOAL`.
    """

    frontend: str = ""  #: "fx" or "export": what built the traced graph
    inputs: str = ""  #: the example input's shape(s)
    kinds: dict[str, list[int]] = field(default_factory=dict)  #: kind -> [units, moved, head moved, head dim moved]
    exact_diff: float = math.nan
    float32_ops: tuple[str, ...] = ()  #: operators giving float32 tensors in the float64 model, most called first

    def failures(self) -> list[str]:
        """A failed trace or check, a function the spec changes (float64 throughout), a planted permutation missed."""
        if self.skipped:
            return []
        if self.error:
            return [f"{self.name}: {self.error}"]
        changed = [] if self.kept else [f"{self.name}: a random permutation changes the outputs by "
                                        f"{self.exact_diff:.1e} in float64 (the spec is wrong)"]  # fmt: skip
        return changed + ([f"{self.name}: weight matching missed the planted permutation"] if self.recovered == "NO"
                          else [])  # fmt: skip


def survey_hf_model(name: str, *, seed: int = 0, repeat: int = 1) -> HFSurveyRow:
    """Build, trace and check one model of :data:`HF_MODELS` (see :class:`HFSurveyRow`)."""
    from pyperm.benchmarks._report import time_call
    from pyperm.benchmarks.trace import _match_planted
    from pyperm.nn import trace_model

    row = HFSurveyRow(name)
    model, x = _built(row, seed)
    if model is None:
        return row
    row.params, row.inputs = sum(p.numel() for p in model.parameters()), _shapes(x)
    try:
        depends = _layers_depend(model, x, seed)
    except Exception as exc:  # a model that cannot run here is no finding about the tracer
        row.skipped = f"skipped: cannot run: {type(exc).__name__}: {_first_line(exc, 120)}"
        return row
    try:
        timing = time_call(lambda: trace_model(model, x, composite="fix"), repeat)
    except Exception as exc:  # a model the tracer cannot take is this row's finding, not the survey's end
        row.error = f"trace failed: {type(exc).__name__}: {_first_line(exc, 300)}"
        return row
    result = timing.result
    row.seconds, row.causes, row.frontend = timing.median, result.composites, result.frontend
    _count_kinds(row, model, result.spec, depends)
    for step, measure in (("weight matching", _match_planted), ("the float64 check", _check_function)):
        try:  # the float64 check last: it leaves the model in float64, permuted
            measure(row, model, result.spec, x, seed)
        except Exception as exc:
            row.error = f"{step} failed: {type(exc).__name__}: {_first_line(exc, 200)}"
            return row
    return row


def _built(row: HFSurveyRow, seed: int) -> tuple[Any, Any]:
    """The model and its input, or (None, None) with the row's reason to skip (no transformers, a failed build)."""
    try:
        return build_hf(row.name, seed)
    except ModuleNotFoundError as exc:
        row.skipped = f"skipped: {exc}"
    except Exception as exc:  # an unknown name, or a configuration this transformers version rejects
        row.skipped = f"skipped: cannot build: {type(exc).__name__}: {_first_line(exc, 120)}"
    return None, None


def _first_line(exc: Exception, limit: int) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else ""


def _shapes(x: Any) -> str:
    """``2x8`` for a tensor, ``2x8 + 2x3x32x32`` for a tuple of them."""
    return " + ".join("x".join(map(str, t.shape)) for t in _as_tuple(x))


def _as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _call(model: Any, x: Any) -> Any:
    return model(*_as_tuple(x))


def _other_input(x: Any, seed: int) -> Any:
    """An input of the shapes and dtypes of ``x`` with other values (other ids, other pixels)."""
    import torch

    gen = torch.Generator().manual_seed(seed + 7)
    others = tuple(torch.randint(1, VOCAB, t.shape, generator=gen) if not t.is_floating_point()
                   else torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in _as_tuple(x))  # fmt: skip
    return others if isinstance(x, (tuple, list)) else others[0]


def _layers_depend(model: Any, x: Any, seed: int) -> dict[str, bool]:
    """The paths of the modules one forward pass calls, each with whether its output depends on the input.

    Token ids cannot require gradients (the torchvision survey's test), so the model runs on two inputs: a layer
    whose outputs are equal on both is computed from parameters and positions alone (position embeddings, T5's
    relative position bias). A module whose weight the forward reads without calling it (Whisper's sinusoidal
    positions) is left out: no hook sees it, and it is a table of positions.
    """
    import torch

    runs: list[dict[str, list]] = [{}, {}]
    for outputs, inputs in zip(runs, (x, _other_input(x, seed))):
        handles = [m.register_forward_hook(lambda _, __, out, name=name, outputs=outputs:
                                           outputs.setdefault(name, []).append(_tensors(out)))
                   for name, m in model.named_modules() if name]  # fmt: skip
        try:
            with torch.no_grad():
                _call(model, inputs)
        finally:
            for h in handles:
                h.remove()
    return {name: _differ(calls, runs[1].get(name, [])) for name, calls in runs[0].items()}


def _tensors(out: Any) -> list:
    import torch
    from torch.utils._pytree import tree_flatten

    return [t.detach().clone() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


def _differ(first: list, second: list) -> bool:
    """Whether two runs' outputs of one module differ (different shapes or calls count as different)."""
    import torch

    if len(first) != len(second):
        return True
    return any(len(a) != len(b) or any(s.shape != t.shape or not torch.equal(s, t) for s, t in zip(a, b))
               for a, b in zip(first, second))  # fmt: skip


# --------------------------------------------------------------------------- hidden units by kind

#: The kinds of hidden units, in the table's order.
KINDS = ("residual", "mlp", "attention", "other")
# Attention projections by their transformers names: the spec has no form to tell a projection whose units
# are all fixed (Phi's partial-rotary queries and keys) from any other fixed layer.
_ATTENTION_NAMES = {"q_proj", "k_proj", "v_proj", "q", "k", "v", "query", "key", "value", "c_attn"}


def _producers(model: Any, depends: dict[str, bool]) -> list[tuple[str, str, int, bool]]:
    """``(layer, state_dict key, axis, input-dependent)`` of every producer of hidden units: the torchvision
    survey's (:func:`~pyperm.benchmarks.trace._hidden_axes`) and GPT-2's ``Conv1D``, whose weight is (in, out)."""
    from pyperm.benchmarks.trace import _hidden_axes

    axes = _hidden_axes(model, depends)
    axes += [(name, f"{name}.weight", 1, depends[name]) for name, m in model.named_modules()
             if type(m).__name__ == "Conv1D" and name in depends and not getattr(m, "is_head", False)]  # fmt: skip
    return axes


def _count_kinds(row: HFSurveyRow, model: Any, spec: Any, depends: dict[str, bool]) -> None:
    """The row's hidden units, those a group moves, the layers whose units stay, and the same by kind.

    Kinds come from the spec: a layer whose units split into heads (a ``Tiled``, ``Blocks`` or ``Segments``
    axis, or a query/key/value projection by name) is ``attention``; a group that layers reading different
    inputs write is a sum of streams, the ``residual`` stream (CLIP's joint embedding, where both towers'
    projections meet, counts as one); another group is an ``mlp`` intermediate (or a CNN block's inner
    channels); a fixed layer of none of these is ``other``.
    """
    from pyperm.benchmarks.trace import _moved

    sd = model.state_dict()
    producers = _producers(model, depends)
    writers = _writers(spec, sd, producers)
    for layer, key, axis, dependent in producers:
        n, entry = sd[key].shape[axis], spec.axes[key][axis]
        if not dependent:
            row.constant += n
            continue
        moved = _moved(spec, entry)
        row.hidden, row.permuted = row.hidden + n, row.permuted + moved
        if moved < n:
            row.unpermuted.append((layer, n - moved))
        kind = _kind(layer, entry, writers)
        heads, dims = _head_moves(spec, entry) if kind == "attention" else (0, 0)
        counts = row.kinds.setdefault(kind, [0, 0, 0, 0])
        for k, value in enumerate((n, moved, heads, dims)):
            counts[k] += value
    row.unpermuted.sort(key=lambda item: -item[1])


def _writers(spec: Any, sd: dict, producers: list) -> dict[str, set[str]]:
    """For every group some layer writes as a whole, the inputs (axis entries, as text) of its writers."""
    writers: dict[str, set[str]] = {}
    for _, key, axis, _ in producers:
        entries = spec.axes[key]
        if isinstance(entries[axis], str):
            source = entries[1 - axis] if sd[key].ndim > 1 else None  # an embedding's is the ids: None
            writers.setdefault(entries[axis], set()).add(repr(source))
    return writers


def _kind(layer: str, entry: Any, writers: dict[str, set[str]]) -> str:
    if not isinstance(entry, (str, type(None))) or layer.rpartition(".")[2] in _ATTENTION_NAMES:
        return "attention"
    if entry is None:
        return "other"
    return "residual" if len(writers.get(entry, ())) > 1 else "mlp"


def _head_moves(spec: Any, entry: Any) -> tuple[int, int]:
    """Of an attention projection's units, how many a group moves with their head and how many within it.

    The tracer writes heads x head dims as ``Tiled(dims, outer=heads)``; with the head dims in place (rotary
    queries and keys, grouped-query attention) as ``Tiled(heads, outer=..., inner=head_dim)``: each unit then
    owns a whole head. ``Blocks(heads, dims)`` is a permutation of the dims per head.
    """
    from pyperm.nn.spec import Blocks, Segments, Tiled

    if entry is None:
        return 0, 0
    n = spec.entry_length(entry)
    if isinstance(entry, Segments):
        parts = [_head_moves(spec, part) for part in entry.parts if not isinstance(part, int)]
        return sum(h for h, _ in parts), sum(d for _, d in parts)
    if isinstance(entry, str):  # units free of any head structure
        return (n, n) if spec.sizes[entry] > 1 else (0, 0)
    if isinstance(entry, Blocks):
        return n * _moves(spec, entry.outer), n * _moves(spec, entry.inner)
    assert isinstance(entry, Tiled)
    if entry.inner > 1:  # every unit is a whole head
        return n * (_moves(spec, entry.group) or _moves(spec, entry.outer)), 0
    if not isinstance(entry.group, str):  # a unit form (query heads over kv heads, partial rotary dims)
        heads, dims = _head_moves(spec, entry.group)
        unit = spec.entry_length(entry.group)
        return (n if _moves(spec, entry.outer) else n // unit * heads), n // unit * dims
    return n * _moves(spec, entry.outer), n * _moves(spec, entry.group)


def _moves(spec: Any, group: Any) -> bool:
    """Whether ``group`` (a name, or a number of fixed blocks) moves anything."""
    return isinstance(group, str) and spec.sizes[group] > 1


# --------------------------------------------------------------------------- the float64 check


def _check_function(row: HFSurveyRow, model: Any, spec: Any, x: Any, seed: int) -> None:
    """The largest output change under a random permutation of every group, in float64 as transformers computes
    it (``max_diff``: some norms upcast to float32) and with every float32 cast kept in float64 (``exact_diff``).
    In place: the model is left in float64, permuted."""
    import torch

    from pyperm.benchmarks.trace import load_permuted
    from pyperm.nn import apply_permutation
    from pyperm.testing import random_permutations

    model.double()
    x = tuple(t.double() if t.is_floating_point() else t for t in _as_tuple(x))
    recorder = _Float32Ops()
    with torch.no_grad():
        with recorder:
            before = model(*x)
        with _Float64():
            before64 = model(*x)
        load_permuted(model, apply_permutation(spec, random_permutations(spec, seed), model.state_dict()))
        after = model(*x)
        with _Float64():
            after64 = model(*x)
    row.max_diff = float((before - after).abs().max())
    row.exact_diff = float((before64 - after64).abs().max())
    row.kept = row.exact_diff <= FUNCTION_GOAL
    row.float32_ops = tuple(sorted(recorder.ops, key=lambda op: -recorder.ops[op]))


class _Float64(TorchDispatchMode):
    """Every operator asked for a float32 result (a cast, a new tensor) gives float64 instead: the model runs in
    float64 throughout, so what a permutation changes then is the spec's doing, not float32 rounding."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        import torch

        kwargs = dict(kwargs or {})
        if kwargs.get("dtype") == torch.float32:
            kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


class _Float32Ops(TorchDispatchMode):
    """Counts the operators that give a float32 tensor: in a float64 model, the ones transformers upcasts."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        import torch
        from torch.utils._pytree import tree_flatten

        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in tree_flatten(out)[0]):
            name = func.overloadpacket.__name__
            self.ops[name] = self.ops.get(name, 0) + 1
        return out


# --------------------------------------------------------------------------- the table and the command

HF_HEADERS = ["model", "front end", "input", "params", "hidden units", "permuted", "causes", "residual", "mlp",
              "attention", "heads", "head dims", "trace s", "max abs out change", "all float64", "function kept",
              "planted found", "match s", "note"]  # fmt: skip


def survey_hf(names: Sequence[str], *, seed: int = 0, repeat: int = 1,
              progress: Callable[[str], None] | None = None) -> list[HFSurveyRow]:  # fmt: skip
    """:func:`survey_hf_model` of every model of ``names`` (``progress(name)`` after each)."""
    rows = []
    for name in names:
        rows.append(survey_hf_model(name, seed=seed, repeat=repeat))
        if progress is not None:
            progress(name)
    return rows


def hf_table(rows: Sequence[HFSurveyRow], markdown: bool = False) -> str:
    """The survey as one table: units moved of each kind (moved/units; heads and head dims: the share of the
    attention projections' units moved with their head and within it), trace time and the checks."""
    return (markdown_table if markdown else text_table)(HF_HEADERS, [_cells(r) for r in rows])


def _cells(r: HFSurveyRow) -> list[Any]:
    head = [r.name, r.frontend or "-", r.inputs or "-", f"{r.params / 1e6:.2f}M" if r.params else "-"]
    if r.skipped or not r.hidden:
        return head + ["-"] * 14 + [r.skipped or "FAILED (below)"]
    attention = r.kinds.get("attention", [0, 0, 0, 0])
    measured = not math.isnan(r.max_diff)
    return head + [r.hidden, f"{r.share:.1%}", len(r.causes), *(_fraction(r.kinds.get(k)) for k in KINDS[:3]),
                   _percent(attention[2], attention[0]), _percent(attention[3], attention[0]), f"{r.seconds:.2f}",
                   f"{r.max_diff:.1e}" if measured else "-", f"{r.exact_diff:.1e}" if measured else "-",
                   _kept(r) if measured else "-", r.recovered or "-",
                   "-" if math.isnan(r.match_seconds) else f"{r.match_seconds:.1f}", _note(r)]  # fmt: skip


def _fraction(counts: list[int] | None) -> str:
    return f"{counts[1]}/{counts[0]}" if counts else "-"


def _percent(part: int, whole: int) -> str:
    return f"{part / whole:.0%}" if whole else "-"


def _kept(r: HFSurveyRow) -> str:
    """"yes" within the goal as transformers computes; "fp32" within it in float64 throughout only (transformers'
    float32 norms round a permuted sum otherwise); "NO" when the spec changes the function."""
    if not r.kept:
        return "NO"
    return "yes" if r.max_diff <= FUNCTION_GOAL else "fp32"


def _note(r: HFSurveyRow) -> str:
    other = r.kinds.get("other")
    notes = ["FAILED (below)" if r.failures() else "",
             f"BELOW {SURVEY_TARGET:.0%} (below)" if r.share < SURVEY_TARGET else "",
             f"ABOVE {FUNCTION_GOAL:.0e} (below)" if r.max_diff > FUNCTION_GOAL else "",
             f"other fixed units: {other[0]}" if other else "",
             f"+{r.constant} units from positions alone" if r.constant else ""]  # fmt: skip
    return "; ".join(filter(None, notes))


def hf_flags(rows: Sequence[HFSurveyRow], causes: int = 8) -> list[str]:
    """The models under the share target (:func:`~pyperm.benchmarks.trace.survey_flags`), the trace's causes of
    units left in place of the others, and the models whose outputs move by more than :data:`FUNCTION_GOAL`,
    with the float32 operators that explain it (or not)."""
    lines = survey_flags(rows, causes)
    for r in rows:
        if r.causes and not r.error and r.share >= SURVEY_TARGET:  # survey_flags listed those under the target
            lines.append(f"CAUSES: {r.name} permutes {r.share:.1%} of its hidden units; the trace left units in "
                         f"place for {len(r.causes)} causes")  # fmt: skip
            lines += [f"  cause: {c}" for c in r.causes[:causes]]
            lines += [f"  ... and {len(r.causes) - causes} more causes"] if len(r.causes) > causes else []
    for r in rows:
        if r.skipped or r.error or not r.max_diff > FUNCTION_GOAL:
            continue
        ops = ", ".join(r.float32_ops[:8]) or "none"
        why = ("the spec is exact; the rest is float32 rounding" if r.kept
               else "the spec changes the function (FAILED below)")  # fmt: skip
        lines.append(f"ABOVE {FUNCTION_GOAL:.0e}: {r.name}: outputs change by {r.max_diff:.1e} as transformers "
                     f"computes them, {r.exact_diff:.1e} with its float32 casts kept in float64: {why} (operators "
                     f"giving float32 in the float64 model: {ops})")  # fmt: skip
    return lines


def hf_model_names(text: str | None) -> list[str]:
    """The ``hf:`` names of a ``--models`` value (``gpt2`` or ``hf:gpt2``), or every model of :data:`HF_MODELS`."""
    if not text:
        return hf_names()
    names = [n.strip() for n in text.split(",") if n.strip()]
    return [n if n.startswith("hf:") else f"hf:{n}" for n in names]


def run_hf_survey(args: Any) -> int:
    """``--hf``: the table and its flags; exit status 1 when a trace or check failed, a spec changed the function
    (in float64 throughout) or a planted permutation was missed."""
    import torch

    rows = survey_hf(hf_model_names(args.models), seed=args.seed, repeat=args.repeat,
                     progress=lambda name: print(f"{name} done", file=sys.stderr, flush=True))  # fmt: skip
    print(f"torch {torch.__version__}, transformers {_version()}, one thread; random init, {LAYERS} layers, width "
          f"{WIDTH}, {HEADS} heads ({KV_HEADS} key/value heads for Llama, Mistral, Qwen2), MLP {MLP}, vocabulary "
          f"{VOCAB}, {TOKENS} tokens or {IMAGE}x{IMAGE} images; trace time: median of {args.repeat}; residual, mlp, "
          "attention: units moved by a group / units; heads, head dims: share of the attention projections' units "
          "moved with their head, within it; max abs out change: float64 outputs under a random permutation of "
          "every group as transformers computes them; all float64: with its float32 casts kept in float64")  # fmt: skip
    return print_survey(rows, hf_table(rows, args.markdown), hf_flags(rows))


def _version() -> str:
    try:
        return _transformers().__version__
    except ModuleNotFoundError:
        return "not installed"
