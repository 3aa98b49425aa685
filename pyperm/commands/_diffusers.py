"""``--model hf`` on diffusers folders: a model's ``save_pretrained`` folder (``config.json`` with ``_class_name``,
``diffusion_pytorch_model*.safetensors``, sharded or not).

The model is built from its config by ``diffusers`` (an optional dependency: a clear error names it when it is
missing) and given a forward that takes one tensor, the noisy latents or the image, and returns one, the
model's ``sample``: the other inputs a UNet needs (a timestep, the text encoder's states, SDXL's added text and
time conditions) are fixed tensors built from the config's widths, so tracing and the function check see a
model like any other. ``state_dict`` keys, ``config`` and ``save_pretrained`` are the model's own, so an output
folder (the weights in the input's layout, ``config.json`` copied beside them) is one ``from_pretrained`` loads.

``pyperm align`` and ``pyperm merge`` take pipeline folders (``model_index.json``) component by component
(:mod:`pyperm.commands._pipeline`), and ``pyperm barrier`` scores a pipeline's path on a few prompts
(:mod:`pyperm.commands._pipeline_barrier`); where a model folder is expected, a pipeline folder is refused
with the components to give instead (``unet/``, ``vae/``).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from pyperm.commands._common import CommandError, LoadedModel

__all__ = ["SUPPORTED", "conditions", "diffusers_class_name", "diffusers_model", "evaluation_data"]

#: The diffusers model classes ``--model hf`` reads, and what their forward needs besides the sample.
SUPPORTED = ("UNet2DConditionModel", "UNet2DModel", "AutoencoderKL")


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path`` (a diffusers config or index); a CommandError naming the file if
    it cannot be read or holds something else."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CommandError(f"--model hf: {path} is not a readable JSON file ({exc})") from exc
    if not isinstance(data, dict):
        raise CommandError(f"--model hf: {path} does not hold a JSON object")
    return data


def diffusers_class_name(folder: Path) -> str | None:
    """The ``_class_name`` of a diffusers model folder's ``config.json``, None for other folders.

    Raises CommandError for a pipeline folder (``model_index.json``) or a config.json that is no JSON object.
    """
    if (folder / "model_index.json").is_file() and not (folder / "config.json").is_file():
        components = _components(folder / "model_index.json")
        raise CommandError(
            f"--model hf: {folder} is a diffusers pipeline folder (model_index.json): give one component folder "
            f"at a time, e.g. {folder / 'unet'} ({', '.join(components) or 'no model components listed'})"
        )
    config = folder / "config.json"
    if not config.is_file():
        return None
    name = read_json_object(config).get("_class_name")
    return name if isinstance(name, str) else None


def _components(index: Path) -> list[str]:
    """The model components (folders with a config.json) a pipeline's model_index.json lists (``unet``, ``vae``,
    ``text_encoder`` ...)."""
    try:
        data = json.loads(index.read_text())
    except (OSError, ValueError):
        return []
    return [k for k, v in data.items() if not k.startswith("_") and isinstance(v, list) and len(v) == 2 and v[0]
            and (index.parent / k / "config.json").is_file()]  # fmt: skip


def _diffusers(config: Path, name: str) -> Any:
    from pyperm._optional_imports import prepare_hf_import

    prepare_hf_import()
    try:
        import diffusers
    except ImportError as exc:
        raise CommandError(f"--model hf: {config} is a diffusers model ({name}), which needs diffusers: "
                           f"pip install diffusers ({exc})") from exc  # fmt: skip
    return diffusers


def _size(value: Any) -> int:
    return int(value if isinstance(value, int) else value[0])


def _single_sample_class(cls: type) -> type:
    """A subclass of the diffusers class ``cls`` whose ``forward(sample)`` returns the model's ``sample``."""

    class SingleSample(cls):  # type: ignore[misc, valid-type]
        _pyperm_single_sample = True
        _pyperm_interfaces = False  # True while tracing: see below

        def forward(self, sample, timestep=None):  # noqa: D401 - the model's own forward, its other inputs fixed
            if cls.__name__ == "AutoencoderKL" and self._pyperm_interfaces:
                # The latent space is the VAE's contract with the UNet (and its log-variance half with the
                # sampling of img2img): traced as an output, so that its channels are never permuted.
                posterior = self.encode(sample).latent_dist
                return self.decode(posterior.mode()).sample, posterior.parameters
            inputs = conditions(cls.__name__, self.config, sample)
            if timestep is not None:  # the denoising loss of pyperm barrier: one timestep per sample
                inputs["timestep"] = timestep
            return cls.forward(self, sample, **inputs, return_dict=False)[0]

    SingleSample.__name__ = SingleSample.__qualname__ = cls.__name__
    SingleSample.__module__ = cls.__module__
    return SingleSample


