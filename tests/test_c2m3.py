"""C2M3 (cycle-consistent merging by Frank-Wolfe in a universe): valid permutations, cycle consistency,
planted copies recovered on every spec form, the search's record, the objective and the cycle error
helpers, bad input."""

import copy
import warnings

import numpy as np
import pytest
import torch
from _structured_models import STRUCTURED, outputs, structured_model

from pyperm.nn import MergeResult, Permutations, PermutationSpec, merge_many
from pyperm.nn.align import c2m3 as c2m3_module
from pyperm.nn.align._relaxation import one_hot
from pyperm.nn.align.c2m3 import (
    C2M3Result,
    c2m3_merge,
    cycle_consistency_error,
    merge_objective,
    pairwise_matchings,
)
from pyperm.nn.models import MLP
from pyperm.testing import random_permutations


def _planted(model_state, spec, count, noise=0.0, seed=1):
    """``count`` copies of a model under planted permutations (the first unpermuted), plus noise."""
    gen = torch.Generator().manual_seed(seed)
    planted = [Permutations.identity(spec)] + [Permutations(spec, random_permutations(spec, gen))
                                               for _ in range(count - 1)]  # fmt: skip
    copies = []
    for p in planted:
        state = p.apply(model_state)
        copies.append({k: v + noise * torch.randn(v.shape, generator=gen, dtype=v.dtype) if v.is_floating_point()
                       else v for k, v in state.items()})  # fmt: skip
    return planted, copies


def _mlp(widths=(12, 20, 20, 3), seed=0):
    torch.manual_seed(seed)
    model = MLP(list(widths))
    return model, model.permutation_spec()


def _three_models(name):
    """The spec and three state dicts, floating entries in float64, of an MLP 6-5-4-3 (``"mlp"``) or of a
    structured model."""
    if name == "mlp":
        _, spec = _mlp((6, 5, 4, 3))
        states = [MLP([6, 5, 4, 3]).state_dict() for _ in range(3)]
    else:
        made = [structured_model(name, seed) for seed in range(3)]
        spec, states = made[0][1], [m.state_dict() for m, _, _ in made]
    return spec, [{k: v.double() if v.is_floating_point() else v for k, v in s.items()} for s in states]


def _direct_value(spec, states, matrices, w, keys):
    """F with every model's matrices multiplied out (the reference the closed forms are checked against)."""
    with torch.no_grad():
        return c2m3_module._pair_sum(c2m3_module._relaxed(spec, states, matrices, keys), w, keys)[0]


# --------------------------------------------------------------------------- flat MLPs


@pytest.mark.parametrize("count", [2, 3, 5])
def test_planted_copies_give_back_the_model(count):
    model, spec = _mlp()
    planted, copies = _planted(model.state_dict(), spec, count)
    result = c2m3_merge(spec, copies)
    assert isinstance(result, C2M3Result) and isinstance(result, MergeResult)
    assert result.converged and result.perms[0].is_identity()
    for found, plant in zip(result.perms, planted):
        assert isinstance(found, Permutations) and found.spec is spec and found == plant.inverse()
    for key, t in model.state_dict().items():
        torch.testing.assert_close(result.merged[key], t, msg=key)
    best = merge_objective(spec, [model.state_dict()] * count, [Permutations.identity(spec)] * count)
    assert result.final_objective == pytest.approx(best, rel=1e-9)


def test_noisy_copies_reach_merge_manys_objective_and_keep_the_function():
    """Copies plus noise: the same objective as MergeMany at its optimum, and every model permuted as C2M3
    says computes what it computed."""
    model, spec = _mlp()
    _, copies = _planted(model.state_dict(), spec, 4, noise=0.01)
    result = c2m3_merge(spec, copies)
    mm = merge_many(spec, copies)
    assert result.final_objective == pytest.approx(merge_objective(spec, copies, mm.perms), rel=1e-9)
    x = torch.randn(16, 12, generator=torch.Generator().manual_seed(3))
    for perms, state in zip(result.perms, copies):
        m = copy.deepcopy(model)
        m.load_state_dict(state)
        torch.testing.assert_close(outputs(model, perms.apply(state), x), m(x).detach())


