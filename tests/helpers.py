"""Numerical helpers shared by the test modules."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

#: Test time only: XLA's CPU backend without LLVM's costly optimisations
#: compiles the suite's many small programs in 20-35% less CPU time
#: (tests/conftest.py sets them; the examples' subprocesses get them too).
#: No test measures speed, and the numbers stay IEEE float arithmetic.
FAST_COMPILE_XLA_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
)


def assert_tree_allclose(actual: Any, expected: Any, rtol=1e-5, atol=1e-6) -> None:
    assert jax.tree.structure(actual) == jax.tree.structure(expected), (
        f"structures differ:\n{jax.tree.structure(actual)}\n"
        f"{jax.tree.structure(expected)}"
    )
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert jnp.shape(a) == jnp.shape(e)
        assert jnp.result_type(a) == jnp.result_type(e)
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


def close(actual, expected):
    """Equal at the tensor's own scale: float32 rounding is no divergence."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(float(np.abs(expected).max()), 1e-6)
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=2e-6 * scale)


def numpy_snapshot(tree: Any) -> Any:
    """A deep copy of a pytree's leaves as numpy arrays (structure kept)."""
    return jax.tree.map(lambda x: np.array(x, copy=True), tree)


def assert_tree_equal(actual: Any, expected: Any) -> None:
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def random_like(struct: Any, seed: int = 0) -> Any:
    """Random normal values shaped like the `ShapeDtypeStruct` leaves."""
    leaves, treedef = jax.tree.flatten(struct)
    keys = jax.random.split(jax.random.key(seed), max(len(leaves), 1))
    values = [
        jax.random.normal(k, s.shape, jnp.float32).astype(s.dtype)
        for k, s in zip(keys, leaves, strict=False)
    ]
    return jax.tree.unflatten(treedef, values)


def tree_vdot(a: Any, b: Any) -> jax.Array:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return sum(jnp.vdot(x, y) for x, y in pairs)


def add_at_float_leaves(value: Any, delta: Any) -> Any:
    """`value + delta` where `delta` has `None` at the integer leaves."""
    deltas = iter(jax.tree.leaves(delta))
    return jax.tree.map(
        lambda x: x + next(deltas) if jnp.issubdtype(x.dtype, jnp.inexact) else x,
        value,
    )


def nnx_supported() -> bool:
    """Whether the installed flax has the NNX bridge probes (flax >= 0.12, the
    first with `nnx.List`); bridge raises an ImportError naming it before."""
    try:
        from flax import nnx
    except ImportError:
        return False
    return hasattr(nnx, "List")


def float_leaves(value: Any) -> list:
    """The floating-point leaves of `value`: those a site's gradient has."""
    return [x for x in jax.tree.leaves(value) if jnp.issubdtype(x.dtype, jnp.inexact)]


def assert_activations_equal_recorded(result: Any, recorded: dict) -> None:
    """Every site's activation equals the library's own recording of it, and
    its gradient has the shapes of the value's floating leaves."""
    assert set(result.activations) == set(recorded)
    assert set(result.activation_grads) == set(recorded)
    for site, value in result.activations.items():
        want = float_leaves(recorded[site])
        got = jax.tree.leaves(value)
        assert len(got) == len(want), site
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=site)
        grads = jax.tree.leaves(result.activation_grads[site])
        assert [g.shape for g in grads] == [w.shape for w in want], site


def assert_directional_derivatives(
    result: Any, sites: list, deltas: list, directional: Any
) -> None:
    """`vdot(activation_grad, delta)` at each site equals the reference's
    derivative of the loss along `delta` (a hand-inserted offset)."""
    for site, delta, expected in zip(sites, deltas, directional, strict=True):
        got = tree_vdot(float_leaves(result.activation_grads[site]), delta)
        assert abs(expected) > 1e-6, f"the reference offset at {site} moved nothing"
        np.testing.assert_allclose(got, expected, rtol=2e-4, atol=1e-6, err_msg=site)


def value_and_grad_in(mode: str, probe: Any, loss_fn: Any, args: tuple, kwargs=None):
    """`probe.value_and_grad(loss_fn, *args, **kwargs)`, eagerly or under
    `jax.jit` (`mode`); the probe is traced, the inputs closed over."""
    kwargs = kwargs or {}

    def run(probe):
        return probe.value_and_grad(loss_fn, *args, **kwargs)

    return (jax.jit(run) if mode == "jit" else run)(probe)


