"""``pyperm align|merge|barrier --model hf`` on diffusers pipelines and their model folders (tiny random
pipelines written by :func:`pyperm.testing.tiny_pipeline`, no download)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

pytest.importorskip("diffusers")

from pyperm.cli import main  # noqa: E402

NO_BARS = ["--no-progress"]
MODELS = {"text_encoder": "CLIPTextModel", "unet": "UNet2DConditionModel", "vae": "AutoencoderKL"}


@pytest.fixture(scope="module")
def aligned(pipelines, tmp_path_factory):
    """``pyperm align pa pb --model hf``'s output folder."""
    a, b = pipelines
    out = tmp_path_factory.mktemp("aligned")
    assert main(["align", str(a), str(b), "--model", "hf", "--max-iter", "2", "--out", str(out), *NO_BARS]) == 0
    return out


def _images(folder):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe("a cat", num_inference_steps=2, height=16, width=16, output_type="pt",
                generator=torch.Generator().manual_seed(0)).images  # fmt: skip


def test_aligned_pipeline_loads_and_makes_b_s_images(pipelines, aligned):
    _, b = pipelines
    out = aligned / "pb_permuted"
    torch.testing.assert_close(_images(out), _images(b), rtol=1e-4, atol=1e-4)
    from diffusers import UNet2DConditionModel

    unet_b, unet_out = UNet2DConditionModel.from_pretrained(b / "unet"), UNet2DConditionModel.from_pretrained(out / "unet")
    assert any(not torch.equal(unet_out.state_dict()[k], v) for k, v in unet_b.state_dict().items())
    for copied in ("scheduler/scheduler_config.json", "tokenizer/tokenizer.json", "model_index.json"):
        assert (out / copied).read_bytes() == (b / copied).read_bytes()


def test_aligned_vae_keeps_b_s_latents(pipelines, aligned):
    """A VAE's latent channels are its interface with the UNet: never permuted."""
    from diffusers import AutoencoderKL

    _, b = pipelines
    x = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(2)) * 2 - 1
    with torch.no_grad():
        want = AutoencoderKL.from_pretrained(b / "vae").encode(x).latent_dist.parameters
        got = AutoencoderKL.from_pretrained(aligned / "pb_permuted" / "vae").encode(x).latent_dist.parameters
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_pipeline_report_names_each_component_s_groups_and_objective(aligned):
    report = json.loads((aligned / "report.json").read_text())
    assert report["pipeline"] == "StableDiffusionPipeline"
    rows = {r["name"]: r for r in report["components"]}
    assert set(rows) == {"scheduler", "text_encoder", "tokenizer", "unet", "vae"}
    for name, cls in MODELS.items():
        row = rows[name]
        assert row["class"] == cls and row["action"] == "aligned" and row["groups"]
        assert row["objective"]["after"] >= row["objective"]["before"]
        assert row["max_output_change_of_b"] < 1e-4
        assert (aligned / name / "report.json").is_file() and (aligned / name / "permutations.json").is_file()
    assert rows["scheduler"]["action"].startswith("copied from")
    md = (aligned / "report.md").read_text()
    assert "## unet: groups" in md and "objective" in md


def test_merge_pipelines_with_weights(pipelines, tmp_path):
    from diffusers import StableDiffusionPipeline

    a, b = pipelines
    out = tmp_path / "out"
    assert main(["merge", str(a), str(b), "--model", "hf", "--weights", "0.7,0.3", "--max-iter", "1",
                 "--out", str(out), *NO_BARS]) == 0  # fmt: skip
    StableDiffusionPipeline.from_pretrained(out / "merged")
    report = json.loads((out / "report.json").read_text())
    assert {r["name"]: r["action"] for r in report["components"] if "groups" in r} == dict.fromkeys(MODELS, "merged")
    assert json.loads((out / "unet" / "report.json").read_text())["weights"] == [0.7, 0.3]
    # The process's peak, every component merged in it one after another.
    assert report["peak_rss_bytes"][0] >= json.loads((out / "unet" / "report.json").read_text())["peak_rss_bytes"][0]
    assert "peak resident memory, GB (the process)" in (out / "report.md").read_text()


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_a_pipeline_of_another_class_is_named(pipelines, tmp_path, capsys):
    a, b = pipelines
    other = _copy(b, tmp_path / "other")
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "StableDiffusionXLPipeline"}))
    assert main(["align", str(a), str(other), "--model", "hf", "--out", str(tmp_path / "o"), *NO_BARS]) != 0
    err = capsys.readouterr().err
    assert f"{other / 'model_index.json'} is a StableDiffusionXLPipeline but {a / 'model_index.json'}" in err
    assert main(["align", str(a), str(b / "unet"), "--model", "hf", "--out", str(tmp_path / "o"), *NO_BARS]) != 0
    assert f"{b / 'unet'} is not a diffusers pipeline folder" in capsys.readouterr().err


