"""Any adapter gets every transform right: sites read from the computation.

The adapter here (`tests/minimal_adapter.py`) is written against
`bridge.adapter_api` alone and knows nothing of JAX's transforms: it reaches
each layer call and names it. A layer call or a `bridge.tap` inside the
model's own `jax.vmap`, `lax.scan` (however spelled: `jax.lax.scan`, `from
jax.lax import scan`, `lax.map`, a static `fori_loop`), `lax.cond` or
`jax.jit` is a site with the right values, per-example and per-iteration
gradients and `ran`, each checked against the model written again by hand
with an offset added at every site (the loops unrolled in Python).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import close
from jax import lax
from jax.lax import scan as imported_scan
from minimal_adapter import Dense, dense, model

import bridge

LAYERS = {"a": Dense(4, 5), "b": Dense(5, 5), "c": Dense(5, 2)}
X = jnp.linspace(-1.0, 1.5, 12).reshape(3, 4)


def loss_fn(out):
    return jnp.sum(jnp.sin(out) ** 2)


def stacked(h):
    return jnp.stack([h, 0.5 * h, -h])


# -- the model's loops, however spelled, and the same loop unrolled by hand ------


def step(layers, v):
    return bridge.tap("t", jnp.tanh(layers["b"](v)))


def loop_scan(layers, hs):
    return lax.scan(lambda c, v: (c, step(layers, v)), 0.0, hs)[1].sum(0)


def loop_imported_scan(layers, hs):
    return imported_scan(lambda c, v: (c, step(layers, v)), 0.0, hs)[1].sum(0)


def loop_map(layers, hs):
    return lax.map(lambda v: step(layers, v), hs).sum(0)


def loop_fori(layers, hs):
    return lax.fori_loop(
        0, 3, lambda i, acc: acc + step(layers, hs[i]), jnp.zeros_like(hs[0])
    )


LOOPS = {
    "jax.lax.scan": loop_scan,
    "from jax.lax import scan": loop_imported_scan,
    "jax.lax.map": loop_map,
    "jax.lax.fori_loop": loop_fori,
}


def looped(loop):
    def forward(layers, x):
        h = layers["a"](x)
        return layers["c"](loop(layers, stacked(h)))

    return forward


def looped_by_hand(params, x, eps):
    """The loop unrolled in Python, an offset at every site and iteration."""
    h = dense(params["a"], x) + eps["a"]
    total = 0.0
    for i, v in enumerate(stacked(h)):
        b = dense(params["b"], v) + eps["b"][i]
        total = total + jnp.tanh(b) + eps["t"][i]
    return dense(params["c"], total) + eps["c"]


def looped_values(params, x):
    h = dense(params["a"], x)
    b = jnp.stack([dense(params["b"], v) for v in stacked(h)])
    return {"a": h, "b": b, "t": jnp.tanh(b), "c": None}


# -- the model's own vmap, jit and cond -------------------------------------------


def mapped(layers, x):
    h = layers["a"](x)
    h = jax.vmap(step, in_axes=(None, 0))(layers, h)
    return layers["c"](h)


def jitted(layers, x):
    h = layers["a"](x)
    h = jax.jit(lambda v: step(layers, v))(h)
    return layers["c"](h)


def straight_by_hand(params, x, eps):
    h = dense(params["a"], x) + eps["a"]
    b = dense(params["b"], h) + eps["b"]
    t = jnp.tanh(b) + eps["t"]
    return dense(params["c"], t) + eps["c"]


def straight_values(params, x):
    h = dense(params["a"], x)
    b = dense(params["b"], h)
    return {"a": h, "b": b, "t": jnp.tanh(b), "c": None}


CASES = {
    **{
        f"loop: {name}": (looped(loop), looped_by_hand, looped_values)
        for name, loop in LOOPS.items()
    },
    "jax.vmap": (mapped, straight_by_hand, straight_values),
    "jax.jit": (jitted, straight_by_hand, straight_values),
}


def run(probe, mode, **kwargs):
    call = lambda p, x: p.value_and_grad(loss_fn, x, **kwargs)  # noqa: E731
    return (jax.jit(call) if mode == "jit" else call)(probe, X)


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("case", list(CASES))
def test_values_and_gradients_against_the_model_by_hand(case, mode):
    forward, by_hand, values = CASES[case]
    probe = bridge.probe(model(LAYERS, forward))
    params = probe.params
    sites = probe.sites(X)
    assert list(sites) == ["a", "b", "t", "c"]
    zeros = {name: jnp.zeros(s.shape, s.dtype) for name, s in sites.items()}
    res = run(probe, mode)

    def hand_loss(params, eps):
        return loss_fn(by_hand(params, X, eps))

    loss, (param_grads, activation_grads) = jax.value_and_grad(
        hand_loss, argnums=(0, 1)
    )(params, zeros)
    close(res.loss, loss)
    jax.tree.map(close, res.grads, param_grads)
    for name in sites:
        close(res.activation_grads[name], activation_grads[name])
    for name, value in values(params, X).items():
        if value is not None:
            close(res.activations[name], value)
    # The bias identity: b's bias gradient is its output gradient summed over
    # every axis but the features.
    close(
        res.grads["b"]["b"],
        res.activation_grads["b"].reshape(-1, 5).sum(0),
    )
    assert res.ran == {}


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("loop", list(LOOPS))
def test_patch_per_iteration(loop, mode):
    probe = bridge.probe(model(LAYERS, looped(LOOPS[loop])))
    patch = jnp.arange(45.0).reshape(3, 3, 5) / 45.0
    res = run(probe, mode, at="t", patch={"b": patch, "t": lambda t: t * 2.0})

    def hand(params, eps):
        h = dense(params["a"], X)
        total = 0.0
        for i, _ in enumerate(stacked(h)):
            total = total + 2.0 * jnp.tanh(patch[i]) + eps[i]
        return loss_fn(dense(params["c"], total))

    loss, grad = jax.value_and_grad(hand, argnums=1)(probe.params, jnp.zeros((3, 3, 5)))
    close(res.loss, loss)
    close(res.activation_grads["t"], grad)
    close(res.activations["t"], 2.0 * jnp.tanh(patch))


def test_inputs_per_iteration():
    probe = bridge.probe(model(LAYERS, looped(loop_scan)))
    res = probe.value_and_grad(loss_fn, X, at="b", with_inputs=True)
    (inputs,) = res.inputs["b"]
    close(inputs, stacked(dense(probe.params["a"], X)))


def branched(layers, x):
    h = layers["a"](x)
    return lax.cond(
        jnp.sum(x) > 0,
        lambda v: layers["c"](step(layers, v)),
        lambda v: 2.0 * v[:, :2],
        h,
    )


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_cond_holds_the_branch_that_ran(sign, mode):
    probe = bridge.probe(model(LAYERS, branched))
    x = sign * X
    call = lambda p, x: p.value_and_grad(loss_fn, x)  # noqa: E731
    res = (jax.jit(call) if mode == "jit" else call)(probe, x)
    took = bool(jnp.sum(x) > 0)
    assert {name: bool(where) for name, where in res.ran.items()} == {
        "b": took,
        "t": took,
        "c": took,
    }

    def hand(params, eps):
        h = dense(params["a"], x) + eps["a"]
        if not took:
            return loss_fn(2.0 * h[:, :2])
        t = jnp.tanh(dense(params["b"], h) + eps["b"]) + eps["t"]
        return loss_fn(dense(params["c"], t) + eps["c"])

    assert_matches_by_hand(res, probe, x, hand)
    b = dense(probe.params["b"], dense(probe.params["a"], x))
    close(res.activations["b"], b if took else jnp.zeros_like(b))


def assert_matches_by_hand(res, probe, x, hand):
    """The loss, parameter and activation gradients of `res` equal those of
    `hand(params, offsets)`, the model written by hand with an offset at
    every site, differentiated by `jax.grad` at zero offsets."""
    sites = probe.sites(x)
    zeros = {name: jnp.zeros(s.shape) for name, s in sites.items()}
    loss, (param_grads, grads) = jax.value_and_grad(hand, argnums=(0, 1))(
        probe.params, zeros
    )
    close(res.loss, loss)
    jax.tree.map(close, res.grads, param_grads)
    for name in sites:
        close(res.activation_grads[name], grads[name])


def branched_per_example(layers, x):
    h = layers["a"](x)
    return lax.cond(
        jnp.sum(x) > 0,
        lambda v: layers["c"](step(layers, v)),
        lambda v: 2.0 * v[:2],
        h,
    )


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_probe_vmap_around_a_branch_on_each_example(mode):
    """`vmap=True` around a branch on a per-example predicate, where JAX
    computes both branches and selects: `ran` says which examples took it,
    their values are the branch's and the others' zeros, and each example's
    gradients are its own, against the branch taken by hand per example."""
    probe = bridge.probe(model(LAYERS, branched_per_example), vmap=True)
    took = jnp.sum(X, axis=1) > 0
    assert took.any() and not took.all(), "the batch must take both branches"
    call = lambda p, x: p.value_and_grad(loss_fn, x)  # noqa: E731
    res = (jax.jit(call) if mode == "jit" else call)(probe, X)
    assert set(res.ran) == {"b", "t", "c"}
    for where in res.ran.values():
        np.testing.assert_array_equal(where, took)

    def hand(params, eps):
        outputs = []
        for i, x in enumerate(X):
            h = dense(params["a"], x) + eps["a"][i]
            if not took[i]:
                outputs.append(2.0 * h[:2])
                continue
            t = jnp.tanh(dense(params["b"], h) + eps["b"][i]) + eps["t"][i]
            outputs.append(dense(params["c"], t) + eps["c"][i])
        return loss_fn(jnp.stack(outputs))

    assert probe.sites(X)["b"].shape == (3, 5)
    assert_matches_by_hand(res, probe, X, hand)
    b = dense(probe.params["b"], dense(probe.params["a"], X))
    close(res.activations["b"], jnp.where(took[:, None], b, 0.0))


def per_example(layers, tokens):
    h = layers["a"](tokens)
    h = jax.vmap(lambda v: bridge.tap("t", jnp.tanh(layers["b"](v))))(h)
    return layers["c"](h).sum(0)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_probe_vmap_around_the_models_own_vmap(mode):
    """`vmap=True`: the batch axis first, then the model's mapped axis."""
    probe = bridge.probe(model(LAYERS, per_example), vmap=True)
    tokens = jnp.linspace(-1.0, 1.0, 2 * 3 * 4).reshape(2, 3, 4)
    sites = probe.sites(tokens)
    assert sites["b"].shape == sites["t"].shape == (2, 3, 5)
    call = lambda p, x: p.value_and_grad(loss_fn, x)  # noqa: E731
    res = (jax.jit(call) if mode == "jit" else call)(probe, tokens)

    def hand(params, eps):
        h = dense(params["a"], tokens) + eps["a"]
        t = jnp.tanh(dense(params["b"], h) + eps["b"]) + eps["t"]
        return loss_fn((dense(params["c"], t) + eps["c"]).sum(1))

    zeros = {name: jnp.zeros(s.shape) for name, s in sites.items()}
    loss, grads = jax.value_and_grad(hand, argnums=1)(probe.params, zeros)
    close(res.loss, loss)
    for name in sites:
        close(res.activation_grads[name], grads[name])


