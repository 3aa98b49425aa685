"""``--model hf``: the checkpoint sub-commands on Hugging Face ``save_pretrained`` folders (single-file and
sharded safetensors), writing folders that ``from_pretrained`` loads, config and tokenizer files copied."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("matplotlib")

from _vision import import_transformers

from pyperm.cli import main

transformers = import_transformers()

NO_BARS = ["--no-progress"]


def _gpt2(seed: int):
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config).eval()


def _save(model, folder, sharded: bool):
    """``model`` as ``save_pretrained`` writes it, with a tokenizer file beside it (copied by the commands)."""
    model.save_pretrained(str(folder), max_shard_size="40KB" if sharded else "1GB")
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {str(i): i for i in range(64)}}}))
    return str(folder)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_align_writes_a_folder_from_pretrained_loads(tmp_path, sharded):
    a, b = _gpt2(0), _gpt2(1)
    path_a, path_b = _save(a, tmp_path / "a", sharded), _save(b, tmp_path / "b", sharded)
    assert (tmp_path / "b" / "model.safetensors.index.json").exists() == sharded
    out = tmp_path / "out"
    assert main(["align", path_a, path_b, "--model", "hf", "--out", str(out)] + NO_BARS) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["max_output_change_of_b"] < 1e-4
    folder = out / "b_permuted"
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in (tmp_path / "b").iterdir())
    assert (folder / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()
    aligned = transformers.GPT2LMHeadModel.from_pretrained(str(folder)).eval()
    ids = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(aligned, ids), _logits(b, ids), rtol=1e-4, atol=1e-4)
    moved = [g for g in report["groups"] if g["units_moved"]]
    assert moved, "random models: weight matching moves some units"
    # The residual stream, the MLP's hidden units and the heads are all groups of the traced spec.
    assert len(report["groups"]) >= 3


def test_merge_writes_a_folder(tmp_path):
    paths = [_save(_gpt2(seed), tmp_path / f"m{seed}", sharded=False) for seed in range(3)]
    out = tmp_path / "out"
    assert main(["merge", *paths, "--model", "hf", "--out", str(out)] + NO_BARS) == 0
    merged = transformers.GPT2LMHeadModel.from_pretrained(str(out / "merged")).eval()
    assert (out / "merged" / "config.json").exists() and (out / "merged" / "tokenizer.json").exists()
    assert sum(p.numel() for p in merged.parameters()) == sum(p.numel() for p in _gpt2(0).parameters())


def test_a_folder_without_config_is_one_clear_error(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    torch.save({"w": torch.zeros(2)}, tmp_path / "a" / "model.pt")
    assert main(["align", str(tmp_path / "a"), str(tmp_path / "a"), "--model", "hf", "--out", str(tmp_path / "o")]
                + NO_BARS) == 1  # fmt: skip
    assert "has no config.json" in capsys.readouterr().err