def test_the_search_only_ascends_and_its_record_is_consistent():
    model, spec = _mlp(seed=1)
    states = [MLP([12, 20, 20, 3]).state_dict() for _ in range(4)]
    result = c2m3_merge(spec, states, max_iter=30)
    assert len(result.objective) == result.iterations + 1
    assert len(result.step_sizes) == len(result.gaps) == result.iterations
    assert all(b >= a for a, b in zip(result.objective, result.objective[1:]))
    assert all(0.0 <= s <= 1.0 for s in result.step_sizes) and result.history == []
    assert result.final_objective == pytest.approx(merge_objective(spec, states, result.perms), rel=1e-12)
    assert result.seconds > 0.0
    # the merged model is the mean of the permuted models
    for key in states[0]:
        expected = sum(p.apply(s)[key] for p, s in zip(result.perms, states)) / 4
        torch.testing.assert_close(result.merged[key], expected, msg=key)
    stopped = c2m3_merge(spec, states, max_iter=1)
    assert stopped.iterations == 1


def test_the_relaxed_objective_at_permutations_is_the_merge_objective_and_its_gradient_is_exact():
    """At one-hot matrices the relaxation is the objective of the permuted models; the gradient of the
    relaxed objective (which the linear steps solve) matches finite differences at a soft point."""
    _, spec = _mlp((6, 5, 4, 3))
    states = [{k: v.double() for k, v in MLP([6, 5, 4, 3]).state_dict().items()} for _ in range(3)]
    keys = c2m3_module._matched_keys(spec, states[0])
    perms = [Permutations(spec, random_permutations(spec, torch.Generator().manual_seed(i))) for i in range(3)]
    w = [1.0, 1.0, 1.0]
    value, _ = c2m3_module._gradient_pass(spec, states, [one_hot(spec, p) for p in perms], w, keys)[:2]
    assert value == pytest.approx(merge_objective(spec, states, perms), rel=1e-12)
    gen = torch.Generator().manual_seed(5)
    soft = [{g: torch.rand(m.shape, generator=gen, dtype=torch.float64) for g, m in one_hot(spec, p).items()}
            for p in perms]  # fmt: skip
    value, grads = c2m3_module._gradient_pass(spec, states, soft, w, keys)[:2]
    for a in range(3):
        for g in spec.sizes:
            bumped = [{h: m.clone() for h, m in ms.items()} for ms in soft]
            bumped[a][g][1, 2] += 1e-6
            numeric = (_direct_value(spec, states, bumped, w, keys) - value) / 1e-6
            assert numeric == pytest.approx(float(grads[a][g][1, 2]), rel=1e-4, abs=1e-8)


@pytest.mark.parametrize("name", ["mlp", "attention-heads", "grouped-convolution"])
@pytest.mark.parametrize("anchor", [True, False])
def test_the_line_search_finds_the_best_step_of_the_segment(name, anchor):
    """The step and gain from the Gram matrix of the models' interpolated points are those of F evaluated
    directly along the segment (every model multiplied out at each t), on plain and Blocks specs."""
    spec, states = _three_models(name)
    keys = c2m3_module._matched_keys(spec, states[0])
    gen = torch.Generator().manual_seed(3)
    w = [0.5, 0.3, 0.2]
    identity = one_hot(spec, spec.identity())
    soft = [{g: torch.rand(m.shape, generator=gen, dtype=torch.float64) for g, m in identity.items()} for _ in states]
    vertex = [random_permutations(spec, gen) for _ in states]
    directions = [{g: t - ms[g] for g, t in one_hot(spec, p).items()} for p, ms in zip(vertex, soft)]
    if anchor:
        soft[0] = directions[0] = None
    degree = max(c2m3_module._key_degree(spec, k) for k in spec.axes)
    _, _, here, partials = c2m3_module._gradient_pass(spec, states, soft, w, keys)
    ends = c2m3_module._relaxed(spec, states, c2m3_module._moved(soft, directions, 1.0), keys)
    vertex = [None if ms is None else p for p, ms in zip(vertex, soft)]
    step, gain = c2m3_module._line_search(spec, states, soft, directions, w, keys, degree, here, ends, partials,
                                          vertex, c2m3_module.ONE_PROCESS)  # fmt: skip

    def f(t):
        return _direct_value(spec, states, c2m3_module._moved(soft, directions, t), w, keys)

    assert 0.0 <= step <= 1.0
    assert gain == pytest.approx(f(step) - f(0.0), rel=1e-9, abs=1e-9)
    assert all(f(step) >= f(t) - 1e-9 * abs(f(t)) for t in np.linspace(0, 1, 41))


