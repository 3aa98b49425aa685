"""``pyperm bench match --scale sd15-unet --pipelines DIR``: ``pyperm merge --weights`` of two SD-1.5-shaped pipelines.

The pair is written once into ``DIR/sd15-pipeline-<dtype>/`` (reused while its ``pair.json`` names the same
dtype and seed) as two ``StableDiffusionPipeline`` folders, ``a/`` and ``b/``, by ``save_pretrained``:

- A: Stable Diffusion 1.5's components at their sizes (the UNet of 860M parameters, the 84M VAE, the 123M
  CLIP text encoder), diffusers' and transformers' random initialisation, a tokenizer over a small alphabet
  (no vocabulary is downloaded) and SD's DDPM scheduler;
- B: every model component of A permuted by a planted permutation of each group of the spec the command
  line traces, plus noise of ``NOISE`` times each tensor's standard deviation.

Then ``pyperm merge DIR/a DIR/b --model hf --weights 0.7,0.3`` runs in a fresh process, as a user runs it.
The row gives its wall time, its own report's peak resident memory (the process's, every component merged in
it one after another; the inputs' mapped pages it touched count), and the check of the result: B aligned to A
is A plus its noise, so each merged tensor is A's plus ``0.3 x`` that noise. A tensor further from A's than
``OFF`` (relative to its norm) is counted as off: a group left misaligned, or weights not applied, shows there.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pyperm.benchmarks._match_scale import _SD15_UNET, NOISE

HEADERS = ["pipeline", "dtype", "params", "pipeline GB", "merge s", "peak RSS GB", "peak / pipeline",
           "rounds (unet)", "tensors off", "median gap to A", "expected"]  # fmt: skip
WEIGHTS = (0.7, 0.3)
#: A merged tensor this far from A's (relative to A's norm) is misplaced: aligned, it is about
#: ``WEIGHTS[1] * NOISE`` (0.003) away.
OFF = 0.05

# Stable Diffusion 1.5's components (diffusers' and transformers' defaults for the rest).
SD15_PIPELINE = {
    "unet": dict(_SD15_UNET),
    "vae": {"in_channels": 3, "out_channels": 3, "down_block_types": ("DownEncoderBlock2D",) * 4,
            "up_block_types": ("UpDecoderBlock2D",) * 4, "block_out_channels": (128, 256, 512, 512),
            "layers_per_block": 2, "latent_channels": 4, "sample_size": 512},
    "text_encoder": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                     "num_attention_heads": 12, "max_position_embeddings": 77, "projection_dim": 768,
                     "hidden_act": "quick_gelu"},
}  # fmt: skip
MODEL_COMPONENTS = ("unet", "vae", "text_encoder")


def write_pipelines(folder: str | Path, dtype_name: str, seed: int = 0, configs: dict | None = None) -> Path:
    """The pair of pipelines in ``folder`` (``a/``, ``b/``; reused when ``pair.json`` matches)."""
    import torch

    from pyperm._staging import write_text
    from pyperm.benchmarks._align_ranks import pair_is_written
    from pyperm.commands._common import build_model
    from pyperm.nn import Permutations
    from pyperm.nn.permutations import permute_entry
    from pyperm.testing import random_permutations, sd_pipeline

    configs = configs or SD15_PIPELINE
    folder = Path(folder)
    marker = {"dtype": dtype_name, "seed": seed, "noise": NOISE, "configs": json.loads(json.dumps(configs))}
    if pair_is_written(folder, marker):
        return folder
    dtype = getattr(torch, dtype_name)
    pipeline = sd_pipeline(configs, seed)
    if dtype != torch.float32:  # (diffusers warns of any cast, even to float32)
        pipeline.to(dtype)
    pipeline.save_pretrained(str(folder / "a"))
    gen = torch.Generator().manual_seed(seed + 2)
    for name in MODEL_COMPONENTS:
        module = getattr(pipeline, name)
        spec = build_model("hf", None, str(folder / "a" / name), meta=True).spec  # the command line's spec
        planted = Permutations(spec, random_permutations(spec, seed + 1))
        with torch.no_grad():
            for key, t in module.state_dict().items():  # the module's own tensors, overwritten in place
                if not t.is_floating_point():
                    t.copy_(permute_entry(spec, planted, key, t))
                    continue
                b = permute_entry(spec, planted, key, t).float()
                scale = NOISE * float(b.std()) if b.numel() > 1 else 0.0
                t.copy_((b + scale * torch.randn(b.shape, generator=gen)).to(t.dtype))
    pipeline.save_pretrained(str(folder / "b"))
    write_text(folder / "pair.json", json.dumps(marker))
    return folder


def _relative_gaps(merged: Path, a: Path) -> list[float]:
    """|merged - A| / |A| of every floating-point tensor of one component, read one mapped tensor at a time
    (a tensor of zeros, as GroupNorm's biases at initialisation, gives its absolute gap)."""
    from pyperm.checkpoints import load_checkpoint

    got, want = load_checkpoint(merged).state, load_checkpoint(a).state
    if set(got) != set(want):
        raise RuntimeError(f"{merged}: keys differ from {a}'s: {sorted(set(got) ^ set(want))[:5]}")
    gaps = []
    for key, w in want.items():
        if not w.is_floating_point():
            continue
        w, g = w.float(), got[key].float()
        norm = float(w.norm())
        gaps.append(float((g - w).norm()) / (norm if norm > 0 else 1.0))
    return gaps


def measure(folder: str | Path, dtype_name: str, timeout: float = 7200.0, configs: dict | None = None) -> dict[str, Any]:
    """One row: write the pair (once; ``configs`` as :data:`SD15_PIPELINE`, its default), run ``pyperm merge``
    on it, check the merged pipeline."""
    import statistics

    from pyperm.benchmarks._align_ranks import _run
    from pyperm.checkpoints import load_checkpoint

    folder = write_pipelines(folder, dtype_name, configs=configs)
    out = folder / "out"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "pyperm", "merge", str(folder / "a"), str(folder / "b"), "--model", "hf",
           "--weights", ",".join(map(str, WEIGHTS)), "--out", str(out), "--no-progress"]  # fmt: skip
    wall = _run(cmd, timeout)
    report = json.loads((out / "report.json").read_text())
    gaps: list[float] = []
    params = 0
    nbytes = 0
    for name in MODEL_COMPONENTS:
        gaps += _relative_gaps(out / "merged" / name, folder / "a" / name)
        for t in load_checkpoint(folder / "a" / name).state.values():
            params += t.numel()
            nbytes += t.numel() * t.element_size()
    unet = json.loads((out / "unet" / "report.json").read_text())
    row = {"dtype": dtype_name, "params": params, "pipeline_bytes": nbytes, "wall": wall,
           "peak_rss": report["peak_rss_bytes"][0], "rounds": unet["iterations"], "tensors": len(gaps),
           "off": sum(g > OFF for g in gaps), "median_gap": statistics.median(gaps)}  # fmt: skip
    shutil.rmtree(out, ignore_errors=True)
    return row


