"""A strict test configuration, in the style of Equinox's.

Required imports: `BRIDGE_TEST_REQUIRED_IMPORTS` (set by `.ci/run`, unset by
default) names the packages the run's install must provide, separated by
spaces or commas. There, a skip because one of them does not import is a
failure (an Equinox broken by a missing `jaxtyping` once showed as one
SKIPPED line), and so is one of them not importing at all, skip or none
(`tests/cases` leaves out the conformance cases of an absent library). A skip
counts as caused by a required package when it is `pytest.importorskip`'s of
that package or a module under it, or when its reason names one that does not
import in that process (`find_spec` guards: "torch is not installed"). An
optional package (not named) still skips. Checked by
`tests/test_required_imports.py`.
"""

from __future__ import annotations

import functools
import importlib
import os
import re

import jax
import pytest
from helpers import FAST_COMPILE_XLA_FLAGS

# Keras 3 reads its backend once, at import: the tests probe Keras on JAX.
os.environ.setdefault("KERAS_BACKEND", "jax")
# Read when the CPU client starts, after this (`helpers.FAST_COMPILE_XLA_FLAGS`).
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), *FAST_COMPILE_XLA_FLAGS]
).strip()

jax.config.update("jax_numpy_rank_promotion", "raise")
# Test time only: on CPU, the partitionable threefry compiles each random draw
# several times slower (~10% of the suite); no test depends on the stream.
jax.config.update("jax_threefry_partitionable", False)


@functools.cache
def _build(builder):
    return builder()


@pytest.fixture
def allow_rank_promotion():
    """Transformers' Flax code broadcasts by rank promotion (`FlaxConv1D` adds a
    `(features,)` bias to `(batch, seq, features)`), which the suite's
    `jax_numpy_rank_promotion="raise"` refuses."""
    import jax

    with jax.numpy_rank_promotion("allow"):
        yield


@pytest.fixture
def case(request):
    """A conformance case, built once per session: probing never mutates it.
    Keras's own layers broadcast by rank promotion (`Dense` adds a `(units,)`
    bias to `(batch, units)`): its cases build and run with it allowed."""
    keras_case = request.param.__module__ == "cases.keras"
    with jax.numpy_rank_promotion("allow" if keras_case else "raise"):
        yield _build(request.param)


@pytest.hookimpl(tryfirst=True)  # before `-m 'not slow'` deselects
def pytest_collection_modifyitems(items):
    """Keep each conformance case on one xdist worker (`--dist loadgroup`): a
    case is built, and its eager operations compiled, once instead of once per
    worker.

    A PyTorch case has no jitted mode: its eager runs, in the slow tier for
    JAX cases (where the jitted run covers the behaviour), are its only runs
    and stay in the default tier.

    Outside the conformance suite, a test run eagerly whose twin runs the same
    behaviour under `jax.jit` (the same id, `jit` or `jitted` for `eager`)
    is in the slow tier: the jitted run traces the same Python, and CI keeps
    within its budget. The conformance suite's eager runs stay (where a slow
    mark does not say otherwise): every adapter is still run eagerly there.

    A test of `COVERED_BY_ITS_VARIANTS` keeps in the default tier a covering
    set of its variants (`_covered_variants`), the rest in the slow tier.
    """
    ids = {item.nodeid for item in items}
    _covered_variants(items)
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None:
            continue
        if "case" not in callspec.params:
            if _jitted_twin(item.nodeid) & ids:
                item.add_marker(pytest.mark.slow)
            continue
        parts = callspec.id.split("-")
        if parts[0] in ("eager", "jit"):
            parts = parts[1:]
        item.add_marker(pytest.mark.xdist_group("-".join(parts[:2])))
        if parts[0] == "torch":
            item.own_markers = [m for m in item.own_markers if m.name != "slow"]


#: Tests over a product of two things (a library and a spelling of a loop, a
#: model and a port's direction, an outer and an inner transform), each
#: variant costly, whose default tier runs each value of each factor once.
COVERED_BY_ITS_VARIANTS = frozenset(
    {
        "test_closed_over_scans.py::test_a_cell_a_scan_closes_over_is_a_site_per_step",
        "test_control_flow.py::test_a_branch_site_holds_the_branch_that_ran_and_zeros_elsewhere",
        "test_control_flow.py::test_one_call_in_a_branch_without_vmap_has_a_scalar_ran",
        "test_control_flow.py::test_a_branch_site_the_loss_does_not_reach_says_where_it_ran",
        "test_control_flow.py::test_a_site_in_a_fori_loop_holds_every_iteration",
        "test_control_flow.py::test_jvp_along_a_branch_site_equals_its_gradient",
        "test_control_flow.py::test_inputs_of_a_branch_site_are_recorded_where_it_ran",
        "test_control_flow.py::test_every_branch_site_is_a_site_holding_every_example",
        "test_control_flow.py::test_a_patch_in_a_branch_applies_where_it_runs",
        "test_control_flow.py::test_jvp_along_every_iteration_of_a_loop_site",
        "test_taps_traced_twice.py::test_a_tap_in_a_scan_traced_twice_is_one_site_of_every_iteration",
        "test_taps_traced_twice.py::test_a_tap_in_a_scan_bound_at_import_is_one_site_of_every_iteration",
        "test_cross_framework.py::test_ported_model_agrees_at_every_site",
        "test_cross_framework.py::test_the_models_disagreed_before_the_transfer",
        "test_cross_framework.py::test_transfer_equals_a_port_written_by_hand",
        "test_cross_framework.py::test_compare_finds_no_divergence",
        "test_cross_library.py::test_ported_model_agrees_at_every_site",
        "test_routing.py::test_a_layer_in_two_transforms_is_probed_or_refused_naming_one",
        "test_routing.py::test_jax_transform_inside_a_librarys_stack_is_weighed_by_the_router",
        "test_llama_ports.py::test_compare_names_each_bug_at_its_layer",
    }
)


