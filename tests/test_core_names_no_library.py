"""The core names no model library: `bridge/` recognises a library's models
through the registry and its values through the adapter's porting side,
never by a module name (`type(x).__module__ == "torch"`). Only the registry's
built-in registrations and the supported versions name one."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

CORE = pathlib.Path(__file__).resolve().parents[1] / "bridge"

#: The files allowed to name a library's package: the built-in registrations
#: and the versions bridge supports.
ALLOWED = {CORE / "_probe" / "registry.py", CORE / "_versions.py"}

#: A string that is a library's module path: `"torch"`, `"flax.linen"`,
#: `"torch.bfloat16"`, `"torch."`.
LIBRARY_NAME = re.compile(
    r"^(torch|flax|haiku|equinox|transformers|penzai)(\.[A-Za-z_0-9]*)*$"
)


def _library_names(path: pathlib.Path) -> list[tuple[int, str]]:
    """`(line, string)` of each string constant naming a library's module."""
    return [
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and LIBRARY_NAME.match(node.value)
    ]


@pytest.mark.parametrize(
    "path",
    [p for p in sorted(CORE.rglob("*.py")) if p not in ALLOWED],
    ids=lambda p: str(p.relative_to(CORE)),
)
def test_the_core_names_no_library_package(path):
    found = _library_names(path)
    assert not found, (
        f"{path.relative_to(CORE.parent)} names a library at {found}: bridge/ "
        "recognises a library through the registry and the adapter's porting "
        "side, not by its module name"
    )


def test_the_reader_finds_a_library_name(tmp_path):
    source = tmp_path / "example.py"
    source.write_text(
        'x = type(v).__module__.split(".")[0] == "torch"\n'
        'y = str(d) == "torch.bfloat16"\n'
        'z = "torch tensors against JAX arrays"\n'
    )
    assert _library_names(source) == [(1, "torch"), (2, "torch.bfloat16")]


def test_the_registry_derives_the_library_packages():
    from bridge._session import inside_functions

    packages = set(inside_functions._LIBRARY_PACKAGES)
    assert {"flax", "haiku", "equinox", "torch", "jax", "builtins", "abc"} <= packages
    # A Hugging Face class's same-package bases are rewritten by `inside=`.
    assert "transformers" not in packages
