"""``pyperm merge A B --method zipit --data ...``: zip two checkpoints (ZipIt!, :func:`pyperm.nn.zipit`).

A full zip writes one checkpoint of the architecture (``zipped``). A partial zip (``--stop GROUP``) writes the
two heads of the multi-head model (``zipped_a`` and ``zipped_b``: each the zipped trunk, then one input's own
layers reading it through its unmerge; their trunk entries are equal). ``report.json`` and ``report.md`` hold
the groups, the same-model merges, the stops the model allows, and the test loss and accuracy of the inputs and
of the zip (the heads', and their ensemble's: the mean of their softmax outputs).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pyperm._json import write_json
from pyperm._staging import write_text

__all__ = ["run_zipit"]


def run_zipit(args: argparse.Namespace) -> int:
    """Zip, write the checkpoint(s) and the reports."""
    from pyperm.checkpoints import save_checkpoint
    from pyperm.commands._checkpoint_pair import load_for_model, refuse_inputs
    from pyperm.commands._common import (
        CommandError,
        Timer,
        build_model,
        check_inputs,
        checkpoint_outputs,
        float_state,
        load_data,
        prepare_out,
        resolve_device,
    )
    from pyperm.commands._matching import _model_with
    from pyperm.nn import zipit

    if len(args.checkpoints) != 2:
        raise CommandError(f"--method zipit zips two checkpoints, got {len(args.checkpoints)}")
    if not args.data:
        raise CommandError("--method zipit needs --data (the features are correlated over its training split)")
    if args.weights is not None:
        raise CommandError("--weights is not an option of --method zipit (its merge matrices weigh the features)")
    device = resolve_device(args.device)
    loaded = build_model(args.model, args.example_input_shape, args.checkpoints[0])
    ckpts = load_for_model(args.checkpoints, loaded)
    out = Path(args.out)
    stems = ["zipped"] if args.stop is None else ["zipped_a", "zipped_b"]
    files = [checkpoint_outputs(ckpts[0], out, stem, args.model) for stem in stems]
    names = [str(p.relative_to(out)) for fs in files for p in fs] + ["report.json", "report.md"]
    refuse_inputs([out / n for n in names], ckpts)
    prepare_out(out, names, args.force)
    data = load_data(args, device)
    check_inputs(loaded, data, device)
    states = [float_state(c.state, device) for c in ckpts]
    models = [_model_with(loaded, s, device) for s in states]
    with Timer() as timer:
        try:
            result = zipit(models[0], models[1], loaded.spec, data.train, alpha=args.alpha, beta=args.beta,
                           stop=args.stop, max_batches=getattr(args, "max_batches", None), progress=args.progress)  # fmt: skip
        except ValueError as exc:
            if args.stop is None or "stop" not in str(exc):
                raise
            raise CommandError(f"--stop {args.stop}: {exc}") from None
    heads = [result.state] if args.stop is None else list(result.partial_states(args.stop))
    written = []
    for head, fs in zip(heads, files):
        stored = {k: v.to(ckpts[0].state[k].dtype) for k, v in head.items()}
        written += save_checkpoint(ckpts[0], stored, fs[0], force=args.force)
    report: dict[str, Any] = {
        "method": "zipit",
        "inputs": [str(c.path) for c in ckpts],
        "outputs": [str(p) for p in written],
        "alpha": args.alpha,
        "beta": args.beta,
        "stop": args.stop,
        "stops": list(result.stops),
        "zipped_groups": list(result.zipped),
        "structured_groups": list(result.structured),
        "same_model_merges": {g: p.same_model_merges.tolist() for g, p in result.pairings.items()},
        "seconds": timer.seconds,
        "num_batches": result.num_batches,
    }
    evaluation = {str(c.path): _accuracy([m], data, device) for c, m in zip(ckpts, models)}
    evaluation["ensemble of the inputs"] = _accuracy(models, data, device)
    zipped = _with_batchnorm_reset(result.model, data)
    evaluation["zipped" if args.stop is None else "zipped (both heads)"] = _accuracy([zipped], data, device)
    report["data"] = {"name": data.name, "test_samples": data.num_test}
    report["evaluation"] = evaluation
    write_json(out / "report.json", report)
    write_text(out / "report.md", _markdown(report))
    print(f"zipped 2 checkpoints ({timer.seconds:.2f} s): {', '.join(str(p) for p in written)}")
    for name, e in evaluation.items():
        print(f"  {name}: test loss {e['loss']:.4f}, accuracy {100 * e['accuracy']:.2f}%")
    print(f"report: {out / 'report.md'}")
    return 0


def _with_batchnorm_reset(model: Any, data: Any) -> Any:
    """A copy of the zip with its BatchNorm statistics recomputed on the training batches (as the paper
    evaluates its zips); the zip itself when it has none."""
    import copy

    from pyperm.commands._common import has_batchnorm
    from pyperm.nn import reset_bn_stats

    if not has_batchnorm(model):
        return model
    model = copy.deepcopy(model)
    reset_bn_stats(model, data.train)
    return model


def _accuracy(models: list, data: Any, device: Any) -> dict[str, float]:
    """Test loss and accuracy of the mean of the softmax outputs of ``models`` (a model returning a tuple, the
    partial zip, counts each output)."""
    import torch

    total = correct = 0
    loss = 0.0
    with torch.no_grad():
        for m in models:
            m.eval()
        for x, y in data.test:
            x, y = x.to(device), y.to(device)
            outs = []
            for m in models:
                o = m(x)
                outs += list(o) if isinstance(o, tuple) else [o]
            p = torch.stack([o.float().softmax(-1) for o in outs]).mean(0)
            loss += float(torch.nn.functional.nll_loss(p.clamp_min(1e-12).log(), y, reduction="sum"))
            correct += int((p.argmax(-1) == y).sum())
            total += len(y)
    return {"loss": loss / max(total, 1), "accuracy": correct / max(total, 1)}


def _markdown(report: dict) -> str:
    lines = [f"# pyperm merge --method zipit\n", f"- inputs: {', '.join(report['inputs'])}",
             f"- outputs: {', '.join(report['outputs'])}",
             f"- alpha {report['alpha']}, beta {report['beta']}, stop {report['stop'] or 'none (full zip)'}",
             f"- groups zipped: {len(report['zipped_groups'])}; stops allowed: {', '.join(report['stops'])}",
             f"- same-model merges (A, B) per group: "
             + ", ".join(f"{g} {a}/{b}" for g, (a, b) in report["same_model_merges"].items()),
             f"- time: {report['seconds']:.2f} s over {report['num_batches']} batches", "",
             f"| model | test loss | test accuracy ({report['data']['name']}) |", "| --- | ---: | ---: |"]  # fmt: skip
    for name, e in report["evaluation"].items():
        lines.append(f"| {name} | {e['loss']:.4f} | {100 * e['accuracy']:.2f}% |")
    return "\n".join(lines) + "\n"
