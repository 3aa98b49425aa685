r"""``pyperm barrier A B --model hf`` on diffusers pipeline folders (``model_index.json``): the path of the
pipeline, scored on a few prompts.

A point :math:`t` of the path is the whole pipeline interpolated, :math:`(1 - t)\,\Theta_A + t\,\Theta_B` for
every model component. Its text encoder is part of the path: each point encodes the prompts with its own
interpolated text encoder, and its interpolated UNet is scored by the denoising loss it was trained with on
latents conditioned on those prompts. That is the ``pipeline`` barrier. Two barriers split it by component:

- ``unet``: the interpolated UNet under text states interpolated linearly between the endpoints' own,
  :math:`(1 - t)\,c_A + t\,c_B`, so that only the UNet's weights leave the chord;
- ``vae`` (with ``--vae``): the interpolated VAE's reconstruction error of random images in [-1, 1].

The prompts are tokenized by A's tokenizer (B's must give the same token ids). The draws are fixed (seeded
by ``--seed``), so both endpoints and every point see the same latents, noises,
timesteps and prompts: ``--max-samples`` draws (16 by default), the prompts taken in turn. A draw's clean
latents :math:`x_0` and noise :math:`\epsilon` are standard normal, at the UNet's ``sample_size`` (or the
H, W of ``--example-input-shape``); the timestep is uniform over the training steps of A's scheduler, whose
noise schedule (Stable Diffusion's ``scaled_linear`` betas, for its pipelines) gives
:math:`x_t = \sqrt{\bar\alpha_t}\,x_0 + \sqrt{1 - \bar\alpha_t}\,\epsilon`, and whose ``prediction_type``
gives the target (the noise, the velocity or the sample). The loss is the mean squared error of the UNet's
prediction. Random latents measure how the models along the path agree with what they were trained to
predict, not image quality.

With ``--align weight`` each model component of B (text encoder, UNet, VAE) is matched to A's by weight
matching and the path to B permuted is evaluated too; permuting a text encoder's hidden units keeps its
outputs, so the endpoints are the same pipelines.

Supported: Stable Diffusion 1.x/2.x-shaped pipelines (a ``UNet2DConditionModel`` without added conditions,
one text encoder and its tokenizer, optionally an ``AutoencoderKL``); SDXL's second text encoder is refused
with the components to evaluate one at a time instead.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyperm.commands._common import CommandError
from pyperm.commands._diffusers import read_json_object

__all__ = ["DEFAULT_PROMPTS", "PromptDraws", "check_pipeline_options", "denoising_loss", "draws_for", "encode",
           "parse_prompts", "pipeline_barrier", "reconstruction_loss"]  # fmt: skip

#: The prompts scored when ``--prompts`` is not given: short captions of everyday scenes.
DEFAULT_PROMPTS = (
    "a photograph of an astronaut riding a horse",
    "a watercolour painting of a fox in the snow",
    "a bowl of fruit on a wooden table",
    "a city street at night in the rain",
)
_REQUIRED = {"unet": "UNet2DConditionModel", "text_encoder": None, "tokenizer": None}
#: Stable Diffusion's training schedule, used when a pipeline lists no scheduler.
_SD_SCHEDULE = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
                "prediction_type": "epsilon"}  # fmt: skip


def parse_prompts(value: str | None) -> list[str]:
    """``--prompts``: a file (one prompt a line, blank lines skipped) or prompts separated by commas."""
    if value is None:
        return list(DEFAULT_PROMPTS)
    path = Path(value)
    if path.is_file():
        try:
            prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as exc:
            raise CommandError(f"--prompts {value}: cannot read the file ({exc})") from exc
        if not prompts:
            raise CommandError(f"--prompts {value}: the file holds no prompt (one a line)")
        return prompts
    prompts = [p.strip() for p in value.split(",")]
    if not all(prompts):
        raise CommandError(f"--prompts {value!r}: an empty prompt between commas (give prompts separated by commas, "
                           "or a file with one prompt a line)")  # fmt: skip
    return prompts


@dataclass(frozen=True)
class PromptDraws:
    """The fixed draws every point of the path is scored on.

    ``ids`` holds the token ids of each prompt (one row a prompt); draw ``i`` is conditioned on prompt
    ``prompt_of[i]``, noised from ``noisy[i]`` at ``timesteps[i]``, and ``targets[i]`` is what the UNet
    should predict. ``images`` are the VAE's inputs (None without ``--vae``).
    """

    prompts: list[str]
    ids: Any
    attention_mask: Any
    prompt_of: Any
    noisy: Any
    timesteps: Any
    targets: Any
    images: Any
    schedule: dict[str, Any]

    @property
    def num_samples(self) -> int:
        return int(self.noisy.shape[0])


def _alphas_cumprod(schedule: dict[str, Any]) -> Any:
    """:math:`\\bar\\alpha_t` of a scheduler's config, through diffusers' DDPM scheduler (same betas)."""
    from pyperm._optional_imports import prepare_hf_import

    prepare_hf_import()
    import diffusers

    known = {k: schedule[k] for k in ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule",
                                      "trained_betas", "prediction_type") if k in schedule}  # fmt: skip
    try:
        return diffusers.DDPMScheduler(**known).alphas_cumprod
    except Exception as exc:
        raise CommandError(f"--model hf: the scheduler's noise schedule {known} is not one diffusers builds "
                           f"({exc})") from exc  # fmt: skip


def draws_for(prompts: list[str], tokenizer: Any, unet_config: Any, schedule: dict[str, Any], samples: int, seed: int,
              *, latent_hw: tuple[int, int] | None = None, vae_config: Any = None) -> PromptDraws:  # fmt: skip
    """The fixed draws of ``samples`` latents conditioned on ``prompts`` in turn (see the module's notes)."""
    import torch

    tokens = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                       return_tensors="pt")  # fmt: skip
    side = unet_config.sample_size
    hw = latent_hw or ((side, side) if isinstance(side, int) else tuple(side))
    shape = (samples, int(unet_config.in_channels), *hw)
    generator = torch.Generator().manual_seed(seed)
    latents, noise = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    steps = int(schedule["num_train_timesteps"])
    timesteps = torch.randint(0, steps, (samples,), generator=generator)
    alpha_bar = _alphas_cumprod(schedule).to(torch.float64)[timesteps].float().view(-1, 1, 1, 1)
    noisy = alpha_bar.sqrt() * latents + (1 - alpha_bar).sqrt() * noise
    prediction = schedule.get("prediction_type", "epsilon")
    if prediction == "epsilon":
        targets = noise
    elif prediction == "v_prediction":
        targets = alpha_bar.sqrt() * noise - (1 - alpha_bar).sqrt() * latents
    elif prediction == "sample":
        targets = latents
    else:
        raise CommandError(f"--model hf: the scheduler's prediction_type {prediction!r} is not one of epsilon, "
                           "v_prediction, sample")  # fmt: skip
    images = None
    if vae_config is not None:
        size = vae_config.sample_size
        size = size if isinstance(size, int) else size[0]
        images = torch.rand((samples, int(vae_config.in_channels), size, size), generator=generator) * 2 - 1
    prompt_of = torch.arange(samples) % len(prompts)
    return PromptDraws(list(prompts), tokens["input_ids"], tokens.get("attention_mask"), prompt_of, noisy, timesteps,
                       targets, images, dict(schedule))  # fmt: skip


