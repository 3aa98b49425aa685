"""Git Re-Basin sec. 5.4 in ``pyperm reproduce rebasin``: the split-data experiment (Figs. 5, 9, 10).

The experiment runs on digits with tiny models (seconds); the CIFAR-100 settings (the paper's
ResNet20) run end to end on tiny pickle files the test writes. The numbers of the findings are
not asserted, only what the experiment computes and how the findings judge it.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from pyperm.reproduce._data import load_data
from pyperm.reproduce.rebasin import _split as sp
from pyperm.reproduce.rebasin._experiments import EpochBar, train_endpoint
from pyperm.reproduce.rebasin._findings import _split as split_findings
from pyperm.reproduce.rebasin._settings import SETTINGS, mlp_name
from pyperm.testing import one_thread
from test_datasets import write_cifar100


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


CFG = dict(SETTINGS["smoke"], width=16, epochs=4, split_epochs=4, marks=[2, 4], ste_epochs=1, split_points=5)


def _ends(data, cfg, epochs_trained):
    """Figure 2's endpoints as the report hands them over: the first one trained for ``epochs_trained``."""
    name = mlp_name(data, cfg["width"], cfg["depth"])
    model, state = train_endpoint(name, data, cfg["recipe"], cfg["batch"], epochs_trained, 1, "cpu")
    return SimpleNamespace(name=name, model=model, states=[state], seeds=[1], snapshots=[{}])


@pytest.fixture(scope="module")
def digits_run():
    with one_thread():
        data = load_data("digits", "cpu", CFG["eval_batch"], ste=CFG["ste_batch"])
        ends = _ends(data, CFG, CFG["epochs"])
        models = sp.train_split_models("smoke", CFG, data, ends, "cpu", 0, EpochBar(False, 0))
        return data, ends, models, sp.split_experiment(CFG, data, models, 0, False)


def test_a_and_b_hold_the_papers_shares_of_each_half(digits_run):
    data, _, models, _ = digits_run
    y = data["y_train"].numpy()
    n_first, n_second = int((y < 5).sum()), int((y >= 5).sum())
    assert models.halves["A"] == (round(0.2 * n_first), round(0.8 * n_second))
    assert models.halves["B"] == (n_first - models.halves["A"][0], n_second - models.halves["A"][1])
    assert models.seeds["A"] != models.seeds["B"]


def test_the_union_model_is_figure_2s_first_endpoint_when_trained_alike(digits_run):
    _, ends, models, _ = digits_run
    assert models.states["union"] is ends.states[0] and "first endpoint" in models.union_source


def test_the_paths_the_ensemble_and_the_merged_model_agree_with_the_inputs(digits_run):
    _, _, _, result = digits_run
    scores, paths, ens = result["scores"], result["paths"], result["ensemble"]
    assert len(result["ts"]) == CFG["split_points"] and set(paths) == {"naive", "weight", "activation", "ste"}
    for label, path in paths.items():  # every path runs from A to B (a permuted B is B's function)
        assert path.loss[0] == pytest.approx(scores["A"]["test_loss"], rel=1e-5), label
        assert path.loss[-1] == pytest.approx(scores["B"]["test_loss"], rel=1e-5), label
    assert ens["loss"][0] == pytest.approx(scores["A"]["test_loss"], rel=1e-9)
    assert ens["loss"][-1] == pytest.approx(scores["B"]["test_loss"], rel=1e-9)
    mid = len(result["ts"]) // 2
    assert result["ts"][mid] == 0.5 and ens["loss"][mid] == pytest.approx(scores["ensemble"]["test_loss"], rel=1e-9)
    # The merged model is the weight-matched path's lowest point strictly between A and B.
    inner = paths["weight"].loss[1:-1]
    assert 0 < result["best_t"] < 1 and result["ts"].index(result["best_t"]) == 1 + int(np.argmin(inner))
    assert scores["merged"]["test_loss"] == pytest.approx(float(inner.min()), rel=1e-5)
    for s in scores.values():
        assert 0 <= s["calibration"]["ece"] <= 1 and len(s["calibration"]["bins"]) == 15


