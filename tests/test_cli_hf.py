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
    from pyperm.checkpoints import load_checkpoint
    from pyperm.commands._common import build_model
    from pyperm.nn import average, merge_many

    paths = [_save(_gpt2(seed), tmp_path / f"m{seed}", sharded=False) for seed in range(3)]
    out = tmp_path / "out"
    assert main(["merge", *paths, "--model", "hf", "--out", str(out)] + NO_BARS) == 0
    merged = transformers.GPT2LMHeadModel.from_pretrained(str(out / "merged")).eval()
    assert (out / "merged" / "config.json").exists() and (out / "merged" / "tokenizer.json").exists()
    # The written values are merge_many's (same spec, seed and rounds), not an average of unaligned models.
    spec = build_model("hf", checkpoint=paths[0]).spec
    states = [{k: v.float() for k, v in _gpt2(seed).state_dict().items()} for seed in range(3)]
    want = merge_many(spec, states, max_iter=100, seed=0).merged
    written = load_checkpoint(out / "merged").state
    got = merged.state_dict()
    for key, value in written.items():
        torch.testing.assert_close(value, want[key], rtol=0, atol=0, msg=key)
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
    plain = average(states)
    assert any(not torch.equal(want[k], plain[k]) for k in written), "the models were aligned before averaging"


def test_weights_in_a_ckpt_file_are_written_permuted_not_copied_over(tmp_path):
    """A folder whose weights are ``*.ckpt``: the old command took them for a config file and copied B's unpermuted
    weights over the permuted ones after writing them (issue 34, item 4)."""
    from pyperm.checkpoints import load_checkpoint

    models = [_gpt2(0), _gpt2(1)]
    for name, model in zip("ab", models):
        folder = tmp_path / name
        _save(model, folder, sharded=False)
        (folder / "model.safetensors").unlink()
        torch.save(model.state_dict(), folder / "model.ckpt")
    out = tmp_path / "out"
    assert main(["align", str(tmp_path / "a"), str(tmp_path / "b"), "--model", "hf", "--out", str(out)] + NO_BARS) == 0
    written = load_checkpoint(out / "b_permuted" / "model.ckpt").state
    b = models[1].state_dict()
    assert any(not torch.equal(written[k], b[k]) for k in b), "B's weights, unpermuted, were written as the result"
    model = _gpt2(5)
    model.load_state_dict(written)
    ids = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(model.eval(), ids), _logits(models[1], ids), rtol=1e-4, atol=1e-4)
    assert (out / "b_permuted" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()


def test_a_link_at_the_output_folder_or_a_copied_file_is_replaced_not_followed(tmp_path, capsys):
    paths = [_save(_gpt2(seed), tmp_path / f"m{seed}", sharded=False) for seed in range(2)]
    out = tmp_path / "out"
    out.mkdir()
    victim_folder = tmp_path / "victim_folder"
    victim_folder.mkdir()
    (victim_folder / "config.json").write_text("victim")
    (out / "merged").symlink_to(victim_folder, target_is_directory=True)
    argv = ["merge", *paths, "--model", "hf", "--out", str(out)] + NO_BARS
    assert main(argv) == 1 and "exists; pass --force" in capsys.readouterr().err
    assert main(argv + ["--force"]) == 0
    assert sorted(p.name for p in victim_folder.iterdir()) == ["config.json"]
    assert (victim_folder / "config.json").read_text() == "victim"
    assert not (out / "merged").is_symlink()
    # Links at the copied files of a folder that is already there.
    victim = tmp_path / "victim.json"
    victim.write_text("victim")
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        (out / "merged" / name).unlink()
        (out / "merged" / name).symlink_to(victim)
    assert main(argv + ["--force"]) == 0
    assert victim.read_text() == "victim"
    assert json.loads((out / "merged" / "config.json").read_text())["model_type"] == "gpt2"


def test_a_folder_without_config_is_one_clear_error(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    torch.save({"w": torch.zeros(2)}, tmp_path / "a" / "model.pt")
    assert main(["align", str(tmp_path / "a"), str(tmp_path / "a"), "--model", "hf", "--out", str(tmp_path / "o")]
                + NO_BARS) == 1  # fmt: skip
    assert "has no config.json" in capsys.readouterr().err
