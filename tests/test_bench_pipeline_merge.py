"""``pyperm bench match --pipelines DIR``: the end-to-end merge of two pipelines, run on tiny ones (the SD-1.5
configs are only checked for their sizes, on the meta device)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from pyperm.benchmarks import _pipeline_merge  # noqa: E402
from pyperm.testing import TINY_PIPELINE  # noqa: E402


def test_sd15_configs_have_the_published_parameter_counts():
    import torch
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel

    configs = _pipeline_merge.SD15_PIPELINE
    with torch.device("meta"):
        vae = AutoencoderKL(**configs["vae"])
        text = CLIPTextModel(CLIPTextConfig(vocab_size=49408, **configs["text_encoder"]))
    assert sum(p.numel() for p in vae.parameters()) / 1e6 == pytest.approx(83.65, abs=0.1)
    assert sum(p.numel() for p in text.parameters()) / 1e6 == pytest.approx(123.06, abs=0.1)


def test_tiny_pipelines_merge_back_to_a_plus_the_weighted_noise(tmp_path):
    row = _pipeline_merge.measure(tmp_path / "pair", "float32", timeout=600, configs=TINY_PIPELINE)
    assert row["off"] == 0 and row["tensors"] > 50
    # Aligned, merged = A + 0.3 x the noise (relative 0.003); equal weights would give 0.005, a wrong group ~0.4.
    assert row["median_gap"] == pytest.approx(_pipeline_merge.WEIGHTS[1] * _pipeline_merge.NOISE, rel=0.3)
    assert row["peak_rss"] > 0 and row["rounds"] >= 1
    assert not (tmp_path / "pair" / "out").exists()
    # Written once: a second run reuses the pair (the marker names the same dtype, seed and configs).
    marker = (tmp_path / "pair" / "pair.json").read_text()
    assert json.loads(marker)["dtype"] == "float32"
    before = (tmp_path / "pair" / "a" / "model_index.json").stat().st_mtime_ns
    _pipeline_merge.write_pipelines(tmp_path / "pair", "float32", configs=TINY_PIPELINE)
    assert (tmp_path / "pair" / "a" / "model_index.json").stat().st_mtime_ns == before


def test_the_table_counts_a_misaligned_tensor_as_a_failure(tmp_path, monkeypatch):
    def measure(folder, dtype):
        return {"dtype": dtype, "params": 10, "pipeline_bytes": 40, "wall": 1.0, "peak_rss": 100, "rounds": 2,
                "tensors": 5, "off": 1, "median_gap": 0.003}  # fmt: skip

    monkeypatch.setattr(_pipeline_merge, "measure", measure)
    table, failures = _pipeline_merge.rows(["float32"], tmp_path, lambda line: None)
    assert len(table) == 1 and table[0][8] == "1/5" and table[0][6] == "2.50x"
    assert failures == ["SD-1.5 pipelines float32: 1 of 5 merged tensors off A's"]
