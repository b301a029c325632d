"""CI (`.ci/run`) runs the README's test command verbatim, and requires the
imports of every package the install it runs provides (tests/conftest.py's
`BRIDGE_TEST_REQUIRED_IMPORTS`): a package added to an extra, or a floor's
pin, without its import named here would go back to skipping silently.
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import re
import shlex

import pytest
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
CI = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
CONTRIBUTING = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
SET_UP = README.split("\n## Set-up\n", 1)[1].split("\n## ", 1)[0]

#: The packages whose import name is not their distribution's.
IMPORT_NAMES = {"dm-haiku": "haiku", "scikit-learn": "sklearn"}
#: Installed by the tests' extras, but tools no test imports.
TOOLS = {"pytest", "pytest-xdist", "ruff"}


def _import_name(distribution: str) -> str:
    name = re.sub(r"[-_.]+", "-", distribution).lower()
    return IMPORT_NAMES.get(name, name.replace("-", "_"))


def _ci_commands() -> list[list[str]]:
    """`.ci/run`'s simple commands, as words: a command goes on over lines
    ending in `\\` and over the newlines inside its quotes."""
    commands, pending = [], ""
    for line in CI.splitlines():
        pending += line + "\n"
        try:
            words = shlex.split(pending.replace("\\\n", " "), comments=True)
        except ValueError:  # an open quote
            continue
        if not pending.rstrip().endswith("\\"):
            commands.append(words)
            pending = ""
    return [words for words in commands if words]


def test_the_readme_sets_up_in_two_commands_and_ci_runs_the_second():
    blocks = re.findall(r"```bash\n(.*?)```", SET_UP, re.DOTALL)
    assert len(blocks) == 2, blocks
    quickstart, tests = (block.strip() for block in blocks)
    assert "\n" not in quickstart and "\n" not in tests, blocks
    assert quickstart == (
        'python -m pip install -e ".[all,examples]" && python examples/quickstart.py'
    )
    assert tests.startswith('python -m pip install -e ".[all,test]" && ')
    assert tests in CI.splitlines(), "CI must run the README's test command"


def test_the_readme_quick_command_selects_existing_tests():
    quick = re.findall(r"`(python -m pytest [^`]*)`", SET_UP)
    assert len(quick) == 1, quick
    paths = [word for word in shlex.split(quick[0]) if word.startswith("tests/")]
    assert len(paths) >= 2, quick
    missing = [path for path in paths if not (ROOT / path).exists()]
    assert not missing, missing


def test_ci_leaves_the_slow_tier_to_local_runs():
    """CI stays within its 30 minutes: the slow tier (costlier duplicates of
    covered behaviours) runs locally, as CONTRIBUTING.md says."""
    commands = [line for line in CI.splitlines() if not line.lstrip().startswith("#")]
    assert not any("-m slow" in line for line in commands)
    assert "python -m pytest -q -n auto --dist loadgroup -m slow" in CONTRIBUTING


class _Item:
    """What `_covered_variants` reads of a collected test."""

    def __init__(self, nodeid: str, slow: bool = False):
        self.nodeid, self.slow = nodeid, slow

    def get_closest_marker(self, name: str):
        return name if name == "slow" and self.slow else None

    def add_marker(self, marker) -> None:
        self.slow = self.slow or marker.name == "slow"


def test_a_covered_test_keeps_every_value_of_each_factor_in_the_default_tier():
    import conftest

    test = (
        "tests/test_closed_over_scans.py::"
        "test_a_cell_a_scan_closes_over_is_a_site_per_step"
    )
    ids = ["a-x", "a-y", "b-x", "b-y", "c-z", "c-x"]
    items = [_Item(f"{test}[{variant}]") for variant in ids]
    other = _Item("tests/test_core.py::test_other[a-x]")
    already = _Item(f"{test}[d-w]", slow=True)
    conftest._covered_variants([*items, other, already])
    default = [v for v, item in zip(ids, items, strict=True) if not item.slow]
    assert default == ["a-x", "a-y", "b-x", "c-z"]
    assert not other.slow  # a test not listed keeps every variant
    # Every value of each factor still runs in the default tier.
    assert {v.split("-")[0] for v in default} == {"a", "b", "c"}
    assert {v.split("-")[1] for v in default} == {"x", "y", "z"}
    # A listed test's entry names a test that exists.
    for entry in conftest.COVERED_BY_ITS_VARIANTS:
        module, name = entry.split("::")
        assert f"def {name}(" in (ROOT / "tests" / module).read_text(encoding="utf-8")


def _exported_required() -> list[str]:
    (value,) = re.findall(
        r"^export BRIDGE_TEST_REQUIRED_IMPORTS=(.*)$", CI, re.MULTILINE
    )
    return shlex.split(value)[0].split()


def _requirements(extras: set[str]) -> set[str]:
    """The distributions `pip install ".[extras]"` names, its own extras
    expanded."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names, todo, seen = set(), list(project["dependencies"]), set()
    todo += [r for extra in extras for r in project["optional-dependencies"][extra]]
    while todo:
        requirement = Requirement(todo.pop())
        if requirement.name == project["name"]:
            for extra in requirement.extras - seen:
                seen.add(extra)
                todo += project["optional-dependencies"][extra]
        else:
            names.add(re.sub(r"[-_.]+", "-", requirement.name).lower())
    return names


def test_ci_requires_every_package_its_main_install_provides():
    (install,) = re.findall(r'pip install -e "\.\[([\w,]+)\]" && ', CI)
    distributions = _requirements(set(install.split(","))) - TOOLS
    assert {"jax", "flax", "equinox", "dm-haiku", "torch"} <= distributions
    required = set(_exported_required())
    missing = sorted(d for d in distributions if _import_name(d) not in required)
    assert not missing, f"add their imports to BRIDGE_TEST_REQUIRED_IMPORTS: {missing}"


def _minimum_runs() -> list[list[str]]:
    return [words[1:] for words in _ci_commands() if words[0] == "minimum"]


def test_each_minimum_run_requires_its_pins():
    runs = _minimum_runs()
    assert len(runs) == 2, runs
    for name, _, pins, _, required, *_keyword in runs:
        expected = {_import_name(Requirement(pin).name) for pin in pins.split()}
        assert set(required.split()) == expected, name


def test_the_import_names_are_the_packages_own():
    """Where a package is installed, the import name assumed for it above is
    one of its modules."""
    modules: dict[str, set[str]] = {}
    for module, distributions in importlib.metadata.packages_distributions().items():
        for distribution in distributions:
            name = re.sub(r"[-_.]+", "-", distribution).lower()
            modules.setdefault(name, set()).add(module)
    checked = 0
    for distribution in _requirements({"all", "test"}) - TOOLS:
        if distribution in modules:
            assert _import_name(distribution) in modules[distribution], distribution
            checked += 1
    assert checked >= 4  # jax, numpy, and the test tools at least
