"""Input checkpoints in each layout the writers keep (torch file, one safetensors file, two shards and
an index), shared by the kill and symlink tests of the checkpoint writer."""

from __future__ import annotations

import json
from pathlib import Path

import safetensors.torch
import torch

LAYOUTS = ["sharded", "safetensors", "torch"]


def write_layout(folder: Path, layout: str, state: dict[str, torch.Tensor]) -> Path:
    """``state`` written in ``layout`` into the new folder ``folder``; returns the path to load."""
    folder.mkdir()
    if layout == "torch":
        torch.save(state, folder / "m.pt")
        return folder / "m.pt"
    if layout == "safetensors":
        safetensors.torch.save_file(state, str(folder / "m.safetensors"))
        return folder / "m.safetensors"
    keys = sorted(state)
    weight_map = {k: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, k in enumerate(keys)}
    for shard in set(weight_map.values()):
        safetensors.torch.save_file({k: state[k] for k in keys if weight_map[k] == shard}, str(folder / shard))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder / "model.safetensors.index.json"
