"""``pyperm barrier A B --model hf`` on diffusers pipeline folders: the pipeline's path scored on prompts' latents
(tiny random pipelines written by :func:`pyperm.testing.tiny_pipeline`, no download)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

pytest.importorskip("diffusers")

from pyperm.cli import main  # noqa: E402
from pyperm.commands._pipeline_barrier import DEFAULT_PROMPTS, draws_for, parse_prompts  # noqa: E402

NO_BARS = ["--no-progress"]
PROMPTS = ["a red cat", "two dogs on a hill", "a boat"]


def _barrier(a, b, out, *extra):
    args = ["barrier", str(a), str(b), "--model", "hf", "--prompts", ",".join(PROMPTS), "--num-points", "3",
            "--max-samples", "5", "--batch-size", "2", "--out", str(out), *NO_BARS, *extra]  # fmt: skip
    assert main(args) == 0
    return json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def report(pipelines, tmp_path_factory):
    """The barrier of pa to pb with the VAE and weight matching."""
    a, b = pipelines
    return _barrier(a, b, tmp_path_factory.mktemp("barrier"), "--vae", "--align", "weight", "--max-iter", "2")


def _own_losses(folder, prompts, samples):
    """The pipeline's denoising loss and its VAE's reconstruction error, computed here from the draws' inputs."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(folder / "tokenizer")
    unet = UNet2DConditionModel.from_pretrained(folder / "unet").eval()
    vae = AutoencoderKL.from_pretrained(folder / "vae").eval()
    schedule = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    draws = draws_for(prompts, tokenizer, unet.config, schedule, samples, 0, vae_config=vae.config)
    with torch.no_grad():
        ids = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                        return_tensors="pt").input_ids  # fmt: skip
        states = CLIPTextModel.from_pretrained(folder / "text_encoder").eval()(ids).last_hidden_state
        conditions = torch.stack([states[i % len(prompts)] for i in range(samples)])
        predicted = unet(draws.noisy, draws.timesteps, encoder_hidden_states=conditions).sample
        rebuilt = vae(draws.images, sample_posterior=False).sample
    return float(((predicted - draws.targets) ** 2).mean()), float(((rebuilt - draws.images) ** 2).mean())


def test_endpoints_are_the_pipelines_own_losses(pipelines, report):
    a, b = pipelines
    assert report["prompts"] == PROMPTS and report["data"]["samples"] == 5
    unet_a, vae_a = _own_losses(a, PROMPTS, 5)
    unet_b, vae_b = _own_losses(b, PROMPTS, 5)
    for label in ("naive", "weight"):
        for part, (want_a, want_b) in (("pipeline", (unet_a, unet_b)), ("unet", (unet_a, unet_b)),
                                       ("vae", (vae_a, vae_b))):  # fmt: skip
            loss = report["components"][part][label]["loss"]
            assert len(loss) == 3 and all(math.isfinite(v) and v > 0 for v in loss)
            assert loss[0] == pytest.approx(want_a, rel=1e-5)
            assert loss[-1] == pytest.approx(want_b, rel=1e-4)  # B permuted on the weight path
            assert math.isfinite(report["components"][part][label]["loss_barrier"])
        assert report["paths"][label] == report["components"]["pipeline"][label]
    assert set(report["matching"]["weight"]) == {"text_encoder", "unet", "vae"}


def test_the_barrier_is_deterministic(pipelines, report, tmp_path):
    a, b = pipelines
    again = _barrier(a, b, tmp_path / "again", "--vae", "--align", "weight", "--max-iter", "2")
    assert again["components"] == report["components"]
    md = (tmp_path / "again" / "report.md").read_text()
    assert "pipeline (text encoder and UNet interpolated together)" in md and "VAE (reconstruction" in md
    assert (tmp_path / "again" / "barrier.png").is_file() and (tmp_path / "again" / "vae.png").is_file()


