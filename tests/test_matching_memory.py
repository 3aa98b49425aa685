"""Weight matching at scale: the stored tensors read in place, in blocks, in the models' own precision.

The matcher never converts or arranges whole tensors: it takes blocks of them into reused work
buffers, keeps similarity matrices within a byte budget (rebuilding evicted ones), and runs a bfloat16
model's products in bfloat16. None of that may change an answer: tiny blocks and a zero budget give
the default's permutations, a bfloat16 planted pair is recovered exactly as in float32, and bfloat16
products give the float32 products' objective on independent pairs. The memory a call adds is
measured in a child process (peak RSS, Linux).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

from pyperm.nn import Permutations, apply_permutation, matching_objective, weight_matching
from pyperm.nn.align import _matcher, _similarity, _starts
from pyperm.nn.align._matcher import WeightMatcher
from pyperm.nn.models import MLP, ResNet20
from pyperm.nn.spec import Blocks, PermutationSpec
from pyperm.testing import random_permutations


def _state(model_fn, seed, dtype=torch.float32):
    torch.manual_seed(seed)
    model = model_fn()
    return model.permutation_spec(), {k: v.to(dtype) if v.is_floating_point() else v
                                      for k, v in model.state_dict().items()}  # fmt: skip


MODELS = {
    "mlp": lambda: MLP([20, 64, 48, 64, 5]),
    "resnet20": lambda: ResNet20(width_multiplier=2, shortcut="B"),
}


def _planted(spec, sa, noise=1e-3, seed=3):
    """B: a random permutation of A plus small noise; and the permutations that undo it."""
    perms = random_permutations(spec, seed)
    sb = apply_permutation(spec, perms, sa)
    gen = torch.Generator().manual_seed(seed)
    for k, v in sb.items():
        if v.is_floating_point() and v.numel() > 1:
            sb[k] = (v.float() + noise * float(v.float().std()) * torch.randn(v.shape, generator=gen)).to(v.dtype)
    return sb


def _aligned_error(spec, sa, sb, perms):
    """Largest relative distance between A and B permuted by ``perms``, over the float tensors."""
    aligned = Permutations(spec, dict(perms)).apply(sb)
    return max(float((aligned[k].float() - sa[k].float()).norm() / (sa[k].float().norm() + 1e-12))
               for k in sa if sa[k].is_floating_point())  # fmt: skip


@pytest.mark.parametrize("name", list(MODELS))
def test_tiny_blocks_and_no_kept_similarities_give_the_same_answer(name, monkeypatch):
    """Blocks of 4 KiB (many products per term, gathers across block edges) and a zero budget (every
    similarity rebuilt at each visit, solved cold) must find what the defaults find."""
    spec, sa = _state(MODELS[name], 1)
    _, sb = _state(MODELS[name], 2)
    default = weight_matching(spec, sa, sb, init="identity", seed=4)
    monkeypatch.setattr(_similarity, "BLOCK_BYTES", 4096)
    monkeypatch.setattr(_matcher, "COST_BUDGET_FRACTION", 0.0)
    monkeypatch.setattr(_matcher, "COST_BUDGET_MIN", 0)
    small = weight_matching(spec, sa, sb, init="identity", seed=4)
    assert small.iterations == default.iterations
    for g in spec.sizes:
        assert torch.equal(small.perms[g], default.perms[g]), g
    assert small.objective[-1] == pytest.approx(default.objective[-1], rel=1e-6)


def test_the_kept_similarities_stay_within_their_budget(monkeypatch):
    spec, sa = _state(MODELS["mlp"], 1)
    _, sb = _state(MODELS["mlp"], 2)
    monkeypatch.setattr(_matcher, "COST_BUDGET_FRACTION", 0.0)
    one = 64 * 64 * 4  # the largest group's similarity, float32
    monkeypatch.setattr(_matcher, "COST_BUDGET_MIN", one)
    matcher = WeightMatcher(spec, sb)
    seen = []
    matcher.match(sa, callback=lambda *_: seen.append(sum(g.cost is not None for g in matcher._groups.values())))
    assert seen and max(seen) == 1  # only the group being visited holds its similarity
    # Every work buffer holds one block at most.
    assert all(b.numel() * b.element_size() <= _similarity.BLOCK_BYTES for b in matcher._work._buffers.values())


def test_arranged_copies_leave_room_for_the_work_buffers(monkeypatch):
    """The similarities, the arranged copies of convolutions (held from a term's second whole product) and
    the work buffers together stay within the budget. A budget that fits every similarity and exactly every
    copy once left the work buffers on top of it (Stable Diffusion's UNet: similarities 0.29x the model,
    copies 0.11x, buffers 0.08x against a budget of 0.4x). Here: a budget of the similarities and every copy
    the default budget grants."""
    spec, sa = _state(MODELS["resnet20"], 1)
    _, sb = _state(MODELS["resnet20"], 2)
    monkeypatch.setattr(_matcher, "COST_BUDGET_FRACTION", 0.0)
    monkeypatch.setattr(_matcher, "COST_BUDGET_MIN", 1 << 40)
    probe = WeightMatcher(spec, sb)  # a budget that grants every copy asked for
    probe.match(sa, seed=4)
    similarities = sum(g.cost.numel() * g.cost.element_size() for g in probe._cache.held)
    copies = (1 << 40) - probe._cache.budget
    assert copies > 0  # the model has terms that hold copies
    budget = similarities + copies
    monkeypatch.setattr(_matcher, "COST_BUDGET_FRACTION", 0.0)
    monkeypatch.setattr(_matcher, "COST_BUDGET_MIN", budget)
    matcher = WeightMatcher(spec, sb)
    reference = weight_matching(spec, sa, sb, init="identity", seed=4)
    result = matcher.match(sa, seed=4)
    held = sum(g.cost.numel() * g.cost.element_size() for g in matcher._cache.held)
    taken = budget - matcher._cache.budget  # the arranged copies granted
    # No copy granted beyond what the similarities and the buffers leave (here the buffers take it all).
    assert taken == 0 or held + taken + matcher._work.nbytes() <= budget
    # Copies or not, the answer is the same.
    assert result.objective[-1] == pytest.approx(reference.objective[-1], rel=1e-6)
    for g in spec.sizes:
        assert torch.equal(result.perms[g], reference.perms[g]), g


@pytest.mark.parametrize("name", list(MODELS))
def test_bfloat16_planted_pair_recovers_the_float32_permutation(name):
    spec, sa32 = _state(MODELS[name], 1)
    sb32 = _planted(spec, sa32)
    sa16 = {k: v.bfloat16() if v.is_floating_point() else v for k, v in sa32.items()}
    sb16 = {k: v.bfloat16() if v.is_floating_point() else v for k, v in sb32.items()}
    exact = weight_matching(spec, sa32, sb32, seed=0)
    half = weight_matching(spec, sa16, sb16, seed=0)
    assert _aligned_error(spec, sa32, sb32, exact.perms) < 1e-2  # the planted permutation, found
    for g in spec.sizes:
        assert torch.equal(half.perms[g], exact.perms[g]), g


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bfloat16_products_agree_with_float32_products_on_independent_pairs(seed):
    spec, sa = _state(MODELS["mlp"], 10 + seed, torch.bfloat16)
    _, sb = _state(MODELS["mlp"], 20 + seed, torch.bfloat16)
    native = weight_matching(spec, sa, sb, init="identity", seed=seed)
    wide = weight_matching(spec, sa, sb, init="identity", seed=seed, product_dtype=torch.float32)
    # The objectives of the two answers, computed afresh (float64 accumulation) from the bfloat16 weights.
    obj_native = matching_objective(spec, sa, sb, native.perms)
    obj_wide = matching_objective(spec, sa, sb, wide.perms)
    assert obj_native == pytest.approx(obj_wide, rel=1e-3)
    assert native.objective[-1] == pytest.approx(obj_native, rel=1e-3)  # the history read off the similarities


def test_bfloat16_state_dicts_are_not_converted_whole():
    """The matcher's terms hold the stored tensors themselves (views), in their own dtype."""
    spec, sa = _state(MODELS["mlp"], 1, torch.bfloat16)
    _, sb = _state(MODELS["mlp"], 2, torch.bfloat16)
    matcher = WeightMatcher(spec, sb)
    matcher.match(sa, max_iter=1)
    assert matcher.product_dtype == torch.bfloat16
    pointers = {t.untyped_storage().data_ptr() for t in [*sa.values(), *sb.values()]}
    for group in matcher._groups.values():
        for term in group.all_terms:
            assert term.a.dtype == term.b.dtype == torch.bfloat16
            assert term.a.untyped_storage().data_ptr() in pointers
            assert term.b.untyped_storage().data_ptr() in pointers


def test_product_dtype_is_checked():
    spec, sa = _state(MODELS["mlp"], 1)
    with pytest.raises(TypeError, match="product_dtype"):
        weight_matching(spec, sa, sa, product_dtype=torch.int32)
    with pytest.raises(TypeError, match="product_dtype"):
        weight_matching(spec, sa, sa, product_dtype="bfloat16")


_MEASURE = textwrap.dedent("""
    import gc, json, sys, torch
    from pyperm.nn import weight_matching
    from pyperm.nn.models import MLP
    dtype = getattr(torch, sys.argv[1])
    torch.manual_seed(0)
    model = MLP([784, 2048, 2048, 2048, 10])
    spec = model.permutation_spec()
    sa = {k: v.to(dtype) for k, v in model.state_dict().items()}
    sb = {k: v.to(dtype) for k, v in MLP([784, 2048, 2048, 2048, 10]).state_dict().items()}
    del model
    # The libraries warmed up at these sizes (oneDNN's kernels and caches): their buffers are not the call's.
    weight_matching(spec, sb, sa, max_iter=3)
    gc.collect()
    from pyperm._memory import release_free_memory, reset_peak_resident, resident_bytes
    release_free_memory()
    before = resident_bytes("VmRSS")
    assert reset_peak_resident()
    weight_matching(spec, sa, sb, max_iter=3)
    size = sum(t.numel() * t.element_size() for t in sa.values())
    largest = max(t.numel() * t.element_size() for t in sa.values())
    print(json.dumps({"extra": resident_bytes("VmHWM") - before, "model": size, "largest": largest}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS is reset through /proc (Linux)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_extra_memory_is_the_kept_similarities_and_a_few_blocks(dtype, tmp_path):
    """An MLP 784-[2048]x3-10 (40 MB in float32): at its peak the call adds its kept similarities (3 x 16 MiB,
    within the 64 MiB minimum budget), work buffers and products of a few blocks (each at most the largest
    tensor in float32, 16 MiB) and 16 MiB of slack, nothing in proportion to the whole model: about 3.4 float32
    models here, measured 127 MiB in float32 and 118 MiB in bfloat16. (Arranging transposed copies of both
    models, as the matcher once did, added 235 MB in float32, 383 MB in bfloat16; a float32 copy of a
    bfloat16 model would add 40 MB.)"""
    # Run outside the source tree: ``python -c`` puts the working directory first on the path, and the
    # installed package (CI tests a wheel) must be the one imported.
    proc = subprocess.run([sys.executable, "-c", _MEASURE, dtype], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    largest = 2048 * 2048 * 4
    similarities = 3 * largest
    assert r["extra"] <= similarities + 5 * largest + (16 << 20), r


_RETAINED = textwrap.dedent("""
    import gc, json, torch
    gc.disable()  # as between two runs of the cyclic collector: only reference counts free memory
    from pyperm._memory import release_free_memory, resident_bytes
    from pyperm.nn import weight_matching
    from pyperm.nn.models import MLP
    torch.manual_seed(0)
    spec = MLP([784, 2048, 2048, 2048, 10]).permutation_spec()
    sa, sb = (dict(MLP([784, 2048, 2048, 2048, 10]).state_dict()) for _ in range(2))
    weight_matching(spec, sb, sa, max_iter=3)  # the libraries warmed up at these sizes
    release_free_memory()
    before = resident_bytes("VmRSS")
    weight_matching(spec, sa, sb, max_iter=3)
    release_free_memory()
    print(json.dumps({"retained": resident_bytes("VmRSS") - before}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="resident memory is read from /proc (Linux)")
def test_memory_is_freed_when_weight_matching_returns(tmp_path):
    """The kept similarities (3 x 16 MiB here) and the views of A and B go when the call returns, without the
    cyclic garbage collector: the similarity cache and the groups once referenced each other, and 120 MB stayed
    resident after the call until a collection."""
    proc = subprocess.run([sys.executable, "-c", _RETAINED], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    retained = json.loads(proc.stdout.strip().splitlines()[-1])["retained"]
    assert retained < (16 << 20), f"{retained >> 20} MiB still resident after weight_matching returned"


def test_scale_bench_floor_times_one_product_per_tensor_axis_of_each_group(monkeypatch):
    """``pyperm bench match --scale``'s floor: one (n, K) x (K, n) product per (tensor, axis) a group acts on, in
    the model's dtype, and nothing else timed."""
    from pyperm.benchmarks import _match_scale

    spec, sa = _state(MODELS["mlp"], 1)
    sb = _planted(spec, sa)
    calls = []
    real = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda x, y: calls.append((tuple(x.shape), tuple(y.shape))) or real(x, y))
    assert _match_scale.floor_seconds(spec, sa, sb) > 0
    expected = []
    for axes in spec.group_axes.values():
        for key, axis in axes:
            n = sa[key].shape[axis]
            expected.append(((n, sa[key].numel() // n), (sa[key].numel() // n, n)))
    assert sorted(calls) == sorted(expected)


def test_scale_bench_counts_a_group_found_only_when_every_unit_is_back():
    """One swapped pair of units in a 1024-wide group is a group not found (the old check accepted ten times the
    planted noise: about 28 misplaced units of a 5632-wide group counted as found)."""
    from pyperm.benchmarks import _match_scale

    spec, sa = _state(lambda: MLP([8, 1024, 16, 4]), 1)
    planted = Permutations(spec, random_permutations(spec, 3))
    sb = _planted(spec, sa, noise=_match_scale.NOISE)
    found = weight_matching(spec, sa, sb).perms
    assert found == planted.inverse()
    assert _match_scale.recovered_groups(spec, sb, found, planted) == len(spec.sizes)
    assert _match_scale.recovered_groups(spec, sb, spec.identity(), planted) == 0
    wide = max(spec.sizes, key=spec.sizes.get)
    swapped = dict(found)
    swapped[wide] = found[wide].clone()
    swapped[wide][[0, 1]] = swapped[wide][[1, 0]]
    assert _match_scale.recovered_groups(spec, sb, Permutations(spec, swapped), planted) == len(spec.sizes) - 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status is Linux's")
def test_resident_memory_readings():
    from pyperm._memory import release_free_memory, reset_peak_resident, resident_bytes

    release_free_memory()
    assert reset_peak_resident()
    now, peak = resident_bytes(), resident_bytes("VmHWM")
    assert 0 < now <= peak
    with pytest.raises(ValueError, match="field"):
        resident_bytes("NoSuchLine")



def _attention_layers(layers=3, heads=4, head_dim=6, width=10):
    """A spec of attention layers (heads moving with their q/k and v dims: Blocks inner groups) and a state."""
    axes, sizes, state = {}, {}, {}
    gen = torch.Generator().manual_seed(0)
    for i in range(layers):
        qk, v = Blocks(f"heads{i}", f"qk{i}"), Blocks(f"heads{i}", f"v{i}")
        sizes |= {f"heads{i}": heads, f"qk{i}": heads * head_dim, f"v{i}": heads * head_dim}
        axes |= {f"q{i}": (qk, None), f"k{i}": (qk, None), f"v{i}": (v, None), f"out{i}": (None, v)}
        for key in (f"q{i}", f"k{i}", f"v{i}"):
            state[key] = torch.randn(heads * head_dim, width, generator=gen)
        state[f"out{i}"] = torch.randn(width, heads * head_dim, generator=gen)
    return PermutationSpec(axes, sizes), state


def test_signature_start_keeps_one_cost_and_returns_free_pages_as_it_goes(monkeypatch):
    """The signature start (the default start's second run, after a stalled identity start) solves each group
    as soon as its signature cost is made and returns free pages every TRIM_SECONDS: keeping every Blocks
    inner group's float64 cost to the end, and every group's sorted copies of its tensors in the heap, took
    a reduced Stable Diffusion UNet from 0.67x to 1.05x the model (the matcher's similarities still held)."""
    spec, sa = _attention_layers()
    planted = Permutations(spec, random_permutations(spec, 5))
    sb = apply_permutation(spec, planted, sa)
    alive, most, trims = [], [0], []
    real = _starts.signature_cost

    def tracked(*args):
        cost = real(*args)
        most[0] = max(most[0], sum(ref() is not None for ref in alive))  # earlier costs still held
        if cost is not None:
            alive.append(weakref.ref(cost))
        return cost

    monkeypatch.setattr(_starts, "signature_cost", tracked)
    monkeypatch.setattr(_starts, "TRIM_SECONDS", 0.0)
    monkeypatch.setattr(_starts, "release_free_memory", lambda: trims.append(1))
    perms = _starts.signature_start(spec, sa, sb, None)
    assert len(alive) == len(spec.sizes) and most[0] == 0
    assert len(trims) == len(spec.sizes)
    assert Permutations(spec, perms) == planted.inverse()  # the planted permutation, as before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape", "axis"), [((40, 300), 0), ((12, 40, 3, 3), 1), ((40,), 0), ((7, 40), 1)])
@pytest.mark.parametrize("per_unit", [1, 4])  # positions a unit owns: 4 for an outer group of blocks of 4
def test_signatures_taken_in_chunks_equal_the_whole_tensor_sorted(monkeypatch, dtype, shape, axis, per_unit):
    """A tensor's units' signatures come in chunks of SIGNATURE_CHUNK_BYTES (no whole sorted copy); a chunk of
    one unit, of a few units, or the whole tensor give the same rows, for all positions or a subset in any order."""
    t = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    some = torch.randperm(40, generator=torch.Generator().manual_seed(1))[:24]
    n_all, n_some = 40 // per_unit, 24 // per_unit
    whole_all = _starts._signature(t.movedim(axis, 0).reshape(n_all, -1))
    whole_some = _starts._signature(t.index_select(axis, some).movedim(axis, 0).reshape(n_some, -1))
    for chunk in (1, 3 * per_unit * t[0].numel() * t.element_size() if axis == 0 else 100, 1 << 30):
        monkeypatch.setattr(_starts, "SIGNATURE_CHUNK_BYTES", chunk)
        assert torch.equal(_starts._unit_signatures(t, axis, None, n_all), whole_all)
        assert torch.equal(_starts._unit_signatures(t, axis, some, n_some), whole_some)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape", "axes"), [((64, 48), (0,)), ((64, 48), (1,)), ((64, 48), (0, 1)),
                                             ((16, 24, 3, 3), (0, 1)), ((5, 7), (0, 1)), ((33,), (0,))])  # fmt: skip
def test_the_objective_permutes_b_in_chunks_of_rows(monkeypatch, dtype, shape, axes):
    """The objective makes permuted B a chunk of rows at a time (no whole copy); any chunk size gives the whole
    tensors' sum, up to the float64 additions of the chunks."""
    from pyperm.nn.align import _objective

    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    indexes = {ax: torch.randperm(shape[ax], generator=gen) for ax in axes}
    permuted = b
    for ax, index in indexes.items():
        permuted = permuted.index_select(ax, index)
    want = float((a.double() * permuted.double()).sum())
    for chunk in (1, 1000, 1 << 30):
        monkeypatch.setattr(_objective, "CHUNK_BYTES", chunk)
        assert _objective._permuted_dot(a, b, indexes) == pytest.approx(want, rel=1e-6, abs=1e-9)


def test_a_second_start_begins_with_the_first_runs_similarities_given_back(monkeypatch):
    """After a stalled identity start, the matcher gives its similarities back before the signature start (whose
    costs would otherwise sit on top of them), and the second run rebuilds them: the same answer as a fresh
    matcher's from that start."""
    spec, sa = _state(MODELS["resnet20"], 0)
    sb = _planted(spec, sa)
    events = []
    real_release, real_signatures = WeightMatcher.release_similarities, _starts.signature_start

    def release(self):
        assert self._cache.held, "the first run keeps its similarities until then"
        real_release(self)
        assert not self._cache.held and all(g.cost is None for g in self._groups.values())
        events.append("release")

    def signatures(*args):
        events.append("signatures")
        return real_signatures(*args)

    monkeypatch.setattr(WeightMatcher, "release_similarities", release)
    monkeypatch.setattr(_starts, "signature_start", signatures)
    monkeypatch.setattr(_starts, "stalled", lambda *args: True)  # force the second start
    best = weight_matching(spec, sa, sb, seed=1)
    assert events == ["release", "signatures"]
    fresh = weight_matching(spec, sa, sb, seed=1, init="signatures")
    identity = weight_matching(spec, sa, sb, seed=1, init="identity")
    assert best.objective[-1] == max(fresh.objective[-1], identity.objective[-1])
