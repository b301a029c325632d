"""`BRIDGE_TEST_REQUIRED_IMPORTS` (tests/conftest.py): under it, a skip because
a required package does not import fails, and an optional one still skips.

Each check runs pytest in a subprocess, in a directory of its own, on a few
tiny test files with this suite's conftest.py (copied, plus a hook recording
each outcome), under pytest-xdist as CI runs it (where reports cross from the
workers to the controller) unless the check is about something else.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

CONFTEST = pathlib.Path(__file__).with_name("conftest.py")

#: Appended to the copied conftest: each report's outcome, as the run's
#: controller sees it (after the workers' hooks made it), one JSON a line.
RECORDER = """

def pytest_runtest_logreport(report):
    _record(report)


def pytest_collectreport(report):
    _record(report)


def _record(report):
    if os.environ.get("PYTEST_XDIST_WORKER") or report.passed:
        return
    if report.when not in ("call", "collect", "setup"):
        return
    with open("outcomes.jsonl", "a") as out:
        out.write(json.dumps([report.nodeid, report.outcome]) + "\\n")
"""

#: `required_*` names a module the environment variable requires, `optional_*`
#: one it does not; neither is installed. `brokenpkg` is installed but its
#: import fails on a missing dependency (as Equinox without jaxtyping did).
FILES = {
    "brokenpkg/__init__.py": "import bridge_test_absent_dependency\n",
    "test_module_required.py": (
        "import pytest\n"
        "pytest.importorskip('bridge_test_required')\n"
        "def test_never_runs():\n    pass\n"
    ),
    "test_module_optional.py": (
        "import pytest\n"
        "pytest.importorskip('bridge_test_optional')\n"
        "def test_never_runs():\n    pass\n"
    ),
    "test_module_broken.py": (
        "import pytest\n"
        "pytest.importorskip('brokenpkg')\n"
        "def test_never_runs():\n    pass\n"
    ),
    "test_in_tests.py": """\
import importlib.util

import pytest


def test_required():
    pytest.importorskip("bridge_test_required")


def test_optional():
    pytest.importorskip("bridge_test_optional")


def test_required_submodule():
    pytest.importorskip("jax.bridge_test_absent_submodule")


def test_broken():
    pytest.importorskip("brokenpkg")


def test_required_by_find_spec():
    if importlib.util.find_spec("bridge_test_required") is None:
        pytest.skip("bridge_test_required is not installed")


def test_optional_by_find_spec():
    if importlib.util.find_spec("bridge_test_optional") is None:
        pytest.skip("bridge_test_optional is not installed")


def test_required_and_imported_but_skipped():
    pytest.skip("this jax lacks something")


@pytest.mark.skipif(True, reason="bridge_test_required is not installed")
def test_required_by_skipif():
    pass


@pytest.mark.xfail(reason="bridge_test_required", strict=True)
def test_xfail_stays_xfail():
    raise AssertionError


def test_passes():
    pass
""",
}

REQUIRED = "jax bridge_test_required brokenpkg"


def _run(directory: pathlib.Path, required: str | None, *files: str, workers=2):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.pop("BRIDGE_TEST_REQUIRED_IMPORTS", None)
    if required is not None:
        env["BRIDGE_TEST_REQUIRED_IMPORTS"] = required
    env["PYTHONPATH"] = str(directory)  # brokenpkg, found by find_spec
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + ["-p", "no:benchmark", "--continue-on-collection-errors"]
        + (["-n", str(workers)] if workers else ["-p", "no:xdist"])
        + list(files),
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    path = directory / "outcomes.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    outcomes = {}
    for line in lines:
        nodeid, outcome = json.loads(line)
        outcomes[nodeid.rpartition("::")[2] or nodeid] = outcome
    path.unlink(missing_ok=True)
    return done, outcomes


@pytest.fixture
def directory(tmp_path):
    (tmp_path / "conftest.py").write_text(
        CONFTEST.read_text() + "\nimport json\n" + RECORDER
    )
    # What the conftest imports of this suite's own.
    helpers = CONFTEST.with_name("helpers.py")
    (tmp_path / helpers.name).write_text(helpers.read_text())
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


TEST_FILES = [name for name in FILES if name.startswith("test_")]


def test_a_skip_for_a_required_import_fails_and_for_an_optional_one_skips(
    directory,
):
    done, outcomes = _run(directory, REQUIRED, *TEST_FILES)
    log = done.stdout + done.stderr
    assert outcomes == {
        # Module level: a collection error, or a skipped module.
        "test_module_required.py": "failed",
        "test_module_broken.py": "failed",
        "test_module_optional.py": "skipped",
        # Inside tests.
        "test_required": "failed",
        "test_required_submodule": "failed",
        "test_broken": "failed",
        "test_required_by_find_spec": "failed",
        "test_required_by_skipif": "failed",
        "test_optional": "skipped",
        "test_optional_by_find_spec": "skipped",
        "test_required_and_imported_but_skipped": "skipped",
        "test_xfail_stays_xfail": "skipped",
    }, log
    assert done.returncode == 1, log
    assert "No module named 'bridge_test_absent_dependency'" in log, log
    # And the summary names what does not import.
    assert "required imports" in log, log
    assert "bridge_test_required: ModuleNotFoundError" in log, log
    assert "brokenpkg: ModuleNotFoundError" in log, log
    assert "  jax: " not in log, log  # jax imports: not in the summary


def test_without_the_variable_every_missing_import_skips(directory):
    done, outcomes = _run(directory, None, *TEST_FILES, workers=0)
    log = done.stdout + done.stderr
    assert set(outcomes.values()) == {"skipped"}, (outcomes, log)
    assert len(outcomes) == 12, (outcomes, log)
    assert done.returncode == 0, log
    assert "required imports" not in log, log


def test_a_required_import_missing_fails_the_run_even_without_a_skip(directory):
    done, outcomes = _run(directory, REQUIRED, "test_in_tests.py::test_passes")
    log = done.stdout + done.stderr
    assert outcomes == {}, log
    assert "1 passed" in log, log
    assert done.returncode == 1, log
    assert "bridge_test_required: ModuleNotFoundError" in log, log

    done, _ = _run(directory, "jax", "test_in_tests.py::test_passes", workers=0)
    assert done.returncode == 0, done.stdout + done.stderr
