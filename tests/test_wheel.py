"""The installed pyperm is what a wheel must be.

Always: the CUDA module links the CUDA runtime statically (a user needs only a driver).
With PYPERM_TEST_INSTALLED=1, which .ci/run and .ci/build-wheels set when they test a wheel
installed into a fresh environment: pyperm is imported from that installed, non-editable copy
(not the source folder), its compiled modules are in the wheel's RECORD, and a manylinux
wheel's modules ask for no newer glibc or libstdc++ symbols than its tag allows and link only
the libraries every manylinux system has. The ELF checks read the modules with binutils'
readelf and skip where it is missing.
"""

import json
import os
import re
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

import pytest

import pyperm
from pyperm._ext import _load_cuda, core

REPO = Path(__file__).resolve().parents[1]
PACKAGE = Path(pyperm.__file__).resolve().parent
installed_only = pytest.mark.skipif(
    os.environ.get("PYPERM_TEST_INSTALLED") != "1", reason="tests an installed wheel (PYPERM_TEST_INSTALLED=1)"
)
needs_readelf = pytest.mark.skipif(shutil.which("readelf") is None, reason="needs binutils' readelf")

# Libraries every manylinux system provides (PEP 600; auditwheel's list, less the X11 and GLib ones).
MANYLINUX_LIBS = {
    "libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1", "libstdc++.so.6", "libgcc_s.so.1",
    "ld-linux-x86-64.so.2", "libutil.so.1", "libanl.so.1", "libresolv.so.2", "libnsl.so.1", "libz.so.1",
    "libatomic.so.1", "libmvec.so.1", "libexpat.so.1",
}  # fmt: skip
# The newest libstdc++ symbol versions manylinux_2_27/2_28 allow (GCC 7's libstdc++, CentOS/RHEL 8).
MAX_GLIBCXX_2_28 = (3, 4, 24)
MAX_CXXABI_2_28 = (1, 3, 11)


def cuda_module_file() -> Path | None:
    module = _load_cuda()[0]
    return None if module is None else Path(module.__file__)


def modules() -> list[Path]:
    """The compiled modules as loaded (an editable install keeps them outside the source folder),
    and any library auditwheel grafted beside the package."""
    found = [Path(core.__file__)] + [p for p in [cuda_module_file()] if p is not None]
    return found + sorted(Path(core.__file__).parent.parent.glob("pyperm.libs/*.so*"))


def needed(path: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def version_needs(path: Path) -> set[str]:
    """The symbol versions a module asks of its libraries (GLIBC_2.14, GLIBCXX_3.4.21, ...)."""
    out = subprocess.run(["readelf", "-V", "-W", str(path)], capture_output=True, text=True, check=True).stdout
    section = out.split(".gnu.version_r", 1)[1] if ".gnu.version_r" in out else ""
    return set(re.findall(r"Name: (\S+)\s+Flags", section))


def numbers(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version))


def wheel_tags() -> list[str]:
    wheel = metadata.distribution("pyperm").read_text("WHEEL") or ""
    return [line.split(":", 1)[1].strip() for line in wheel.splitlines() if line.startswith("Tag:")]


@needs_readelf
def test_cuda_runtime_is_linked_statically():
    cuda = cuda_module_file()
    if cuda is None:
        pytest.skip(f"no CUDA module: {_load_cuda()[1]}")
    libs = needed(cuda)
    assert not [lib for lib in libs if lib.startswith(("libcudart", "libcuda."))], libs


@installed_only
def test_imported_from_an_installed_wheel():
    assert PACKAGE != REPO / "pyperm", "pyperm was imported from the source folder, not the installed wheel"
    assert "site-packages" in PACKAGE.parts
    direct = metadata.distribution("pyperm").read_text("direct_url.json")
    if direct:
        assert not json.loads(direct).get("dir_info", {}).get("editable", False), "an editable install"


@installed_only
def test_wheel_record_lists_the_compiled_modules():
    files = {str(f) for f in metadata.files("pyperm") or []}
    assert any(re.fullmatch(r"pyperm/_core\..*\.so", f) for f in files), sorted(files)
    if core.build_info()["cuda_built"]:
        assert any(re.fullmatch(r"pyperm/_cuda\..*\.so", f) for f in files), sorted(files)
        assert pyperm.cuda_built(), pyperm.cuda_unavailable_reason()


@installed_only
@needs_readelf
def test_manylinux_wheel_needs_no_newer_symbols():
    plats = [tag.split("-")[-1] for tag in wheel_tags()]
    glibc = [numbers(p)[1] for p in plats if re.fullmatch(r"manylinux_2_\d+_x86_64", p)]
    if not glibc:
        pytest.skip(f"not a manylinux wheel: {plats}")
    newest = (2, max(glibc))
    for module in modules():
        libs = needed(module)
        assert set(libs) <= MANYLINUX_LIBS, f"{module.name} links {sorted(set(libs) - MANYLINUX_LIBS)}"
        for version in version_needs(module):
            assert version != "GLIBC_PRIVATE", f"{module.name} uses glibc's private symbols"
            if re.fullmatch(r"GLIBC_[\d.]+", version):
                assert numbers(version) <= newest, f"{module.name} needs {version}, newer than manylinux_2_{newest[1]}"
            elif re.fullmatch(r"GLIBCXX_[\d.]+", version) and newest <= (2, 28):
                assert numbers(version) <= MAX_GLIBCXX_2_28, f"{module.name} needs {version}"
            elif re.fullmatch(r"CXXABI_[\d.]+", version) and newest <= (2, 28):
                assert numbers(version) <= MAX_CXXABI_2_28, f"{module.name} needs {version}"
