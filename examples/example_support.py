"""What every example shares: how to install what it needs, the smoke mode of
the tests, and where its figure goes (nowhere unless asked).

An example runs as a script, ``python examples/NAME.py``, so this directory is
on ``sys.path`` and ``from example_support import ...`` finds this module.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

INSTALL = 'python -m pip install -e ".[all,examples]"'
INSTALL_TORCH = 'python -m pip install -e ".[all,examples,torch]"'

# Module names whose distribution is named otherwise.
_DISTRIBUTIONS = {"sklearn": "scikit-learn", "haiku": "dm-haiku"}

# ``BRIDGE_EXAMPLES_SMOKE=1``: a few steps and small models, for the tests.
SMOKE = os.environ.get("BRIDGE_EXAMPLES_SMOKE", "") not in ("", "0")


def require(*modules: str) -> None:
    """Exits with the install line if one of `modules` is not installed.

    Call it before importing them: the message names what is missing and the
    command that installs every example's dependencies (with PyTorch where
    `modules` include ``torch``), instead of a traceback.
    """
    missing = [name for name in modules if not _installed(name)]
    if missing:
        names = ", ".join(_DISTRIBUTIONS.get(name, name) for name in missing)
        install = INSTALL_TORCH if "torch" in modules else INSTALL
        script = Path(sys.argv[0]).name or "this example"
        raise SystemExit(
            f"{script} needs {names}, not installed here. From the repository's "
            f"root, install it and the other examples' dependencies with\n"
            f"    {install}"
        )


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a finder that refuses, a broken entry
        return False


class Figure:
    """The example's figure, written only where ``--out DIR`` (or the
    environment variable ``BRIDGE_EXAMPLES_OUT``) asks.

    Made at the top of the script, so that the command line is read (and
    ``--help`` answered) before any work; ``save`` draws at the end.
    """

    def __init__(self, name: str):
        self.name = name
        doc = (sys.modules["__main__"].__doc__ or "").strip().splitlines()
        parser = argparse.ArgumentParser(description=doc[0] if doc else None)
        parser.add_argument(
            "--out",
            metavar="DIR",
            type=Path,
            default=os.environ.get("BRIDGE_EXAMPLES_OUT") or None,
            help=f"write {name} into DIR (--out docs redraws the committed "
            "figure); without it, nothing is written",
        )
        out = parser.parse_args().out
        self.path = None if out is None else Path(out) / name

    def save(self, draw: Callable[[Path], None]) -> None:
        """Calls ``draw(path)`` if a directory was asked for; else says how to."""
        if self.path is None:
            print(f"(no figure written: pass --out DIR to write {self.name} there)")
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        draw(self.path)
        print(f"wrote {self.path}")
