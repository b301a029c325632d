"""Every example runs to the end, in smoke mode, in a fresh interpreter.

``BRIDGE_EXAMPLES_SMOKE=1`` makes the examples take a few steps only;
``BRIDGE_EXAMPLES_OUT`` sends their figures to a temporary directory, so the
committed ones in ``docs/`` are left alone.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

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
}


@pytest.mark.parametrize("name", list(CASES))
def test_example_runs_in_smoke_mode(name, tmp_path):
    needs, figures = CASES[name]
    for package in needs:
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{name} needs {package}")
    if "matplotlib" in needs:
        pytest.importorskip("matplotlib")
    env = {
        **os.environ,
        "BRIDGE_EXAMPLES_SMOKE": "1",
        "BRIDGE_EXAMPLES_OUT": str(tmp_path),
        "MPLBACKEND": "Agg",
    }
    # sharded_step.py sets its own device count; one from the test run's
    # environment (say, a multi-device session) must not override it.
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (
        f"{name} exited with {done.returncode}\n"
        f"--- stdout ---\n{done.stdout[-4000:]}\n--- stderr ---\n{done.stderr[-4000:]}"
    )
    for figure in figures:
        path = tmp_path / figure
        assert path.is_file() and path.stat().st_size > 0, f"{name} wrote no {figure}"


def test_the_quickstart_leaves_the_committed_figure_alone_unless_asked(tmp_path):
    for package in CASES["quickstart.py"][0]:
        pytest.importorskip(package)
    figure = EXAMPLES.parent / "docs" / "quickstart.png"
    before = figure.stat().st_mtime_ns if figure.exists() else None
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    env.pop("BRIDGE_EXAMPLES_OUT", None)
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "pass --plot to draw the figure" in done.stdout
    assert (figure.stat().st_mtime_ns if figure.exists() else None) == before