@pytest.mark.parametrize("name", ["mlp", "cnn", "square"] + sorted(STRUCTURED))
def test_the_closed_form_gradients_are_automatic_differentiations(name, monkeypatch):
    """The plain keys' products and gradients formed in closed form (dense and convolution weights, biases, one
    group on both axes of a square matrix) equal automatic differentiation of the relaxed product."""
    if name == "cnn":
        from pyperm.nn.models import create_model

        torch.manual_seed(0)
        models = [create_model("tinyten:1,num_classes=3") for _ in range(3)]  # convolutions, BatchNorm
        spec, states = models[0].permutation_spec(), [m.state_dict() for m in models]
    elif name == "square":  # one group on both axes (a recurrent weight), beside a plain input weight
        spec = PermutationSpec({"h.w": ("h", "h"), "in.w": ("h", None)}, {"h": 5})
        gen = torch.Generator().manual_seed(1)
        states = [{"h.w": torch.randn(5, 5, generator=gen), "in.w": torch.randn(5, 3, generator=gen)} for _ in range(3)]
    else:
        spec, states = _three_models(name)
    states = [{k: v.double() if v.is_floating_point() else v for k, v in s.items()} for s in states]
    keys = c2m3_module._matched_keys(spec, states[0])
    gen = torch.Generator().manual_seed(2)
    soft = [None] + [{g: torch.rand(m.shape, generator=gen, dtype=torch.float64)
                      for g, m in one_hot(spec, spec.identity()).items()} for _ in states[1:]]  # fmt: skip
    w = [0.5, 0.3, 0.2]
    value, grads = c2m3_module._gradient_pass(spec, states, soft, w, keys)[:2]
    monkeypatch.setattr(c2m3_module, "_plain_axes", lambda spec, key: None)  # every key through autograd
    auto_value, auto_grads = c2m3_module._gradient_pass(spec, states, soft, w, keys)[:2]
    assert value == pytest.approx(auto_value, rel=1e-12)
    for ours, theirs in zip(grads[1:], auto_grads[1:]):
        for g in theirs:
            torch.testing.assert_close(ours[g], theirs[g], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ["mlp", "grouped-convolution", "attention-heads"])
def test_at_permutation_matrices_the_gathers_are_the_products(name):
    """At permutation matrices the plain keys are gathered, not multiplied: the same value, gradients, universe
    and partial products as the dense products (beside the keys of other forms)."""
    spec, states = _three_models(name)
    keys = c2m3_module._matched_keys(spec, states[0])
    gen = torch.Generator().manual_seed(4)
    perms = [None] + [random_permutations(spec, gen) for _ in states[1:]]
    matrices = [None if p is None else one_hot(spec, p) for p in perms]
    w = [1.0, 1.0, 1.0]
    dense = c2m3_module._gradient_pass(spec, states, matrices, w, keys)
    gathered = c2m3_module._gradient_pass(spec, states, matrices, w, keys, perms)
    assert gathered[0] == pytest.approx(dense[0], rel=1e-12)
    assert any(parts for parts in gathered[3])  # some plain keys
    for ours, theirs in zip(gathered[1:], dense[1:]):
        for a in (1, 2):
            for k in theirs[a]:
                if isinstance(theirs[a][k], tuple):
                    for x, y in zip(ours[a][k], theirs[a][k]):
                        torch.testing.assert_close(x, y)
                else:
                    torch.testing.assert_close(ours[a][k], theirs[a][k])


def test_the_warm_linear_steps_solve_as_the_batched_cold_ones():
    """The Frank-Wolfe vertices from the warm solvers kept across calls reach the optimum of each
    assignment, as the batched cold call does (compared by objective: ties may pick other columns)."""
    _, spec = _mlp((6, 30, 30, 3))
    gen = torch.Generator().manual_seed(0)
    warm = {}
    for _ in range(4):  # changing scores, one warm state
        scores = [{g: torch.randn(n, n, generator=gen, dtype=torch.float64) for g, n in spec.sizes.items()}
                  for _ in range(2)]  # fmt: skip
        hot, cold = c2m3_module._assign(spec, scores, warm), c2m3_module._assign(spec, scores)
        for a in range(2):
            for g, score in scores[a].items():
                assert sorted(hot[a][g].tolist()) == list(range(score.shape[0]))
                rows = torch.arange(score.shape[0])
                assert float(score[rows, hot[a][g]].sum()) == pytest.approx(float(score[rows, cold[a][g]].sum()))
    assert len(warm) == 2 * len(spec.sizes)