def encode(text_encoder: Any, draws: PromptDraws) -> Any:
    """Each prompt's text states, as Stable Diffusion's pipelines compute them (the last hidden state; the
    attention mask only for a text encoder configured to use one)."""
    import torch

    mask = draws.attention_mask if getattr(text_encoder.config, "use_attention_mask", False) else None
    with torch.no_grad():
        return text_encoder(draws.ids, attention_mask=mask)[0]


def denoising_loss(unet: Any, states: Any, draws: PromptDraws, batch_size: int) -> float:
    """The mean squared error of ``unet``'s predictions over the draws, each under its prompt's ``states``."""
    import torch

    total = 0.0
    with torch.no_grad():
        for start in range(0, draws.num_samples, batch_size):
            sl = slice(start, start + batch_size)
            out = unet(draws.noisy[sl], draws.timesteps[sl], encoder_hidden_states=states[draws.prompt_of[sl]],
                       return_dict=False)[0]  # fmt: skip
            total += float(torch.nn.functional.mse_loss(out.double(), draws.targets[sl].double(), reduction="sum"))
    return total / draws.targets.numel()


def reconstruction_loss(vae: Any, draws: PromptDraws, batch_size: int) -> float:
    """The mean squared reconstruction error of the VAE (the mode of its posterior, decoded) over the images."""
    import torch

    total = 0.0
    with torch.no_grad():
        for x in draws.images.split(batch_size):
            out = vae.decode(vae.encode(x).latent_dist.mode()).sample
            total += float(torch.nn.functional.mse_loss(out.double(), x.double(), reduction="sum"))
    return total / draws.images.numel()


