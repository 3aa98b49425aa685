"""Malformed and hostile checkpoints: every one is a CheckpointError naming the file (and the key), quickly and in
bounded memory; the command line prints one line and exits 1.

The cases are those a review fed the old hand-written safetensors parser (issue 34, item 3): duplicate keys,
overlapping tensors, a header over the 100 MB cap, a deeply nested header, a 5000-digit number, a shape torch
cannot hold, truncation, bad dtypes, offsets and shapes, and index files with bad entries; then random
mutations of a valid file, each of which pyperm must read exactly as the safetensors library does or refuse.
"""

from __future__ import annotations

import json
import random

import pytest

torch = pytest.importorskip("torch")
safetensors = pytest.importorskip("safetensors")
safetensors_torch = pytest.importorskip("safetensors.torch")

from pyperm._memory import resident_bytes
from pyperm.checkpoints import CheckpointError, load_checkpoint


def _raw(path, header: bytes | str | dict, data: bytes = b"", length: int | None = None):
    """A safetensors file from its parts: the 8-byte header length (the real one unless given), the header padded
    with spaces to 8 bytes as writers do (so that every tensor is aligned: a reader may map it as a view), data."""
    text = header if isinstance(header, bytes) else (header if isinstance(header, str) else json.dumps(header)).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes((len(text) if length is None else length).to_bytes(8, "little") + text + data)
    return path


def _entry(dtype="F32", shape=(1,), offsets=(0, 4)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


# name -> (header, data, the key the message must name, or None where the library's message names none)
SAFETENSORS_CASES = {
    "duplicate_key": (b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                      b'"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', b"\0" * 8, "w"),
    "overlapping": ({"a": _entry(shape=(2,), offsets=(0, 8)), "b": _entry(shape=(2,), offsets=(4, 12))}, b"\0" * 12,
                    "b"),
    "aliasing": ({"a": _entry(shape=(2,), offsets=(0, 8)), "b": _entry(shape=(2,), offsets=(0, 8))}, b"\0" * 8, None),
    "deep_nesting": (b'{"__metadata__":' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"", None),
    "deep_nesting_in_entry": (b'{"w":' + b"{" * 50_000 + b"}" * 50_000 + b"}", b"", None),
    "huge_number": (b'{"w":{"dtype":"F32","shape":[' + b"1" * 5000 + b'],"data_offsets":[0,4]}}', b"\0" * 4, None),
    "shape_over_int64": ({"w": _entry(shape=(0, 2**63), offsets=(0, 0))}, b"", "w"),
    "shape_over_uint64": (b'{"w":{"dtype":"F32","shape":[0,18446744073709551617],"data_offsets":[0,0]}}', b"", None),
    "negative_shape": ({"w": _entry(shape=(-1,), offsets=(0, 4))}, b"\0" * 4, None),
    "float_shape": ({"w": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}}, b"\0" * 4, None),
    # The library's message names no key here ("invalid shape, data type, or offset for tensor").
    "shape_bytes_mismatch": ({"w": _entry(shape=(3,), offsets=(0, 8))}, b"\0" * 8, None),
    "truncated": ({"w": _entry(shape=(4,), offsets=(0, 16))}, b"\0" * 8, None),
    "trailing_bytes": ({"w": _entry()}, b"\0" * 8, None),
    "gap": ({"w": _entry(offsets=(4, 8))}, b"\0" * 8, "w"),
    "reversed_offsets": ({"w": _entry(offsets=(4, 0))}, b"\0" * 4, None),
    "offsets_not_a_pair": ({"w": _entry(offsets=(0, 4, 8))}, b"\0" * 4, None),
    "unknown_dtype": ({"w": _entry(dtype="F33")}, b"\0" * 4, None),
    "dtype_not_a_string": ({"w": _entry(dtype=7)}, b"\0" * 4, None),
    "packed_float4": ({"w": _entry(dtype="F4", shape=(2,), offsets=(0, 1))}, b"\0", "w"),
    "entry_not_an_object": ({"w": [1, 2, 3]}, b"", None),
    "header_a_list": ("[1, 2]", b"", None),
    "header_not_json": ("{garbage", b"", None),
    "header_not_utf8": (b"\xff\xfe\xfd\xfc", b"", None),
    "metadata_not_strings": ({"__metadata__": {"n": 1}, "w": _entry()}, b"\0" * 4, None),
    "no_tensors": ({}, b"", None),
}


