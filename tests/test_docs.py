"""Every ```python block of the documentation runs.

One test per page (each page under ``docs/`` and the README): the page's python
blocks run in order, in one fresh interpreter, sharing one namespace, as a
reader pasting them one after the other would run them. Blocks in other
languages (``bash``, ``text``, ``console``) are not run. A failure names the
page and the line where the failing block starts.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ALL_PAGES = sorted(
    [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")],
    key=lambda path: str(path.relative_to(ROOT)),
)

# A fence opens with ``` or ~~~ (maybe indented, inside a list item) and a
# language; it closes with the same fence at the same indentation or less.
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")

# Runs the blocks given as JSON on stdin, in order, in one namespace.
_RUNNER = """
import json, sys, traceback
blocks = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
for page, path, line, source in blocks:
    try:
        # Padded, and named by the page's path, so that a traceback shows the
        # page's own lines.
        exec(compile("\\n" * line + source, path, "exec"), namespace)
    except BaseException:
        print(f"the python block at {page}:{line} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
"""


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """`(line of the opening fence, code)` for each ```python block, in order."""
    blocks = []
    lines = path.read_text(encoding="utf-8").splitlines()
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        language = opening["info"].strip().split(" ")[0].lower()
        body = []
        index += 1
        while index < len(lines):
            closing = _FENCE.match(lines[index])
            if (
                closing is not None
                and closing["fence"].startswith(fence)
                and not closing["info"].strip()
                and len(closing["indent"]) <= indent
            ):
                break
            body.append(lines[index])
            index += 1
        start = index - len(body)  # 1-based line of the opening fence
        if language in ("python", "py"):
            blocks.append((start, textwrap.dedent("\n".join(body)) + "\n"))
        index += 1
    return blocks


def _page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


# The pages with something to run (the API reference, for one, has none).
PAGES = [page for page in ALL_PAGES if python_blocks(page)]


def test_pages_are_found():
    names = {_page_id(path) for path in PAGES}
    assert {"README.md", "docs/index.md", "docs/concepts.md"} <= names


def test_fences_are_parsed(tmp_path):
    """Blocks in list items (indented) run too; other languages do not."""
    page = tmp_path / "page.md"
    page.write_text(
        "Text.\n```python\nx = 1\n```\n"
        "- item\n\n  ```bash\n  ls\n  ```\n"
        "  ```python\n  y = x\n  ```\n",
        encoding="utf-8",
    )
    assert python_blocks(page) == [(2, "x = 1\n"), (10, "y = x\n")]


#: Pages whose blocks the default tier runs otherwise: the README's, each on
#: its own (`test_every_readme_block_runs_on_its_own`), and Keras's page,
#: whose calls tests/test_keras.py and the Grad-CAM recipe's blocks make.
SLOW_PAGES = ("README.md", "docs/libraries/keras.md")


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(page, marks=pytest.mark.slow)
        if _page_id(page) in SLOW_PAGES
        else page
        for page in PAGES
    ],
    ids=_page_id,
)
def test_python_blocks_run(page, tmp_path):
    blocks = python_blocks(page)
    code = "\n".join(source for _, source in blocks)
    for package in ("torch", "transformers", "penzai", "matplotlib"):
        imported = re.search(rf"^\s*(import|from) {package}\b", code, re.MULTILINE)
        if imported and importlib.util.find_spec(package) is None:
            pytest.skip(f"{_page_id(page)} needs {package}")
    blocks_json = json.dumps(
        [(_page_id(page), str(page), line, source) for line, source in blocks]
    )
    # A file a block writes (a figure) lands in tmp_path.
    completed = subprocess.run(
        [sys.executable, "-c", _RUNNER],
        input=blocks_json,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert completed.returncode == 0, (
        f"{_page_id(page)}: {completed.stderr[-6000:]}\n{completed.stdout[-2000:]}"
    )


README_BLOCKS = python_blocks(ROOT / "README.md")


@pytest.mark.parametrize(
    "line, source", README_BLOCKS, ids=[f"line-{line}" for line, _ in README_BLOCKS]
)
def test_every_readme_block_runs_on_its_own(line, source):
    """A reader copies one library's snippet: its imports, data and loss are
    in it (the page's test runs them in order, sharing names)."""
    needed = re.findall(r"^(?:import|from) (\w+)", source, flags=re.MULTILINE)
    for module in needed:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    result = subprocess.run(
        [sys.executable, "-c", source],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, f"README.md:{line}\n{result.stderr[-3000:]}"
