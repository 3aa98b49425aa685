"""``pyperm reproduce NAME --smoke`` end to end: every report runs, writes its files, and its json parses.

The smoke settings are tiny (seconds each), so the findings themselves are not asserted; the
``--quick`` runs that are meant to agree with the papers are in the reports the README shows.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from pyperm.cli import main
from pyperm.reproduce import REPORTS, SCALES, load_report
from pyperm.testing import one_thread

NEEDS = {
    "curves": "pyperm.nn.align.proximal",
    "robust": "pyperm.nn.eval.robust",
    "teacher-student": "pyperm.teacher_student",
}


def _available(name: str) -> bool:
    module = NEEDS.get(name)
    return module is None or importlib.util.find_spec(module) is not None


@pytest.fixture(autouse=True)
def _one_thread():
    """The smoke models are tiny: one torch thread is fastest, and far faster on a shared machine."""
    with one_thread():
        yield


@pytest.mark.parametrize("name", list(REPORTS))
def test_smoke_report(name, tmp_path, capsys):
    assert _available(name), f"{NEEDS[name]} is missing"  # a missing feature fails, never skips
    report = load_report(name)
    out = tmp_path / name
    assert main(["reproduce", name, "--smoke", "--out", str(out), "--no-progress"]) == 0
    assert f"{name} (smoke) done" in capsys.readouterr().out
    for file in report.OUTPUTS:
        assert (out / file).stat().st_size > 0, file
        if file.endswith(".png"):
            assert (out / file).read_bytes()[:4] == b"\x89PNG", file
    body = json.loads((out / "report.json").read_text())
    assert body["scale"] == "smoke" and body["findings"]
    for finding in body["findings"]:
        assert set(finding) == {"source", "paper", "ours", "agrees", "test"}
        assert isinstance(finding["agrees"], bool)
    md = (out / "report.md").read_text()
    assert "## The papers' findings and ours" in md and "| source | paper | ours | agrees |" in md
    for file in report.OUTPUTS:
        if file.endswith(".png"):
            assert f"({file})" in md, f"{file} is not shown in report.md"


def test_reports_declare_their_outputs():
    for name in REPORTS:
        if not _available(name):
            continue
        report = load_report(name)
        assert "report.md" in report.OUTPUTS and "report.json" in report.OUTPUTS
        # Every report has the laptop scales; the papers' scale where the report reproduces a paper's setting.
        assert {"smoke", "quick", "full"} <= set(report.SETTINGS) <= set(SCALES), name
    assert all("paper" in load_report(n).SETTINGS for n in ("rebasin", "curves", "robust"))


def test_a_scale_the_report_lacks_is_named(tmp_path, capsys):
    assert main(["reproduce", "teacher-student", "--scale", "paper", "--out", str(tmp_path), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "--scale paper: the teacher-student report has no such scale" in err and "Traceback" not in err


def test_existing_report_is_refused(tmp_path, capsys):
    (tmp_path / "report.md").write_text("mine")
    assert main(["reproduce", "rebasin", "--smoke", "--out", str(tmp_path), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "report.md: exists; pass --force" in err and "Traceback" not in err
    assert (tmp_path / "report.md").read_text() == "mine"


def test_unknown_report_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "nope", "--out", "x"])
    assert exc.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err


def test_quick_and_smoke_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        main(["reproduce", "rebasin", "--quick", "--smoke", "--out", "x"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_reproduce_does_not_import_the_command_line():
    """The reports sit below the command line: pyperm.commands runs them, never the other way round."""
    import ast
    import pathlib

    import pyperm.reproduce

    for path in pathlib.Path(pyperm.reproduce.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n == "pyperm.commands" or n.startswith("pyperm.commands.") for n in names), path.name
