"""Reference implementations and test inputs shared by pyperm's tests and benchmarks.

Plain, obviously correct versions of what pyperm computes fast (scipy-based Birkhoff
greedies, the weight matching of Ainsworth et al., "Git Re-Basin: Merging Models modulo
Permutation Symmetries" (ICLR 2023), as the public PyTorch port writes it), the inputs both
sides use, the measures of a traced spec (the share of hidden units it permutes), and the
test helpers every test file shares (random permutations of a spec's groups, a permuted copy
of a model, :func:`assert_same_function`, :func:`one_thread`). Tests check pyperm against
them; benchmarks check every answer against them before timing. scipy and torch are
imported only by the functions that need them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from pyperm._optional_imports import import_torchvision

__all__ = [
    "assert_same_function",
    "dense_doubly_stochastic",
    "free_port",
    "import_torchvision",
    "iou_cost",
    "limited_objective",
    "limited_reference",
    "one_thread",
    "permutable_share",
    "permuted_copy",
    "planted",
    "random_permutations",
    "reconstruct",
    "reference_weight_matching",
    "scipy_bottleneck_greedy",
    "scipy_bottleneck_matching",
    "scipy_max_weight_greedy",
    "sd_pipeline",
    "tiny_pipeline",
]


# ----------------------------------------------------------------------------- inputs


def iou_cost(n_tracks: int, n_detections: int, rng: np.random.Generator, overlap: float = 0.7) -> np.ndarray:
    """A tracker's association cost, 1 - IoU of boxes: ``overlap`` of the detections are
    jittered copies of tracks (those pairs cost little), the others fall anywhere."""

    def boxes(k):
        corner = rng.random((k, 2)) * 100.0
        return np.concatenate([corner, corner + 5.0 + 20.0 * rng.random((k, 2))], axis=1)

    tracks = boxes(n_tracks)
    seen = min(n_tracks, int(round(overlap * n_detections)))
    dets = np.concatenate([tracks[rng.permutation(n_tracks)[:seen]] + rng.normal(0.0, 2.0, (seen, 4)),
                           boxes(n_detections - seen)])
    dets[:, 2:] = np.maximum(dets[:, 2:], dets[:, :2] + 1.0)
    low = np.maximum(tracks[:, None, :2], dets[None, :, :2])
    high = np.minimum(tracks[:, None, 2:], dets[None, :, 2:])
    inter = np.prod(np.clip(high - low, 0.0, None), axis=2)
    area = lambda b: np.prod(b[:, 2:] - b[:, :2], axis=1)  # noqa: E731
    return 1.0 - inter / (area(tracks)[:, None] + area(dets)[None, :] - inter)


def limited_objective(cost, rows, cols, cost_limit: float, maximize: bool = False) -> float:
    """lap's thresholded objective: the matched entries plus ``cost_limit / 2`` per unmatched
    row and column, or, maximising, the matched values minus ``cost_limit / 2`` per unmatched
    row and column (lap's objective mirrored): the quantity
    :func:`pyperm.linear_sum_assignment` with ``cost_limit`` minimises, or maximises."""
    cost = np.asarray(cost, dtype=np.float64)
    rows, cols = np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)
    unmatched = cost.shape[0] + cost.shape[1] - 2 * len(rows)
    penalty = unmatched * cost_limit / 2 if unmatched else 0.0
    total = float(cost[rows, cols].sum())
    return total - penalty if maximize else total + penalty


def limited_reference(cost, cost_limit: float, maximize: bool = False) -> float:
    """The optimum of :func:`limited_objective` for a finite ``cost_limit``, from scipy on
    lap's (n + m) x (n + m) extended matrix: ``cost`` top left, ``cost_limit / 2`` (its
    negation when maximising) in the blocks that leave a row or a column unmatched, zeros
    bottom right."""
    from scipy.optimize import linear_sum_assignment

    cost = np.asarray(cost, dtype=np.float64)
    n, m = cost.shape
    extended = np.full((n + m, n + m), -cost_limit / 2 if maximize else cost_limit / 2)
    extended[:n, :m] = cost
    extended[n:, m:] = 0.0
    rows, cols = linear_sum_assignment(extended, maximize=maximize)
    return float(extended[rows, cols].sum())


def dense_doubly_stochastic(n: int, seed: int, dtype=np.float64) -> np.ndarray:
    """A dense (n, n) doubly stochastic matrix: Sinkhorn scaling of log-normal entries."""
    from pyperm import sinkhorn

    rng = np.random.default_rng(seed)
    return sinkhorn(np.exp(2.0 * rng.standard_normal((n, n))), iters=10000, tol=1e-12).astype(dtype)


def planted(n: int, k: int, seed: int, dtype=np.float64):
    """A convex combination of ``k`` random permutations: ``(D, weights, perms)``."""
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.ones(k))
    perms = np.array([rng.permutation(n) for _ in range(k)])
    D = np.zeros((n, n))
    for w, p in zip(weights, perms):
        D[np.arange(n), p] += w
    return D.astype(dtype), weights, perms


def reconstruct(coeffs, perms, n: int | None = None) -> np.ndarray:
    """sum_t coeffs[t] * P_t as a dense (n, n) float64 matrix (n: the permutations' length
    by default; give it when there may be no terms)."""
    perms = np.asarray(perms)
    if n is None:
        n = perms.shape[1]
    out = np.zeros((n, n))
    rows = np.arange(n)
    for c, p in zip(np.asarray(coeffs, dtype=np.float64), perms):
        out[rows, p] += c
    return out


# ----------------------------------------------------------------------------- Birkhoff-von Neumann references
def scipy_bottleneck_matching(R: np.ndarray) -> tuple[float, np.ndarray] | None:
    """The perfect matching on ``R > 0`` whose smallest matched entry is largest, by binary
    search over the distinct positive values with scipy's Hopcroft-Karp: ``(that entry,
    column of each row)``, or None when ``R > 0`` has no perfect matching."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import maximum_bipartite_matching

    values = np.unique(R[R > 0])
    lo, hi, best = 0, len(values) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        match = maximum_bipartite_matching(csr_matrix(R >= values[mid]), perm_type="column")
        if (match >= 0).all():
            best, lo = (float(values[mid]), match), mid + 1
        else:
            hi = mid - 1
    return best


