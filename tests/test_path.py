"""PathResult, BarrierResult, CurveResult: one result for points along a path; plot_paths and summary_table."""

import dataclasses
import json
import math

import numpy as np
import pytest

from pyperm.nn.eval.path import BarrierResult, CurveResult, PathResult, plot_paths, summary_table

PNG = b"\x89PNG\r\n\x1a\n"


def _curve(robust=None):
    return CurveResult(ts=np.linspace(0, 1, 3), loss=[0.1, 0.5, 0.2], accuracy=[0.9, 0.7, 0.8], num_samples=10,
                       robust_accuracy=robust)


def _barrier(accuracy=(0.9, 0.6, 0.8)):
    return BarrierResult(ts=[0.0, 0.5, 1.0], loss=[0.2, 0.9, 0.4], accuracy=accuracy, num_samples=7,
                         loss_barrier=0.6, accuracy_barrier=math.nan if accuracy is None else 0.25)


def test_missing_values_are_nan_arrays():
    r = PathResult(ts=[0.0, 1.0], loss=[1.0, 2.0], accuracy=None, num_samples=3)
    assert r.accuracy.dtype == np.float64 and np.isnan(r.accuracy).all() and not r.has_accuracy
    assert math.isnan(r.average_accuracy) and math.isnan(r.min_accuracy)
    b = _barrier(accuracy=None)
    assert math.isnan(b.accuracy_barrier) and np.isnan(b.accuracy).all()
    c = _curve()
    assert c.robust_accuracy.shape == (3,) and np.isnan(c.robust_accuracy).all() and not c.has_robust_accuracy


def test_summaries_are_tatro_table_columns():
    r = _curve()
    assert r.min_accuracy == pytest.approx(0.7) and r.max_loss == pytest.approx(0.5)
    assert r.average_accuracy == pytest.approx(0.8) and r.average_loss == pytest.approx(0.8 / 3)
    assert list(_barrier().summary())[-2:] == ["loss barrier", "accuracy barrier"]


def test_results_are_frozen_and_checked():
    r = _curve()
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.loss = np.zeros(3)
    with pytest.raises(ValueError, match=r"loss must hold 3 values \(one per point of ts\)"):
        PathResult(ts=[0.0, 0.5, 1.0], loss=[1.0, 2.0], accuracy=None, num_samples=1)
    with pytest.raises(ValueError, match="robust_accuracy must hold 3 values"):
        _curve(robust=[0.5])
    with pytest.raises(TypeError, match="num_samples"):
        CurveResult(ts=[0.0, 1.0], loss=[1.0, 2.0], accuracy=[0.5, 0.5])


def test_to_dict_is_json_with_nan_for_missing_values():
    d = json.loads(json.dumps(_curve().to_dict()))
    assert d["min_accuracy"] == pytest.approx(0.7) and d["num_samples"] == 10
    assert len(d["robust_accuracy"]) == 3 and all(math.isnan(v) for v in d["robust_accuracy"])
    b = json.loads(json.dumps(_barrier(accuracy=None).to_dict()))
    assert all(math.isnan(v) for v in b["accuracy"]) and math.isnan(b["accuracy_barrier"])
    assert b["loss_barrier"] == 0.6 and b["loss_barrier_t"] == 0.5 and b["bn_reset"] is False


def test_to_markdown_shows_the_columns_a_path_has():
    text = _curve(robust=[0.5, 0.25, 0.4]).to_markdown()
    assert text.splitlines()[0] == "| t | loss | accuracy (%) | robust accuracy (%) |"
    assert "| 0.5 | 0.5 | 70 | 25 |" in text and "min accuracy: 70.00%" in text
    plain = PathResult(ts=[0.0, 1.0], loss=[1.0, 2.0], accuracy=None, num_samples=3).to_markdown()
    assert plain.splitlines()[0] == "| t | loss |" and "accuracy" not in plain
    assert "accuracy barrier: 25.00 pp" in _barrier().to_markdown()


def test_summary_table_unions_the_columns():
    table = summary_table({"curve": _curve(), "line": _barrier()})
    header, _, curve_row, line_row = table.splitlines()
    assert header == ("| path | average accuracy (%) | min accuracy (%) | average loss | max loss | loss barrier "
                      "| accuracy barrier (pp) |")
    assert curve_row == "| curve | 80 | 70 | 0.2667 | 0.5 | n/a | n/a |"
    assert line_row.startswith("| line | 76.67 | 60 |") and line_row.endswith("| 0.6 | 25 |")
    assert "robust" in summary_table({"robust": _curve(robust=[0.5, 0.2, 0.4])}).splitlines()[0]
    with pytest.raises(TypeError, match=r"results\['x'\] must be a PathResult"):
        summary_table({"x": 1.0})


def test_plot_paths_takes_results_first(tmp_path):
    results = {"curve": _curve(robust=[0.5, 0.2, 0.4]), "line": _barrier(), "regression": _barrier(None)}
    out = plot_paths(results, tmp_path / "paths.png", title="three paths", dashed=["line"])
    assert out == tmp_path / "paths.png" and out.read_bytes()[:8] == PNG
    assert _barrier(None).plot(str(tmp_path / "one.png")).read_bytes()[:8] == PNG
    with pytest.raises(TypeError, match="results must be a mapping of labels to PathResult"):
        plot_paths([_curve()], tmp_path / "x.png")
    with pytest.raises(ValueError, match="at least one"):
        plot_paths({}, tmp_path / "x.png")
    with pytest.raises(TypeError, match="path must be a str or pathlib.Path"):
        plot_paths({"a": _curve()}, 3)
    with pytest.raises(TypeError, match="results must be a mapping of labels to PathResult, got PosixPath"):
        plot_paths(tmp_path / "x.png", {"a": _curve()})  # the old order (path first)
    with pytest.raises(ValueError, match=r"dashed names labels that are not in results: \['straight'\]"):
        plot_paths(results, tmp_path / "x.png", dashed=["straight"])
    with pytest.raises(TypeError, match="dashed must be an iterable of labels"):
        plot_paths(results, tmp_path / "x.png", dashed="line")
    with pytest.raises(TypeError, match="takes 2 positional arguments"):
        plot_paths(results, tmp_path / "x.png", "title")