def conditions(name: str, config: Any, sample: Any) -> dict[str, Any]:
    """The inputs besides the sample that a model's forward needs: a timestep for a UNet, the text encoder's
    states (8 tokens) for a conditional one, SDXL's added text embeddings and time ids. Deterministic values
    (no random generator inside the traced forward), on the sample's device and dtype.

    Each is computed from the sample (plus the sample's first entry times zero): a graph exported with the
    example's fixed shapes then still has the conditions flow from the input, as one with dynamic sizes
    does through the batch size, so the units of the time and text embeddings are traced as hidden units,
    not as constants."""
    import torch

    if name == "AutoencoderKL":
        return {}
    batch, device, dtype = sample.shape[0], sample.device, sample.dtype
    zero = sample.reshape(batch, -1)[:, :1] * 0  # (batch, 1)

    def wave(*shape: int) -> torch.Tensor:
        count = 1
        for n in shape:
            count *= n
        values = torch.cos(torch.arange(count, device=device, dtype=dtype) * 0.37).reshape(shape)
        return values + zero.reshape(batch, *[1] * (len(shape) - 1))

    out: dict[str, Any] = {"timestep": (zero[:, 0] + 10).to(torch.int64)}
    if name == "UNet2DConditionModel":
        out["encoder_hidden_states"] = wave(batch, 8, int(config.cross_attention_dim))
        if config.addition_embed_type == "text_time":
            time_ids = 6  # SDXL: original size, crop corner, target size
            text = int(config.projection_class_embeddings_input_dim) - time_ids * int(config.addition_time_embed_dim)
            out["added_cond_kwargs"] = {"text_embeds": wave(batch, text), "time_ids": wave(batch, time_ids)}
        elif config.addition_embed_type is not None:
            raise CommandError(f"--model hf: UNet2DConditionModel with addition_embed_type="
                               f"{config.addition_embed_type!r} is not supported (None and 'text_time' are)")  # fmt: skip
    return out


def _example_shape(config: Any) -> tuple[int, ...]:
    """A small batch of samples: the spec does not depend on the spatial size, which needs only to halve once
    per down block (so the config's ``sample_size``, 512 for a VAE, is not used)."""
    side = 2 ** max(1, len(config.block_out_channels))
    return (2, int(config.in_channels), side, side)


def diffusers_model(folder: Path, name: str, shape: tuple[int, ...] | None, *, meta: bool = False) -> LoadedModel:
    """The model of the diffusers folder ``folder`` (class ``name``), with a one-tensor forward, and its spec."""
    import torch

    from pyperm.nn.trace import trace_model

    config_file = folder / "config.json"
    diffusers = _diffusers(config_file, name)
    if name not in SUPPORTED:
        raise CommandError(f"--model hf: {config_file} names diffusers class {name!r}; supported: {', '.join(SUPPORTED)}")
    cls = getattr(diffusers, name)
    try:
        config = cls.load_config(str(folder))
    except Exception as exc:
        raise CommandError(f"--model hf: {config_file} cannot be read by diffusers ({exc})") from exc
    single = _single_sample_class(cls)

    def build() -> Any:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return single.from_config(config).eval()

    try:
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = build()
    except CommandError:
        raise
    except Exception as exc:
        raise CommandError(f"--model hf: diffusers cannot build {name} from {config_file} ({exc})") from exc
    shape = shape or _example_shape(model.config)
    example = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    model._pyperm_interfaces = True  # a VAE's latents are traced as an output (SingleSample.forward)
    try:
        # The example's shapes only (no dynamic sizes: several times faster to export): only the spec is kept.
        spec = trace_model(model, example.to("meta") if meta else example, dynamic=False).spec
    finally:
        del model._pyperm_interfaces
    return LoadedModel(f"hf ({name})", model, spec, tuple(shape), example, build=build)


def evaluation_data(loaded: LoadedModel, samples: int, batch_size: int, seed: int) -> tuple[Any, Any]:
    """The batches ``pyperm barrier`` evaluates a diffusers model on, and its loss: ``(Data, loss_fn)``.

    A UNet: the denoising loss it was trained with, on fixed draws. ``samples`` latents
    :math:`x_0` and noises :math:`\\epsilon` from a standard normal, timesteps :math:`t` uniform in
    0..999 (seeded by ``seed``), noised with Stable Diffusion's schedule (``scaled_linear`` betas from
    0.00085 to 0.012), :math:`x_t = \\sqrt{\\bar\\alpha_t}\\,x_0 + \\sqrt{1 - \\bar\\alpha_t}\\,\\epsilon`; the loss is
    the mean squared error of the predicted noise, under the fixed conditions of :func:`conditions`.
    A VAE: the mean squared reconstruction error of ``samples`` images uniform in [-1, 1]. Random inputs
    measure how the models agree, not image quality; the accuracy is NaN.
    """
    import torch

    from pyperm.commands._common import Data

    generator = torch.Generator().manual_seed(seed)
    shape = (samples, *loaded.input_shape[1:])
    name = loaded.name.removeprefix("hf (").removesuffix(")")
    if name == "AutoencoderKL":
        images = torch.rand(shape, generator=generator) * 2 - 1
        batches = [(x, x) for x in images.split(batch_size)]
        what = f"reconstruction of {samples} random images"
    else:
        latents, noise = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
        timesteps = torch.randint(0, 1000, (samples,), generator=generator)
        betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float64) ** 2
        alpha_bar = torch.cumprod(1 - betas, 0)[timesteps].float().view(-1, 1, 1, 1)
        noisy = alpha_bar.sqrt() * latents + (1 - alpha_bar).sqrt() * noise
        batches = [((x, t), e) for x, t, e in zip(noisy.split(batch_size), timesteps.split(batch_size),
                                                  noise.split(batch_size))]  # fmt: skip
        what = f"denoising of {samples} noisy latents"
    data = Data(f"{what} (seed {seed})", batches, batches, samples, samples)
    return data, torch.nn.functional.mse_loss
