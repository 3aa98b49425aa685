"""pyperm.show_config and pyperm.__version__: one version everywhere, and a report with every field."""

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import pyperm
from pyperm import _ext
from pyperm._ext import core

REPO = Path(__file__).resolve().parents[1]


def test_version_is_the_package_metadata():
    assert pyperm.__version__ == metadata.version("pyperm")
    # The compiled core was given the same version by CMake (scikit-build-core passes it on).
    assert core.build_info()["version"] == pyperm.__version__


def test_version_is_pyprojects():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = REPO / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip("no pyproject.toml beside the tests")
    with pyproject.open("rb") as f:
        assert tomllib.load(f)["project"]["version"] == pyperm.__version__


def test_show_config_prints_every_field(capsys):
    assert pyperm.show_config() is None
    out = capsys.readouterr().out
    for field in ("version:", "compiler:", "cxx flags:", "build type:", "compiled:", "chosen at run time:",
                  "module built:", "available:"):
        assert field in out, field
    assert f"version:    {pyperm.__version__}" in out
    assert f"chosen at run time: {core.best_isa()}" in out
    assert "baseline" in out  # every x86-64 build has the portable variant
    if pyperm.cuda_built():
        for field in ("architectures:", "runtime:", "driver:", "devices:"):
            assert field in out, field
    if not pyperm.cuda_available():
        assert f"unavailable because: {pyperm.cuda_unavailable_reason()}" in out


def test_show_config_dicts():
    cfg = pyperm.show_config(mode="dicts")
    assert list(cfg) == ["pyperm", "python", "build", "simd", "cuda", "dependencies"]
    assert cfg["pyperm"]["version"] == pyperm.__version__
    assert cfg["build"]["compiler"].split()[0] in {"GNU", "Clang", "AppleClang", "IntelLLVM"}
    simd = cfg["simd"]
    compiled = [entry.split(" ")[0] for entry in simd["compiled"].split(", ")]
    assert compiled[0] == "baseline"
    assert simd["chosen_at_run_time"] in compiled
    cuda = cfg["cuda"]
    assert cuda["available"] == pyperm.cuda_available()
    assert cuda["module_built"] == core.build_info()["cuda_built"]
    if pyperm.cuda_built():
        archs = cuda["architectures"].split(", ")
        assert archs and all(a.split("-")[0].isdigit() for a in archs)
        assert cuda["runtime"].startswith(_ext._load_cuda()[0].runtime_version())
    if not cuda["available"]:
        assert cuda["unavailable_because"] == pyperm.cuda_unavailable_reason()
    assert cfg["dependencies"]["numpy"] == metadata.version("numpy")


def test_show_config_says_why_cuda_is_missing(monkeypatch, capsys):
    why = "pyperm was built without CUDA support: (a test's stand-in)"
    monkeypatch.setattr(_ext, "_load_cuda", lambda: (None, why))
    pyperm.show_config()
    out = capsys.readouterr().out
    assert "available:           no" in out
    assert f"unavailable because: {why}" in out
    assert "architectures:" not in out


@pytest.mark.parametrize("mode", ["json", "", None, 1])
def test_show_config_rejects_unknown_modes(mode):
    with pytest.raises(ValueError, match="mode must be one of"):
        pyperm.show_config(mode=mode)


def test_show_config_imports_no_torch():
    code = "import sys, pyperm; pyperm.show_config(); assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO / "tests")
    assert done.returncode == 0, done.stderr
    assert "chosen at run time" in done.stdout