def scipy_bottleneck_greedy(D: np.ndarray, max_terms: int | None = None, tol: float = 1e-9):
    """Greedy Birkhoff with a bottleneck matching per term: binary search + Hopcroft-Karp."""
    R = np.array(D, dtype=np.float64)
    n = R.shape[0]
    rows = np.arange(n)
    coeffs, perms = [], []
    while (max_terms is None or len(coeffs) < max_terms) and R.sum() / n > tol:
        found = scipy_bottleneck_matching(R)
        if found is None:
            break
        best = found[1]
        alpha = R[rows, best].min()
        R[rows, best] -= alpha
        R[R <= 1e-14] = 0.0
        coeffs.append(alpha)
        perms.append(best.astype(np.int64))
    return np.array(coeffs), np.array(perms, dtype=np.int64).reshape(-1, n)


def scipy_max_weight_greedy(D: np.ndarray, max_terms: int):
    """Greedy Birkhoff with scipy's linear_sum_assignment solved from scratch every term."""
    from scipy.optimize import linear_sum_assignment

    R = np.array(D, dtype=np.float64)
    n = R.shape[0]
    rows = np.arange(n)
    coeffs, perms = [], []
    for _ in range(max_terms):
        cost = np.where(R > 0, -R, 1e6)  # finite and large: off the support
        _, cols = linear_sum_assignment(cost)
        if (R[rows, cols] <= 0).any():
            break
        alpha = R[rows, cols].min()
        R[rows, cols] -= alpha
        R[R <= 1e-14] = 0.0
        coeffs.append(alpha)
        perms.append(cols.astype(np.int64))
    return np.array(coeffs), np.array(perms, dtype=np.int64).reshape(-1, n)


