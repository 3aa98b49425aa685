"""The Permutations type: validation, identity, inverse, composition, application, dicts."""

import json

import pytest
import torch

from pyperm.nn import PermutationSpec, Permutations, apply_permutation

SPEC = PermutationSpec(
    axes={"w1": ("h", None), "b1": ("h",), "w2": ("k", "h"), "w3": (None, "k")},
    sizes={"h": 5, "k": 4},
)


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(5, 3, generator=g),
        "b1": torch.randn(5, generator=g),
        "w2": torch.randn(4, 5, generator=g),
        "w3": torch.randn(2, 4, generator=g),
    }


def _random(seed):
    g = torch.Generator().manual_seed(seed)
    return Permutations(SPEC, {name: torch.randperm(n, generator=g) for name, n in SPEC.sizes.items()})


def test_is_a_read_only_mapping_of_int64_tensors():
    p = Permutations(SPEC, {"h": [4, 3, 2, 1, 0], "k": (0, 1, 3, 2)})
    assert list(p) == ["h", "k"] and len(p) == 2
    assert p["h"].dtype == torch.int64 and p["h"].tolist() == [4, 3, 2, 1, 0]
    with pytest.raises(TypeError):
        p["h"] = torch.arange(5)  # type: ignore[index]


def test_identity_changes_nothing():
    p = Permutations.identity(SPEC)
    assert p.is_identity()
    sd = _state()
    assert all(torch.equal(v, sd[k]) for k, v in p.apply(sd).items())


def test_inverse_undoes_and_compose_matches_applying_twice():
    p, q = _random(1), _random(2)
    sd = _state()
    back = p.inverse().apply(p.apply(sd))
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    twice = p.apply(q.apply(sd))
    once = p.compose(q).apply(sd)
    assert all(torch.equal(once[k], twice[k]) for k in sd)
    assert p.compose(p.inverse()) == Permutations.identity(SPEC)
    assert not p.compose(q).is_identity() or p.compose(q) == Permutations.identity(SPEC)


def test_apply_is_apply_permutation():
    p = _random(3)
    sd = _state(1)
    expected = apply_permutation(SPEC, dict(p), sd)
    assert all(torch.equal(p.apply(sd)[k], expected[k]) for k in sd)


def test_dict_round_trip_through_json():
    p = _random(4)
    again = Permutations.from_dict(SPEC, json.loads(json.dumps(p.to_dict())))
    assert again == p and again == dict(p)


def test_equality_with_other_mappings():
    p = _random(5)
    assert p == {g: t.tolist() for g, t in p.items()}
    assert p == {g: t.int() for g, t in p.items()} and {g: t.numpy() for g, t in p.items()} == p
    assert p != {"h": list(range(5))}
    assert p != {"h": p["h"], "k": p["k"][:2]}  # a shorter permutation is another one
    assert p != 3


@pytest.mark.parametrize(
    ("perms", "error", "match"),
    [
        ([1, 2], TypeError, "perms must be a mapping"),
        ({"h": list(range(5))}, ValueError, "missing"),
        ({"h": list(range(5)), "k": [0, 1, 2, 2]}, ValueError, "not a permutation"),
        ({"h": list(range(5)), "k": [0.0, 1.0, 2.0, 3.0]}, TypeError, "integers"),
        ({"h": list(range(4)), "k": list(range(4))}, ValueError, r"shape \(5,\)"),
        ({"h": list(range(5)), "k": list(range(4)), "x": [0]}, ValueError, "unexpected"),
    ],
)
def test_bad_permutations_raise_naming_the_group(perms, error, match):
    with pytest.raises(error, match=match):
        Permutations(SPEC, perms)


def test_bad_spec_and_compose_argument():
    with pytest.raises(TypeError, match="spec must be a pyperm.nn.PermutationSpec"):
        Permutations({"h": 5}, {"h": list(range(5))})
    with pytest.raises(ValueError, match="other"):
        _random(1).compose({"h": list(range(5))})
