"""Every example runs to the end, in smoke mode, in a fresh interpreter; says
how to install what it needs, and how when something is missing; and writes
into the repository only when asked.

``BRIDGE_EXAMPLES_SMOKE=1`` makes the examples take a few steps only;
``BRIDGE_EXAMPLES_OUT`` sends their figures to a temporary directory, so the
committed ones in ``docs/`` are left alone.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FAST_COMPILE_XLA_FLAGS

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
# Modules the examples import, not examples themselves.
HELPERS = ("example_support.py", "port_plot.py", "llama_ports.py")

# example -> (libraries it needs, figures it writes)
CASES = {
    "quickstart.py": (("flax", "sklearn", "matplotlib"), ("quickstart.png",)),
    "saliency.py": (
        ("equinox", "optax", "sklearn", "tqdm", "matplotlib"),
        ("saliency.png",),
    ),
    "gradient_flow.py": (
        ("haiku", "optax", "sklearn", "tqdm", "matplotlib"),
        ("gradient_flow.png",),
    ),
    "sharded_step.py": (("flax",), ()),
    "porting.py": (("flax", "equinox", "haiku"), ()),
    "kfac.py": (("flax", "matplotlib"), ("kfac.png",)),
    "mixture_of_experts.py": (("flax", "optax", "sklearn"), ()),
    "activation_patching.py": (
        ("flax", "optax", "matplotlib"),
        ("activation_patching.png",),
    ),
    "port_from_pytorch.py": (
        ("flax", "torch", "transformers", "matplotlib"),
        ("port_from_pytorch.png",),
    ),
    "attention_attribution.py": (
        ("flax", "optax", "torch", "transformers", "matplotlib"),
        ("attention_attribution.png",),
    ),
    "port_transformer.py": (
        ("flax", "torch", "transformers", "matplotlib"),
        ("port_transformer.png",),
    ),
    "penzai_adapter.py": (("penzai",), ()),
    "port_llama_equinox_nnx.py": (("equinox", "flax", "torch", "transformers"), ()),
    "keras_grad_cam.py": (("keras", "sklearn", "matplotlib"), ("keras_grad_cam.png",)),
}
# The quickest example that draws a figure: its smoke run is told where with
# --out (the others with BRIDGE_EXAMPLES_OUT), and it is run once without.
QUICK = "activation_patching.py"


def _environment(**overrides):
    """The test run's environment for an example, without the variables that
    would change what it does unless set here."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("XLA_FLAGS", "BRIDGE_EXAMPLES_OUT", "BRIDGE_EXAMPLES_SMOKE")
    }
    compile_fast = {"XLA_FLAGS": " ".join(FAST_COMPILE_XLA_FLAGS)}
    return {**env, "MPLBACKEND": "Agg", **compile_fast, **overrides}


def _run(command, cwd, env):
    return subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def _failure(name, done):
    return (
        f"{name} exited with {done.returncode}\n"
        f"--- stdout ---\n{done.stdout[-4000:]}\n--- stderr ---\n{done.stderr[-4000:]}"
    )


def _skip_unless_installed(name):
    for package in CASES[name][0]:
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{name} needs {package}")


#: Smoke runs whose work the default tier runs elsewhere: the ports (tested
#: on their own: tests/test_llama_ports.py, tests/test_hf_ports.py,
#: tests/test_cross_framework.py, and docs/porting.md's blocks), the examples
#: a recipe page of docs/recipes/ walks through (its blocks run in
#: tests/test_docs.py), and Penzai's adapter (tests/test_penzai.py): local
#: runs.
SLOW_EXAMPLES = (
    "port_llama_equinox_nnx.py",
    "port_transformer.py",
    "port_from_pytorch.py",
    "porting.py",
    "attention_attribution.py",
    "gradient_flow.py",
    "kfac.py",
    "saliency.py",
    "keras_grad_cam.py",
    "penzai_adapter.py",
)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.slow) if name in SLOW_EXAMPLES else name
        for name in CASES
    ],
)
def test_example_runs_in_smoke_mode(name, tmp_path):
    _skip_unless_installed(name)
    # sharded_step.py sets its own device count; one from the test run's
    # environment (say, a multi-device session) must not override it.
    env = _environment(BRIDGE_EXAMPLES_SMOKE="1")
    command = [sys.executable, str(EXAMPLES / name)]
    out = tmp_path / "figures"
    if name == QUICK:  # the directory asked for on the command line
        command += ["--out", str(out)]
    else:  # or in the environment
        env["BRIDGE_EXAMPLES_OUT"] = str(out)
    done = _run(command, tmp_path, env)
    assert done.returncode == 0, _failure(name, done)
    for figure in CASES[name][1]:
        path = out / figure
        assert path.is_file() and path.stat().st_size > 0, f"{name} wrote no {figure}"
        assert f"wrote {path}" in done.stdout


