"""A strict test configuration, in the style of Equinox's."""

import functools

import jax
import pytest

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
    """A conformance case, built once per session: probing never mutates it."""
    return _build(request.param)


@pytest.hookimpl(tryfirst=True)  # before `-m 'not slow'` deselects
def pytest_collection_modifyitems(items):
    """Keep each conformance case on one xdist worker (`--dist loadgroup`): a
    case is built, and its eager operations compiled, once instead of once per
    worker.

    A PyTorch case has no jitted mode: its eager runs, in the slow tier for
    JAX cases (where the jitted run covers the behaviour), are its only runs
    and stay in the default tier.
    """
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or "case" not in callspec.params:
            continue
        parts = callspec.id.split("-")
        if parts[0] in ("eager", "jit"):
            parts = parts[1:]
        item.add_marker(pytest.mark.xdist_group("-".join(parts[:2])))
        if parts[0] == "torch":
            item.own_markers = [m for m in item.own_markers if m.name != "slow"]