# ------------------------------------------------------------------------------ loading


def _check_components(class_name: str, components: list, index: Path, want_vae: bool) -> dict[str, Any]:
    """The components the path needs, by name; a CommandError names the index for one missing or unsupported."""
    by_name = {c.name: c for c in components}
    if "text_encoder_2" in by_name:
        raise CommandError(f"--model hf: {index} lists a second text encoder ({class_name}, SDXL-shaped): the "
                           "pipeline barrier scores Stable Diffusion 1.x/2.x-shaped pipelines; give the component "
                           f"folders one at a time instead (e.g. {index.parent / 'unet'})")  # fmt: skip
    needed = dict(_REQUIRED, **({"vae": "AutoencoderKL"} if want_vae else {}))
    for name, cls in needed.items():
        if name not in by_name:
            extra = " (--vae scores it)" if name == "vae" else ""
            raise CommandError(f"--model hf: {index} lists no component {name!r}, which the pipeline barrier "
                               f"needs{extra}")  # fmt: skip
        if cls is not None and by_name[name].class_name != cls:
            raise CommandError(f"--model hf: {index} has a {by_name[name].class_name} as {name!r}; the pipeline "
                               f"barrier scores a {cls}")  # fmt: skip
    return {name: by_name[name] for name in needed}


def _load(folder: Path, component: Any, device: Any) -> Any:
    """A component of a pipeline folder, by its class in model_index.json, in float32 and eval mode."""
    if component.library == "diffusers":
        from pyperm._optional_imports import prepare_hf_import

        prepare_hf_import()
        import diffusers as library
    elif component.library == "transformers":
        from pyperm.commands._hf import _transformers

        library = _transformers()
    else:
        raise CommandError(f"--model hf: {folder} is a {component.library} component ({component.class_name}); the "
                           "pipeline barrier reads diffusers and transformers components")  # fmt: skip
    cls = getattr(library, component.class_name, None)
    if cls is None:
        raise CommandError(f"--model hf: {folder}: {component.library} has no class {component.class_name!r}")
    try:
        if component.library == "diffusers":  # without accelerate, the default would print a recommendation
            loaded = cls.from_pretrained(str(folder), low_cpu_mem_usage=False)
        else:
            loaded = _quietly(cls.from_pretrained, str(folder))
    except Exception as exc:
        raise CommandError(f"--model hf: {folder} cannot be loaded as a {component.class_name} ({exc})") from exc
    if component.name == "tokenizer":
        return loaded
    return loaded.float().to(device).eval()


