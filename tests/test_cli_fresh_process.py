"""``pyperm align --model hf`` on diffusers folders in a fresh interpreter, as a user runs it.

In a test process something may already have imported torchvision the tolerant way
(:func:`pyperm.testing.import_torchvision`), which hides whether the command does so itself: a
torchvision built for another torch (the registry's, beside the CPU torch) fails to import
("operator torchvision::nms does not exist"), and diffusers and transformers import it.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("diffusers")

from _diffusion import tiny_vae  # noqa: E402

# Children run from the tests folder: from the repository root, `-m pyperm` would import the
# source folder, which has no compiled module (the installed package is what is tested).
HERE = os.path.dirname(os.path.abspath(__file__))


def test_align_diffusers_folders_in_a_fresh_process(tmp_path):
    folders = []
    for seed in (0, 1):
        model, _ = tiny_vae(seed)
        folders.append(tmp_path / f"vae{seed}")
        model.save_pretrained(folders[-1])
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "pyperm", "align", str(folders[0]), str(folders[1]), "--model", "hf",
         "--out", str(out), "--no-progress"],
        cwd=HERE, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["model"] == "hf (AutoencoderKL)" and report["max_output_change_of_b"] < 1e-4
