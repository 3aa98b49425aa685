"""``pyperm bench merge`` on tiny digits MLPs: the table's rows for every count of models, the cache of trained
models named by their epochs and reused, the written table."""

from __future__ import annotations

import pytest

from pyperm.cli import main


def test_bench_merge_tables_every_method_and_reuses_its_cache(tmp_path, capsys):
    argv = ["bench", "merge", "--scale", "smoke", "--models", "2,3", "--epochs", "1", "--cache", str(tmp_path / "c"),
            "--points", "3", "--write", str(tmp_path / "w"), "--threads", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for method in ("endpoints (mean)", "naive average", "MergeMany", "C2M3 (", "MergeMany + REPAIR", "C2M3 + REPAIR",
                   "pairwise WM"):
        assert out.count(method) >= 2, method  # one row per count of models
    assert "models: 1 epochs of training each (seeds 1 to 3); barriers on 3 points of each pair's line; times on 1 " \
           "torch thread(s)" in out
    cached = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert cached == [f"digits-smoke-mlp_64,32,32,10-epochs1-{k}.pt" for k in (1, 2, 3)]
    stamps = [p.stat().st_mtime_ns for p in sorted((tmp_path / "c").iterdir())]
    written = (tmp_path / "w" / "bench-merge-digits-smoke-epochs1.md").read_text()
    assert "C2M3 + REPAIR" in written and "models: 1 epochs of training each" in written
    assert main(argv[:-4] + ["--threads", "1"]) == 0  # the same models again (no --write): read back, not retrained
    assert [p.stat().st_mtime_ns for p in sorted((tmp_path / "c").iterdir())] == stamps


def test_bench_merge_refuses_a_bad_epoch_count(capsys):
    for option in ("--epochs", "--points"):
        with pytest.raises(SystemExit):
            main(["bench", "merge", option, "0"])
        assert option in capsys.readouterr().err
