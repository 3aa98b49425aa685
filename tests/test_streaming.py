"""Checkpoints streamed in and out (issue 27): memory-mapped reading, tensor-by-tensor writing, meta-built models.

- a sharded checkpoint aligned gives exactly the tensors of the same checkpoint as one file, in the input's
  shards and index;
- loaded tensors are views of a private map of the file (file-backed, no memory used until read, the file
  never written), for safetensors and for torch files;
- the inputs are unchanged byte for byte after ``pyperm align``;
- a write that fails midway leaves no file under a final name, no hidden partial file, and an earlier
  output (``--force``) as it was;
- corrupt and truncated files are named;
- without ``--data`` the command builds its model on the meta device, and ties are still found there.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
pytest.importorskip("matplotlib")

from _vision import import_transformers

import pyperm.checkpoints._write as write_module
from pyperm._memory import resident_bytes
from pyperm.checkpoints import CheckpointError, LazyState, load_checkpoint, save_checkpoint
from pyperm.cli import main

NO_BARS = ["--no-progress"]
LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")

MLP_WIDTHS = [12, 16, 16, 16, 4]
MLP = "mlp:" + ",".join(map(str, MLP_WIDTHS))


# ------------------------------------------------------------------------------ helpers


def _mlp_state(seed: int) -> dict:
    from pyperm.nn.models import MLP as Net

    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in Net(MLP_WIDTHS).state_dict().items()}


def _write_mlp(folder, state, sharded: bool):
    """``state`` as one safetensors file, or as three shards and their index (returns the path to pass)."""
    folder.mkdir()
    if not sharded:
        safetensors_torch.save_file(state, str(folder / "model.safetensors"))
        return folder / "model.safetensors"
    keys = sorted(state)
    weight_map = {k: f"model-{1 + i % 3:05d}-of-00003.safetensors" for i, k in enumerate(keys)}
    for shard in set(weight_map.values()):
        safetensors_torch.save_file({k: state[k] for k in keys if weight_map[k] == shard}, str(folder / shard))
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return index


def _llama(seed: int):
    transformers = import_transformers()
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=32,
                                      tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()


def _write_llama(folder, seed: int, sharded: bool):
    """A bfloat16 Llama as ``save_pretrained`` writes it: one file, or several shards and an index."""
    _llama(seed).save_pretrained(str(folder), max_shard_size="10KB" if sharded else "1GB")
    return folder


def _digest(folder) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _mapped_from(path) -> list[tuple[int, int]]:
    """The address ranges of this process mapped from the file ``path``."""
    ranges = []
    target = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == target:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((lo, hi))
    return ranges


def _is_view_of(tensor, path) -> bool:
    return any(lo <= tensor.data_ptr() < hi for lo, hi in _mapped_from(path))


# ------------------------------------------------------------------------------ (a) sharded == whole file


def _align(tmp_path, name, a, b, model):
    out = tmp_path / name
    argv = ["align", str(a), str(b), "--model", model, "--max-iter", "5", "--out", str(out), *NO_BARS]
    assert main(argv) == 0
    return out, json.loads((out / "report.json").read_text())


@pytest.mark.parametrize("kind", ["mlp", "llama-bf16-hf"])
def test_sharded_align_equals_the_whole_file_result(tmp_path, kind):
    if kind == "mlp":
        write, model = (lambda folder, seed, sharded: _write_mlp(folder, _mlp_state(seed), sharded)), MLP
    else:
        write, model = _write_llama, "hf"
    inputs = {
        layout: [write(tmp_path / f"{layout}_{n}", seed, layout == "sharded") for n, seed in (("a", 1), ("b", 2))]
        for layout in ("single", "sharded")
    }
    whole_out, whole = _align(tmp_path, "out_single", *inputs["single"], model)
    shard_out, sharded = _align(tmp_path, "out_sharded", *inputs["sharded"], model)
    assert sharded["format"] == "sharded" and whole["format"] == "safetensors"
    assert json.loads((shard_out / "permutations.json").read_text()) == json.loads(
        (whole_out / "permutations.json").read_text()
    )
    assert any(g["units_moved"] for g in sharded["groups"]), "random models: some units move"

    one = load_checkpoint(whole["outputs"][0]).state
    many = load_checkpoint(sharded["outputs"][0])
    assert one.keys() == many.state.keys()
    for key in one:
        assert torch.equal(one[key], many.state[key]), key
        assert one[key].dtype == many.state[key].dtype == (torch.bfloat16 if kind != "mlp" else torch.float32)

    # The input's shard names and weight_map; total_size recomputed from what was written.
    source = load_checkpoint(inputs["sharded"][1])
    shards = sorted(set(source.weight_map.values()))
    assert len(shards) >= 3
    assert [p.split("/")[-1] for p in sharded["outputs"][1:]] == shards
    index = json.loads(Path(sharded["outputs"][0]).read_text())
    assert index["weight_map"] == source.weight_map
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in many.state.values())
    assert not list(shard_out.rglob(".*.pyperm-partial"))

    if kind != "mlp":
        # The output folder loads, computes B's function, and the check ran in the checkpoint's bfloat16.
        transformers = import_transformers()
        folder = shard_out / f"{inputs['sharded'][1].name}_permuted"
        aligned = transformers.LlamaForCausalLM.from_pretrained(str(folder))
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            got, want = aligned.eval()(ids).logits.float(), _llama(2)(ids).logits.float()
        assert (got - want).abs().max() < 0.1 * want.abs().max()
        assert sharded["output_check_dtype"] == "bfloat16"
        assert sharded["max_output_change_of_b"] < 0.1 * float(want.abs().max())


def test_sharded_merge_equals_the_whole_file_result(tmp_path):
    merged = {}
    for layout in ("single", "sharded"):
        paths = [str(_write_mlp(tmp_path / f"{layout}_{seed}", _mlp_state(seed), layout == "sharded"))
                 for seed in (1, 2, 3)]  # fmt: skip
        out = tmp_path / f"out_{layout}"
        assert main(["merge", *paths, "--model", MLP, "--max-iter", "3", "--out", str(out), *NO_BARS]) == 0
        merged[layout] = json.loads((out / "report.json").read_text())["outputs"]
    one = load_checkpoint(merged["single"][0]).state
    many = load_checkpoint(merged["sharded"][0])
    assert [p.split("/")[-1] for p in merged["sharded"][1:]] == sorted(set(many.weight_map.values()))
    assert many.weight_map == load_checkpoint(tmp_path / "sharded_1" / "model.safetensors.index.json").weight_map
    assert one.keys() == many.state.keys() and all(torch.equal(one[k], many.state[k]) for k in one)


# ------------------------------------------------------------------------------ (b) mapped, not read


@LINUX
def test_safetensors_tensors_are_views_of_the_file_not_copies(tmp_path):
    path = tmp_path / "big.safetensors"
    size = 200 << 20
    safetensors_torch.save_file(
        {"big": torch.ones(size // 4), "small": torch.arange(6.0).reshape(2, 3)}, str(path)
    )  # fmt: skip
    before = resident_bytes()
    ckpt = load_checkpoint(path)
    grown = resident_bytes() - before
    assert grown < (20 << 20), f"loading a 200 MB file took {grown >> 20} MB of memory"
    big = ckpt.state["big"]
    assert _is_view_of(big, path) and _is_view_of(ckpt.state["small"], path)
    assert torch.equal(ckpt.state["small"], torch.arange(6.0).reshape(2, 3))
    # Copy on write: this process's tensor changes, the file does not.
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    big[:1000] = -1.0
    del big, ckpt
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
    assert torch.equal(load_checkpoint(path).state["big"][:1000], torch.ones(1000))
    # mmap=False reads the tensors into memory instead: one copy, and no mapping of the file left behind.
    gc.collect()
    assert not _mapped_from(path), "the mapped checkpoint's tensors are gone"
    copied = load_checkpoint(path, mmap=False).state
    assert not _mapped_from(path), "mmap=False keeps no mapping of the file"
    assert torch.equal(copied["small"], torch.arange(6.0).reshape(2, 3)) and torch.equal(copied["big"][:10], torch.ones(10))


def test_every_dtype_reads_back_exactly(tmp_path):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, generator=gen) * 100
    state = {
        "bf16": x.bfloat16(), "f16": x.half(), "f32": x, "f64": x.double(), "i64": x.long(), "i32": x.int(),
        "i16": x.short(), "i8": x.clamp(-100, 100).to(torch.int8), "u8": x.abs().clamp(0, 255).to(torch.uint8),
        "bool": x > 0, "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3), "fp8": x.to(torch.float8_e4m3fn),
    }  # fmt: skip
    safetensors_torch.save_file(state, str(tmp_path / "m.safetensors"), metadata={"note": "kept"})
    ckpt = load_checkpoint(tmp_path / "m.safetensors")
    assert ckpt.metadata == {"note": "kept"}
    for key, value in state.items():
        got = ckpt.state[key]
        assert got.dtype == value.dtype and got.shape == value.shape, key
        assert torch.equal(got.view(torch.uint8), value.view(torch.uint8)) if key == "fp8" else torch.equal(got, value)
    # Written back by pyperm's own writer, tensor by tensor: safetensors reads it, every byte the same.
    save_checkpoint(ckpt, ckpt.state, tmp_path / "again.safetensors")
    again = safetensors_torch.load_file(str(tmp_path / "again.safetensors"))
    for key, value in state.items():
        assert again[key].dtype == value.dtype and again[key].shape == value.shape
        assert again[key].reshape(-1).view(torch.uint8).tolist() == value.reshape(-1).view(torch.uint8).tolist()


def test_a_misaligned_tensor_is_read_instead_of_mapped(tmp_path):
    """safetensors' writers align every tensor; a file that does not (a 3-byte tensor before a float32 one) is
    still read, the misaligned tensor copied."""
    header = {"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]}}  # fmt: skip
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    data = bytes([1, 2, 3]) + torch.tensor([1.5, -2.0]).numpy().tobytes()
    (tmp_path / "odd.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + data)
    state = load_checkpoint(tmp_path / "odd.safetensors").state
    assert state["a"].tolist() == [1, 2, 3] and state["b"].tolist() == [1.5, -2.0]


# ------------------------------------------------------------------------------ (c) inputs unchanged


def test_align_leaves_its_inputs_unchanged_byte_for_byte(tmp_path):
    a = _write_mlp(tmp_path / "a", _mlp_state(1), sharded=True)
    b = _write_mlp(tmp_path / "b", _mlp_state(2), sharded=True)
    before = (_digest(a.parent), _digest(b.parent))
    stamps = [p.stat().st_mtime_ns for p in sorted(b.parent.iterdir())]
    _align(tmp_path, "out", a, b, MLP)
    assert (_digest(a.parent), _digest(b.parent)) == before
    assert [p.stat().st_mtime_ns for p in sorted(b.parent.iterdir())] == stamps


# ------------------------------------------------------------------------------ (d) partial outputs


def _fail_after_first_shard(monkeypatch):
    written = []
    real = write_module.write_safetensors

    def write(f, *args):
        if written:
            f.write(b"half a shard")  # what a full disk leaves
            raise OSError("No space left on device")
        written.append(f.name)
        return real(f, *args)

    monkeypatch.setattr(write_module, "write_safetensors", write)
    return written


def test_a_failed_sharded_write_leaves_no_final_and_no_partial_file(tmp_path, monkeypatch, capsys):
    a = _write_mlp(tmp_path / "a", _mlp_state(1), sharded=True)
    b = _write_mlp(tmp_path / "b", _mlp_state(2), sharded=True)
    written = _fail_after_first_shard(monkeypatch)
    out = tmp_path / "out"
    assert main(["align", str(a), str(b), "--model", MLP, "--out", str(out), *NO_BARS]) == 1
    assert "No space left on device" in capsys.readouterr().err
    assert len(written) == 1  # the first shard was complete when the second failed
    assert list(out.iterdir()) == [], "no shard, index or partial file under any name"


def test_a_failed_write_over_an_earlier_output_leaves_it_whole(tmp_path, monkeypatch):
    a = _write_mlp(tmp_path / "a", _mlp_state(1), sharded=True)
    b = _write_mlp(tmp_path / "b", _mlp_state(2), sharded=True)
    c = _write_mlp(tmp_path / "c", _mlp_state(3), sharded=True)
    out, _ = _align(tmp_path, "out", a, b, MLP)
    shards = out / "model_permuted.safetensors.index.json"
    before = _digest(out)
    _fail_after_first_shard(monkeypatch)
    argv = ["align", str(a), str(c), "--model", MLP, "--out", str(out), "--force", *NO_BARS]
    assert main(argv) == 1
    assert _digest(out) == before, "the earlier output is untouched: nothing is renamed until all is written"
    assert load_checkpoint(shards).format == "sharded"


def test_a_lazy_tensor_of_the_wrong_shape_is_refused_before_a_file_appears(tmp_path):
    state = _mlp_state(1)
    source = _write_mlp(tmp_path / "in", state, sharded=True)
    ckpt = load_checkpoint(source)
    lazy = LazyState(ckpt.state, lambda key, t: t.reshape(-1) if key == "layers.1.weight" else t)
    (tmp_path / "out").mkdir()
    with pytest.raises(CheckpointError, match=r"key 'layers.1.weight' has shape \(256,\) and dtype torch.float32"):
        save_checkpoint(ckpt, lazy, tmp_path / "out" / "x.safetensors.index.json")
    assert list((tmp_path / "out").iterdir()) == []


# ------------------------------------------------------------------------------ (e) torch files


@LINUX
def test_torch_files_are_memory_mapped_and_old_ones_still_read(tmp_path):
    state = {"w": torch.randn(64, 32), "b": torch.arange(5)}
    torch.save({"state_dict": state, "epoch": 3}, tmp_path / "new.pt")
    ckpt = load_checkpoint(tmp_path / "new.pt")
    assert ckpt.wrapper_key == "state_dict" and ckpt.dropped == ["epoch"]
    assert all(torch.equal(ckpt.state[k], v) for k, v in state.items())
    assert _is_view_of(ckpt.state["w"], tmp_path / "new.pt")
    digest = hashlib.sha256((tmp_path / "new.pt").read_bytes()).hexdigest()
    ckpt.state["w"].zero_()  # copy on write, even when torch's default is a shared map
    with torch.serialization.set_default_mmap_options(__import__("mmap").MAP_SHARED):
        load_checkpoint(tmp_path / "new.pt").state["w"].zero_()
    assert hashlib.sha256((tmp_path / "new.pt").read_bytes()).hexdigest() == digest
    # torch's format before the zip file (torch < 1.6) cannot be mapped: it is read.
    torch.save(state, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    old = load_checkpoint(tmp_path / "old.pt")
    assert all(torch.equal(old.state[k], v) for k, v in state.items())
    # Written back, a mapped tensor is saved as its own bytes, not the whole map it views.
    save_checkpoint(load_checkpoint(tmp_path / "new.pt"), state, tmp_path / "out.pt")
    assert (tmp_path / "out.pt").stat().st_size < 2 * (tmp_path / "new.pt").stat().st_size


def test_align_of_torch_checkpoints_reads_them_mapped(tmp_path):
    torch.save(_mlp_state(1), tmp_path / "a.pt")
    torch.save(_mlp_state(2), tmp_path / "b.pt")
    single_a = _write_mlp(tmp_path / "sa", _mlp_state(1), sharded=False)
    single_b = _write_mlp(tmp_path / "sb", _mlp_state(2), sharded=False)
    _, from_torch = _align(tmp_path, "out_pt", tmp_path / "a.pt", tmp_path / "b.pt", MLP)
    _, from_st = _align(tmp_path, "out_st", single_a, single_b, MLP)
    got = load_checkpoint(from_torch["outputs"][0]).state
    want = load_checkpoint(from_st["outputs"][0]).state
    assert all(torch.equal(got[k], want[k]) for k in want)


# ------------------------------------------------------------------------------ (f) corrupt files


def _header_file(path, header: dict, data: bytes = b""):
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return path


def test_corrupt_and_truncated_safetensors_are_named(tmp_path):
    """The safetensors library checks the header; pyperm names the file (tests/test_checkpoint_fuzz.py has every
    kind of bad file)."""
    safetensors_torch.save_file({"w": torch.ones(4, 4), "v": torch.ones(3)}, str(tmp_path / "ok.safetensors"))
    data = (tmp_path / "ok.safetensors").read_bytes()
    for name, content in {"cut": data[:-8], "head": data[:40], "tiny": b"\x01\x02"}.items():
        (tmp_path / f"{name}.safetensors").write_bytes(content)
        with pytest.raises(CheckpointError, match=rf"{name}\.safetensors: not a readable safetensors file"):
            load_checkpoint(tmp_path / f"{name}.safetensors")
    _header_file(tmp_path / "f4.safetensors", {"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"x" * 8)
    with pytest.raises(CheckpointError, match=r"f4\.safetensors: "):
        load_checkpoint(tmp_path / "f4.safetensors")
    # A shard of a sharded checkpoint is named itself.
    (tmp_path / "sharded").mkdir()
    index = _write_mlp(tmp_path / "sharded" / "m", _mlp_state(1), sharded=True)
    shard = index.parent / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4])
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003\.safetensors: not a readable safetensors file"):
        load_checkpoint(index)


# ------------------------------------------------------------------------------ meta-built models


def test_weight_matching_without_data_builds_the_model_on_meta():
    from pyperm.commands._common import build_model

    meta = build_model(MLP, meta=True)
    real = build_model(MLP)
    assert meta.on_meta and not real.on_meta
    assert meta.spec.axes == real.spec.axes and meta.spec.sizes == real.spec.sizes


def test_a_hugging_face_model_traced_on_meta_has_the_real_spec_and_ties(tmp_path):
    transformers = import_transformers()
    from pyperm.commands._checkpoint_pair import model_with
    from pyperm.commands._common import build_model
    from pyperm.nn.state import shared_tensors

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(config).eval()
    gpt2.save_pretrained(str(tmp_path / "g"))
    meta = build_model("hf", checkpoint=str(tmp_path / "g"), meta=True)
    real = build_model("hf", checkpoint=str(tmp_path / "g"))
    assert meta.on_meta and not real.on_meta
    assert meta.spec.axes == real.spec.axes and meta.spec.sizes == real.spec.sizes
    # Ties: on meta every data_ptr() is 0, so ties are found by storage.
    assert shared_tensors(meta.module.state_dict()) == shared_tensors(real.module.state_dict()) == [
        ["transformer.wte.weight", "lm_head.weight"]]
    # The meta model runs a checkpoint's tensors as its own (buffers real, parameters the state's).
    state = gpt2.state_dict()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model_with(meta, state, "cpu")(ids), gpt2(ids).logits)
