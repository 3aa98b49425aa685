"""``pyperm bench match``: weight matching (Git Re-Basin Algorithm 1), pyperm against a reference.

Three tables, each from pairs of independently initialised models (seeded):

- The flat cases (``--models``): MLP 784-512-512-512-10, MLP 784-[2048]x4-10, ResNet20 x16
  (shortcut B, widths 256/512/1024) and VGG16 with BatchNorm. ``pyperm.nn.weight_matching`` from
  the identity is timed against :func:`reference_weight_matching`, a straightforward
  implementation in the style of the public PyTorch port of Git Re-Basin: every step rebuilds its
  group's similarity from all its weights (float32 torch matmuls) and solves it with
  ``scipy.optimize.linear_sum_assignment``. Both visit the groups in the same seeded order, so
  their objectives are comparable; pyperm's must be at least the reference's (exit status 1).
- Structured specs (``--structured``): torchvision's AlexNet and VGG11-BN with the flat traced
  spec and the structured one (``PermutationSpec.from_model(..., structured=True)``, which adds
  the flattened classifier input), and ResNet20 x16 with its spec written in structured forms
  (the same groups). Each row gives the similarity products of one sweep in which every
  similarity is computed whole (2 n^2 K flops per group and tensor), the arithmetic behind the
  structured/flat ratio.
- At scale (``--scale``): a 1.1B-parameter Llama pair, GPT-2, ResNet50 and ViT-B/16 in float32 and
  bfloat16: peak memory, the memory the call adds per model, time per sweep against the floor of
  plain matrix products (see :mod:`pyperm.benchmarks._match_scale`). With ``--ranks N``, also each
  pair from the identity in one process and over N gloo processes on this machine, each a share of
  the keys: peak RSS per rank and in all, time per sweep, bytes sent per sweep, groups found (see
  :mod:`pyperm.benchmarks._match_ranks`).
- The starts (``--starts``): ``init="identity"``, ``"signatures"`` and the default ``"best"``
  on the bundled models, torchvision's MobileNetV2 and timm's ViT-Tiny (``--planted``: also on a
  model and a permuted copy of it, where the identity start stalls on MobileNetV2 and ViT).

Times are medians (and the best) of ``--repeat`` runs of the public API (validation
included), the contenders of a row alternating round by round, after one untimed run each;
``--clock cpu`` with ``--threads 1`` measures the thread's CPU time, steady on a busy machine.
The objectives of the flat table are both computed by ``pyperm.nn.matching_objective``;
``same perms`` says whether the two found identical permutations.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from pyperm._plotting import save_figure
from pyperm._argtypes import choices_list, int_at_least, positive_int
from pyperm._tables import markdown_table, text_table
from pyperm.benchmarks._match_scale import DEFAULT as SCALE_DEFAULT
from pyperm.benchmarks._match_scale import MODELS as SCALE_MODELS
from pyperm.benchmarks._match_starts import MODELS as START_MODELS
from pyperm.benchmarks._match_structured import CASES as STRUCTURED_CASES
from pyperm.benchmarks._report import kernels, time_calls, write_generated
from pyperm.testing import reference_weight_matching


@dataclass(frozen=True)
class Case:
    """One benchmark model: its registry name, what the table calls it, and its target seconds."""

    model: str
    description: str
    target: float
    gpu_target: float


# Targets: seconds on the 2-core development machine, and with --device cuda on an H100/H200.
CASES = {
    "mlp512": Case("mlp:784,512,512,512,10", "MLP 784-512-512-512-10", 0.04, 0.04),
    "mlp2048": Case("mlp:784,2048,2048,2048,2048,10", "MLP 784-[2048]x4-10", 3.0, 0.3),
    "resnet20x16": Case("resnet20:16", "ResNet20 x16 (shortcut B)", 1.0, 0.2),
    "vgg16": Case("vgg16", "VGG16-BN (CIFAR)", 2.0, 0.2),
}


# The structured table's cases without --structured CASES.
STRUCTURED_DEFAULT = ["alexnet", "vgg11_bn", "resnet20x16-tiled"]


def build_model(name: str, seed: int):
    """The benchmark model ``name`` (a key of :data:`CASES`), initialised from ``seed`` (global RNG untouched)."""
    import torch

    from pyperm.nn.models import create_model

    if name not in CASES:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(CASES)}")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return create_model(CASES[name].model)


# torchvision and timm models: the input that traces them (their specs do not depend on its size).
LIBRARY_INPUTS = {"alexnet": (1, 3, 64, 64), "vgg11_bn": (1, 3, 64, 64), "mobilenet_v2": (1, 3, 64, 64),
                  "vit_tiny": (1, 3, 224, 224)}  # fmt: skip


def library_model(name: str, seed: int):
    """A torchvision model (or ``vit_tiny``: timm's vit_tiny_patch16_224) initialised from ``seed`` in
    eval mode, and an input that traces it. ModuleNotFoundError when the library is missing."""
    import torch

    from pyperm._optional_imports import import_torchvision

    if name not in LIBRARY_INPUTS:
        raise ValueError(f"unknown library model {name!r}; choose from {sorted(LIBRARY_INPUTS)}")
    tv = import_torchvision()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if name == "vit_tiny":
            import timm

            model = timm.create_model("vit_tiny_patch16_224", pretrained=False)
        else:
            model = getattr(tv.models, name)(weights=None)
    return model.eval(), torch.zeros(LIBRARY_INPUTS[name])


@dataclass
class Row:
    name: str
    params: int
    groups: int
    ours_s: float
    ours_best: float
    ours_iterations: int
    ours_obj: float
    ref_s: float | None = None
    ref_iterations: int | None = None
    ref_obj: float | None = None
    same_perms: bool | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--repeat", type=positive_int, default=3, help="timed runs of pyperm per model (median reported)"
    )
    parser.add_argument(
        "--reference-repeat", type=positive_int, default=1, help="timed runs of the (slow) reference per model (median)"
    )
    parser.add_argument(
        "--models",
        type=choices_list(list(CASES)),
        default=list(CASES),
        help=f"comma-separated subset of {','.join(CASES)} (default: all)",
    )
    parser.add_argument("--no-reference", action="store_true", help="time pyperm only")
    parser.add_argument("--seed", type=int_at_least(0), default=0, help="seed of the visiting order")
    parser.add_argument("--model-seeds", type=int, nargs=2, default=(1, 2), metavar=("A", "B"))
    parser.add_argument("--plot", metavar="PNG", help="save a bar chart of the times to this file")
    parser.add_argument("--structured", nargs="?", type=choices_list(list(STRUCTURED_CASES)),
                        const=STRUCTURED_DEFAULT, default=None, metavar="CASES",
                        help="also the flat and structured specs of one pair, side by side (cases: "
                             f"{','.join(STRUCTURED_CASES)}; default {','.join(STRUCTURED_DEFAULT)}; "
                             "AlexNet and VGG need torchvision)")
    parser.add_argument("--starts", nargs="?", type=choices_list(list(START_MODELS)), const=list(START_MODELS),
                        default=None, metavar="MODELS",
                        help="also the starts table: identity, signatures and the default (default models: "
                             f"{','.join(START_MODELS)}; the last two need torchvision and timm)")
    parser.add_argument("--planted", action="store_true",
                        help="the starts table also on a model and a permuted copy of it")
    parser.add_argument("--scale", nargs="?", type=choices_list(list(SCALE_MODELS)), const=SCALE_DEFAULT,
                        default=None, metavar="MODELS",
                        help="also the scale table: peak memory, time per sweep and the matmul floor of large "
                             f"models in float32 and bfloat16 (models: {','.join(SCALE_MODELS)}; default "
                             f"{','.join(SCALE_DEFAULT)}; the 1.1B Llama pair needs 9 GB in float32 and about 25 "
                             "minutes, the others minutes, the 3B pair 13 GB in bfloat16, the SD-1.5 UNet pair "
                             "(sd15-unet, 860M) 7 GB in float32, the SDXL UNet pair (sdxl-unet, 2.6B) 21 GB in "
                             "float32 and 10 GB in float16 or bfloat16; the Hugging Face rows need transformers, the "
                             "UNet rows diffusers, the others torchvision)")
    parser.add_argument("--pipelines", metavar="DIR", default=None,
                        help="also the pipeline table: pyperm merge --model hf --weights 0.7,0.3 of two SD-1.5-shaped "
                             "pipeline folders (UNet, VAE, CLIP text encoder; B a planted permutation of A plus "
                             "noise) written to DIR once per dtype of --dtypes, end to end in a fresh process: time, "
                             "peak RSS, merged tensors against A's (needs diffusers and transformers; 9 GB of disk "
                             "and about 12 GB of memory in float32)")
    parser.add_argument("--no-flat", action="store_true", help="skip the flat table (--models)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: the thread's CPU time (with --threads 1 on a busy machine)")
    parser.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    parser.add_argument("--write", metavar="DIR", default=None,
                        help="also write each table as DIR/bench-match-<table>.md, headed by this command and the "
                             "date (the docs include docs/_generated/); the scale table of other models than the "
                             "default's as bench-match-scale-<models>.md")
    parser.add_argument("--device", default="cpu",
                        help="where the flat and scale tables' models live (cpu, cuda, cuda:N); on a GPU the flat "
                             "table's reference is pyperm on the CPU, whose objective the GPU's must equal")
    parser.add_argument("--dtypes", type=choices_list(["float32", "float16", "bfloat16"]),
                        default=["float32", "bfloat16"],
                        help="the scale table's dtypes (float32, float16, bfloat16; default: float32,bfloat16)")
    parser.add_argument("--ranks", type=positive_int, default=None, metavar="N",
                        help="with --scale, also the ranks table: each model and dtype matched from the identity in "
                             "one process and over N gloo processes on this machine, each a contiguous share of the "
                             "keys (peak RSS per rank and in all, time per sweep, bytes sent per sweep, groups found)")
    parser.add_argument("--checkpoints", metavar="DIR", default=None,
                        help="with --scale and --ranks: run the ranks table through the command line instead (pyperm "
                             "align in one process, then under torchrun), on the pair written to DIR once as sharded "
                             "safetensors (Hugging Face models only; the scale table is not run)")


def run(args: argparse.Namespace) -> int:
    import torch

    import pyperm

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        print(f"--device: not a torch device: {args.device!r}", file=sys.stderr)
        return 2
    if device.type == "cuda" and not (torch.cuda.is_available() and pyperm.cuda_available()):
        print(f"--device {args.device}: {pyperm.cuda_unavailable_reason() or 'torch sees no CUDA device'}",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.checkpoints is not None and (args.scale is None or args.ranks is None or device.type != "cpu"):
        print("--checkpoints: needs --scale and --ranks, on the CPU (the command line's ranks are gloo processes)",
              file=sys.stderr)  # fmt: skip
        return 2
    where = f", device {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    print(
        f"pyperm {pyperm.__version__}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"kernels: {kernels()}, model seeds {tuple(args.model_seeds)}, order seed {args.seed}, clock {args.clock}{where}"
    )
    failures: list[str] = []
    if not args.no_flat:
        rows = _flat_rows(args, failures)
        _print_table(rows, args.markdown, args.device != "cpu", args.write)
        if args.plot:
            _plot(rows, args.plot)
            print(f"plot saved to {args.plot}")
    if args.structured:
        from pyperm.benchmarks import _match_structured

        print("\nflat and structured specs of one pair, from the identity (first sweep Gflop: every similarity "
              "computed whole; run Gflop: the products the run needed, from the units that moved)", flush=True)  # fmt: skip
        table = _match_structured.rows(args.structured, tuple(args.model_seeds), args.repeat, args.clock, args.seed,
                                       _report)  # fmt: skip
        _print(_match_structured.HEADERS, table, args.markdown, args.write, "structured")
    if args.starts:
        from pyperm.benchmarks import _match_starts

        print("\nthe starts: identity, signatures and the default (best)", flush=True)
        kinds = ["independent", "planted"] if args.planted else ["independent"]
        table, failed = _match_starts.rows(args.starts, kinds, tuple(args.model_seeds), args.repeat, args.clock,
                                           args.seed, _report)  # fmt: skip
        failures += failed
        _print(_match_starts.HEADERS, table, args.markdown, args.write, "starts")
    if args.scale:
        from pyperm.benchmarks import _match_scale

        if args.checkpoints is None:
            print("\nweight matching at scale: B a planted permutation of A plus noise, defaults; each row in its own "
                  "process", flush=True)  # fmt: skip
            table, failed = _match_scale.rows(args.scale, args.dtypes, args.repeat, _report, args.device)
            failures += failed
            # The default models' table is bench-match-scale.md; other models' get their own file beside it.
            name = "scale" if args.scale == SCALE_DEFAULT else "scale-" + "-".join(args.scale)
            _print(_match_scale.headers(args.device), table, args.markdown, args.write, name)
        if args.ranks is not None and args.checkpoints is not None:
            from pyperm.benchmarks import _align_ranks, _match_ranks

            print(f"\npyperm align over ranks: 1 process and torchrun with {args.ranks} gloo "
                  f"processes, each mapping its shards of the pair in {args.checkpoints}", flush=True)  # fmt: skip
            table, failed = _align_ranks.rows(args.scale, args.dtypes, args.ranks, args.checkpoints, _report)
            failures += failed
            _print(_match_ranks.HEADERS, table, args.markdown, args.write, "ranks-cli")
        elif args.ranks is not None:
            from pyperm.benchmarks import _match_ranks

            backend = "gloo" if args.device == "cpu" else _match_ranks.backend_for(args.device, args.ranks)
            print(f"\nweight matching over ranks: from the identity, 1 process and {args.ranks} {backend} processes "
                  "(each a contiguous share of the keys); each row in its own processes", flush=True)  # fmt: skip
            table, failed = _match_ranks.rows(args.scale, args.dtypes, args.ranks, _report, device=args.device)
            failures += failed
            _print(_match_ranks.headers(args.device), table, args.markdown, args.write, "ranks")
    if args.pipelines is not None:
        from pyperm.benchmarks import _pipeline_merge

        print(f"\npyperm merge of two SD-1.5-shaped pipelines in {args.pipelines}, end to end in a fresh process "
              f"(B a planted permutation of A plus noise; merged = A + {_pipeline_merge.WEIGHTS[1]} x noise when "
              "aligned)", flush=True)  # fmt: skip
        table, failed = _pipeline_merge.rows(args.dtypes, args.pipelines, _report)
        failures += failed
        _print(_pipeline_merge.HEADERS, table, args.markdown, args.write, "pipelines")
    for f in failures:
        print("FAIL:", f, file=sys.stderr)
    return 1 if failures else 0


def _flat_rows(args: argparse.Namespace, failures: list[str]) -> list[Row]:
    """The flat table: pyperm from the identity against the reference, model by model."""
    import torch

    from pyperm.nn import matching_objective, weight_matching

    rows: list[Row] = []
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    if on_gpu:
        print("  reference: pyperm on the CPU (same order seed); the GPU's objective must equal it", flush=True)
    for name in args.models:
        model_a = build_model(name, args.model_seeds[0])
        model_b = build_model(name, args.model_seeds[1])
        spec = model_a.permutation_spec()
        cpu_a, cpu_b = model_a.state_dict(), model_b.state_dict()
        sa = {k: v.to(device) for k, v in cpu_a.items()}
        sb = {k: v.to(device) for k, v in cpu_b.items()}

        def match_here():
            result = weight_matching(spec, sa, sb, seed=args.seed, init="identity")
            if on_gpu:
                torch.cuda.synchronize(device)
            return result

        # One untimed run first: the process's first call of weight matching pays about 12 ms
        # of one-time costs, a third of MLP-512's time. The identity start: Algorithm 1 as the
        # reference (and every other library) runs it; the starts table times the default.
        ours = time_calls({"": match_here}, args.repeat, clock=args.clock)[""]
        t_ours, best, res = ours.median, ours.best, ours.result
        row = Row(
            name=name,
            params=sum(p.numel() for p in model_a.parameters()),
            groups=len(spec.sizes),
            ours_s=t_ours,
            ours_best=best,
            ours_iterations=res.iterations,
            ours_obj=matching_objective(spec, cpu_a, cpu_b, res.perms),
        )
        if on_gpu:
            cpu = time_calls({"": lambda: weight_matching(spec, cpu_a, cpu_b, seed=args.seed, init="identity")},
                             args.repeat, clock=args.clock)[""]  # fmt: skip
            row.ref_s, row.ref_iterations = cpu.median, cpu.result.iterations
            row.ref_obj = matching_objective(spec, cpu_a, cpu_b, cpu.result.perms)
            row.same_perms = all(torch.equal(cpu.result.perms[g], res.perms[g]) for g in spec.sizes)
        elif not args.no_reference:
            # The reference's runs last seconds, where one-time costs do not show: no warm-up.
            ref = time_calls({"": lambda: reference_weight_matching(spec, sa, sb, seed=args.seed)},
                             args.reference_repeat, clock=args.clock, warmup=False)[""]  # fmt: skip
            t_ref, (perm_ref, sweeps_ref) = ref.median, ref.result
            row.ref_s, row.ref_iterations = t_ref, sweeps_ref
            row.ref_obj = matching_objective(spec, sa, sb, perm_ref)
            row.same_perms = all(torch.equal(perm_ref[g], res.perms[g]) for g in spec.sizes)
            if row.ours_obj < row.ref_obj - 1e-6 * abs(row.ref_obj):
                failures.append(f"{name}: objective {row.ours_obj:.9g} below the reference's {row.ref_obj:.9g}")
        if on_gpu and row.ref_obj is not None and abs(row.ours_obj - row.ref_obj) > 1e-5 * abs(row.ref_obj):
            failures.append(f"{name}: objective on {device} {row.ours_obj:.9g} differs from the CPU's {row.ref_obj:.9g}")
        rows.append(row)
        _print_row(row)
    return rows


def _report(line: str) -> None:
    print(line, flush=True)


def _print(headers: list[str], table: list[list], markdown: bool, write: str | None = None, name: str = "") -> None:
    print()
    print(markdown_table(headers, table) if markdown else text_table(headers, table), flush=True)
    if write is not None:
        print(f"table written to {write_generated(write, f'bench-match-{name}', markdown_table(headers, table))}")


def _print_row(row: Row) -> None:
    msg = f"  {row.name}: pyperm {row.ours_s:.3f} s, best {row.ours_best:.3f} s ({row.ours_iterations} sweeps)"
    if row.ref_s is not None:
        msg += f", reference {row.ref_s:.3f} s ({row.ref_iterations} sweeps)"
    print(msg, flush=True)


def _print_table(rows: list[Row], markdown: bool, on_gpu: bool = False, write: str | None = None) -> None:
    ref = "cpu" if on_gpu else "ref"
    headers = ["model", "params", "groups", "sweeps", "pyperm s", "best s", f"{ref} s", "speedup", "target s", "met",
               "objective (pyperm)", f"objective ({ref})", "same perms"]  # fmt: skip
    table = []
    for r in rows:
        case = CASES[r.name]
        target = case.gpu_target if on_gpu else case.target
        sweeps = f"{r.ours_iterations}" + (f"/{r.ref_iterations}" if r.ref_iterations is not None else "")
        speedup = f"{r.ref_s / r.ours_s:.1f}x" if r.ref_s is not None else None
        table.append([
            case.description, f"{r.params:,}", r.groups, sweeps, r.ours_s, r.ours_best, r.ref_s, speedup, target,
            "yes" if r.ours_s <= target else "no", f"{r.ours_obj:.6f}",
            None if r.ref_obj is None else f"{r.ref_obj:.6f}", r.same_perms,
        ])  # fmt: skip
    _print(headers, table, markdown, write, "flat")


def _plot(rows: list[Row], path: str) -> None:
    from pyperm._plotting import agg_figure

    labels = [CASES[r.name].description for r in rows]
    x = range(len(rows))
    fig = agg_figure(1.8 + 2.2 * len(rows), 4, layout="tight")
    ax = fig.add_subplot()
    ax.bar([i - 0.2 for i in x], [r.ours_s for r in rows], width=0.4, label="pyperm")
    if any(r.ref_s is not None for r in rows):
        ax.bar([i + 0.2 for i in x], [r.ref_s or 0 for r in rows], width=0.4, label="reference (scipy LSA)")
    ax.scatter(list(x), [CASES[r.name].target for r in rows], marker="_", s=600, color="k", label="target", zorder=3)
    ax.set_yscale("log")
    ax.set_ylabel("seconds (median)")
    ax.set_xticks(list(x), labels, rotation=10)
    ax.set_title("weight matching, two independently initialised models")
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":  # python -m pyperm.benchmarks.match
    _parser = argparse.ArgumentParser(prog="pyperm bench match", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