def test_a_missing_component_is_named(pipelines, tmp_path, capsys):
    a, b = pipelines
    other = _copy(b, tmp_path / "other")
    shutil.rmtree(other / "vae")
    assert main(["merge", str(a), str(other), "--model", "hf", "--out", str(tmp_path / "o"), *NO_BARS]) != 0
    assert f"{other / 'vae'} is missing: {other / 'model_index.json'} lists the component 'vae'" in capsys.readouterr().err
    index = json.loads((other / "model_index.json").read_text())
    del index["vae"]
    (other / "model_index.json").write_text(json.dumps(index))
    assert main(["merge", str(a), str(other), "--model", "hf", "--out", str(tmp_path / "o"), *NO_BARS]) != 0
    assert f"{other / 'model_index.json'} lists no component 'vae'" in capsys.readouterr().err
    assert not (tmp_path / "o" / "merged").exists()  # refused before any work


def test_barrier_of_unet_folders_is_the_denoising_loss(pipelines, tmp_path, capsys):
    a, b = pipelines
    out = tmp_path / "out"
    assert main(["barrier", str(a / "unet"), str(b / "unet"), "--model", "hf", "--align", "weight", "--num-points", "3",
                 "--max-samples", "4", "--max-iter", "1", "--out", str(out), *NO_BARS]) == 0  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    assert report["data"]["name"].startswith("denoising of 4 noisy latents")
    for label in ("naive", "weight"):
        path = report["paths"][label]
        assert len(path["loss"]) == 3 and all(math.isfinite(v) and v > 0 for v in path["loss"])
    # The endpoints are the checkpoints themselves: B permuted has B's loss.
    assert report["paths"]["weight"]["loss"][-1] == pytest.approx(report["paths"]["naive"]["loss"][-1], rel=1e-4)
    capsys.readouterr()
    for extra in (["--data", "digits"], ["--align", "activation"]):
        assert main(["barrier", str(a / "unet"), str(b / "unet"), "--model", "hf", *extra, "--out", str(out),
                     "--force", *NO_BARS]) != 0  # fmt: skip
        assert "diffusers model folder" in capsys.readouterr().err


def test_barrier_without_data_on_other_models_says_data_is_required(tmp_path, capsys):
    from pyperm.nn.models import create_model

    for name in ("a.pt", "b.pt"):
        torch.save(create_model("mlp:4,8,2").state_dict(), tmp_path / name)
    assert main(["barrier", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--model", "mlp:4,8,2",
                 "--out", str(tmp_path / "o"), *NO_BARS]) != 0  # fmt: skip
    assert "--data is required" in capsys.readouterr().err


def test_pipeline_barrier_of_an_aligned_pair(pipelines, aligned, tmp_path):
    """``pyperm align`` first, then the barrier of A to B permuted: finite, and B permuted scores as B."""
    a, b = pipelines
    losses = {}
    for name, other in (("naive", b), ("aligned", aligned / "pb_permuted")):
        out = tmp_path / name
        assert main(["barrier", str(a), str(other), "--model", "hf", "--prompts", "a cat,a dog", "--num-points", "3",
                     "--max-samples", "4", "--out", str(out), *NO_BARS]) == 0  # fmt: skip
        path = json.loads((out / "report.json").read_text())["paths"]["naive"]
        assert all(math.isfinite(v) for v in path["loss"]) and math.isfinite(path["loss_barrier"])
        losses[name] = path["loss"]
    assert losses["aligned"][0] == losses["naive"][0]
    assert losses["aligned"][-1] == pytest.approx(losses["naive"][-1], rel=1e-4)