def test_every_example_is_run_by_these_tests():
    scripts = {path.name for path in EXAMPLES.glob("*.py")} - set(HELPERS)
    assert scripts == set(CASES)


def _support():
    spec = importlib.util.spec_from_file_location(
        "example_support", EXAMPLES / "example_support.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", list(CASES))
def test_the_docstring_names_an_install_line_of_existing_extras(name):
    tomllib = pytest.importorskip("tomllib")  # Python 3.11
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    docstring = ast.get_docstring(ast.parse((EXAMPLES / name).read_text()))
    lines = re.findall(r'python -m pip install -e "\.\[([^\]]*)\]"', docstring)
    assert len(lines) == 1, f"{name}: {len(lines)} install lines in its docstring"
    named = lines[0].split(",")
    assert set(named) <= set(extras), f"{name} names extras {named}, not all exist"
    # The same line that the example prints when something is missing.
    support = _support()
    needs_torch = "torch" in CASES[name][0]
    expected = support.INSTALL_TORCH if needs_torch else support.INSTALL
    assert expected in docstring
    # And the extras hold what the example needs.
    distributions = {"sklearn": "scikit-learn", "haiku": "dm-haiku"}
    held = " ".join(requirement for extra in named for requirement in extras[extra])
    for package in CASES[name][0]:
        assert distributions.get(package, package) in held, (name, package)


# Runs an example with its imports of one package refused, as if not installed.
_BLOCKED = """
import runpy, sys
blocked, script = sys.argv[1:]
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name == blocked or name.startswith(blocked + "."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Refuse())
sys.path.insert(0, str(__import__("pathlib").Path(script).parent))
sys.argv = [script]
runpy.run_path(script, run_name="__main__")
"""


@pytest.mark.parametrize(
    "name, missing",
    [("port_from_pytorch.py", "torch"), ("penzai_adapter.py", "penzai")],
)
def test_a_missing_package_is_named_with_the_install_line(name, missing, tmp_path):
    done = _run(
        [sys.executable, "-c", _BLOCKED, missing, str(EXAMPLES / name)],
        tmp_path,
        _environment(),
    )
    support = _support()
    install = support.INSTALL_TORCH if "torch" in CASES[name][0] else support.INSTALL
    assert done.returncode == 1, _failure(name, done)
    assert f"{name} needs {missing}, not installed" in done.stderr
    assert install in done.stderr
    assert "Traceback" not in done.stderr, done.stderr


# Text that people edit, possibly while the tests run in the same checkout:
# not what an example would write, so left out of the comparison.
_SOURCES = (".py", ".md", ".toml", ".yml", ".yaml", ".cfg", ".txt", ".sh")


def _repository_state():
    """What a run could change in the repository: git's view of its files but
    source text, and the committed figures' modification times."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout")
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    changed = {line for line in status if not line.endswith(_SOURCES)}
    figures = {path.name: path.stat().st_mtime_ns for path in ROOT.glob("docs/*.png")}
    return changed, figures


def test_an_example_run_without_out_writes_nothing(tmp_path):
    _skip_unless_installed(QUICK)
    before = _repository_state()
    done = _run(
        [sys.executable, str(EXAMPLES / QUICK)],
        tmp_path,
        _environment(BRIDGE_EXAMPLES_SMOKE="1"),
    )
    assert done.returncode == 0, _failure(QUICK, done)
    assert "pass --out DIR to write activation_patching.png" in done.stdout
    assert _repository_state() == before
    assert list(tmp_path.iterdir()) == []  # nor in the working directory