@pytest.mark.parametrize("case", sorted(SAFETENSORS_CASES))
def test_a_hostile_safetensors_file_is_one_error_naming_file_and_key(tmp_path, case):
    header, data, key = SAFETENSORS_CASES[case]
    path = _raw(tmp_path / f"{case}.safetensors", header, data)
    for mmap in (True, False):
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(path, mmap=mmap)
        message = str(info.value)
        assert message.startswith(f"{path}: "), message
        if key is not None:
            assert f"`{key}`" in message or f"'{key}'" in message, message


@pytest.mark.parametrize("declared", ["length_beyond_file", "length_over_cap", "tiny_file"])
def test_a_header_length_that_cannot_be_is_refused_unread(tmp_path, declared):
    """The library caps the header at 100 MB and checks the length against the file before reading it: a sparse
    file declaring a 108 MB header costs no memory (the hand parser read it whole: 32 s and 1.9 GB)."""
    path = tmp_path / f"{declared}.safetensors"
    if declared == "tiny_file":
        path.write_bytes(b"\x01\x02")
    else:
        length = 108_000_000 if declared == "length_over_cap" else 1_000
        with open(path, "wb") as f:
            f.write(length.to_bytes(8, "little") + b"{")
            if declared == "length_over_cap":
                f.truncate(8 + length + 16)  # sparse: the header's bytes exist but take no disk or memory
    before = resident_bytes()
    with pytest.raises(CheckpointError, match=rf"{path.name}: not a readable safetensors file"):
        load_checkpoint(path)
    assert resident_bytes() - before < (20 << 20)


def _shards(folder, state, names=("s1.safetensors", "s2.safetensors")):
    keys = sorted(state)
    weight_map = {k: names[i % len(names)] for i, k in enumerate(keys)}
    for name in names:
        safetensors_torch.save_file({k: state[k] for k in keys if weight_map[k] == name}, str(folder / name))
    return weight_map


def _state():
    gen = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(3, 2, generator=gen), "a.bias": torch.randn(3, generator=gen),
            "b.weight": torch.randn(1, 3, generator=gen)}  # fmt: skip


# name -> (the index file's text from a valid weight_map, the key the message must name or None)
INDEX_CASES = {
    "value_not_a_string": (lambda wm: json.dumps({"weight_map": {**wm, "a.bias": 3}}), "a.bias"),
    "value_a_list": (lambda wm: json.dumps({"weight_map": {**wm, "a.bias": ["s1.safetensors"]}}), "a.bias"),
    "value_with_folders": (lambda wm: json.dumps({"weight_map": {**wm, "a.bias": "../s1.safetensors"}}), "a.bias"),
    "value_absolute": (lambda wm: json.dumps({"weight_map": {**wm, "a.bias": "/etc/passwd"}}), "a.bias"),
    "value_not_a_checkpoint": (lambda wm: json.dumps({"weight_map": {**wm, "a.bias": "config.json"}}), "a.bias"),
    "missing_shard": (lambda wm: json.dumps({"weight_map": {**wm, "a.bias": "s9.safetensors"}}), None),
    "key_in_another_shard": (lambda wm: json.dumps({"weight_map": {**wm, "a.bias": "s2.safetensors"
                             if wm["a.bias"] == "s1.safetensors" else "s1.safetensors"}}), "a.bias"),
    "key_in_no_shard": (lambda wm: json.dumps({"weight_map": {**wm, "ghost": "s1.safetensors"}}), "ghost"),
    "duplicate_key": (lambda wm: json.dumps({"weight_map": wm})[:-2] + ', "a.bias": "s1.safetensors"}}', "a.bias"),
    "weight_map_a_list": (lambda wm: json.dumps({"weight_map": list(wm)}), "weight_map"),
    "weight_map_empty": (lambda wm: json.dumps({"weight_map": {}}), "weight_map"),
    "no_weight_map": (lambda wm: json.dumps({"metadata": {}}), "weight_map"),
    "metadata_a_string": (lambda wm: json.dumps({"metadata": "x", "weight_map": wm}), "metadata"),
    "index_a_list": (lambda wm: json.dumps([wm]), "weight_map"),
    "not_json": (lambda wm: "{not json", None),
    "deep_nesting": (lambda wm: '{"metadata": ' + "[" * 100_000 + "]" * 100_000 + "}", None),
    "huge_number": (lambda wm: '{"metadata": {"total_size": ' + "9" * 5000 + "}}", None),
}


