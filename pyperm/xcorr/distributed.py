r"""Cross-correlation statistics of data-parallel workers, all-reduced with torch.distributed."""

from __future__ import annotations

from typing import Any

from pyperm.xcorr.accumulator import CrossCorrelation

__all__ = ["all_reduce_cross_correlation"]


def all_reduce_cross_correlation(acc: CrossCorrelation, group: Any = None, device: Any = None) -> CrossCorrelation:
    r"""All-reduce an accumulator across data-parallel workers with ``torch.distributed``.

    Every rank calls it (a collective) after accumulating its own shard; afterwards every
    rank's ``acc`` holds the statistics of all shards together, exactly as if one process had
    seen all the data. Chan's merge is not a plain sum, so the co-moments are first moved to
    the common mean (the parallel-axis theorem), which makes them summable:

    .. math::

        n = \sum_k n_k, \quad \mu = \frac{1}{n}\sum_k n_k \mu_k, \quad
        C = \sum_k \big[ C_k + n_k (\mu_{A,k} - \mu_A)(\mu_{B,k} - \mu_B)^\top \big],

    and likewise for the sums of squares; ranges reduce with MIN and MAX. Each term is centred
    near the global mean, so the sum keeps the accuracy of the single-process accumulator.
    That is four small all-reduces per side plus one of the ``dim_a x dim_b`` matrix (in the
    accumulator dtype). The same recipe works with any all-reduce: take :meth:`~CrossCorrelation.state`,
    reduce as above, rebuild with :meth:`~CrossCorrelation.from_state`.

    Parameters
    ----------
    acc : CrossCorrelation
        This rank's accumulator; updated in place. Ranks that saw no data take part too.
    group : torch.distributed.ProcessGroup, optional
        The process group (default: the world).
    device : torch.device or str, optional
        Where the reduction buffers live: CPU by default (gloo); pass the rank's CUDA device
        for the NCCL backend.

    Returns
    -------
    CrossCorrelation
        ``acc``.

    Raises
    ------
    TypeError
        ``acc`` is not a CrossCorrelation.
    RuntimeError
        torch.distributed is not initialised.

    Examples
    --------
    In each worker of a ``torchrun`` job::

        acc = pyperm.CrossCorrelation(512, 512)
        for xa, xb in my_shard:                      # this rank's activations
            acc.update(xa, xb)
        pyperm.all_reduce_cross_correlation(acc)     # every rank now has the global statistics
        perm = pyperm.linear_sum_assignment(acc.correlation(), maximize=True)[1]
    """
    if not isinstance(acc, CrossCorrelation):
        raise TypeError(f"acc must be a CrossCorrelation, got {type(acc).__name__}")
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call torch.distributed.init_process_group first")
    dev = torch.device("cpu") if device is None else torch.device(device)
    f64 = dict(dtype=torch.float64, device=dev)
    SUM, MIN, MAX = dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX
    s = acc.state()
    n_local = float(s["count"])
    total = torch.tensor([n_local], **f64)
    dist.all_reduce(total, op=SUM, group=group)
    n_total = float(total.item())
    if n_total == 0:
        return acc

    deltas = {}
    out: dict[str, Any] = {"count": int(round(n_total))}
    for side in ("a", "b"):
        mean_k = torch.as_tensor(s[f"mean_{side}"], **f64)
        mean = mean_k * n_local
        dist.all_reduce(mean, op=SUM, group=group)
        mean /= n_total
        delta = mean_k - mean
        m2 = torch.as_tensor(s[f"m2_{side}"], **f64) + n_local * delta * delta
        dist.all_reduce(m2, op=SUM, group=group)
        lo = torch.as_tensor(s[f"min_{side}"], **f64)
        hi = torch.as_tensor(s[f"max_{side}"], **f64)
        dist.all_reduce(lo, op=MIN, group=group)
        dist.all_reduce(hi, op=MAX, group=group)
        deltas[side] = delta
        out.update({f"mean_{side}": mean, f"m2_{side}": m2, f"min_{side}": lo, f"max_{side}": hi})

    comoment = torch.as_tensor(s["comoment"], device=dev)
    if n_local > 0:
        comoment += (n_local * torch.outer(deltas["a"], deltas["b"])).to(comoment.dtype)
    dist.all_reduce(comoment, op=SUM, group=group)
    out["comoment"] = comoment
    merged = CrossCorrelation.from_state(**{k: v.cpu() if torch.is_tensor(v) else v for k, v in out.items()})
    # Merging into an emptied accumulator copies the merged statistics exactly, on acc's device.
    return acc.reset().merge(merged)
