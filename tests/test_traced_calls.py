"""A site is a call in the computation that runs (DESIGN.md).

JAX runs the model's Python when it traces, and a trace is not a call:

- a `jax.jit` helper inside the model whose trace is cached (by `init`, by an
  earlier call at the same shapes) runs no Python, and one called twice in
  one model re-uses its first trace: bridge runs the model's own jits inline
  while it probes, so each call is a site;
- a `lax.scan` body whose carry changes type is traced twice and the first
  trace is thrown away: its calls are no sites;
- a call whose value reaches nothing is marked dead;
- a selected or patched site that a run does not reach raises, never a
  silent zero.

References do not use bridge: the models' computations written out by hand
from their parameters, differentiated with `jax.grad` with respect to
offsets inserted at each site, and plain `jax.grad` for the parameters.
"""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_tree_allclose, nnx_supported

import bridge
from bridge._probe import discovery_cache
from bridge._probe.jax_backend import ProbeBase

X = jax.random.normal(jax.random.key(1), (3, 5))
IN, HIDDEN, OUT = 5, 4, 2
TRACES = {"helper": 0}


@jax.jit
def helper(h):
    """A jitted function of the model's own code, with a tap inside."""
    TRACES["helper"] += 1
    return bridge.tap("inner", jnp.tanh(h)) * 2.0


def loss_fn(outputs):
    return jnp.sum(outputs**2)


# -- one model per library: Dense(4) -> helper (once or twice) -> Dense(2) ------


def linen_model(twice):
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = helper(nn.Dense(HIDDEN, name="first")(x))
            if twice:
                h = helper(h)
            return nn.Dense(OUT, name="head")(h)

    model = Model()
    variables = model.init(jax.random.key(0), X)  # traces `helper` at X's shapes
    p = variables["params"]
    weights = (
        p["first"]["kernel"],
        p["first"]["bias"],
        p["head"]["kernel"],
        p["head"]["bias"],
    )
    return bridge.probe(model, variables), weights


def haiku_model(twice):
    def forward(x):
        h = helper(hk.Linear(HIDDEN, name="first")(x))
        if twice:
            h = helper(h)
        return hk.Linear(OUT, name="head")(h)

    transformed = hk.without_apply_rng(hk.transform(forward))
    params = transformed.init(jax.random.key(0), X)
    weights = (
        params["first"]["w"],
        params["first"]["b"],
        params["head"]["w"],
        params["head"]["b"],
    )
    return bridge.probe(transformed, params), weights


class _EquinoxModel(eqx.Module):
    first: eqx.nn.Linear
    head: eqx.nn.Linear
    twice: bool = eqx.field(static=True)

    def __call__(self, x):
        h = helper(self.first(x))
        if self.twice:
            h = helper(h)
        return self.head(h)


def equinox_model(twice):
    k1, k2 = jax.random.split(jax.random.key(0))
    model = _EquinoxModel(
        eqx.nn.Linear(IN, HIDDEN, key=k1), eqx.nn.Linear(HIDDEN, OUT, key=k2), twice
    )
    jax.vmap(model)(X)  # warms `helper` at one example's shapes
    weights = (
        model.first.weight.T,
        model.first.bias,
        model.head.weight.T,
        model.head.bias,
    )
    return bridge.probe(model, vmap=True), weights


def nnx_model(twice):
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.first = nnx.Linear(IN, HIDDEN, rngs=rngs)
            self.head = nnx.Linear(HIDDEN, OUT, rngs=rngs)

        def __call__(self, x):
            h = helper(self.first(x))
            if twice:
                h = helper(h)
            return self.head(h)

    model = Model(nnx.Rngs(0))
    model(X)  # warms `helper`
    weights = (
        model.first.kernel.get_value(),
        model.first.bias.get_value(),
        model.head.kernel.get_value(),
        model.head.bias.get_value(),
    )
    return bridge.probe(model), weights


LIBRARIES = {
    "linen": linen_model,
    "haiku": haiku_model,
    "equinox": equinox_model,
    "nnx": nnx_model,
}


