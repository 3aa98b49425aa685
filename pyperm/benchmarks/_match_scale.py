"""``pyperm bench match --scale``: weight matching at the size of current models, in float32, float16 and bfloat16.

Every row is one model and dtype, run in a fresh Python process (so that its peak memory is its own):
model A at random initialisation, model B a planted permutation of A plus small noise (0.01 times each
tensor's standard deviation), ``weight_matching`` with its defaults. The row gives

- the model's size and the process's peak resident memory (``peak RSS``), and the memory the call
  added on top of the two models, divided by one model's size (``extra / model``: the peak during the
  call minus the resident memory just before it);
- the sweeps, the time per sweep (the whole call divided by its sweeps, starts included) and the
  first sweep alone, in which every similarity is computed whole;
- the *floor*: the same similarity products, one whole product per tensor and axis a group acts on,
  as plain ``torch.matmul`` calls on tensors arranged beforehand (the arranging not timed), in the
  dtype weight matching runs its products in (bfloat16 for a bfloat16 model, float32 otherwise), timed in the same process, alternating with the first sweep (medians of
  ``--repeat``); ``first / floor`` is the price of reading the stored tensors in place;
- the assignment solves' share of the call, and whether every group's planted permutation was found.

The models: the Llama architecture at 1.1B parameters (hidden 2048, MLP 5632, 22 layers, 32 query
heads over 4 key/value heads, vocabulary 32000: TinyLlama's shape), GPT-2 (124M), torchvision's
ResNet50 and ViT-B/16, and two diffusers ``UNet2DConditionModel`` shapes: Stable Diffusion 1.5's (860M:
blocks of 320, 640, 1280 and 1280 channels, cross-attention on 768-wide text states) and SDXL's base UNet
(2.6B: blocks of 320, 640 and 1280 channels with 1, 2 and 10 transformer layers, 2048-wide text states,
added text and time conditioning). The Hugging Face and diffusers models are built from their configs on
the meta device (nothing is downloaded) and traced there, the UNets with the fixed conditions of ``pyperm
--model hf``; their tensors are then drawn one at a time (normal, standard deviation 0.02; norms' weights
near 1).
"""

from __future__ import annotations

import functools
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

from pyperm.benchmarks._report import run_child

HEADERS = ["model", "dtype", "params", "model GB", "peak RSS GB", "extra / model", "sweeps", "s / sweep",
           "first sweep s", "floor s", "first / floor", "LAP share", "groups found"]  # fmt: skip


def headers(device: str = "cpu") -> list[str]:
    """The table's headers; on a GPU the peak is the device's (torch's allocator), not the process's RSS."""
    return [("peak device GB" if h == "peak RSS GB" else h) for h in HEADERS] if device != "cpu" else HEADERS

