"""``pyperm align|merge --model hf`` on diffusers model folders (tiny random models written here, no download)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

pytest.importorskip("diffusers")

from _diffusion import tiny_unet, tiny_vae  # noqa: E402

from pyperm.cli import main  # noqa: E402

NO_BARS = ["--no-progress"]


def _folders(tmp_path, kind: str, shard: str = "5GB"):
    paths = []
    for seed in (0, 1):
        model, _ = tiny_vae(seed) if kind == "vae" else tiny_unet(kind, seed)
        paths.append(tmp_path / f"{kind}{seed}")
        model.save_pretrained(paths[-1], max_shard_size=shard)
    return paths


def test_align_two_vae_folders_writes_a_folder_from_pretrained_loads(tmp_path):
    from diffusers import AutoencoderKL

    a, b = _folders(tmp_path, "vae")
    out = tmp_path / "out"
    assert main(["align", str(a), str(b), "--model", "hf", "--out", str(out), *NO_BARS]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["model"] == "hf (AutoencoderKL)" and report["max_output_change_of_b"] < 1e-4
    aligned = AutoencoderKL.from_pretrained(out / "vae1_permuted").eval()
    original = AutoencoderKL.from_pretrained(b).eval()
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(aligned(x).sample, original(x).sample, rtol=1e-4, atol=1e-4)
    assert any(not torch.equal(aligned.state_dict()[k], v) for k, v in original.state_dict().items())


def test_merge_sharded_sdxl_unet_folders_with_weights(tmp_path):
    from diffusers import UNet2DConditionModel

    a, b = _folders(tmp_path, "sdxl", shard="100KB")
    assert len(list(a.glob("diffusion_pytorch_model-*.safetensors"))) > 1
    out = tmp_path / "out"
    assert main(["merge", str(a), str(b), "--model", "hf", "--weights", "0.7,0.3", "--max-iter", "1", "--out", str(out),
                 *NO_BARS]) == 0  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    assert report["model"] == "hf (UNet2DConditionModel)" and report["weights"] == [0.7, 0.3]
    merged = UNet2DConditionModel.from_pretrained(out / "merged")
    assert merged.config.addition_embed_type == "text_time"
    assert (out / "merged" / "diffusion_pytorch_model.safetensors.index.json").is_file()


def test_barrier_of_a_pipeline_without_text_encoder_names_its_index(tmp_path, capsys):
    for name in ("p", "q"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model_index.json").write_text(json.dumps({
            "_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"],
            "vae": ["diffusers", "AutoencoderKL"], "scheduler": ["diffusers", "DDPMScheduler"],
            "safety_checker": [None, None]}))  # fmt: skip
        for component in ("unet", "vae", "scheduler"):
            (tmp_path / name / component).mkdir()
        for component in ("unet", "vae"):
            (tmp_path / name / component / "config.json").write_text("{}")
    assert main(["barrier", str(tmp_path / "p"), str(tmp_path / "q"), "--model", "hf", "--out", str(tmp_path / "o"),
                 *NO_BARS]) != 0  # fmt: skip
    # A pipeline's barrier needs its text encoder and tokenizer: the index is named.
    assert f"{tmp_path / 'p' / 'model_index.json'} lists no component 'text_encoder'" in capsys.readouterr().err


def test_an_unsupported_class_and_a_missing_diffusers_are_named(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "m"
    folder.mkdir()
    config = folder / "config.json"
    config.write_text(json.dumps({"_class_name": "UNet3DConditionModel"}))
    args = ["align", str(folder), str(folder), "--model", "hf", "--out", str(tmp_path / "o"), *NO_BARS]
    assert main(args) != 0
    assert f"{config} names diffusers class 'UNet3DConditionModel'; supported: " in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "diffusers", None)  # as if it were not installed
    assert main(args) != 0
    assert "which needs diffusers: pip install diffusers" in capsys.readouterr().err


def test_folders_of_two_classes_are_refused(tmp_path, capsys):
    (unet, _), (vae, _) = _folders(tmp_path / "u", "sd"), _folders(tmp_path / "v", "vae")
    assert main(["align", str(unet), str(vae), "--model", "hf", "--out", str(tmp_path / "o"), *NO_BARS]) != 0
    assert str(vae) in capsys.readouterr().err