def _covered_variants(items) -> None:
    """For each test of `COVERED_BY_ITS_VARIANTS` (ids `FIRST-REST`: its
    first factor, then the others), a variant whose first factor and whose
    rest both ran in an earlier variant of the default tier is in the slow
    tier: every library, every spelling, every direction still runs in CI,
    not every pairing of them."""
    seen: dict[str, tuple[set[str], set[str]]] = {}
    for item in items:
        test, _, rest = item.nodeid.partition("[")
        module_test = test.rsplit("/", 1)[-1]
        if module_test not in COVERED_BY_ITS_VARIANTS or not rest:
            continue
        if item.get_closest_marker("slow") is not None:
            continue
        first, _, others = rest.removesuffix("]").partition("-")
        firsts, rests = seen.setdefault(module_test, (set(), set()))
        if first in firsts and others in rests:
            item.add_marker(pytest.mark.slow)
        firsts.add(first)
        rests.add(others)


def _jitted_twin(nodeid: str) -> set[str]:
    """The ids a test run eagerly would have run under `jax.jit`."""
    test, _, rest = nodeid.partition("[")
    parts = rest.removesuffix("]").split("-")
    if "eager" not in parts:
        return set()
    return {
        f"{test}[{'-'.join(mode if part == 'eager' else part for part in parts)}]"
        for mode in ("jit", "jitted")
    }


#: The environment variable naming the packages the run must import.
REQUIRED_IMPORTS_VARIABLE = "BRIDGE_TEST_REQUIRED_IMPORTS"
REQUIRED_IMPORTS = tuple(
    os.environ.get(REQUIRED_IMPORTS_VARIABLE, "").replace(",", " ").split()
)

#: `pytest.importorskip`'s reasons: a failed import, a too old version.
_IMPORTORSKIP_REASON = re.compile(
    r"could not import '([\w.]+)'|module '([\w.]+)' has __version__"
)


@functools.cache
def _import_error(module: str) -> str | None:
    """Why `module` does not import here, or `None` where it does."""
    try:
        importlib.import_module(module)
    except Exception as error:  # a broken install raises anything
        return f"{type(error).__name__}: {error}"
    return None


def _required_package(module: str) -> str | None:
    """The required package `module` is or lies under, if any."""
    for package in REQUIRED_IMPORTS:
        if module == package or module.startswith(package + "."):
            return package
    return None


def required_import_failure(reason: str) -> str | None:
    """Why a skip with this reason is a failure under `REQUIRED_IMPORTS`, or
    `None` where it may stay a skip."""
    match = _IMPORTORSKIP_REASON.search(reason)
    if match:
        module = match.group(1) or match.group(2)
        package = _required_package(module)
        if package == module:
            return f"{module} is required"
        if package is not None:
            return f"{module} is under the required {package}"
    for package in REQUIRED_IMPORTS:
        named = re.search(rf"(?<![\w.]){re.escape(package)}(?!\w)", reason)
        if named and _import_error(package) is not None:
            return f"the required {package} does not import ({_import_error(package)})"
    return None


def _failed_instead(report, skipped: BaseException) -> None:
    why = required_import_failure(str(skipped))
    if why is None:
        return
    report.outcome = "failed"
    report.longrepr = (
        f"Skipped: {skipped}\n"
        f"A failure instead: {why}. {REQUIRED_IMPORTS_VARIABLE} says this "
        f"run's install provides {' '.join(REQUIRED_IMPORTS)}: a skip for one "
        "of them is a failure (tests/conftest.py)."
    )


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A module-level `pytest.importorskip` of a required package fails."""
    report = yield
    excinfo = getattr(getattr(report, "call", None), "excinfo", None)
    if REQUIRED_IMPORTS and report.skipped and excinfo is not None:
        _failed_instead(report, excinfo.value)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A skip in a test (or a fixture) for a required package fails."""
    report = yield
    if (
        REQUIRED_IMPORTS
        and report.skipped
        and not hasattr(report, "wasxfail")
        and call.excinfo is not None
        and isinstance(call.excinfo.value, pytest.skip.Exception)
    ):
        _failed_instead(report, call.excinfo.value)
    return report


def _missing_required_imports() -> list[str]:
    return [
        f"{package}: {_import_error(package)}"
        for package in REQUIRED_IMPORTS
        if _import_error(package) is not None
    ]


_MISSING = pytest.StashKey[list]()


def pytest_sessionfinish(session):
    """Every required package imports, whether or not a test skipped for it
    (checked once, where the results are reported: not on xdist's workers)."""
    if REQUIRED_IMPORTS and not hasattr(session.config, "workerinput"):
        session.config.stash[_MISSING] = missing = _missing_required_imports()
        if missing and session.exitstatus in (
            pytest.ExitCode.OK,
            pytest.ExitCode.NO_TESTS_COLLECTED,
        ):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config):
    missing = config.stash.get(_MISSING, [])
    if missing:
        terminalreporter.section("required imports", sep="=", red=True, bold=True)
        terminalreporter.line(
            f"{REQUIRED_IMPORTS_VARIABLE} names packages this environment does "
            "not import, so the run fails:",
            red=True,
        )
        for line in missing:
            terminalreporter.line(f"  {line}", red=True)