def rows(dtypes: list[str], folder: str | Path, report: Callable[[str], None]) -> tuple[list[list[Any]], list[str]]:
    """The table's rows and the failures (tensors off, or a merge that failed)."""
    table: list[list[Any]] = []
    failures: list[str] = []
    for dtype in dtypes:
        report(f"  SD-1.5-shaped pipelines, {dtype}: writing the pair to {folder} (once), then pyperm merge "
               f"--weights {','.join(map(str, WEIGHTS))} ...")  # fmt: skip
        started = time.perf_counter()
        try:
            r = measure(Path(folder) / f"sd15-pipeline-{dtype}", dtype)
        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
            failures.append(f"SD-1.5 pipelines {dtype}: {exc}")
            continue
        report(f"    done in {time.perf_counter() - started:.0f} s (the pair's writing included)")
        if r["off"]:
            failures.append(f"SD-1.5 pipelines {dtype}: {r['off']} of {r['tensors']} merged tensors off A's")
        table.append([
            "SD-1.5 shape (unet, vae, text_encoder)", dtype, f"{r['params'] / 1e6:.0f}M",
            f"{r['pipeline_bytes'] / 1e9:.2f}", f"{r['wall']:.0f}", f"{r['peak_rss'] / 1e9:.2f}",
            f"{r['peak_rss'] / r['pipeline_bytes']:.2f}x", r["rounds"], f"{r['off']}/{r['tensors']}",
            f"{r['median_gap']:.2g}", f"{WEIGHTS[1] * NOISE:.2g}",
        ])  # fmt: skip
    return table, failures
