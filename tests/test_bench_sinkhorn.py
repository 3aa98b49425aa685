"""``pyperm bench sinkhorn`` on tiny digits MLPs: every method's row, the cache of the trained pair named by its
epochs (bench merge's names) and reused, the written table."""

from __future__ import annotations

import re

import pytest

from pyperm.cli import main


def test_bench_sinkhorn_tables_every_method_and_reuses_its_cache(tmp_path, capsys, monkeypatch):
    argv = ["bench", "sinkhorn", "--scale", "smoke", "--epochs", "1", "--cache", str(tmp_path / "c"), "--threads", "1",
            "--clock", "cpu"]
    assert main([*argv, "--write", str(tmp_path / "w")]) == 0
    out = capsys.readouterr().out
    for method in ("naive", "weight matching", "STE", "Sinkhorn, distance", "Sinkhorn, midpoint",
                   "Sinkhorn, midpoint from WM"):
        assert f" {method} " in out, method
    assert "goal: Sinkhorn (midpoint) mean test loss barrier" in out
    cached = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert cached == [f"digits-smoke-mlp_64,32,32,10-epochs1-{k}.pt" for k in (1, 2)]
    written = (tmp_path / "w" / "bench-sinkhorn-digits-smoke-epochs1.md").read_text()
    assert "| 0 | Sinkhorn, midpoint |" in written

    import pyperm.reproduce.rebasin._experiments as experiments

    def refuse(*args, **kwargs):
        raise AssertionError("the cached pair was trained again")

    monkeypatch.setattr(experiments, "train_endpoint", refuse)
    assert main(argv) == 0  # the same pair again: read back, not retrained
    assert _barriers(capsys.readouterr().out) == _barriers(out)  # the same pair: the same answers


def _barriers(out: str) -> dict[str, list[str]]:
    """Each row's method and its loss barrier, accuracy barrier and distance (not its seconds)."""
    rows = [re.split(r"\s{2,}", line.strip()) for line in out.splitlines() if line[:1].isdigit()]
    return {row[1]: row[2:5] for row in rows if len(row) == 7}


def test_bench_sinkhorn_refuses_a_bad_epoch_count(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "sinkhorn", "--epochs", "0"])
    assert "--epochs" in capsys.readouterr().err