def test_weights_weight_the_merge_and_the_pairs():
    model, spec = _mlp()
    _, copies = _planted(model.state_dict(), spec, 3, noise=0.05)
    weights = [0.5, 0.3, 0.2]
    result = c2m3_merge(spec, copies, weights=weights)
    for key in copies[0]:
        expected = sum(w * p.apply(s)[key] for w, p, s in zip(weights, result.perms, copies))
        torch.testing.assert_close(result.merged[key], expected, msg=key)
    plain = merge_objective(spec, copies, result.perms)
    weighted = merge_objective(spec, copies, result.perms, weights=weights)
    assert weighted != pytest.approx(plain)


def test_the_unanchored_and_identity_starts_run_and_give_valid_permutations():
    """The authors' form (every model free) and the identity start: valid, cycle-consistent permutations."""
    model, spec = _mlp()
    states = [MLP([12, 20, 20, 3]).state_dict() for _ in range(3)]
    for options in ({"anchor": False}, {"init": "identity"}, {"anchor": False, "init": "identity"}):
        result = c2m3_merge(spec, states, max_iter=20, **options)
        assert result.perms[0].is_identity() and result.cycle_error == 0.0
        assert all(sorted(p[g].tolist()) == list(range(spec.sizes[g])) for p in result.perms for g in spec.sizes)
    _, copies = _planted(model.state_dict(), spec, 3)
    start = c2m3_merge(spec, copies, init=[Permutations.identity(spec)] * 3, max_iter=1)
    assert start.iterations == 1


# --------------------------------------------------------------------------- cycle consistency


def test_cycle_error_of_the_result_is_zero_and_of_pairwise_matching_is_measured():
    model, spec = _mlp(seed=2)
    states = [MLP([12, 20, 20, 3]).state_dict() for _ in range(4)]
    result = c2m3_merge(spec, states, max_iter=20)
    assert result.cycle_error == 0.0 == cycle_consistency_error(spec, result.perms)
    pairwise = pairwise_matchings(spec, states)
    assert set(pairwise) == {(a, b) for a in range(4) for b in range(4) if a != b}
    error = cycle_consistency_error(spec, pairwise)
    assert 0.0 < error <= 1.0  # unrelated random models: pairwise matchings do not compose around cycles
    # pairwise permutations derived from one universe compose exactly
    derived = {(a, b): result.perms[a].inverse().compose(result.perms[b]) for a, b in pairwise}
    assert cycle_consistency_error(spec, derived) == 0.0


def test_cycle_error_counts_the_units_a_cycle_moves():
    _, spec = _mlp((4, 6, 6, 2))  # 12 units in two groups
    i = Permutations.identity(spec)
    swap = Permutations(spec, {"hidden1": [1, 0, 2, 3, 4, 5], "hidden2": list(range(6))})
    pairs = {(a, b): i for a in range(3) for b in range(3) if a != b}
    pairs[0, 1] = swap  # every cycle through 0 -> 1 or 1 -> 0 ... only the orientation using (0, 1) moves 2 units
    assert cycle_consistency_error(spec, pairs) == pytest.approx(2 / 12 / 2)
    assert cycle_consistency_error(spec, {(0, 1): swap, (1, 0): i}) == pytest.approx(2 / 12)
    assert cycle_consistency_error(spec, {(0, 1): swap, (1, 0): swap}) == 0.0


# --------------------------------------------------------------------------- every spec form


@pytest.mark.parametrize("name", sorted(STRUCTURED))
def test_planted_copies_of_a_structured_model_are_recovered(name):
    """Heads, blocks, segments, tiles, interleaves, recurrent units: each planted permutation is found back,
    and the merged model is the model."""
    model, spec, x = structured_model(name, seed=0)
    planted, copies = _planted(model.state_dict(), spec, 3)
    result = c2m3_merge(spec, copies)
    assert result.perms[0].is_identity() and result.cycle_error == 0.0
    for found, plant in zip(result.perms, planted):
        assert found.spec is spec and found == plant.inverse()
    for key, t in model.state_dict().items():
        torch.testing.assert_close(result.merged[key], t, msg=key)
    torch.testing.assert_close(outputs(model, result.merged, x), model(x))