def test_a_snapshot_under_a_constant_step_is_the_same_run_as_training_that_long():
    """The paper scale's union model is Figure 2's first endpoint after ``split_epochs`` (Adam, constant step)."""
    data = load_data("digits", "cpu", 512)
    name = "mlp:64,8,10"
    seen = {}

    def keep(done, model):
        seen[done] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    train_endpoint(name, data, "adam", 64, 3, 7, "cpu", keep)
    _, two = train_endpoint(name, data, "adam", 64, 2, 7, "cpu")
    assert all(torch.equal(two[k], seen[2][k]) for k in two)


def test_the_union_model_is_a_snapshot_or_trained_as_the_settings_say():
    data = load_data("digits", "cpu", 512, ste=128)
    paper_like = dict(CFG, recipe="adam", epochs=4, split_epochs=2, marks=[1, 2, 4])
    ends = _ends(data, paper_like, 4)
    ends.snapshots[0][2] = {k: v.clone() for k, v in ends.states[0].items()}
    models = sp.train_split_models("quick", paper_like, data, ends, "cpu", 0, EpochBar(False, 0))
    assert models.states["union"] is ends.snapshots[0][2] and "after 2 epochs" in models.union_source
    # A cosine schedule stopped early is not a shorter run: the union model is trained, from its own seed.
    cosine = dict(CFG, epochs=4, split_epochs=2, marks=[1, 2, 4])
    ends.snapshots[0][2] = ends.states[0]
    models = sp.train_split_models("quick", cosine, data, ends, "cpu", 0, EpochBar(False, 0))
    assert models.states["union"] is not ends.states[0] and models.union_source.startswith("trained")
    assert models.seeds["union"] not in (models.seeds["A"], models.seeds["B"], 1)
    runs = sp.split_runs("quick", cosine, data, ends.name)
    assert len(runs) == 3 and sum(r[4] for r in runs) == pytest.approx(2.0)
    assert len(sp.split_runs("quick", paper_like, data, ends.name)) == 2


def test_too_few_points_are_refused(digits_run):
    data, _, models, _ = digits_run
    with pytest.raises(ValueError, match="split_points must be at least 3"):
        sp.split_experiment(dict(CFG, split_points=2), data, models, 0, False)


class _Path:
    def __init__(self, loss):
        self.loss = np.asarray(loss, dtype=float)
        self.ts = np.linspace(0, 1, len(loss))


def _result(merged_loss=0.8, naive_mid=2.0, ece_merged=0.05, ens=0.5, union=0.3, acc_merged=0.7):
    score = lambda loss, acc, ece: {"test_loss": loss, "test_accuracy": acc, "calibration": {"ece": ece}}  # noqa: E731
    return {
        "paths": {"naive": _Path([1.0, 1.5, naive_mid, 1.5, 1.2]), "weight": _Path([1.0, 0.9, merged_loss, 0.9, 1.2])},
        "best_t": 0.5,
        "scores": {"A": score(1.0, 0.75, 0.2), "B": score(1.2, 0.72, 0.15), "merged": score(merged_loss, acc_merged,
                   ece_merged), "ensemble": score(ens, 0.85, 0.1), "union": score(union, 0.9, 0.05)},
    }  # fmt: skip


def _verdicts(**kw):
    return [f.agrees for f in split_findings(_result(**kw))]


def test_the_findings_follow_their_criteria():
    assert _verdicts() == [True, True, True, True, True]  # the paper's picture
    assert _verdicts(merged_loss=1.05, naive_mid=3.0) == [False, True, True, True, True]  # no better than model A
    assert _verdicts(naive_mid=1.5) == [True, False, True, True, True]  # 0.8 is not below half of 1.5
    assert _verdicts(ens=0.85)[2] is False and _verdicts(union=0.81)[2] is False
    assert _verdicts(acc_merged=0.8)[3] is False  # above the better input's accuracy
    assert _verdicts(ece_merged=0.16)[4] is False  # between B's 0.15 and A's 0.2


