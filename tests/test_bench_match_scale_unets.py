"""``pyperm bench match --scale sd15-unet,sdxl-unet``: the diffusers UNet rows, run on tiny pairs of the same
blocks (the full-size configs are only built on the meta device here)."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("diffusers")

from pyperm.benchmarks import _match_scale, match  # noqa: E402


@pytest.mark.parametrize(("name", "billions"), [("sd15-unet", 0.86), ("sdxl-unet", 2.57)])
def test_full_size_configs_have_the_published_parameter_counts(name, billions):
    import torch
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        model = UNet2DConditionModel.from_config(_match_scale._DIFFUSERS_CONFIGS[name])
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.01)
    assert name in _match_scale.MODELS


# Each model traced once (cached in the process); the dtypes shared out between them.
@pytest.mark.parametrize(("name", "dtype"), [("sd15-unet-tiny", "float32"), ("sd15-unet-tiny", "float16"),
                                             ("sdxl-unet-tiny", "bfloat16")])  # fmt: skip
def test_tiny_unet_row_finds_every_planted_group(name, dtype):
    r = _match_scale.measure(name, dtype, repeat=1)
    assert r["groups"] > 20  # GroupNorm's channels are permuted: the UNet is not left a no-op
    assert r["found"] == r["groups"]
    assert r["dtype"] == dtype and r["params"] > 0 and r["model_bytes"] == r["params"] * (4 if dtype == "float32" else 2)
    assert r["sweeps"] >= 1 and r["per_sweep"] > 0 and r["first_sweep"] > 0 and r["floor"] > 0


def test_the_pair_is_a_planted_permutation_of_a_traced_sdxl_unet():
    import torch

    spec, sa, sb, planted = _match_scale._pair("sdxl-unet-tiny", torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in sa.values())
    assert sa.keys() == sb.keys() and any(k.startswith("add_embedding.") for k in sa)  # SDXL's added conditions
    assert _match_scale.recovered_groups(spec, sb, spec.identity(), planted) < len(spec.sizes)


def test_the_command_line_offers_the_unet_rows_and_float16():
    parser = argparse.ArgumentParser()
    match.add_arguments(parser)
    args = parser.parse_args(["--scale", "sd15-unet,sdxl-unet", "--dtypes", "float16,bfloat16"])
    assert args.scale == ["sd15-unet", "sdxl-unet"] and args.dtypes == ["float16", "bfloat16"]
    assert "sdxl-unet" not in _match_scale.DEFAULT  # 21 GB in float32: only on request
    with pytest.raises(SystemExit):
        parser.parse_args(["--scale", "sd15-unet-tiny"])
