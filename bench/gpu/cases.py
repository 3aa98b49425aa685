"""The GPU checks that are not tests or benchmarks (run by bench/gpu/check.sh on a CUDA machine).

    python bench/gpu/cases.py sanitize      small cases for compute-sanitizer (run it under each tool)
    python bench/gpu/cases.py memory        the scratch pool is reused; the out-of-memory message
    python bench/gpu/cases.py activations   activation matching keeps the activations on the device
    python bench/gpu/cases.py checkpoints DIR   two MLPs trained on digits, saved as DIR/a.pt and DIR/b.pt

Each prints what it measured and exits 1 when a check fails.
"""

from __future__ import annotations

import sys

import torch

import pyperm

CUDA = torch.device("cuda")


def sanitize() -> int:
    """Every CUDA kernel family on small inputs: LAP single and batched (each strategy, float32 and
    float64, square, wide and tall), a cross-correlation update with a one-row batch, and BvN."""
    from pyperm.lap import _cuda as lap_cuda

    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        for method in ("auto", "block", "device"):
            for shape in [(1, 1), (37, 37), (20, 45), (45, 20), (130, 130)]:
                cost = torch.rand(shape, device=CUDA, dtype=dtype, generator=gen)
                lap_cuda.linear_sum_assignment(cost, method=method)
                lap_cuda.linear_sum_assignment(cost, maximize=True, method=method)
            for shape in [(1, 1, 1), (8, 37, 37), (5, 20, 45), (5, 45, 20), (3, 130, 130)]:
                lap_cuda.batch_linear_sum_assignment(torch.rand(shape, device=CUDA, dtype=dtype, generator=gen),
                                                     method=method)  # fmt: skip
        # The public entry point too (its device dispatch), not only the backend.
        _, cols = pyperm.linear_sum_assignment(torch.rand(64, 64, device=CUDA, dtype=dtype, generator=gen))
        print(f"lap {dtype}: done ({int(cols.numel())} pairs in the last single solve)")
    for dtype in (torch.float32, torch.float64):
        acc = pyperm.CrossCorrelation(33, 17)
        acc.update(torch.randn(1, 33, device=CUDA, dtype=dtype), torch.randn(1, 17, device=CUDA, dtype=dtype))
        acc.update(torch.randn(5, 33, device=CUDA, dtype=dtype), torch.randn(5, 17, device=CUDA, dtype=dtype))
        other = pyperm.CrossCorrelation(33, 17)
        other.update(torch.randn(1, 33, device=CUDA, dtype=dtype), torch.randn(1, 17, device=CUDA, dtype=dtype))
        acc.merge(other)
        corr = acc.correlation()
        torch.cuda.synchronize()
        print(f"xcorr {dtype}: count {acc.count}, correlation {tuple(corr.shape)} on {corr.device}")
    for dtype in (torch.float64, torch.float32):
        D = pyperm.sinkhorn(torch.rand(48, 48, device=CUDA, dtype=dtype, generator=gen) + 0.1)
        for method in ("max-weight", "bottleneck"):
            coeffs, perms = pyperm.birkhoff_decomposition(D, method=method, max_terms=12)
            torch.cuda.synchronize()
            print(f"bvn {dtype} {method}: {len(coeffs)} terms, perms on {perms.device}")
    return 0


def _free() -> int:
    return torch.cuda.mem_get_info()[0]


