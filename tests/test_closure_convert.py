"""A layer inside a closure-converted function (`equinox.filter_closure_convert`,
`jax.closure_convert`), as solver libraries convert the function they solve.

The conversion traces the function once, into a jaxpr that every call of
the converted function runs: a call inside is one trace standing for every
use (`f(f(h))` calls it twice), whose value belongs to the conversion's own
trace. bridge lists it with its shape, leaves it out of the default
selection with a `bridge.BridgeWarning` naming the conversion, refuses it
where selected or patched, and probes every other site as usual
(DESIGN.md, "A site is a call in the computation that runs").

Each model is `rhs_net`, then `f = convert(lambda v: 2 v + op(v))` applied
twice, then `head`. The references never use bridge: the model written out
from its parameters with offsets added by hand at `rhs_net` and `head`,
differentiated with `jax.grad`.
"""

from __future__ import annotations

import re

import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import jaxpr_traces_say_what_traced_them, leaves_out, nnx_supported
from jax.extend.core import jaxpr_as_fun

import bridge

WIDTH, OUT, BATCH = 4, 2, 3
X = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
#: The conversions, by their names.
NAMES = {"equinox": "equinox.filter_closure_convert", "jax": "jax.closure_convert"}
#: How the core names a conversion where it refuses a call inside it: JAX's
#: by its trace's name (where this jax keeps it), Equinox's, traced as a
#: `jax.jit` of its own, as a function traced apart.
TRACED_APART = re.escape(
    "a function the model's code traced apart and runs as a jaxpr (a closure "
    "conversion such as equinox.filter_closure_convert, jax.make_jaxpr)"
)


def named(conversion: str) -> str:
    """The pattern of the conversion's name in a refusal."""
    if conversion == "jax" and jaxpr_traces_say_what_traced_them():
        return "jax.closure_convert"
    return TRACED_APART


def converted(conversion, function, example):
    """`function` converted at `example` by `equinox.filter_closure_convert`
    or `jax.closure_convert`, as a function of one argument."""
    if conversion == "equinox":
        return eqx.filter_closure_convert(function, example)
    closed, constants = jax.closure_convert(function, example)
    return lambda v: closed(v, *constants)


def loss_fn(outputs):
    return jnp.sum(jnp.square(outputs - 0.3))


# -- the models -------------------------------------------------------------------


class EqxConverted(eqx.Module):
    conversion: str = eqx.field(static=True)
    rhs_net: eqx.nn.Linear
    op: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, conversion, key):
        keys = jax.random.split(key, 3)
        self.conversion = conversion
        self.rhs_net = eqx.nn.Linear(WIDTH, WIDTH, key=keys[0])
        self.op = eqx.nn.Linear(WIDTH, WIDTH, key=keys[1])
        self.head = eqx.nn.Linear(WIDTH, OUT, key=keys[2])

    def __call__(self, x):
        h = self.rhs_net(x)
        f = converted(self.conversion, lambda v: 2.0 * v + self.op(v), h)
        return self.head(f(f(h)))


def _equinox(conversion, vmap):
    model = EqxConverted(conversion, jax.random.key(0))
    weights = [
        (layer.weight.T, layer.bias) for layer in (model.rhs_net, model.op, model.head)
    ]
    # An Equinox layer takes one example: without the probe's vmap, one.
    return bridge.probe(model, vmap=vmap), weights, X if vmap else X[0]


def _haiku_function(conversion):
    def forward(x):
        h = hk.Linear(WIDTH, name="rhs_net")(x)
        op = hk.Linear(WIDTH, name="op")
        if hk.running_init():  # parameters are made outside the conversion
            op(h)
        f = converted(conversion, lambda v: 2.0 * v + op(v), h)
        return hk.Linear(OUT, name="head")(f(f(h)))

    return forward


def _haiku(conversion, vmap):
    transformed = hk.transform(_haiku_function(conversion))
    params = transformed.init(jax.random.key(0), X)
    weights = [(params[n]["w"], params[n]["b"]) for n in ("rhs_net", "op", "head")]
    return bridge.probe(transformed, params, vmap=vmap), weights, X


class NnxConverted(nnx.Module):
    def __init__(self, conversion, rngs):
        self.conversion = conversion
        self.rhs_net = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.op = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.head = nnx.Linear(WIDTH, OUT, rngs=rngs)

    def __call__(self, x):
        h = self.rhs_net(x)
        f = converted(self.conversion, lambda v: 2.0 * v + self.op(v), h)
        return self.head(f(f(h)))


def _nnx(conversion, vmap):
    model = NnxConverted(conversion, nnx.Rngs(0))
    weights = [
        (layer.kernel[...], layer.bias[...])
        for layer in (model.rhs_net, model.op, model.head)
    ]
    return bridge.probe(model, vmap=vmap), weights, X


BUILDERS = {"equinox": _equinox, "haiku": _haiku}
if nnx_supported():
    BUILDERS["nnx"] = _nnx