@pytest.mark.parametrize("name", sorted(STRUCTURED))
def test_unrelated_structured_models_keep_each_models_function(name):
    models = [structured_model(name, seed) for seed in range(3)]
    spec, x = models[0][1], models[0][2]
    states = [m.state_dict() for m, _, _ in models]
    result = c2m3_merge(spec, states, max_iter=10)
    assert all(b >= a for a, b in zip(result.objective, result.objective[1:]))
    for (model, _, _), perms, state in zip(models, result.perms, states):
        torch.testing.assert_close(outputs(model, perms.apply(state), x), model(x))
    assert result.final_objective == pytest.approx(merge_objective(spec, states, result.perms), rel=1e-12)


def test_assignments_solved_on_the_host_for_device_tensors_are_said():
    with pytest.warns(UserWarning, match="assignments of these cuda tensors are solved on the CPU"):
        c2m3_module._warn_host_assignments(torch.device("cuda", 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c2m3_module._warn_host_assignments(torch.device("cpu"))


# --------------------------------------------------------------------------- bad input


def test_bad_input_names_the_argument():
    model, spec = _mlp((4, 6, 2))
    sd = model.state_dict()
    with pytest.raises(TypeError, match="spec"):
        c2m3_merge({}, [sd, sd])
    with pytest.raises(TypeError, match="states must be a sequence"):
        c2m3_merge(spec, sd)
    with pytest.raises(ValueError, match="at least two"):
        c2m3_merge(spec, [sd])
    with pytest.raises(ValueError, match=r"states\[1\]"):
        c2m3_merge(spec, [sd, MLP([4, 7, 2]).state_dict()])
    with pytest.raises(ValueError, match="max_iter must be at least 1"):
        c2m3_merge(spec, [sd, sd], max_iter=0)
    with pytest.raises(ValueError, match="tol"):
        c2m3_merge(spec, [sd, sd], tol=-1.0)
    with pytest.raises(ValueError, match="init must be one of"):
        c2m3_merge(spec, [sd, sd], init="random")
    with pytest.raises(ValueError, match="init must hold one set of permutations per model"):
        c2m3_merge(spec, [sd, sd], init=[Permutations.identity(spec)])
    with pytest.raises(ValueError, match="weights"):
        c2m3_merge(spec, [sd, sd], weights=[0.5, 0.6])
    with pytest.raises(TypeError, match="seed"):
        c2m3_merge(spec, [sd, sd], seed="x")
    nan = {k: v.clone() for k, v in sd.items()}
    nan["layers.0.weight"][0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"states\[1\]\['layers.0.weight'\].*NaN"):
        c2m3_merge(spec, [sd, nan])
    with pytest.raises(ValueError, match="perms must hold one set of permutations per model"):
        merge_objective(spec, [sd, sd], [Permutations.identity(spec)])
    with pytest.raises(ValueError, match=r"misses the pair \(1, 0\)"):
        cycle_consistency_error(spec, {(0, 1): Permutations.identity(spec)})
    with pytest.raises(TypeError, match=r"\(int, int\) keys"):
        cycle_consistency_error(spec, {("a", "b"): Permutations.identity(spec)})
    assert c2m3_merge(spec, [sd, sd], max_iter=np.int64(2), seed=np.int64(0)).perms[1].is_identity()


@pytest.mark.parametrize("name", sorted(STRUCTURED))
def test_the_search_alone_finds_planted_copies_on_every_form(name):
    """No weight matching at the start: Frank-Wolfe from the identity or from the barycenter (the better
    rounded objective of the two) finds the planted permutations of every form back."""
    model, spec, _ = structured_model(name, seed=0)
    planted, copies = _planted(model.state_dict(), spec, 3)
    results = [c2m3_merge(spec, copies, init=init, max_iter=50) for init in ("identity", "barycenter")]
    best = max(results, key=lambda r: r.final_objective)
    assert not best.kept_start and best.iterations >= 2
    assert all(found == plant.inverse() for found, plant in zip(best.perms, planted))


@pytest.mark.parametrize("count", [2, 3, 5])
def test_the_search_alone_finds_planted_copies_of_an_mlp_from_the_barycenter(count):
    model, spec = _mlp((12, 32, 32, 3))
    planted, copies = _planted(model.state_dict(), spec, count, noise=0.01)
    result = c2m3_merge(spec, copies, init="barycenter")
    assert all(found == plant.inverse() for found, plant in zip(result.perms, planted))


# --------------------------------------------------------------------------- REPAIR of a merge


def _mlp_batches():
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(32, 12, generator=gen) for _ in range(2)]


def test_repair_many_of_two_states_is_repair():
    from pyperm.nn import repair
    from pyperm.nn.eval.repair import repair_many

    model, _ = _mlp()
    a, b = MLP([12, 20, 20, 3]).state_dict(), MLP([12, 20, 20, 3]).state_dict()
    data = _mlp_batches()
    for t in (0.5, 0.25):
        expected = repair(model, None, a, b, data, t=t)
        got = repair_many(model, None, [a, b], data, weights=[1 - t, t])
        for key, v in expected.items():
            torch.testing.assert_close(got[key], v, msg=key)


def test_repair_many_gives_every_unit_the_models_mean_statistics():
    from pyperm.nn.eval.repair import repair_many

    model, spec = _mlp()
    states = [MLP([12, 20, 20, 3]).state_dict() for _ in range(3)]
    merged = c2m3_merge(spec, states, max_iter=5)
    aligned = [p.apply(s) for p, s in zip(merged.perms, states)]
    data = _mlp_batches()
    repaired = repair_many(model, spec, aligned, data)
    x = torch.cat(data)

    def first_layer(state):
        return torch.nn.functional.linear(x, state["layers.0.weight"], state["layers.0.bias"])

    z = first_layer(repaired)
    torch.testing.assert_close(z.std(0), sum(first_layer(s).std(0) for s in aligned) / 3, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(z.mean(0), sum(first_layer(s).mean(0) for s in aligned) / 3, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="at least two"):
        repair_many(model, spec, aligned[:1], data)
    with pytest.raises(TypeError, match="states must be a sequence"):
        repair_many(model, spec, aligned[0], data)
    with pytest.raises(ValueError, match="weights"):
        repair_many(model, spec, aligned, data, weights=[0.5, 0.5, 0.5])
    with pytest.raises(ValueError, match=r"states\[2\]"):
        repair_many(model, spec, [*aligned[:2], MLP([12, 21, 20, 3]).state_dict()], data)


# --------------------------------------------------------------------------- the command line


def test_pyperm_merge_method_c2m3(tmp_path):
    """``pyperm merge A B C --method c2m3``: the merged checkpoint is c2m3_merge's merge, the reports say so."""
    import json

    from pyperm.checkpoints import load_checkpoint
    from pyperm.cli import main

    widths = [8, 12, 12, 3]
    states = [MLP(widths).state_dict() for _ in range(3)]
    paths = []
    for i, state in enumerate(states):
        paths.append(tmp_path / f"m{i}.pt")
        torch.save(state, paths[-1])
    out = tmp_path / "out"
    model = "mlp:" + ",".join(map(str, widths))
    assert main(["merge", *map(str, paths), "--model", model, "--method", "c2m3", "--out", str(out),
                 "--no-progress"]) == 0  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    assert report["method"] == "c2m3" and report["c2m3"]["cycle_error"] == 0.0
    expected = c2m3_merge(MLP(widths).permutation_spec(), states)
    assert report["c2m3"]["objective"] == pytest.approx(expected.final_objective)
    merged = load_checkpoint(out / "merged.pt").state
    for key, t in expected.merged.items():
        torch.testing.assert_close(merged[key], t, msg=key)
    assert "Frank-Wolfe iterations of C2M3" in (out / "report.md").read_text()
    with pytest.raises(SystemExit):
        main(["merge", *map(str, paths), "--model", model, "--method", "bogus", "--out", str(out)])


def test_merge_many_method_c2m3_runs_c2m3():
    model, spec = _mlp()
    states = [MLP([12, 20, 20, 3]).state_dict() for _ in range(3)]
    result = merge_many(spec, states, method="c2m3", max_iter=7, seed=3)
    expected = c2m3_merge(spec, states, max_iter=7, seed=3)
    assert isinstance(result, C2M3Result) and result.perms == expected.perms
    assert result.objective == expected.objective and result.iterations == expected.iterations
    with pytest.raises(ValueError, match="method must be one of 'mergemany', 'c2m3'"):
        merge_many(spec, states, method="bogus")
    with pytest.raises(TypeError, match="method"):
        merge_many(spec, states, method=1)