def memory() -> int:
    """100 solves in a loop: the device's free memory (the driver's count, which includes pyperm's own
    pool) must stay flat after the first; then a problem whose scratch cannot fit must give the message."""
    failed = 0
    cost = torch.rand(256, 256, 256, device=CUDA)
    torch.cuda.synchronize()
    start = _free()
    used = []
    for _ in range(100):
        pyperm.batch_linear_sum_assignment(cost)
        used.append((start - _free()) / 2**20)
    print("100 batch solves of 256 x 256 x 256 float32, device memory in use beyond the input after each, MiB:")
    print("  " + " ".join(f"{u:.0f}" for u in used))
    if max(used[1:]) > used[0] + 1e-6:
        print("FAIL: device memory grew after the first solve")
        failed = 1
    single = torch.rand(4096, 4096, device=CUDA)
    torch.cuda.synchronize()
    start = _free()
    used = []
    for _ in range(20):
        pyperm.linear_sum_assignment(single, maximize=True)  # maximize: a scratch copy of the costs (64 MiB)
        used.append((start - _free()) / 2**20)
    print("20 single solves of 4096 x 4096 (maximize), MiB in use after each: " + " ".join(f"{u:.0f}" for u in used))
    if max(used[1:]) > used[0] + 1e-6:
        print("FAIL: device memory grew after the first solve")
        failed = 1

    # Out of memory: fill the device until 64 MiB are left, then ask for a batch whose scratch copy of the
    # costs (maximize=True negates them into scratch: 512 MiB) is more than that and pyperm's pool keeps.
    costs = torch.rand(2048, 256, 256, device=CUDA)
    torch.cuda.synchronize()
    fillers = []
    try:
        while _free() > 2**30:
            fillers.append(torch.empty(max(_free() - 2**30, 2**20) // 2, dtype=torch.uint8, device=CUDA))
        fillers.append(torch.empty(_free() - 64 * 2**20, dtype=torch.uint8, device=CUDA))
    except torch.OutOfMemoryError:
        pass
    print(f"device filled: {_free() / 2**20:.0f} MiB free")
    try:
        pyperm.batch_linear_sum_assignment(costs, maximize=True)
        print("FAIL: no out-of-memory error although the scratch could not fit")
        failed = 1
    except Exception as exc:  # the message is what this shows
        print(f"out of memory, as expected: {type(exc).__name__}: {exc}")
    del fillers
    torch.cuda.empty_cache()
    _, cols = pyperm.batch_linear_sum_assignment(costs[:4], maximize=True)
    print(f"after freeing, a solve works again: {tuple(cols.shape)}")
    return failed


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits (no download) as flat float32 inputs and labels."""
    from pyperm.datasets import load_digits

    ds = load_digits(0)
    return torch.from_numpy(ds.x_train.reshape(len(ds.x_train), -1)), torch.from_numpy(ds.y_train)


def activations() -> int:
    """Activation matching of two MLPs on the GPU: the device-to-host copies and the host memory must not
    grow with the number of batches (the per-batch statistics stay on the device)."""
    from torch.profiler import ProfilerActivity, profile

    from pyperm.nn import activation_matching
    from pyperm.nn.models import create_model

    x = _digits()[0].to(CUDA)
    torch.manual_seed(0)
    a, b = (create_model("mlp:64,256,256,256,10").to(CUDA).eval() for _ in range(2))
    spec = a.permutation_spec()

    def run(n_batches: int) -> tuple[int, int]:
        data = [(x[i * 64:(i + 1) * 64],) for i in range(n_batches)]
        activation_matching(a, b, spec, data)  # untimed first run: one-time allocations and kernel loads
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            activation_matching(a, b, spec, data)
            torch.cuda.synchronize()
        copies = [e for e in prof.events() if "Memcpy DtoH" in e.name or "Memcpy Device -> Host" in e.name]
        return len(copies), sum(getattr(e, "device_memory_usage", 0) for e in copies)

    few, many = run(4), run(16)
    print(f"device-to-host copies in activation matching: {few[0]} with 4 batches, {many[0]} with 16 batches "
          f"({(many[0] - few[0]) / 12:.1f} per batch, over 3 activation sites)")
    before = torch.cuda.memory_allocated()
    print(f"torch.cuda.memory_allocated after the runs: {before / 2**20:.1f} MiB")
    if many[0] > few[0]:
        print("FAIL: the device-to-host copies grow with the batches (a host copy per batch)")
        return 1
    return 0


def checkpoints(folder: str) -> int:
    """Two bundled MLPs 64-128-128-10 trained on digits from different seeds, saved as plain state dicts."""
    import os

    from pyperm.nn._training import train_classifier
    from pyperm.nn.models import create_model

    x, y = _digits()
    batches = [(x[i:i + 128], y[i:i + 128]) for i in range(0, len(y), 128)]
    os.makedirs(folder, exist_ok=True)
    for name, seed in (("a", 1), ("b", 2)):
        torch.manual_seed(seed)
        model = create_model("mlp:64,128,128,10")
        train_classifier(model, batches, epochs=5, lr=3e-3, seed=seed)
        torch.save(model.state_dict(), os.path.join(folder, f"{name}.pt"))
    print(f"wrote {folder}/a.pt and {folder}/b.pt")
    return 0


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "checkpoints":
        sys.exit(checkpoints(sys.argv[2]))
    if what not in ("sanitize", "memory", "activations"):
        sys.exit(__doc__)
    sys.exit(globals()[what]())