def in_a_while_loop(layers, x):
    h = layers["a"](x)
    h = lax.while_loop(
        lambda s: s[1] < 2, lambda s: (jnp.tanh(layers["b"](s[0])), s[1] + 1), (h, 0)
    )[0]
    return layers["c"](h)


def test_a_while_loop_is_refused_naming_it():
    probe = bridge.probe(model(LAYERS, in_a_while_loop))
    assert list(probe.sites(X)) == ["a", "b", "c"]
    with pytest.raises(bridge.BridgeError, match=r"jax\.lax\.while_loop.*'b'"):
        probe.value_and_grad(loss_fn, X, at="b")
    with pytest.warns(bridge.BridgeWarning, match="'b'"):
        res = probe.apply(X)
    assert list(res.activations) == ["a", "c"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", bridge.BridgeWarning)
        ran = probe.apply(X, at=["a", "c"])
    close(ran.activations["a"], dense(probe.params["a"], X))


# -- a trace JAX serves from its cache -------------------------------------------


def _squashed(v):
    """A pure function at module level: `lax.cond` caches its trace by the
    function, so a later trace of the model runs none of its Python."""
    return bridge.tap("squash", jnp.tanh(v))


def branched_at_module_level(layers, x):
    h = layers["a"](x)
    return layers["b"](lax.cond(jnp.sum(x) > 0, _squashed, jnp.sin, h))


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_branch_whose_trace_jax_serves_from_its_cache(mode):
    """Discovery traces the branch; the run's trace is JAX's cached one, no
    Python runs, and the site is read from the markers that trace holds:
    the same numbers as by hand, not an error nor a zero."""
    probe = bridge.probe(model(LAYERS, branched_at_module_level))
    call = lambda p, x: p.value_and_grad(loss_fn, x, at="squash")  # noqa: E731
    res = (jax.jit(call) if mode == "jit" else call)(probe, X)
    assert bool(res.ran["squash"])

    def hand(offset):
        h = jnp.tanh(dense(probe.params["a"], X)) + offset
        return loss_fn(dense(probe.params["b"], h))

    h = jnp.tanh(dense(probe.params["a"], X))
    close(res.activations["squash"], h)
    close(res.activation_grads["squash"], jax.grad(hand)(jnp.zeros_like(h)))
    # Again, with a patch: the cached trace takes it too.
    patched = probe.value_and_grad(loss_fn, X, patch={"squash": lambda v: 2.0 * v})
    close(patched.loss, loss_fn(dense(probe.params["b"], 2.0 * h)))