# ----------------------------------------------------------------------------- weight matching reference
def reference_weight_matching(
    spec, state_a: Mapping, state_b: Mapping, max_iter: int = 100, seed: int = 0, lsa: Callable | None = None
) -> tuple[dict, int]:
    """Weight matching (Algorithm 1 of Ainsworth et al., "Git Re-Basin: Merging Models modulo
    Permutation Symmetries", ICLR 2023) written plainly, as the public PyTorch port does it.

    Every step permutes all of the group's tensors of B by the other groups' current
    permutations, rebuilds the similarity with float32 torch matmuls, and solves it with
    ``lsa`` (default ``scipy.optimize.linear_sum_assignment``). The visiting order is
    drawn like pyperm's (``torch.randperm`` from a generator seeded with ``seed``, anew
    each sweep). Returns the permutations and the number of sweeps.
    """
    import torch

    if lsa is None:
        from scipy.optimize import linear_sum_assignment as lsa
    keys = {k for k in spec.axes if state_a[k].is_floating_point()}
    perm = {g: torch.arange(n) for g, n in spec.sizes.items()}
    names = list(spec.sizes)
    gen = torch.Generator().manual_seed(seed)
    sweeps = 0
    for _ in range(max_iter):
        sweeps += 1
        progress = False
        for ix in torch.randperm(len(names), generator=gen).tolist():
            p = names[ix]
            n = spec.sizes[p]
            sim = torch.zeros((n, n))
            for key, axis in spec.group_axes[p]:
                if key not in keys:
                    continue
                w_a = state_a[key].float()
                w_b = state_b[key].float()
                for ax, g in enumerate(spec.axes[key]):
                    if ax != axis and g is not None:
                        w_b = torch.index_select(w_b, ax, perm[g])
                w_a = torch.moveaxis(w_a, axis, 0).reshape((n, -1))
                w_b = torch.moveaxis(w_b, axis, 0).reshape((n, -1))
                sim += w_a @ w_b.T
            _, ci = lsa(sim.numpy(), maximize=True)
            ci = torch.as_tensor(ci, dtype=torch.int64)
            rows = torch.arange(n)
            old_l = sim[rows, perm[p]].sum()
            new_l = sim[rows, ci].sum()
            progress = progress or bool(new_l > old_l + 1e-12)
            perm[p] = ci
        if not progress:
            break
    return perm, sweeps


# ----------------------------------------------------------------------------- traced models
def permutable_share(model, spec) -> float:
    """The share of hidden units that ``spec`` permutes: the outputs of every Linear,
    convolution, embedding, recurrent and attention layer, except layers marked with an
    ``is_head`` attribute (they produce the model's outputs)."""
    from torch import nn

    sd = model.state_dict()
    produced = []  # (state_dict key, axis holding the produced units)
    for name, m in model.named_modules():
        if getattr(m, "is_head", False) or name.endswith("out_proj"):
            continue  # out_proj is counted with its attention module
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            produced.append((f"{name}.weight", 0))
        elif isinstance(m, (nn.Embedding, nn.ConvTranspose2d)):
            produced.append((f"{name}.weight", 1))
        elif isinstance(m, (nn.LSTM, nn.GRU, nn.RNN)):
            produced.append((f"{name}.weight_hh_l0", 1))
        elif isinstance(m, nn.MultiheadAttention):
            produced += [(f"{name}.in_proj_weight", 0), (f"{name}.out_proj.weight", 0)]
    total = sum(sd[key].shape[axis] for key, axis in produced)
    return sum(sd[key].shape[axis] for key, axis in produced if spec.axes[key][axis] is not None) / total


