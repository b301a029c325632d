"""Data parallelism through JAX's SPMD engine, on 8 simulated CPU devices.

Each library's script runs in a subprocess: the device count is fixed when JAX
starts.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPTS = pathlib.Path(__file__).parent / "multidevice"
LIBRARY_OF = {"linen": "flax", "nnx": "flax", "equinox": "equinox", "haiku": "haiku"}


#: Each script is a subprocess of its own (~30 s of compilation): one runs by
#: default, the others with the slow tier (`-m slow`).
SCRIPT_PARAMS = [
    pytest.param(stem, marks=() if stem == "linen_sharded" else pytest.mark.slow)
    for stem in sorted(p.stem for p in SCRIPTS.glob("*_sharded.py"))
]


@pytest.mark.parametrize("script", SCRIPT_PARAMS)
def test_batch_sharded_step_gives_single_device_numbers(script):
    library = LIBRARY_OF[script.removesuffix("_sharded")]
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed")
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
    }
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / f"{script}.py")],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