CASES = [
    pytest.param(library, conversion, vmap, id=f"{library}-{conversion}-vmap{vmap}")
    for library in BUILDERS
    for conversion in NAMES
    for vmap in (True, False)
]


def by_hand(weights, x, offsets):
    """The model from its parameters, `offsets` added at `rhs_net` and
    `head`: `(outputs, {site: value})`."""
    if x.ndim == 2:  # a batch: one example at a time
        return jax.vmap(lambda x, o: by_hand(weights, x, o))(x, offsets)
    (w1, b1), (w_op, b_op), (w2, b2) = weights
    rhs = x @ w1 + b1 + offsets["rhs_net"]
    f = lambda v: 2.0 * v + (v @ w_op + b_op)  # noqa: E731
    head = f(f(rhs)) @ w2 + b2 + offsets["head"]
    return head, {"rhs_net": rhs, "head": head}


def assert_close(actual, expected):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(float(np.max(np.abs(expected))), 1e-6)
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5 * scale)


# -- the tests ----------------------------------------------------------------------


@pytest.mark.parametrize(("library", "conversion", "vmap"), CASES)
def test_a_call_inside_a_conversion_is_listed_with_its_shape(library, conversion, vmap):
    probe, _, x = BUILDERS[library](conversion, vmap)
    sites = probe.sites(x)
    assert list(sites) == ["rhs_net", "op", "head"]
    assert sites["op"].shape == x.shape


@pytest.mark.parametrize(("library", "conversion", "vmap"), CASES)
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_the_default_selection_leaves_the_conversion_out_and_probes_the_rest(
    library, conversion, vmap, mode
):
    """`at=None` warns naming the site and the conversion, and the other
    sites' values and gradients are the hand offsets' (no silent sum of the
    converted function's two calls anywhere)."""
    probe, weights, x = BUILDERS[library](conversion, vmap)
    zeros = {"rhs_net": jnp.zeros(x.shape), "head": jnp.zeros((*x.shape[:-1], OUT))}

    def hand_loss(offsets):
        outputs, values = by_hand(weights, x, offsets)
        return loss_fn(outputs), values

    (loss, values), offset_grads = jax.value_and_grad(hand_loss, has_aux=True)(zeros)

    def run(x):
        return probe.value_and_grad(loss_fn, x)

    name = named(conversion)
    said = rf"\('op'\).*bridge cannot see through {name} around site 'op'"
    with pytest.warns(bridge.BridgeWarning, match=said):
        res = run(x) if mode == "eager" else jax.jit(run)(x)
    assert set(res.activations) == {"rhs_net", "head"}
    assert_close(res.loss, loss)
    for site in ("rhs_net", "head"):
        assert_close(res.activations[site], values[site])
        assert_close(res.activation_grads[site], offset_grads[site])


@pytest.mark.parametrize(("library", "conversion", "vmap"), CASES)
def test_selecting_or_patching_a_call_inside_a_conversion_names_it(
    library, conversion, vmap
):
    """Refused before any work, naming the site, the conversion, why (one
    trace for every call of the converted function) and the way out."""
    probe, _, x = BUILDERS[library](conversion, vmap)
    message = (
        rf"'op'.*bridge cannot see through {named(conversion)} "
        r"around site 'op'.*"
        r"one epsilon would serve every call of the converted function.*"
        r"call the layer outside the converted function"
    )
    with pytest.raises(bridge.BridgeValueError, match=message):
        probe.value_and_grad(loss_fn, x, at="op")
    with pytest.raises(bridge.BridgeValueError, match=message):
        probe.apply(x, at="op")
    with pytest.raises(bridge.BridgeValueError, match=message):
        probe.apply(x, at="head", patch={"op": jnp.negative})
    with pytest.raises(bridge.BridgeValueError, match=message):
        jax.jit(lambda x: probe.value_and_grad(loss_fn, x, at="op"))(x)


def test_a_jax_make_jaxpr_of_the_models_own_is_refused_not_leaked():
    """A trace the model's code makes of a function apart (`jax.make_jaxpr`,
    here evaluated with `jax.extend.core.jaxpr_as_fun`) is no jit bridge traces
    through: a call there is listed and refused, never recorded from that
    trace."""

    class Traced(eqx.Module):
        rhs_net: eqx.nn.Linear
        op: eqx.nn.Linear

        def __call__(self, x):
            h = self.rhs_net(x)
            (out,) = jaxpr_as_fun(jax.make_jaxpr(self.op)(h))(h)
            return out

    keys = jax.random.split(jax.random.key(0))
    model = Traced(
        eqx.nn.Linear(WIDTH, WIDTH, key=keys[0]),
        eqx.nn.Linear(WIDTH, WIDTH, key=keys[1]),
    )
    probe = bridge.probe(model, vmap=True)
    with leaves_out("op"):
        res = probe.value_and_grad(loss_fn, X)
    expected = jax.vmap(model)(X)
    assert_close(res.loss, loss_fn(expected))
    with pytest.raises(bridge.BridgeValueError, match="jax.make_jaxpr"):
        probe.apply(X, at="op")
