"""pyperm.checkpoints: every layout read and written back in kind; corrupt and mismatched files named."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from pyperm.checkpoints import (
    CheckpointError,
    check_against_model,
    check_pair,
    default_name,
    load_checkpoint,
    output_paths,
    save_checkpoint,
)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "layers.0.weight": torch.randn(5, 3, generator=gen),
        "layers.0.bias": torch.randn(5, generator=gen),
        "layers.1.weight": torch.randn(2, 5, generator=gen),
        "layers.1.bias": torch.randn(2, generator=gen),
    }


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _write_sharded(folder, state, suffix=".safetensors"):
    keys = sorted(state)
    shards = {f"model-0000{i + 1}-of-00002{suffix}": keys[i::2] for i in range(2)}
    weight_map = {}
    for name, part in shards.items():
        tensors = {k: state[k] for k in part}
        if suffix == ".safetensors":
            safetensors_torch.save_file(tensors, str(folder / name))
        else:
            torch.save(tensors, folder / name)
        weight_map.update({k: name for k in part})
    index = folder / f"model{suffix}.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return index


@pytest.mark.parametrize("wrapper", [None, "state_dict", "model"])
@pytest.mark.parametrize("suffix", [".pt", ".pth"])
def test_torch_round_trip(tmp_path, wrapper, suffix):
    state = _state()
    obj = state if wrapper is None else {wrapper: state, "epoch": 7}
    path = tmp_path / f"a{suffix}"
    torch.save(obj, path)
    ckpt = load_checkpoint(path)
    assert ckpt.format == "torch" and ckpt.wrapper_key == wrapper and _same(ckpt.state, state)
    assert ckpt.dropped == ([] if wrapper is None else ["epoch"])
    new = {k: v + 1 for k, v in state.items()}
    out = tmp_path / ("out" + suffix)
    save_checkpoint(ckpt, new, out)
    raw = torch.load(out, weights_only=True)
    assert _same(raw if wrapper is None else raw[wrapper], new)
    assert _same(load_checkpoint(out).state, new)


def test_data_parallel_prefix_is_removed_and_restored(tmp_path):
    state = _state()
    torch.save({"module." + k: v for k, v in state.items()}, tmp_path / "dp.pt")
    ckpt = load_checkpoint(tmp_path / "dp.pt")
    assert ckpt.prefix == "module." and _same(ckpt.state, state)
    save_checkpoint(ckpt, state, tmp_path / "out.pt")
    assert all(k.startswith("module.") for k in torch.load(tmp_path / "out.pt", weights_only=True))


def test_safetensors_round_trip_keeps_metadata_and_dtype(tmp_path):
    state = {k: v.to(torch.bfloat16) for k, v in _state().items()}
    safetensors_torch.save_file(state, str(tmp_path / "a.safetensors"), metadata={"source": "test"})
    ckpt = load_checkpoint(tmp_path / "a.safetensors")
    assert ckpt.format == "safetensors" and ckpt.metadata == {"source": "test"} and _same(ckpt.state, state)
    assert default_name(ckpt, "b_permuted") == "b_permuted.safetensors"
    save_checkpoint(ckpt, state, tmp_path / "b.safetensors")
    again = load_checkpoint(tmp_path / "b.safetensors")
    assert again.metadata == {"source": "test"} and again.state["layers.0.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("suffix", [".safetensors", ".bin"])
def test_sharded_round_trip(tmp_path, suffix):
    state = _state()
    (tmp_path / "in").mkdir()
    index = _write_sharded(tmp_path / "in", state, suffix)
    for where in (index, tmp_path / "in"):  # the index json, or the directory holding it
        ckpt = load_checkpoint(where)
        assert ckpt.format == "sharded" and _same(ckpt.state, state)
    (tmp_path / "out").mkdir()
    target = tmp_path / "out" / default_name(ckpt, "permuted")
    assert target.name == f"permuted{suffix}.index.json"
    planned = output_paths(ckpt, target)
    written = save_checkpoint(ckpt, {k: -v for k, v in state.items()}, target)
    assert written == planned and len(written) == 3
    again = load_checkpoint(target)
    assert again.weight_map == ckpt.weight_map and _same(again.state, {k: -v for k, v in state.items()})


def test_existing_output_is_refused_without_force(tmp_path):
    torch.save(_state(), tmp_path / "a.pt")
    ckpt = load_checkpoint(tmp_path / "a.pt")
    (tmp_path / "out.pt").write_bytes(b"keep me")
    with pytest.raises(CheckpointError, match="out.pt: exists; pass --force"):
        save_checkpoint(ckpt, ckpt.state, tmp_path / "out.pt")
    assert (tmp_path / "out.pt").read_bytes() == b"keep me"
    save_checkpoint(ckpt, ckpt.state, tmp_path / "out.pt", force=True)
    assert _same(load_checkpoint(tmp_path / "out.pt").state, ckpt.state)


def test_corrupt_and_unknown_files_are_named(tmp_path):
    (tmp_path / "bad.pt").write_bytes(b"not a zip file at all")
    with pytest.raises(CheckpointError, match=r"bad\.pt: not a readable PyTorch checkpoint"):
        load_checkpoint(tmp_path / "bad.pt")
    (tmp_path / "bad.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(CheckpointError, match=r"bad\.safetensors: not a readable safetensors file"):
        load_checkpoint(tmp_path / "bad.safetensors")
    safetensors_torch.save_file(_state(), str(tmp_path / "cut.safetensors"))
    data = (tmp_path / "cut.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) - 20])
    with pytest.raises(CheckpointError, match=r"cut\.safetensors"):
        load_checkpoint(tmp_path / "cut.safetensors")
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(CheckpointError, match="unknown checkpoint type '.txt'"):
        load_checkpoint(tmp_path / "a.txt")
    with pytest.raises(CheckpointError, match="missing.pt: no such file"):
        load_checkpoint(tmp_path / "missing.pt")


def test_non_tensor_entries_are_named(tmp_path):
    torch.save({"w": torch.ones(2), "note": "hello"}, tmp_path / "a.pt")
    with pytest.raises(CheckpointError, match=r"a\.pt: key 'note' holds a str"):
        load_checkpoint(tmp_path / "a.pt")
    torch.save([torch.ones(2)], tmp_path / "b.pt")
    with pytest.raises(CheckpointError, match="holds a list, not a state dict"):
        load_checkpoint(tmp_path / "b.pt")


def test_sharded_index_problems_are_named(tmp_path):
    state = _state()
    index = _write_sharded(tmp_path, state)
    body = json.loads(index.read_text())
    body["weight_map"]["extra.weight"] = "model-00003-of-00002.safetensors"
    index.write_text(json.dumps(body))
    with pytest.raises(
        CheckpointError,
        match="model-00003-of-00002.safetensors: shard named in model.safetensors.index.json does not exist",
    ):
        load_checkpoint(index)
    body["weight_map"]["extra.weight"] = "../elsewhere.safetensors"
    index.write_text(json.dumps(body))
    with pytest.raises(CheckpointError, match="not a plain file name"):
        load_checkpoint(index)
    index.write_text("{")
    with pytest.raises(CheckpointError, match="not a readable index json"):
        load_checkpoint(index)


def test_checks_against_the_model_and_between_checkpoints(tmp_path):
    state = _state()
    torch.save(state, tmp_path / "a.pt")
    ckpt = load_checkpoint(tmp_path / "a.pt")
    check_against_model(ckpt, state, "mlp:3,5,2")
    wider = dict(state, **{"layers.0.weight": torch.zeros(6, 3)})
    with pytest.raises(
        CheckpointError, match=r"a\.pt: key 'layers.0.weight' has shape \(5, 3\), model mlp:3,5,6,2 expects \(6, 3\)"
    ):
        check_against_model(ckpt, wider, "mlp:3,5,6,2")
    with pytest.raises(CheckpointError, match=r"key 'other' of model m is missing"):
        check_against_model(ckpt, dict(state, other=torch.zeros(1)), "m")
    nan = dict(state, **{"layers.1.bias": torch.tensor([0.0, float("nan")])})
    torch.save(nan, tmp_path / "nan.pt")
    with pytest.raises(CheckpointError, match=r"nan\.pt: key 'layers.1.bias' holds NaN or inf"):
        check_against_model(load_checkpoint(tmp_path / "nan.pt"), state, "m")
    torch.save({k: v.double() for k, v in state.items()}, tmp_path / "b.pt")
    with pytest.raises(CheckpointError, match=r"b\.pt: key 'layers.0.weight' has dtype torch.float64"):
        check_pair(ckpt, load_checkpoint(tmp_path / "b.pt"))


def test_lightning_style_prefix_is_found_from_the_model(tmp_path):
    state = _state()
    torch.save({"state_dict": {"model." + k: v for k, v in state.items()}, "epoch": 3}, tmp_path / "l.ckpt")
    ckpt = load_checkpoint(tmp_path / "l.ckpt")
    check_against_model(ckpt, state, "mlp")
    assert ckpt.prefix == "model." and _same(ckpt.state, state)
    save_checkpoint(ckpt, state, tmp_path / "out.ckpt")
    raw = torch.load(tmp_path / "out.ckpt", weights_only=True)
    assert sorted(raw["state_dict"]) == sorted("model." + k for k in state)


@pytest.mark.parametrize("layout", ["sharded", "safetensors", "torch"])
def test_a_failed_write_leaves_no_file_under_a_final_name(tmp_path, monkeypatch, layout):
    """Every file is written beside its final name and renamed only once all are written: a write that
    fails halfway (a full disk, a killed process) leaves neither a partial file nor a stale index."""
    import pyperm.checkpoints._write as write_module

    state = _state()
    (tmp_path / "in").mkdir()
    if layout == "sharded":
        source = _write_sharded(tmp_path / "in", state)
    elif layout == "safetensors":
        source = tmp_path / "in" / "m.safetensors"
        safetensors_torch.save_file(state, str(source))
    else:
        source = tmp_path / "in" / "m.pt"
        torch.save(state, source)
    ckpt = load_checkpoint(source)
    calls = []

    def fail_at(f, write):
        calls.append(f)
        if len(calls) == (2 if layout == "sharded" else 1):
            f.write(b"half a file")  # what a crash mid-write leaves
            raise OSError("No space left on device")
        return write()

    if layout == "torch":
        real = torch.save
        monkeypatch.setattr(torch, "save", lambda obj, f: fail_at(f, lambda: real(obj, f)))
    else:  # safetensors files are written tensor by tensor by pyperm's own writer
        real = write_module.write_safetensors
        monkeypatch.setattr(write_module, "write_safetensors", lambda f, *args: fail_at(f, lambda: real(f, *args)))
    (tmp_path / "out").mkdir()
    target = tmp_path / "out" / default_name(ckpt, "permuted")
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(ckpt, state, target)
    assert list((tmp_path / "out").iterdir()) == []