def random_permutations(spec, generator=0) -> dict:
    """A random permutation of every group of ``spec``, drawn by ``generator`` (a
    torch.Generator or an int seed); a Blocks inner group's is random within each of its blocks."""
    import torch

    from pyperm._checks import torch_generator

    generator = torch_generator(generator, "generator")
    perms = {}
    for g, n in spec.sizes.items():
        bs = spec.block_size(g) if g in spec.blocks else n
        local = torch.stack([torch.randperm(bs, generator=generator) for _ in range(n // bs)])
        perms[g] = (local + torch.arange(0, n, bs).view(-1, 1)).reshape(-1)
    return perms


def permuted_copy(model, spec, perms):
    """A deep copy of ``model`` whose state dict is ``model``'s permuted by ``perms`` (a
    Permutations or a mapping group -> permutation): the same function when ``spec`` is right."""
    import copy

    from pyperm.nn import apply_permutation

    other = copy.deepcopy(model)
    other.load_state_dict(apply_permutation(spec, perms, model.state_dict()))
    return other


def assert_same_function(model, spec, *inputs, seed=0, train: bool = False, rtol: float = 1e-4,
                         atol: float = 1e-5) -> None:
    """Assert that a random permutation of every group of ``spec`` leaves ``model``'s outputs unchanged.

    The permutations are ``random_permutations(spec, seed)``. Always in eval mode; with
    ``train=True`` also in train mode, where BatchNorm updates its running statistics from
    the batch, and those must then agree too (up to the permutation). The model is left in
    eval mode.
    """
    import torch

    from pyperm.nn import apply_permutation

    if not spec.sizes:
        raise AssertionError("the spec has no group to permute: nothing would be tested")
    perms = random_permutations(spec, seed)
    other = permuted_copy(model, spec, perms)
    for mode in (False, True) if train else (False,):
        model.train(mode)
        other.train(mode)
        with torch.no_grad():
            want, got = model(*inputs), other(*inputs)
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    if train:
        permuted = apply_permutation(spec, perms, model.state_dict())
        for key, tensor in other.state_dict().items():
            torch.testing.assert_close(tensor, permuted[key], rtol=rtol, atol=atol)
    model.eval()


def tiny_pipeline(folder, seed: int = 0):
    """Write a tiny random Stable-Diffusion-1.x-shaped pipeline (``save_pretrained``) into ``folder``.

    Its components have the real classes and layout (a ``UNet2DConditionModel`` with cross-attention, an
    ``AutoencoderKL``, a ``CLIPTextModel`` and its ``CLIPTokenizer`` over a 54-token alphabet, a
    ``DDPMScheduler``, no safety checker) at a few thousand parameters each, initialised from ``seed``:
    what the tests and the documentation align and merge without downloading a checkpoint. Needs
    diffusers and transformers. Returns the pipeline.
    """
    pipeline = sd_pipeline(TINY_PIPELINE, seed)
    pipeline.save_pretrained(str(folder))
    return pipeline


#: The component configs of :func:`tiny_pipeline`: the UNet's, the VAE's and the text encoder's
#: (``CLIPTextConfig`` arguments; its ``max_position_embeddings`` is also the tokenizer's length).
TINY_PIPELINE = {
    "unet": {"sample_size": 8, "in_channels": 4, "out_channels": 4, "layers_per_block": 1,
             "block_out_channels": (32, 64), "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
             "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"), "cross_attention_dim": 16,
             "attention_head_dim": 8, "norm_num_groups": 8},
    "vae": {"in_channels": 3, "out_channels": 3, "down_block_types": ("DownEncoderBlock2D",) * 2,
            "up_block_types": ("UpDecoderBlock2D",) * 2, "block_out_channels": (16, 32), "latent_channels": 4,
            "norm_num_groups": 8, "sample_size": 16},
    "text_encoder": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "max_position_embeddings": 8, "projection_dim": 16},
}  # fmt: skip


def sd_pipeline(configs: dict, seed: int = 0):
    """A random ``StableDiffusionPipeline`` built from ``configs`` (the shape of :data:`TINY_PIPELINE`),
    initialised from ``seed``, in eval mode; its tokenizer covers a 54-token alphabet (no vocabulary is
    downloaded), its scheduler is SD's ``DDPMScheduler``, it has no safety checker."""
    import json
    import tempfile
    from pathlib import Path

    import torch

    from pyperm._optional_imports import prepare_hf_import

    prepare_hf_import()
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    from pyperm._staging import write_text

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for letter in "abcdefghijklmnopqrstuvwxyz":
        vocab[letter] = len(vocab)
        vocab[f"{letter}</w>"] = len(vocab)
    text = {"vocab_size": len(vocab), **configs["text_encoder"]}
    with tempfile.TemporaryDirectory() as tmp:  # the tokenizer's files, read back at once
        write_text(Path(tmp) / "vocab.json", json.dumps(vocab))
        write_text(Path(tmp) / "merges.txt", "#version: 0.2\n")
        tokenizer = CLIPTokenizer(str(Path(tmp) / "vocab.json"), str(Path(tmp) / "merges.txt"),
                                  model_max_length=text["max_position_embeddings"])  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        text_encoder = CLIPTextModel(CLIPTextConfig(**text, bos_token_id=0, eos_token_id=1, pad_token_id=1))
        unet = UNet2DConditionModel(**configs["unet"])
        vae = AutoencoderKL(**configs["vae"])
    return StableDiffusionPipeline(
        vae=vae.eval(), text_encoder=text_encoder.eval(), tokenizer=tokenizer, unet=unet.eval(),
        scheduler=DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, steps_offset=1,
                                clip_sample=False),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)  # fmt: skip


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the block on one torch thread (restored afterwards).

    On a loaded 2-core machine two spinning OpenMP threads make small matrix products 10-20
    times slower; tests and benchmarks of small models pin one thread for steady timings.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def free_port() -> int:
    """A port no one listens on now, on 127.0.0.1 (for a launcher's rendezvous in tests and benchmarks)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