def _quietly(load: Any, folder: str) -> Any:
    """``load(folder)`` without transformers' progress bar of the weights (restored afterwards)."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return load(folder)
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _state(module: Any) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _check_pair(name: str, state_a: dict, state_b: dict, a: Path, b: Path) -> None:
    """Both sides' component ``name`` has the same tensors (keys and shapes); the error names B's config."""
    for key in sorted(state_a.keys() | state_b.keys()):
        if key not in state_a or key not in state_b:
            raise CommandError(f"--model hf: {b / name / 'config.json'} and {a / name / 'config.json'} describe "
                               f"different models: only one has the tensor {key!r}")  # fmt: skip
        if state_a[key].shape != state_b[key].shape:
            raise CommandError(f"--model hf: {b / name / 'config.json'} and {a / name / 'config.json'} describe "
                               f"different models: {key!r} is {tuple(state_b[key].shape)} in B, "
                               f"{tuple(state_a[key].shape)} in A")  # fmt: skip


def _check_tokens(prompts: list[str], tokenizer_a: Any, tokenizer_b: Any, a: Path, b: Path) -> None:
    """Both pipelines' tokenizers give the prompts the same token ids (every point encodes A's)."""
    ids = [t(prompts, padding="max_length", max_length=t.model_max_length, truncation=True)["input_ids"]
           for t in (tokenizer_a, tokenizer_b)]  # fmt: skip
    if ids[0] != ids[1]:
        raise CommandError(f"--model hf: {b / 'tokenizer'} gives the prompts other token ids than {a / 'tokenizer'}: "
                           "the text encoders of one path must read the same tokens")  # fmt: skip


def _schedule(folder: Path, components: list) -> dict[str, Any]:
    """The noise schedule of A's scheduler config, Stable Diffusion's when the pipeline lists no scheduler."""
    if not any(c.name == "scheduler" for c in components):
        return dict(_SD_SCHEDULE, source="Stable Diffusion's (no scheduler listed)")
    config = folder / "scheduler" / "scheduler_config.json"
    data = read_json_object(config)
    schedule = {k: data.get(k, v) for k, v in _SD_SCHEDULE.items()}
    if "trained_betas" in data and data["trained_betas"] is not None:
        schedule["trained_betas"] = data["trained_betas"]
    schedule["source"] = str(config)
    return schedule


# ------------------------------------------------------------------------------ the command


def check_pipeline_options(args: argparse.Namespace) -> None:
    """The options that apply to pipeline folders only are refused for others, and those that do not apply to
    pipeline folders are refused for them."""
    from pyperm.commands._pipeline import is_pipeline
    from pyperm.commands.barrier import refuse_data

    pipelines = args.model == "hf" and (is_pipeline(args.a) or is_pipeline(args.b))
    if not pipelines:
        for option, value in (("--prompts", args.prompts), ("--vae", args.vae)):
            if value:
                raise CommandError(f"{option}: applies to diffusers pipeline folders (model_index.json) only")
        return
    refuse_data(args, "pipeline folders", "a pipeline is scored on its denoising loss over latents of --prompts")


def pipeline_barrier(args: argparse.Namespace) -> int:
    """``pyperm barrier`` on two pipeline folders: evaluate the paths, write the reports and plots."""
    import numpy as np

    from pyperm._json import write_json
    from pyperm._staging import write_text
    from pyperm.commands._common import prepare_out, resolve_device
    from pyperm.commands._pipeline import INDEX, read_pipelines
    from pyperm.nn import plot_paths

    check_pipeline_options(args)
    device = resolve_device(args.device)
    a, b = Path(args.a), Path(args.b)
    class_name, components = read_pipelines([args.a, args.b])
    needed = _check_components(class_name, components, a / INDEX, args.vae)
    prompts = parse_prompts(args.prompts)
    names = ["report.json", "report.md", "barrier.png"] + (["vae.png"] if args.vae else [])
    out = prepare_out(Path(args.out), names, args.force)

    models = [n for n in ("text_encoder", "unet", "vae") if n in needed]
    modules = {n: _load(a / n, needed[n], device) for n in models}
    states_a = {n: _state(m) for n, m in modules.items()}
    states_b = {n: _state(_load(b / n, needed[n], device)) for n in models}
    for n in models:
        _check_pair(n, states_a[n], states_b[n], a, b)
    if modules["unet"].config.addition_embed_type is not None:
        raise CommandError(f"--model hf: {a / 'unet' / 'config.json'} has addition_embed_type="
                           f"{modules['unet'].config.addition_embed_type!r}: the pipeline barrier scores UNets "
                           "without added conditions (Stable Diffusion 1.x/2.x)")  # fmt: skip
    tokenizer = _load(a / "tokenizer", needed["tokenizer"], device)
    _check_tokens(prompts, tokenizer, _load(b / "tokenizer", needed["tokenizer"], device), a, b)
    hw = tuple(args.example_input_shape[-2:]) if args.example_input_shape else None
    draws = draws_for(prompts, tokenizer, modules["unet"].config, _schedule(a, components), args.max_samples or 16,
                      args.seed, latent_hw=hw, vae_config=modules["vae"].config if args.vae else None)  # fmt: skip
    draws = _on(draws, device)

    paths = {"naive": states_b}
    matchings: dict[str, Any] = {}
    if "weight" in args.align:
        paths["weight"], matchings["weight"] = _align(args, a, models, states_a, states_b, device)
    ts = np.linspace(0.0, 1.0, args.num_points)
    results = {label: _evaluate(modules, states_a, states_b_path, draws, ts, args) for label, states_b_path in
               paths.items()}  # fmt: skip

    report = {
        "command": "barrier",
        "a": str(a),
        "b": str(b),
        "model": f"hf ({class_name})",
        "pipeline": class_name,
        "prompts": prompts,
        "data": {"name": f"denoising of {draws.num_samples} latents of {len(prompts)} prompts (seed {args.seed})",
                 "samples": draws.num_samples, "latent_shape": list(draws.noisy.shape[1:]),
                 "schedule": draws.schedule},  # fmt: skip
        "paths": {label: r["pipeline"].to_dict() for label, r in results.items()},
        "components": {c: {label: r[c].to_dict() for label, r in results.items()} for c in _parts(args.vae)},
        "matching": matchings,
    }
    write_json(out / "report.json", report)
    denoising = {f"{label}: {c}": r[c] for label, r in results.items() for c in ("pipeline", "unet")}
    plot_paths(denoising, out / "barrier.png", title=f"{class_name}: denoising loss on {len(prompts)} prompts")
    if args.vae:
        plot_paths({label: r["vae"] for label, r in results.items()}, out / "vae.png", title="VAE reconstruction")
    write_text(out / "report.md", _markdown(report, results, args.vae))
    for label, r in results.items():
        parts = ", ".join(f"{c} {r[c].loss_barrier:.4g}" for c in _parts(args.vae) if c != "pipeline")
        print(f"{label:>10} path: pipeline loss barrier {r['pipeline'].loss_barrier:.4f} ({parts})")
    print(f"report: {out / 'report.md'}")
    return 0


def _parts(vae: bool) -> list[str]:
    return ["pipeline", "unet"] + (["vae"] if vae else [])


def _on(draws: PromptDraws, device: Any) -> PromptDraws:
    moved = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in vars(draws).items()}
    return PromptDraws(**moved)


def _align(args: argparse.Namespace, a: Path, models: list[str], states_a: dict, states_b: dict,
           device: Any) -> tuple[dict, dict]:  # fmt: skip
    """B's model components permuted into A's basin by weight matching, and each component's matching record."""
    from pyperm.commands._common import build_model
    from pyperm.commands._matching import match
    from pyperm.nn import apply_permutation

    permuted, info = {}, {}
    for n in models:
        loaded = build_model("hf", None, str(a / n), meta=True)
        try:
            perms, info[n] = match("weight", loaded, states_a[n], states_b[n], None, args, device)
        except CommandError as exc:
            raise CommandError(f"component {n!r}: {exc}") from exc
        permuted[n] = apply_permutation(loaded.spec, perms, states_b[n])
    return permuted, info