@pytest.mark.parametrize("case", sorted(INDEX_CASES))
def test_an_index_with_bad_entries_is_one_error_naming_file_and_key(tmp_path, case):
    text, key = INDEX_CASES[case]
    weight_map = _shards(tmp_path, _state())
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(text(weight_map))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(index)
    message = str(info.value)
    assert str(tmp_path) in message.split(":")[0], message
    if key is not None:
        assert f"'{key}'" in message, message


def test_an_index_over_the_cap_is_refused_unread(tmp_path, monkeypatch):
    import pyperm.checkpoints._read as read

    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": _shards(tmp_path, _state()), "metadata": {"pad": "x" * 2000}}))
    monkeypatch.setattr(read, "INDEX_BYTES_MAX", 1000)
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: an index json over 1000 bytes"):
        load_checkpoint(index)


def test_a_fifo_is_refused_not_waited_on(tmp_path):
    import os

    fifo = tmp_path / "m.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match=r"m\.safetensors: not a regular file"):
        load_checkpoint(fifo)


def test_aliasing_tensors_cannot_be_written_through_each_other(tmp_path):
    """With the hand parser, two entries over the same bytes were two views of one mapping: writing one changed
    the other. The library refuses such a file; a valid file's tensors are private copies-on-write."""
    path = tmp_path / "ok.safetensors"
    safetensors_torch.save_file({"a": torch.zeros(2), "b": torch.zeros(2)}, str(path))
    state = load_checkpoint(path).state
    state["a"] += 1
    assert torch.equal(state["b"], torch.zeros(2))
    assert torch.equal(load_checkpoint(path).state["a"], torch.zeros(2))


def _library_read(path):
    with safetensors.safe_open(str(path), framework="pt", device="cpu") as f:
        return {k: f.get_tensor(k).clone() for k in f.keys()}


def test_random_mutations_read_as_the_library_reads_them_or_fail_cleanly(tmp_path):
    """Bytes of a valid file flipped, inserted, deleted or truncated at random: pyperm gives exactly the library's
    tensors, or a CheckpointError naming the file; never another exception."""
    gen = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(4, generator=gen).half(),
             "i": torch.arange(5, dtype=torch.int64)}  # fmt: skip
    safetensors_torch.save_file(state, str(tmp_path / "ok.safetensors"), metadata={"note": "x"})
    good = (tmp_path / "ok.safetensors").read_bytes()
    rng = random.Random(0)
    outcomes = {"read": 0, "refused": 0}
    for trial in range(300):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            where = rng.randrange(len(data))
            how = rng.choice(["flip", "insert", "delete", "truncate", "digit"])
            if how == "flip":
                data[where] ^= 1 << rng.randrange(8)
            elif how == "insert":
                data[where:where] = bytes([rng.randrange(256)])
            elif how == "delete":
                del data[where]
            elif how == "truncate":
                del data[where:]
            else:  # a digit in the header changed: shapes and offsets
                digits = [i for i in range(8, min(len(data), 8 + 200)) if chr(data[i]).isdigit()]
                if digits:
                    data[rng.choice(digits)] = ord(str(rng.randrange(10)))
            if not data:
                data = bytearray(b"\0")
        path = tmp_path / f"m{trial}.safetensors"
        path.write_bytes(bytes(data))
        try:
            expected = _library_read(path)
        except Exception:  # noqa: BLE001 - the library refuses it in whichever way
            expected = None
        if expected is None or not expected:
            with pytest.raises(CheckpointError, match=rf"m{trial}\.safetensors: "):
                load_checkpoint(path)
            outcomes["refused"] += 1
        else:
            for mmap in (True, False):
                got = load_checkpoint(path, mmap=mmap).state
                assert got.keys() == expected.keys(), trial
                for k in got:
                    assert got[k].dtype == expected[k].dtype and torch.equal(got[k].view(torch.uint8),
                                                                            expected[k].view(torch.uint8)), (trial, k)
            outcomes["read"] += 1
        path.unlink()
    assert outcomes["read"] and outcomes["refused"], outcomes  # both branches were exercised


def test_the_command_line_prints_one_line_and_exits_1(tmp_path, capsys):
    from pyperm.cli import main

    good = tmp_path / "good.safetensors"
    safetensors_torch.save_file({"layers.0.weight": torch.zeros(2, 2), "layers.0.bias": torch.zeros(2)}, str(good))
    header, data, _ = SAFETENSORS_CASES["overlapping"]
    bad = _raw(tmp_path / "bad.safetensors", header, data)
    argv = ["align", str(good), str(bad), "--model", "mlp:2,2", "--out", str(tmp_path / "out"), "--no-progress"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad.safetensors: not a readable safetensors file" in err, err
