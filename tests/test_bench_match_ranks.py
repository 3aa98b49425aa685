"""``pyperm bench match --scale --ranks N``: a tiny GPT-2 pair on 2 gloo ranks (spawned, a file store)."""

from __future__ import annotations

from _vision import import_transformers

import_transformers()

from pyperm.benchmarks import _match_ranks  # noqa: E402


def test_shares_are_contiguous_by_layer_and_keep_tied_tensors_together():
    import torch

    from pyperm.benchmarks._match_scale import _pair

    _, sa, _, _ = _pair("gpt2-tiny", torch.float32)
    shares = _match_ranks.shares(sa, 2)
    assert sorted(k for s in shares for k in s) == sorted(sa) and all(shares)
    rank_of = {k: r for r, s in enumerate(shares) for k in s}
    ranks = [rank_of[k] for k in sa if k != "lm_head.weight"]
    assert ranks == sorted(ranks)  # contiguous in the state dict's order
    assert rank_of["lm_head.weight"] == rank_of["transformer.wte.weight"]  # tied: one rank
    assert len({rank_of[k] for k in sa if k.startswith("transformer.h.1.")}) == 1  # a layer stays whole


def test_ranks_rows_are_sane_and_a_group_not_found_fails():
    table, failures = _match_ranks.rows(["gpt2-tiny"], ["float32"], 2, lambda _: None, deadline=120)
    assert failures == []
    assert len(table) == 2
    row = dict(zip(_match_ranks.HEADERS[:4], table[0][:4]))
    assert row["processes"] == 1 and table[1][2] == 2
    for r in table:
        assert r[-1] == "9/9"  # every planted group found
        assert float(r[4]) > 0 and float(r[6]) >= float(r[4]) and r[8] >= 1 and float(r[9]) > 0
    assert table[0][11] == "0" and float(table[1][11]) > 0  # only the ranks send bytes
    assert table[0][5] == table[0][7] == table[0][10] == "1.00x"
    _, failures = _match_ranks.rows(["gpt2-tiny"], ["float32"], 2, lambda _: None, deadline=120, max_iter=0)
    assert len(failures) == 2 and all("planted groups not found" in f for f in failures)


def test_the_command_line_rows_write_a_sharded_pair_once_and_find_every_group(tmp_path):
    """``--checkpoints DIR``: the pair written as two sharded Hugging Face folders (at least 8 shards), then
    ``pyperm align`` in one process and under torchrun over 2 ranks, each run's report read."""
    import json

    from pyperm.benchmarks import _align_ranks

    table, failures = _align_ranks.rows(["gpt2-tiny"], ["float32"], 2, tmp_path, lambda _: None, timeout=300)
    assert failures == []
    assert [r[2] for r in table] == [1, 2] and all(r[-1] == "9/9" for r in table)
    assert table[0][11] == "0" and float(table[1][11]) > 0
    folder = tmp_path / "gpt2-tiny-float32"
    index = json.loads((folder / "b" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= _align_ranks.MIN_SHARDS
    first = folder / "b" / sorted(set(index["weight_map"].values()))[0]
    written = first.stat().st_mtime_ns
    _align_ranks.write_pair("gpt2-tiny", "float32", folder)  # the same pair: kept, not written again
    assert first.stat().st_mtime_ns == written