def assert_equals_plain(result: Any, loss: Any, grads: Any, state: Any) -> None:
    """Loss, parameter gradients and new state equal the plain call's."""
    np.testing.assert_allclose(result.loss, loss, rtol=1e-5)
    assert_tree_allclose(result.grads, grads, rtol=1e-4, atol=1e-5)
    if state is None:
        assert result.state is None
    else:
        assert_tree_allclose(result.state, state, rtol=1e-5, atol=1e-6)


def assert_sites_shaped_like_recorded(sites: dict, recorded: dict) -> None:
    """`probe.sites` names what the library records, with its float leaves' shapes."""
    assert set(sites) == set(recorded)
    for site, struct in sites.items():
        leaves = float_leaves(recorded[site])
        assert [s.shape for s in jax.tree.leaves(struct)] == [x.shape for x in leaves]


@contextlib.contextmanager
def leaves_out(*sites: str):
    """The block's `at=None` leaves out sites bridge cannot probe, with a
    `bridge.BridgeWarning` naming each of `sites` (never in silence)."""
    import bridge

    with pytest.warns(bridge.BridgeWarning) as caught:
        yield
    said = " ".join(
        str(w.message) for w in caught if issubclass(w.category, bridge.BridgeWarning)
    )
    for site in sites:
        assert repr(site) in said, f"no warning names {site!r}: {said}"


def left_out_or_refused(run: Any, *sites: str) -> Any:
    """`run()`, whose `at=None` meets sites bridge cannot probe: it leaves them
    out with a `bridge.BridgeWarning` naming each of `sites`, or, where nothing
    else is left, raises naming them. Returns `run()`'s result, `None` where
    it raised."""
    import bridge

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", bridge.BridgeWarning)
        try:
            result = run()
        except bridge.BridgeValueError as error:
            said = str(error)
            assert "leaves nothing to probe" in said, said
            result = None
        else:
            said = " ".join(
                str(w.message)
                for w in caught
                if issubclass(w.category, bridge.BridgeWarning)
            )
    for site in sites:
        assert repr(site) in said, f"nothing names {site!r}: {said!r}"
    return result


def jaxpr_traces_record_their_parent() -> bool:
    """Whether a jaxpr trace records the trace it runs in (jax >= 0.6.2):
    only then does the Equinox adapter read the transforms around a call
    inside Equinox's while loops (the core's one fallback); before, it is
    listed and refused, saying so."""
    from jax._src import core

    seen = []

    def f(x):
        seen.append(hasattr(core.trace_ctx.trace, "parent_trace"))
        return x

    jax.make_jaxpr(f)(1.0)
    return seen[0]


def jaxpr_traces_say_what_traced_them() -> bool:
    """Whether a jaxpr trace's debug info names the transform that traced it
    (`traced_for`: jax >= 0.6.2 keeps it on the trace): only then can a
    refusal inside `jax.closure_convert` name the conversion; before, it
    names a function the model's code traced apart."""
    from jax._src import core

    seen = []

    def f(x):
        frame = getattr(core.trace_ctx.trace, "frame", None)
        seen.append(getattr(getattr(frame, "debug_info", None), "traced_for", None))
        return x

    jax.closure_convert(f, 1.0)
    return seen[0] == "closure_convert"


def unrolled_linen_steps(step_fn, carry, xs, edits):
    """`step_fn(carry, x)` over `xs`' axis 1 unrolled in Python, without
    bridge: at step `t`, `edits[name](t, out)` replaces the output `out` of
    the submodule `name` that `step_fn` calls (of `step_fn` itself for `""`).
    Returns the outputs stacked on axis 1 and each edited name's values as
    they flow on, stacked per step."""
    import flax.linen as nn

    seen = {name: [] for name in edits}
    step = 0

    def edit(name, out):
        out = edits[name](step, out)
        seen[name].append(out)
        return out

    def hand(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        name = context.module.name
        if context.method_name == "__call__" and name != "" and name in edits:
            out = edit(name, out)
        return out

    ys = []
    with nn.intercept_methods(hand):
        for step in range(xs.shape[1]):
            carry, y = step_fn(carry, xs[:, step])
            if "" in edits:
                carry, y = edit("", (carry, y))
            ys.append(y)
    stacked = {
        name: jax.tree.map(lambda *v: jnp.stack(v), *outs)
        for name, outs in seen.items()
    }
    return jnp.stack(ys, 1), stacked
