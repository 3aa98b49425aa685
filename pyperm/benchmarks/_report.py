"""Timing and plotting shared by the ``pyperm bench`` sub-commands (their tables: :mod:`pyperm._tables`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from pyperm._plotting import save_figure


@dataclass
class Timing:
    """Seconds of each timed call, and the last call's result."""

    samples: list[float] = field(default_factory=list)
    result: object = None

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def best(self) -> float:
        return min(self.samples)


def run_child(code: str, timeout: float | None = None) -> dict:
    """Run ``python -c code`` in a fresh process and return the JSON object its last line prints.

    The child starts in a neutral folder: ``python -c`` puts the working directory first on the
    path, and a source checkout there would shadow the installed package. A child that fails
    raises RuntimeError with the last line of its error output (a timeout: subprocess.TimeoutExpired).
    """
    import json
    import subprocess
    import sys
    import tempfile

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tempfile.gettempdir(),
                          timeout=timeout)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr.strip().splitlines() or ["no message"])[-1])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def kernels() -> str:
    """The SIMD level of the CPU kernels for a bench header, with the cap when one is set
    ("avx2 (PYPERM_MAX_SIMD=avx2; the CPU runs avx512)"): tables taken under a cap say so."""
    from pyperm._ext import SIMD_CAP_VARIABLE, core, simd_cap

    cap = simd_cap()
    if cap is None:
        return core.best_isa()
    return f"{core.best_isa()} ({SIMD_CAP_VARIABLE}={cap}; the CPU runs {core.hardware_isa()})"


def to_host(x: object):
    """A benchmark's answer as a numpy array (CUDA tensors are copied back)."""
    import numpy as np

    return x.cpu().numpy() if hasattr(x, "cpu") else np.asarray(x)


def cuda_device_name() -> str:
    """The current CUDA device's name, for a table's heading."""
    import torch

    return torch.cuda.get_device_name()


def minor_faults() -> int | None:
    """The process's minor page faults so far (pages the kernel mapped in on first touch), or None where the
    system does not count them (``resource`` is Unix-only)."""
    try:
        import resource
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_calls(
    fns: Mapping[str, Callable[[], object]], repeat: int, *, clock: str = "wall", warmup: bool = True
) -> dict[str, Timing]:
    """Times each of ``fns`` ``repeat`` times, alternating between them round by round.

    Alternating makes a slow spell of a busy machine hit every contender alike, so ratios
    stay meaningful. ``warmup``: one untimed call of each first (first calls pay one-time
    costs: allocations, page faults, lazy imports). ``clock="cpu"`` measures the calling
    thread's CPU time, which ignores time spent descheduled (only meaningful for
    single-threaded code).
    """
    timer = time.perf_counter if clock == "wall" else time.thread_time
    timings = {name: Timing() for name in fns}
    if warmup:
        for fn in fns.values():
            fn()
    for _ in range(max(1, repeat)):
        for name, fn in fns.items():
            start = timer()
            result = fn()
            timings[name].samples.append(timer() - start)
            timings[name].result = result
    return timings


def time_call(fn: Callable[[], object], repeat: int, *, clock: str = "wall", warmup: bool = True) -> Timing:
    """:func:`time_calls` of one function."""
    return time_calls({"": fn}, repeat, clock=clock, warmup=warmup)[""]


def save_bar_plot(path: str, title: str, groups: Sequence[str], series: dict[str, Sequence[float | None]],
                  ylabel: str) -> None:
    """Grouped bar chart (one group per case, one bar per series), log-scaled, to PNG."""
    from pyperm._plotting import agg_figure

    fig = agg_figure(max(6.0, 1.2 * len(groups) + 2), 4.5, layout="tight")
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        xs = [g + (k - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ys = [float("nan") if v is None else v for v in values]
        ax.bar(xs, ys, width=width, label=name)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=20, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def write_generated(folder: str, name: str, text: str) -> str:
    """Write a measured table as ``folder/<name>.md``, headed by the command that measured it and the date.

    The README and the guide include these files instead of retyping their numbers, so a page shows
    what the command last measured; the file is staged and renamed into place (:mod:`pyperm._staging`).
    """
    import datetime
    import shlex
    import sys
    from pathlib import Path

    from pyperm._staging import write_text

    command = shlex.join(["pyperm", *sys.argv[1:]])
    date = datetime.date.today().isoformat()
    path = Path(folder) / f"{name}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, f"Measured {date} by `{command}` (written by the command: rerun it, do not edit).\n\n{text}\n")
    return str(path)