def _evaluate(modules: dict, states_a: dict, states_b: dict, draws: PromptDraws, ts: Any,
              args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """The barriers of one path: the pipeline, the UNet under interpolated text states, the VAE."""
    from pyperm._progress import progress_bar
    from pyperm.nn.state import interpolate

    text_encoder, unet = modules["text_encoder"], modules["unet"]
    text_encoder.load_state_dict(states_a["text_encoder"])
    states_at_a = encode(text_encoder, draws)
    text_encoder.load_state_dict(states_b["text_encoder"])
    states_at_b = encode(text_encoder, draws)
    losses: dict[str, list[float]] = {c: [] for c in _parts(args.vae)}
    bar = progress_bar(args.progress, len(ts), "path", "point")
    for t in ts:
        t = float(t)
        text_encoder.load_state_dict(interpolate(states_a["text_encoder"], states_b["text_encoder"], t))
        unet.load_state_dict(interpolate(states_a["unet"], states_b["unet"], t))
        losses["pipeline"].append(denoising_loss(unet, encode(text_encoder, draws), draws, args.batch_size))
        # As interpolate computes weights: t = 0 and t = 1 give the endpoints' own states exactly.
        chord_states = (1.0 - t) * states_at_a + t * states_at_b
        losses["unet"].append(denoising_loss(unet, chord_states, draws, args.batch_size))
        if args.vae:
            modules["vae"].load_state_dict(interpolate(states_a["vae"], states_b["vae"], t))
            losses["vae"].append(reconstruction_loss(modules["vae"], draws, args.batch_size))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return {c: _result(ts, values, draws.num_samples) for c, values in losses.items()}


def _result(ts: Any, losses: list[float], num_samples: int) -> Any:
    import numpy as np

    from pyperm.nn.eval.path import BarrierResult, chord

    loss = np.asarray(losses, dtype=np.float64)
    height = float(np.max(loss - chord(ts, loss)))
    return BarrierResult(ts=ts, loss=loss, accuracy=None, num_samples=num_samples, loss_barrier=max(height, 0.0),
                         accuracy_barrier=math.nan)  # fmt: skip


_WHAT = {
    "pipeline": "pipeline (text encoder and UNet interpolated together)",
    "unet": "UNet (text states interpolated between the endpoints')",
    "vae": "VAE (reconstruction of random images)",
}


def _markdown(report: dict[str, Any], results: dict, vae: bool) -> str:
    from pyperm._tables import markdown_table

    d = report["data"]
    prompts = "; ".join(f"`{p}`" for p in report["prompts"])
    lines = [
        f"# pyperm barrier: {report['a']} to {report['b']} ({report['pipeline']})",
        "",
        (f"- data: {d['name']}, latents of shape {tuple(d['latent_shape'])}, noise schedule from "
         f"{d['schedule']['source']} ({d['schedule']['prediction_type']} prediction)"),
        f"- prompts: {prompts}",
        "- barriers as in Git Re-Basin Definition 2.2 (height above the chord between the endpoints)",
        "",
        "![paths](barrier.png)",
        "",
    ]  # fmt: skip
    if vae:
        lines += ["![VAE](vae.png)", ""]
    rows = [[label, _WHAT[c], r[c].loss_barrier, r[c].loss_barrier_t, r[c].loss[0], r[c].loss[-1]]
            for label, r in results.items() for c in _parts(vae)]  # fmt: skip
    lines.append(markdown_table(["path", "evaluated", "loss barrier", "at t", "loss of A", "loss of B"], rows))
    for method, info in report["matching"].items():
        took = ", ".join(f"{c} {i['seconds']:.3f} s" for c, i in info.items())
        lines.append(f"\n{method} matching took {took}")
    for label, r in results.items():
        for c in _parts(vae):
            lines += ["", f"## {label} path: {_WHAT[c]}", "", r[c].to_markdown()]
    return "\n".join(lines) + "\n"