def test_default_prompts_and_a_prompts_file(pipelines, tmp_path, capsys):
    a, b = pipelines
    out = tmp_path / "out"
    assert main(["barrier", str(a), str(b), "--model", "hf", "--num-points", "2", "--max-samples", "4",
                 "--out", str(out), *NO_BARS]) == 0  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    assert report["prompts"] == list(DEFAULT_PROMPTS) and set(report["components"]) == {"pipeline", "unet"}
    assert "pipeline loss barrier" in capsys.readouterr().out
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n\n a dog \n")
    assert parse_prompts(str(prompts)) == ["a cat", "a dog"]
    assert parse_prompts(" a cat , a dog") == ["a cat", "a dog"]


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--prompts", "a cat,,a dog"], "an empty prompt between commas"),
        (["--data", "digits"], "not on --data"),
        (["--align", "activation"], "pipeline folders align by --align weight"),
    ],
)
def test_bad_options_are_named(pipelines, tmp_path, capsys, option, message):
    a, b = pipelines
    assert main(["barrier", str(a), str(b), "--model", "hf", *option, "--out", str(tmp_path / "o"), *NO_BARS]) != 0
    assert message in capsys.readouterr().err


def test_pipeline_options_on_model_folders_are_refused(pipelines, tmp_path, capsys):
    a, b = pipelines
    for option in (["--prompts", "a cat"], ["--vae"]):
        assert main(["barrier", str(a / "unet"), str(b / "unet"), "--model", "hf", *option,
                     "--out", str(tmp_path / "o"), *NO_BARS]) != 0  # fmt: skip
        assert "applies to diffusers pipeline folders (model_index.json) only" in capsys.readouterr().err


def _edited_copy(src, dst, edit):
    shutil.copytree(src, dst)
    index = json.loads((dst / "model_index.json").read_text())
    edit(index)
    (dst / "model_index.json").write_text(json.dumps(index))
    return dst


def test_missing_and_unsupported_components_name_the_file(pipelines, tmp_path, capsys):
    _, b = pipelines
    no_text = _edited_copy(b, tmp_path / "notext", lambda index: index.pop("text_encoder"))
    assert main(["barrier", str(no_text), str(no_text), "--model", "hf", "--out", str(tmp_path / "o"), *NO_BARS]) != 0
    assert f"{no_text / 'model_index.json'} lists no component 'text_encoder'" in capsys.readouterr().err
    xl = _edited_copy(b, tmp_path / "xl", lambda index: index.update(text_encoder_2=index["text_encoder"]))
    shutil.copytree(b / "text_encoder", xl / "text_encoder_2")
    assert main(["barrier", str(xl), str(xl), "--model", "hf", "--out", str(tmp_path / "o"), *NO_BARS]) != 0
    assert f"{xl / 'model_index.json'} lists a second text encoder" in capsys.readouterr().err
    # Without --vae the VAE is not needed; with it, a pipeline without one is refused naming the index.
    no_vae = _edited_copy(b, tmp_path / "novae", lambda index: index.pop("vae"))
    assert main(["barrier", str(no_vae), str(no_vae), "--model", "hf", "--vae", "--out", str(tmp_path / "o"),
                 *NO_BARS]) != 0  # fmt: skip
    assert f"{no_vae / 'model_index.json'} lists no component 'vae', which the pipeline barrier needs" in (
        capsys.readouterr().err)


def test_components_of_another_shape_name_the_config(pipelines, tmp_path, capsys):
    from diffusers import UNet2DConditionModel

    a, b = pipelines
    other = tmp_path / "other"
    shutil.copytree(b, other)
    shutil.rmtree(other / "unet")
    config = dict(UNet2DConditionModel.load_config(b / "unet"))
    config["block_out_channels"] = [16, 64]
    UNet2DConditionModel.from_config(config).save_pretrained(other / "unet")
    assert main(["barrier", str(a), str(other), "--model", "hf", "--out", str(tmp_path / "o"), *NO_BARS]) != 0
    err = capsys.readouterr().err
    assert f"{other / 'unet' / 'config.json'} and {a / 'unet' / 'config.json'} describe different models" in err


def test_tokenizers_that_disagree_are_named(pipelines, tmp_path, capsys):
    a, b = pipelines
    other = tmp_path / "other"
    shutil.copytree(b, other)
    tokenizer = other / "tokenizer" / "tokenizer.json"
    data = json.loads(tokenizer.read_text())
    vocab = data["model"]["vocab"]
    vocab["c"], vocab["d"] = vocab["d"], vocab["c"]
    tokenizer.write_text(json.dumps(data))
    assert main(["barrier", str(a), str(other), "--model", "hf", "--prompts", "a cat", "--out", str(tmp_path / "o"),
                 *NO_BARS]) != 0  # fmt: skip
    assert f"{other / 'tokenizer'} gives the prompts other token ids than {a / 'tokenizer'}" in capsys.readouterr().err