# name: (what the table calls it, how it is built)
MODELS = {
    "llama-1.1b": ("Llama 1.1B (TinyLlama shape)", "hf"),
    "gpt2": ("GPT-2 124M", "hf"),
    "resnet50": ("ResNet50 (torchvision)", "torchvision"),
    "vit_b_16": ("ViT-B/16 (torchvision)", "torchvision"),
    "llama-3.2-3b": ("Llama 3.2 3B shape", "hf"),
    "sd15-unet": ("SD-1.5 UNet shape", "diffusers"),
    "sdxl-unet": ("SDXL UNet shape", "diffusers"),
}
# What --scale runs when it names no model: the 3B pair (13 GB in bfloat16) and the UNet pairs only on request.
DEFAULT = ["llama-1.1b", "gpt2", "resnet50", "vit_b_16"]
SMALL = ["gpt2", "resnet50", "vit_b_16"]
_HF_CONFIGS = {
    "llama-1.1b": ("LlamaForCausalLM", "LlamaConfig", {
        "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
        "num_key_value_heads": 4, "vocab_size": 32000, "tie_word_embeddings": False}),
    "llama-3.2-3b": ("LlamaForCausalLM", "LlamaConfig", {
        "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
        "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True}),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", {"n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257}),
    # Not in MODELS (not offered on the command line): the tests' pair.
    "gpt2-tiny": ("GPT2LMHeadModel", "GPT2Config", {"n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 64,
                                                    "n_positions": 16}),
}  # fmt: skip
# UNet2DConditionModel configs (diffusers' defaults for the rest): Stable Diffusion 1.5's and SDXL's base UNet.
_SD15_UNET = {
    "sample_size": 64, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
    "block_out_channels": (320, 640, 1280, 1280), "cross_attention_dim": 768, "attention_head_dim": 8,
    "down_block_types": ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    "up_block_types": ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
}
_SDXL_UNET = {
    "sample_size": 128, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
    "block_out_channels": (320, 640, 1280), "cross_attention_dim": 2048, "attention_head_dim": (5, 10, 20),
    "transformer_layers_per_block": (1, 2, 10), "use_linear_projection": True,
    "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    "addition_embed_type": "text_time", "addition_time_embed_dim": 256, "projection_class_embeddings_input_dim": 2816,
}
_DIFFUSERS_CONFIGS = {
    "sd15-unet": _SD15_UNET,
    "sdxl-unet": _SDXL_UNET,
    # Not in MODELS (not offered on the command line): the tests' pairs, the same blocks at a few channels.
    "sd15-unet-tiny": {**_SD15_UNET, "block_out_channels": (32, 32, 64, 64), "cross_attention_dim": 16,
                       "norm_num_groups": 8, "layers_per_block": 1},
    "sdxl-unet-tiny": {**_SDXL_UNET, "block_out_channels": (32, 64, 64), "cross_attention_dim": 16,
                       "attention_head_dim": (4, 8, 8), "transformer_layers_per_block": (1, 1, 2),
                       "norm_num_groups": 8, "layers_per_block": 1, "addition_time_embed_dim": 8,
                       "projection_class_embeddings_input_dim": 8 * 6 + 16},
}  # fmt: skip
NOISE = 0.01


@functools.lru_cache(maxsize=2)  # traced once per process (a row's process, or the tests' dtypes)
def _diffusers_spec_and_shapes(name: str) -> tuple[Any, dict[str, Any]]:
    """A UNet2DConditionModel of ``name``'s config built and traced on the meta device (no download, no
    weights drawn), with the fixed timestep, text states and SDXL conditions of ``pyperm --model hf``."""
    import torch

    from pyperm.commands._diffusers import _diffusers, _example_shape, _single_sample_class
    from pyperm.nn import PermutationSpec

    cls = _single_sample_class(_diffusers(name, "UNet2DConditionModel").UNet2DConditionModel)
    with torch.device("meta"):
        model = cls.from_config(_DIFFUSERS_CONFIGS[name]).eval()
    spec = PermutationSpec.from_model(model, torch.zeros(_example_shape(model.config), device="meta"))
    return spec, model.state_dict()


def _spec_and_shapes(name: str) -> tuple[Any, dict[str, Any], Any]:
    """The traced spec, the state dict's shapes and dtypes (meta tensors), and a real model (torchvision) or None."""
    import torch

    from pyperm.nn import trace_model

    if name in _DIFFUSERS_CONFIGS:
        return (*_diffusers_spec_and_shapes(name), None)
    if name in _HF_CONFIGS:
        from pyperm.benchmarks._hf_models import _transformers
        from pyperm.nn.models import single_output

        transformers = _transformers()
        model_cls, config_cls, kwargs = _HF_CONFIGS[name]
        config = getattr(transformers, config_cls)(**kwargs, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        with torch.device("meta"):
            model = single_output(getattr(transformers, model_cls)(config))
        spec = trace_model(model, torch.zeros(1, 8, dtype=torch.long, device="meta")).spec
        return spec, model.state_dict(), None
    from pyperm._optional_imports import import_torchvision

    torchvision = import_torchvision()
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)().eval()
    size = 224
    spec = trace_model(model, torch.randn(1, 3, size, size)).spec
    return spec, model.state_dict(), model


def _pair(name: str, dtype: Any, seed: int = 0) -> tuple[Any, dict, dict, dict]:
    """The spec, A, B (a planted permutation of A plus noise) and the planted permutations."""
    import torch

    from pyperm.nn import Permutations
    from pyperm.nn.permutations import permute_entry
    from pyperm.nn.state import shared_tensors
    from pyperm.testing import random_permutations

    spec, shapes, model = _spec_and_shapes(name)
    gen = torch.Generator().manual_seed(seed)
    tied = {key: keys[0] for keys in shared_tensors(shapes) for key in keys[1:]}  # tied weights stay tied
    sa: dict[str, Any] = {}
    for key, t in shapes.items():
        if key in tied:
            sa[key] = sa[tied[key]]
        elif model is not None:
            sa[key] = t.detach().to(dtype) if t.is_floating_point() else t.detach().clone()
        elif t.ndim == 1 and key.endswith("weight"):  # a norm's scale
            sa[key] = (1 + 0.02 * torch.randn(t.shape, generator=gen)).to(dtype)
        else:
            sa[key] = (0.02 * torch.randn(t.shape, generator=gen)).to(dtype)
    del model, shapes
    planted = Permutations(spec, random_permutations(spec, seed + 1))
    sb: dict[str, Any] = {}
    for key, t in sa.items():
        if key in tied:
            sb[key] = sb[tied[key]]
            continue
        b = permute_entry(spec, planted, key, t)
        if b.is_floating_point():
            noise = torch.randn(b.shape, generator=gen) * (NOISE * float(b.float().std()) if b.numel() > 1 else 0.0)
            b = (b.float() + noise).to(dtype)
        sb[key] = b
    return spec, sa, sb, planted


def _to_device(state: dict, device: Any) -> dict:
    """``state`` on ``device``, tied tensors still one tensor."""
    moved: dict[int, Any] = {}
    return {key: moved.setdefault(id(t), t.to(device)) for key, t in state.items()}


def _sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def floor_seconds(spec: Any, sa: dict, sb: dict) -> float:
    """The similarity products of one sweep computing every similarity whole, as plain ``torch.matmul`` calls
    on tensors arranged beforehand (each (n, K), in the dtype weight matching runs its products in by default:
    bfloat16 for a bfloat16 model, else float32, so a float16 model's floor is not torch's float16 matmul on
    a CPU without float16 arithmetic, 300 times slower): only the products are timed."""
    import torch

    from pyperm.nn.align._matcher import WeightMatcher, similarity_product_dtype

    matcher = WeightMatcher(spec, sb)
    product = similarity_product_dtype(None, torch.float32, list(sb.values()))
    total = 0.0
    for g, where in matcher._where.items():
        for i, axis in where:
            piece = matcher._pieces[i]
            n = piece.shape[axis]
            x = piece.of(sa[piece.key]).movedim(axis, 0).reshape(n, -1).to(product).contiguous()
            y = piece.of(sb[piece.key]).movedim(axis, 0).reshape(n, -1).to(product).contiguous()
            _sync(x.device)
            started = time.perf_counter()
            torch.matmul(x, y.T)
            _sync(x.device)
            total += time.perf_counter() - started
            del x, y
    return total


def recovered_groups(spec: Any, sb: dict, perms: Any, planted: Any) -> int:
    """The groups whose every tensor, B permuted by ``perms``, is exactly B permuted by the planted permutation's
    inverse: every unit put back where it was (Blocks groups are compared through the index they make
    together). No tolerance: one misplaced unit of a 5632-wide group is a group not found."""
    return len(spec.sizes) - len(wrong_groups(spec, sb, perms, planted))


def wrong_groups(spec: Any, sb: dict, perms: Any, planted: Any) -> set[str]:
    """The groups of the tensors in ``sb`` (all of B, or one rank's share of it) that ``perms`` got wrong."""
    import torch

    from pyperm.nn.permutations import permute_entry

    undo = planted.inverse()
    found = {g: perms[g].cpu() for g in spec.sizes}  # compared on the CPU, one tensor at a time (GPU runs too)
    undo = {g: undo[g].cpu() for g in spec.sizes}
    wrong: set[str] = set()
    for key, b in sb.items():
        groups = {g for g, axes in spec.group_axes.items() if any(k == key for k, _ in axes)}
        if groups and not torch.equal(permute_entry(spec, found, key, b.cpu()), permute_entry(spec, undo, key, b.cpu())):
            # The groups of this tensor that differ from the plant's (Blocks groups may differ each and still
            # make the planted index together: then the tensor is equal and none is wrong).
            wrong |= {g for g in groups if not torch.equal(found[g], undo[g])}
    return wrong


def measure(name: str, dtype_name: str, repeat: int = 3, device: str = "cpu") -> dict[str, Any]:
    """One row, in this process. On a GPU (``device``), the pair is built on the CPU and moved there, and the
    peak is the device's (torch's allocator: pyperm's assignment scratch, from its own pool, is not in it)."""
    import torch

    from pyperm._memory import release_free_memory, reset_peak_resident, resident_bytes
    from pyperm.nn import weight_matching

    dtype = getattr(torch, dtype_name)
    spec, sa, sb, planted = _pair(name, dtype)
    on_gpu = torch.device(device).type == "cuda"
    if on_gpu:
        sa, sb = _to_device(sa, device), _to_device(sb, device)
    distinct = {id(t): t for t in sa.values()}.values()
    model_bytes = sum(t.numel() * t.element_size() for t in distinct)
    params = sum(t.numel() for t in distinct)
    gc.collect()
    release_free_memory()  # garbage left by building the pair is not the call's
    if on_gpu:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before, exact_peak = torch.cuda.memory_allocated(device), True
    else:
        before = resident_bytes("VmRSS")
        exact_peak = reset_peak_resident()
    sweeps = 0

    def count(*_: Any) -> None:
        nonlocal sweeps
        sweeps += 1

    started = time.perf_counter()
    result = weight_matching(spec, sa, sb, callback=count)  # every start's sweeps counted
    _sync(device)
    total = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated(device) if on_gpu else resident_bytes("VmHWM")
    found = recovered_groups(spec, sb, result.perms, planted)
    # The first sweep from the identity alone (every similarity computed whole) and the floor, alternated
    # round by round so that a busy spell of the machine slows both alike; medians of ``repeat``.
    firsts, floors = [], []
    for _ in range(repeat):
        _sync(device)
        started = time.perf_counter()
        weight_matching(spec, sa, sb, init="identity", max_iter=1)
        _sync(device)
        firsts.append(time.perf_counter() - started)
        floors.append(floor_seconds(spec, sa, sb))
    first, floor = statistics.median(firsts), statistics.median(floors)
    sweeps = max(sweeps, 1)
    return {
        "model": MODELS.get(name, (name,))[0], "dtype": dtype_name, "params": params, "model_bytes": model_bytes,
        "peak_rss": peak, "extra": (peak - before) / model_bytes if exact_peak else float("nan"),
        "sweeps": sweeps, "per_sweep": total / sweeps, "first_sweep": first, "floor": floor,
        "assignment": result.seconds.get("assignment", 0.0) / max(result.seconds.get("total", 0.0), 1e-9), "found": found, "groups": len(spec.sizes),
    }  # fmt: skip


def rows(names: list[str], dtypes: list[str], repeat: int, report: Callable[[str], None],
         device: str = "cpu") -> tuple[list[list[Any]], list[str]]:  # fmt: skip
    """The table's rows, each measured in a child process, and the failures (a planted group not found)."""
    table, failures = [], []
    for name in names:
        for dtype in dtypes:
            report(f"  {MODELS.get(name, (name,))[0]}, {dtype} ...")
            code = ("import json, pyperm.benchmarks._match_scale as m; "
                    f"print(json.dumps(m.measure({name!r}, {dtype!r}, {repeat}, {device!r})))")
            try:
                r = run_child(code)
            except RuntimeError as exc:
                failures.append(f"{name} {dtype}: the run failed: {exc}")
                continue
            if r["found"] != r["groups"]:
                failures.append(f"{name} {dtype}: {r['groups'] - r['found']} planted groups not found")
            table.append([
                r["model"], r["dtype"], f"{r['params'] / 1e6:.0f}M", f"{r['model_bytes'] / 1e9:.2f}",
                f"{r['peak_rss'] / 1e9:.2f}", f"{r['extra']:.2f}x", r["sweeps"], f"{r['per_sweep']:.3g}",
                f"{r['first_sweep']:.3g}", f"{r['floor']:.3g}", f"{r['first_sweep'] / r['floor']:.2f}x",
                f"{100 * r['assignment']:.0f}%", f"{r['found']}/{r['groups']}",
            ])  # fmt: skip
    return table, failures
