"""Shared helpers of the GroupNorm and diffusers tests: the share of hidden units a spec moves,
counting the fixed entries inside structured axes, and tiny diffusers models."""

from __future__ import annotations

import torch
from torch import nn

from pyperm._optional_imports import prepare_hf_import
from pyperm.nn.spec import Interleaved, Segments

# diffusers imports torchvision, which fails over a torch it was not built for: import it the
# tolerant way first, as the command line does, so that these files run on their own too.
prepare_hf_import()


def fixed_entries(spec, entry, length: int) -> int:
    """How many of an axis's ``length`` entries ``entry`` leaves in place (fixed parts of a Segments too)."""
    if entry is None:
        return length
    if isinstance(entry, (Segments, Interleaved)):
        return sum(p if isinstance(p, int) else fixed_entries(spec, p, spec.entry_length(p)) for p in entry.parts)
    return 0


def moved_share(model: nn.Module, spec, outputs: tuple[str, ...] = ()) -> float:
    """The share of the output channels of every convolution and Linear (those named in ``outputs``,
    which produce the model's outputs, excepted) that ``spec`` permutes."""
    sd = model.state_dict()
    total = fixed = 0
    for path, m in model.named_modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)) and path not in outputs:
            n = sd[f"{path}.weight"].shape[0]
            total += n
            fixed += fixed_entries(spec, spec.axes[f"{path}.weight"][0], n)
    return 1 - fixed / total


def tiny_unet(kind: str, seed: int = 0) -> tuple[nn.Module, tuple]:
    """A tiny UNet2DConditionModel (``"sd"``: SD-1.x style; ``"sdxl"``: added text/time conditioning,
    linear projections, two transformer layers) and its example inputs."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    common = dict(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
                  cross_attention_dim=16, norm_num_groups=8)  # fmt: skip
    if kind == "sd":
        model = UNet2DConditionModel(down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                     up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), attention_head_dim=8,
                                     **common)  # fmt: skip
        gen = torch.Generator().manual_seed(seed + 1)
        inputs = (torch.randn(2, 4, 8, 8, generator=gen), torch.tensor([3, 5]), torch.randn(2, 5, 16, generator=gen))
    else:
        model = UNet2DConditionModel(down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                     up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(4, 8),
                                     transformer_layers_per_block=(1, 2), addition_embed_type="text_time",
                                     addition_time_embed_dim=8, projection_class_embeddings_input_dim=8 * 6 + 16,
                                     use_linear_projection=True, **common)  # fmt: skip
        gen = torch.Generator().manual_seed(seed + 1)
        added = {"text_embeds": torch.randn(2, 16, generator=gen), "time_ids": torch.randn(2, 6, generator=gen)}
        inputs = (torch.randn(2, 4, 8, 8, generator=gen), torch.tensor([3, 5]), torch.randn(2, 5, 16, generator=gen),
                  None, None, None, None, added)  # fmt: skip
    return model.eval(), inputs


def tiny_vae(seed: int = 0) -> tuple[nn.Module, tuple]:
    """A tiny AutoencoderKL and its example input."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    model = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                          up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), latent_channels=4,
                          norm_num_groups=8, sample_size=16)  # fmt: skip
    return model.eval(), (torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(seed + 1)),)