def reference(weights, twice, offsets=None, replace=None):
    """The model by hand: loss, and the value at each `inner` call."""
    w0, b0, w1, b1 = weights
    offsets = offsets or {}
    replace = replace or {}
    values = {}
    h = X @ w0 + b0[None]
    for name in ["inner", "inner#1"][: 2 if twice else 1]:
        t = replace.get(name, jnp.tanh(h)) + offsets.get(name, 0.0)
        values[name] = t
        h = t * 2.0
    out = h @ w1 + b1[None]
    return loss_fn(out), (out, values)


def reference_activation_grads(weights, twice):
    _, (_, values) = reference(weights, twice)
    zeros = {name: jnp.zeros_like(v) for name, v in values.items()}
    return jax.grad(lambda o: reference(weights, twice, offsets=o)[0])(zeros)


def _close(actual, expected):
    """At the tensor's own scale: float32 rounding differs across CPUs."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape
    scale = max(float(np.max(np.abs(expected))), 1e-6)
    assert float(np.max(np.abs(actual - expected))) <= 1e-5 * scale + 1e-7


@pytest.mark.parametrize("library", sorted(LIBRARIES))
@pytest.mark.parametrize("twice", [False, True], ids=["once", "twice"])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_tap_in_a_cached_jitted_helper_is_a_site_per_call(library, twice, mode):
    if library == "nnx" and not nnx_supported():
        pytest.skip("this flax has no NNX probes")
    probe, weights = LIBRARIES[library](twice)
    names = ["inner", "inner#1"] if twice else ["inner"]
    assert [name for name in probe.sites(X) if name.startswith("inner")] == names

    def run(probe, x):
        return probe.value_and_grad(loss_fn, x, at="inner*")

    result = jax.jit(run)(probe, X) if mode == "jit" else run(probe, X)
    want_loss, (_, want_values) = reference(weights, twice)
    want_grads = reference_activation_grads(weights, twice)
    _close(result.loss, want_loss)
    assert sorted(result.activation_grads) == names
    for name in names:
        _close(result.activations[name], want_values[name])
        _close(result.activation_grads[name], want_grads[name])
        assert float(jnp.max(jnp.abs(result.activation_grads[name]))) > 0


@pytest.mark.parametrize("library", sorted(LIBRARIES))
def test_a_patch_in_a_cached_jitted_helper_takes_effect(library):
    if library == "nnx" and not nnx_supported():
        pytest.skip("this flax has no NNX probes")
    probe, weights = LIBRARIES[library](False)
    patch = {"inner": lambda v: 0.5 * v}
    forward = probe.apply(X, patch=patch, at="inner")
    _, (_, values) = reference(weights, False)
    replaced = {"inner": 0.5 * values["inner"]}
    _, (want_out, _) = reference(weights, False, replace=replaced)
    _close(forward.outputs, want_out)
    _close(forward.activations["inner"], replaced["inner"])


def test_the_helpers_own_cache_is_left_as_it_was():
    """Inline while probing only: outside a probe, the helper's cached trace
    serves again (it is not traced anew), and probing added no entry."""
    probe, _ = linen_model(False)
    helper(jnp.ones((3, HIDDEN)))
    before = TRACES["helper"]
    probe.value_and_grad(loss_fn, X, at="inner")
    during = TRACES["helper"]
    assert during > before  # the probe ran the helper's Python
    helper(jnp.ones((3, HIDDEN)))
    jax.grad(lambda h: helper(h).sum())(jnp.ones((3, HIDDEN)))
    assert TRACES["helper"] == during


# -- a scan body traced twice -----------------------------------------------------


class _Stack(eqx.Module):
    """Stacked layers under `lax.scan` whose carry starts as a Python `0`:
    JAX traces the body twice and keeps the second trace."""

    layers: eqx.nn.Linear

    def __call__(self, x):
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def step(carry, layer):
            h, total = carry
            h = jnp.tanh(eqx.combine(layer, static)(h))
            return (h, total + jnp.mean(h)), None

        (h, total), _ = jax.lax.scan(step, (x, 0), dynamic)
        return h + total


def _stack_by_hand(weights, biases, x, offsets):
    total = 0.0
    h = x
    for i in range(weights.shape[0]):
        h = h @ weights[i].T + biases[i][None] + offsets[i]
        h = jnp.tanh(h)
        total = total + jnp.mean(h, axis=-1, keepdims=True)
    return jnp.sum((h + total) ** 2)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_scan_body_traced_twice_gives_one_site(mode):
    keys = jax.random.split(jax.random.key(0), 3)
    layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(IN, IN, key=k))(keys)
    probe = bridge.probe(_Stack(layers), vmap=True)
    assert list(probe.sites(X)) == ["layers"]
    assert probe.sites(X)["layers"].shape == (3, 3, IN)

    def run(probe, x):
        return probe.value_and_grad(lambda y: jnp.sum(y**2), x)

    result = jax.jit(run)(probe, X) if mode == "jit" else run(probe, X)
    offsets = jnp.zeros((3, 3, IN))
    want = jax.grad(lambda o: _stack_by_hand(layers.weight, layers.bias, X, o))(offsets)
    _close(result.activation_grads["layers"], want)


# -- dead calls -------------------------------------------------------------------


class _DroppedCall(eqx.Module):
    """Calls `norm` twice and drops the first result (a duplicated line)."""

    linear: eqx.nn.Linear
    norm: eqx.nn.LayerNorm

    def __call__(self, x):
        self.norm(x)
        return self.norm(self.linear(x))


def test_a_call_whose_value_reaches_nothing_is_marked_dead():
    model = _DroppedCall(
        eqx.nn.Linear(IN, IN, key=jax.random.key(0)), eqx.nn.LayerNorm(IN)
    )
    probe = bridge.probe(model, vmap=True)
    sites = ProbeBase._discover(probe, (X,), {})[0]
    assert [(site.name, site.dead) for site in sites] == [
        ("norm", True),
        ("linear", False),
        ("norm#1", False),
    ]
    result = probe.value_and_grad(lambda y: jnp.sum(y**2), X, at="norm")
    assert float(jnp.max(jnp.abs(result.activation_grads["norm"]))) == 0.0


# -- a site a run does not reach ---------------------------------------------------

TAPPING = {"on": True}


class _Branching(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(HIDDEN)(x)
        if TAPPING["on"]:  # read when traced: discovery and the run may differ
            h = bridge.tap("branch", h)
        return nn.Dense(OUT)(h)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_selected_site_the_run_does_not_reach_raises(mode):
    """A run that traces the model's Python again (a probe with `inside=`,
    whose runs rewrite functions discovery's trace does not know) and finds
    a branch of Python taken otherwise than at discovery raises, never a
    zero gradient. A run that evaluates discovery's trace computes what was
    discovered, as `jax.jit` reuses its trace; a cleared discovery cache sees
    the model as it is."""
    TAPPING["on"] = True
    model = _Branching()
    variables = model.init(jax.random.key(0), X)
    probe = bridge.probe(model, variables, inside=_Branching)
    discovery_cache.CACHE.clear()  # another test may have kept this structure's
    try:
        assert "branch" in probe.sites(X)  # discovery kept for this structure
        TAPPING["on"] = False

        def run(probe, x):
            return probe.value_and_grad(loss_fn, x, at="branch")

        with pytest.raises(
            bridge.BridgeError,
            match=r"Site 'branch' was selected or patched, but the model's code "
            r"did not reach it in this run: its gradient would be a silent zero",
        ):
            jax.jit(run)(probe, X) if mode == "jit" else run(probe, X)

        probe = bridge.probe(model, variables)
        TAPPING["on"] = True
        assert "branch" in probe.sites(X)
        TAPPING["on"] = False

        def replayed(probe, x):
            return probe.value_and_grad(loss_fn, x, at=["Dense_0", "branch"])

        result = jax.jit(replayed)(probe, X) if mode == "jit" else replayed(probe, X)
        # The tap is the identity: its gradient is Dense_0's output's.
        np.testing.assert_allclose(
            result.activation_grads["branch"], result.activation_grads["Dense_0"]
        )
        discovery_cache.CACHE.clear()
        with pytest.raises(bridge.BridgeError, match="matches no site"):
            probe.value_and_grad(loss_fn, X, at="branch")
    finally:
        TAPPING["on"] = True


def test_parameter_gradients_through_an_inlined_jit_are_plain_ones():
    probe, _ = linen_model(True)
    result = jax.jit(lambda p, x: p.value_and_grad(loss_fn, x))(probe, X)
    model, variables = probe.unwrap()
    want = jax.grad(lambda p: loss_fn(model.apply({"params": p}, X)))(
        variables["params"]
    )
    assert_tree_allclose(result.grads, want, rtol=1e-5, atol=1e-6)