def test_split_on_tiny_cifar100_files_at_paper_scale(tmp_path):
    """At --scale paper on CIFAR, sec. 5.4 trains the paper's ResNet20 (here 1x, one epoch) on labels 0-49 / 50-99,
    and its paths recompute the BatchNorm statistics at every point. (The whole report at --scale paper on CIFAR
    runs in test_reproduce_data.py.)"""
    folder = tmp_path / "cifar100"
    folder.mkdir()
    write_cifar100(folder, n_train=40, n_test=12)
    cfg = dict(SETTINGS["paper"], width=8, epochs=1, marks=[1], ste_epochs=1, ste_batch=8, eval_batch=8, batch=8,
               split_points=3, split_conv={"width": 1, "recipe": "resnet_sgd", "batch": 4, "epochs": 1})  # fmt: skip
    data = load_data(f"cifar100:{folder}", "cpu", 8, ste=8)
    ends = SimpleNamespace(name=mlp_name(data, 8, 3), states=[None], seeds=[1], snapshots=[{}])
    models = sp.train_split_models("paper", cfg, data, ends, "cpu", 0, EpochBar(False, 0))
    assert models.setting == {"name": "resnet20:1,num_classes=100", "recipe": "resnet_sgd", "batch": 4, "epochs": 1,
                              "ste_epochs": 1, "ste_batch": 4}  # fmt: skip
    assert models.union_source.startswith("trained") and models.states["union"] is not None
    y = data["y_train"].numpy()
    first, second = int((y < 50).sum()), int((y >= 50).sum())
    assert models.halves["A"] == (round(0.2 * first), round(0.8 * second))
    result = sp.split_experiment(cfg, data, models, 0, False)
    assert all(path.bn_reset for path in result["paths"].values())
    assert result["ts"] == [0.0, 0.5, 1.0] and result["best_t"] == 0.5
    assert result["ste_steps"] == 40 // 4  # one epoch of the training batches
    assert set(result["scores"]) == {"A", "B", "union", "merged", "ensemble"}
    assert sp.split_json(models, result)["halves"]["A"] == models.halves["A"]


def _cli(args, capsys):
    from pyperm.cli import main

    code = main(["reproduce", *args, "--no-progress"])
    return code, capsys.readouterr().err


def test_split_fractions_on_the_command_line(tmp_path, capsys):
    # The shares reach the report, which refuses a split leaving B empty before any training.
    code, err = _cli(["rebasin", "--smoke", "--split-fractions", "1,1", "--out", str(tmp_path / "a")], capsys)
    assert code == 1 and "leave model B without training examples" in err
    code, err = _cli(["teacher-student", "--smoke", "--split-fractions", "0.5,0.5", "--out", str(tmp_path / "b")],
                     capsys)  # fmt: skip
    assert code == 1 and "--split-fractions: the teacher-student report has no split-data experiment" in err
    for bad in ("0.2", "0.2,1.5", "a,b"):
        with pytest.raises(SystemExit) as exc:
            _cli(["rebasin", "--smoke", "--split-fractions", bad, "--out", str(tmp_path / "c")], capsys)
        assert exc.value.code == 2
        assert "expected two shares in [0, 1]" in capsys.readouterr().err


def test_split_fractions_of_run_are_checked(tmp_path):
    from pyperm.reproduce import rebasin

    with pytest.raises(TypeError, match="split_fractions must be a pair"):
        rebasin.run(tmp_path, "smoke", split_fractions=0.2)
    with pytest.raises(ValueError, match=r"split_fractions\[0\] must lie in \[0, 1\]"):
        rebasin.run(tmp_path, "smoke", split_fractions=(-0.1, 0.5))
