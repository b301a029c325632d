"""Models that mix libraries: a module of one library called inside another's.

A Linen module inside an NNX model (`nnx.bridge.ToNNX`), an NNX module inside
a Linen model (`nnx.bridge.ToLinen`), an `hk.transform`ed function's `apply`
called inside an NNX, Linen or Equinox model, a Linen model inside a Haiku
or Equinox model. The inner library's submodules are sites named under the
outer site (`encoder/Dense_0`), checked against references that share no
code with bridge: activations from each library's own recording
(`nn.intercept_methods`, `hk.intercept_methods`, `nnx.capture`, or a wrapper
of the module's class where NNX's own cannot run: `nnx.capture` fails inside
`ToNNX`), activation gradients against `jax.jvp` of the loss with an offset
`t * delta` inserted at the site by the test's own hook, and parameter
gradients against plain `nnx.grad` / `jax.grad`, eagerly and under `jax.jit`.

Equinox and Haiku hosts need the guest hook in their adapter's run (see
`bridge.adapters.shared.guests.hosted`): those tests are marked until it is there.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    add_at_float_leaves,
    assert_directional_derivatives,
    assert_tree_allclose,
    assert_tree_equal,
    float_leaves,
    nnx_supported,
    numpy_snapshot,
    random_like,
    value_and_grad_in,
)

if not nnx_supported():
    pytest.skip(
        "nnx.bridge.ToNNX/ToLinen models need flax >= 0.12 (the NNX bridge's floor)",
        allow_module_level=True,
    )

import flax.linen as nn  # noqa: E402
from cases.nnx import captured_activations, get_value, snapshot  # noqa: E402
from flax import nnx  # noqa: E402

import bridge  # noqa: E402

hk = pytest.importorskip("haiku")
eqx = pytest.importorskip("equinox")

MODES = ["eager", "jit"]
#: `nnx.iter_modules` since flax 0.12.1; the method of the same walk in 0.12.0.
iter_modules = getattr(nnx, "iter_modules", None) or nnx.Module.iter_modules


def loss_fn(y):
    return jnp.mean(jnp.square(y - 0.3))


def _inputs(*shape, seed=1):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


X = _inputs(5, 4)


def assert_stacked_dense_site(res, site, kernel, bias, bias_grad):
    """A dense layer's site inside a scan over stacked layers, by identities
    bridge does not compute: each layer's value is its recorded inputs times
    its kernel plus its bias, and its bias's gradient (plain JAX's) is its
    activation gradient summed over the batch."""
    (inputs,) = res.inputs[site]
    assert res.activations[site].shape[0] == kernel.shape[0]
    for i in range(kernel.shape[0]):
        expected = inputs[i] @ kernel[i] + bias[i][None]
        scale = float(jnp.max(jnp.abs(expected)))
        np.testing.assert_allclose(
            res.activations[site][i], expected, rtol=1e-5, atol=1e-6 * scale
        )
        np.testing.assert_allclose(
            res.activation_grads[site][i].sum(0), bias_grad[i], rtol=1e-4, atol=1e-6
        )


# -- the test's own hooks: recordings and offsets, per library ------------------


def _numbered(counts: dict, base: str) -> str:
    index = counts.get(base, 0)
    counts[base] = index + 1
    return base if index == 0 else f"{base}#{index}"


def _hooked(name, out, record, offsets):
    if offsets and name in offsets:
        out = add_at_float_leaves(out, offsets[name])
    if record is not None:
        record[name] = out
    return out


@contextlib.contextmanager
def linen_calls(prefix="", record=None, offsets=None):
    """`nn.intercept_methods`: each Linen submodule call's output, named
    `prefix + scope path` (`#k` for repeated calls), recorded and offset."""
    counts: dict[str, int] = {}

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if (
            module.path == ()
            or context.method_name != "__call__"
            or module.is_initializing()
        ):
            return next_fun(*args, **kwargs)
        name = _numbered(counts, prefix + "/".join(module.path))
        return _hooked(name, next_fun(*args, **kwargs), record, offsets)

    with nn.intercept_methods(interceptor):
        yield


@contextlib.contextmanager
def haiku_calls(prefix="", record=None, offsets=None):
    """`hk.intercept_methods`: each Haiku module call's output, named
    `prefix + module_name`, recorded and offset."""
    counts: dict[str, int] = {}

    def interceptor(next_fun, args, kwargs, context):
        if context.method_name != "__call__" or hk.running_init():
            return next_fun(*args, **kwargs)
        name = _numbered(counts, prefix + context.module.module_name)
        return _hooked(name, next_fun(*args, **kwargs), record, offsets)

    with hk.intercept_methods(interceptor):
        yield


@contextlib.contextmanager
def nnx_calls(classes, name_of: Callable, record=None, offsets=None):
    """A wrapper on each class's `__call__` (restored after): the output of
    each call of a module that `name_of(module)` names, recorded and offset."""
    counts: dict[str, int] = {}
    patched = []
    for cls in classes:
        original, own = cls.__call__, "__call__" in vars(cls)

        def hooked(self, *args, _original=original, **kwargs):
            out = _original(self, *args, **kwargs)
            base = name_of(self)
            if base is None:
                return out
            return _hooked(_numbered(counts, base), out, record, offsets)

        cls.__call__ = hooked
        patched.append((cls, original, own))
    try:
        yield
    finally:
        for cls, original, own in patched:
            if own:
                cls.__call__ = original
            else:
                del cls.__call__


def directional(loss_of_offsets: Callable, site: str, delta) -> jax.Array:
    """d/dt of the loss with `t * delta` added at `site`, at t = 0 (`jax.jvp`)."""

    def along(t):
        return loss_of_offsets({site: jax.tree.map(lambda d: t * d, delta)})

    return jax.jvp(along, (0.0,), (1.0,))[1]


def check_activation_grads(result, sites, loss_of_offsets):
    deltas = [
        random_like(jax.tree.leaves(result.activations[site]), seed=i)
        for i, site in enumerate(sites)
    ]
    derivatives = [
        directional(loss_of_offsets, site, delta)
        for site, delta in zip(sites, deltas, strict=True)
    ]
    # `delta` is a list of the float leaves; the gradient's leaves are compared.
    assert_directional_derivatives(result, sites, deltas, derivatives)


def check_activations(result, recorded, sites):
    assert set(result.activations) == set(sites)  # sorted keys under jax.jit
    for site in sites:
        got, want = result.activations[site], float_leaves(recorded[site])
        for g, w in zip(jax.tree.leaves(got), want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=site)
        grads = jax.tree.leaves(result.activation_grads[site])
        assert [g.shape for g in grads] == [w.shape for w in want], site


# -- Linen inside NNX: nnx.bridge.ToNNX -------------------------------------------


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8)(x)
        return nn.Dense(3)(nn.relu(nn.LayerNorm()(h)))


class NnxWithLinen(nnx.Module):
    """The Linen encoder is called twice: its sites are `encoder/...#1` the
    second time."""

    def __init__(self, rngs):
        self.pre = nnx.Linear(4, 6, rngs=rngs)
        self.encoder = nnx.bridge.ToNNX(LinenMLP(), rngs=rngs)
        self.head = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        h = self.pre(x)
        return self.head(nnx.tanh(self.encoder(h) + self.encoder(0.5 * h)))


LINEN_IN_NNX_SITES = [
    "pre",
    "encoder",
    "encoder/Dense_0",
    "encoder/LayerNorm_0",
    "encoder/Dense_1",
    "encoder#1",
    "encoder/Dense_0#1",
    "encoder/LayerNorm_0#1",
    "encoder/Dense_1#1",
    "head",
]


@pytest.fixture(scope="module")
def linen_in_nnx():
    model = NnxWithLinen(nnx.Rngs(0))
    nnx.bridge.lazy_init(model, X)
    return model


def _nnx_outer_calls(model, record=None, offsets=None):
    """The NNX modules of `model` (the outer sites), by attribute path."""
    paths = {
        id(module): "/".join(map(str, path))
        for path, module in iter_modules(model)
        if path
    }
    classes = {type(module) for _, module in iter_modules(model)}
    classes -= {type(model)}
    return nnx_calls(classes, lambda m: paths.get(id(m)), record, offsets)


def _linen_in_nnx_run(model, record=None, offsets=None):
    """The plain model (a clone), with the test's hooks on both libraries."""
    clone = nnx.clone(model)
    with (
        _nnx_outer_calls(clone, record, offsets),
        linen_calls("encoder/", record, offsets),
    ):
        return loss_fn(clone(X))


def test_linen_in_nnx_sites_are_named_under_the_outer_path(linen_in_nnx):
    sites = bridge.probe(linen_in_nnx).sites(X)
    assert list(sites) == LINEN_IN_NNX_SITES
    # Named like the parameters: the Linen variables live on the ToNNX module.
    params = nnx.state(linen_in_nnx, nnx.Param)
    assert params["encoder"]["Dense_0"]["kernel"].shape == (6, 8)
    assert sites["encoder/Dense_0"].shape == (5, 8)


@pytest.mark.parametrize("mode", MODES)
def test_linen_in_nnx_matches_references(linen_in_nnx, mode):
    before = snapshot(linen_in_nnx)
    result = value_and_grad_in(mode, bridge.probe(linen_in_nnx), loss_fn, (X,))
    recorded: dict = {}
    loss = _linen_in_nnx_run(linen_in_nnx, record=recorded)
    np.testing.assert_allclose(result.loss, loss, rtol=1e-5)
    check_activations(result, recorded, LINEN_IN_NNX_SITES)
    check_activation_grads(
        result,
        LINEN_IN_NNX_SITES,
        lambda offsets: _linen_in_nnx_run(linen_in_nnx, offsets=offsets),
    )
    plain = nnx.grad(lambda m: loss_fn(m(X)))(nnx.clone(linen_in_nnx))
    assert_tree_allclose(result.grads, plain, rtol=1e-4, atol=1e-6)
    assert result.grads["encoder"]["Dense_0"]["kernel"].shape == (6, 8)
    # The user's module is untouched.
    assert_tree_equal(snapshot(linen_in_nnx), before)


NEEDS_CAPTURE = pytest.mark.skipif(
    not hasattr(nnx, "capture"), reason="nnx.capture: newer flax than this one"
)


@NEEDS_CAPTURE
def test_linen_in_nnx_outer_sites_match_nnx_capture():
    """Where NNX's own recording runs (no ToNNX in the way), it agrees with
    the test's wrapper: the references above record what NNX records."""
    model = nnx.Sequential(
        nnx.Linear(4, 3, rngs=nnx.Rngs(0)), nnx.Linear(3, 2, rngs=nnx.Rngs(1))
    )
    recorded: dict = {}
    clone = nnx.clone(model)
    with _nnx_outer_calls(clone, record=recorded):
        clone(X)
    captured = captured_activations(model, (X,), {})
    assert set(recorded) == set(captured)
    for site, value in captured.items():
        np.testing.assert_allclose(recorded[site], value, rtol=1e-5)


def test_linen_in_nnx_patch_and_inputs(linen_in_nnx):
    probe = bridge.probe(linen_in_nnx)
    zeros = probe.apply(X, patch={"encoder/LayerNorm_0#1": jnp.zeros_like})
    counts: dict[str, int] = {}

    def zeroing(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.module.path == ():
            return out
        name = _numbered(counts, "encoder/" + "/".join(context.module.path))
        return jnp.zeros_like(out) if name == "encoder/LayerNorm_0#1" else out

    with nn.intercept_methods(zeroing):
        expected = nnx.clone(linen_in_nnx)(X)
    np.testing.assert_allclose(zeros.outputs, expected, rtol=1e-5)
    assert not np.allclose(zeros.outputs, probe.apply(X).outputs)

    result = probe.value_and_grad(loss_fn, X, at="encoder/Dense_0*", with_inputs=True)
    pre = nnx.clone(linen_in_nnx).pre(X)
    np.testing.assert_allclose(result.inputs["encoder/Dense_0"][0], pre, rtol=1e-5)
    np.testing.assert_allclose(
        result.inputs["encoder/Dense_0#1"][0], 0.5 * pre, rtol=1e-5
    )


def test_linen_in_nnx_selection_by_linen_class(linen_in_nnx):
    result = bridge.probe(linen_in_nnx).value_and_grad(loss_fn, X, at=nn.LayerNorm)
    assert list(result.activations) == ["encoder/LayerNorm_0", "encoder/LayerNorm_0#1"]


def test_linen_in_nnx_under_vmap_true(linen_in_nnx):
    batched = bridge.probe(linen_in_nnx).value_and_grad(loss_fn, X)
    mapped = bridge.probe(linen_in_nnx, vmap=True).value_and_grad(loss_fn, X)
    assert list(mapped.activation_grads) == LINEN_IN_NNX_SITES
    for site in LINEN_IN_NNX_SITES:
        np.testing.assert_allclose(
            mapped.activation_grads[site],
            batched.activation_grads[site],
            rtol=1e-4,
            atol=1e-7,
            err_msg=site,
        )


# -- NNX inside Linen: nnx.bridge.ToLinen -----------------------------------------


class NnxMLP(nnx.Module):
    def __init__(self, din, dout, *, rngs):
        self.linear = nnx.Linear(din, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.out = nnx.Linear(8, dout, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.norm(self.linear(x))))


class LinenWithNnx(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(6)(x)
        h = nnx.bridge.ToLinen(NnxMLP, args=(6, 3))(h)
        return nn.Dense(2)(jnp.tanh(h))


NNX_IN_LINEN_SITES = [
    "Dense_0",
    "ToLinen_0",
    "ToLinen_0/linear",
    "ToLinen_0/norm",
    "ToLinen_0/out",
    "Dense_1",
]


@pytest.fixture(scope="module")
def nnx_in_linen():
    model = LinenWithNnx()
    return model, model.init(jax.random.key(0), X)


def _nnx_in_linen_loss(model, variables, record=None, offsets=None):
    """The plain apply, with the test's hooks: Linen's interceptor for the
    Linen sites, a wrapper of the NNX classes for the modules ToLinen builds."""
    built: list = []
    original = NnxMLP.__call__

    def noting(self, *args, **kwargs):
        built.append(self)
        return original(self, *args, **kwargs)

    def name_of(module):
        for path, inner in iter_modules(built[-1]):
            if inner is module and path:
                return "ToLinen_0/" + "/".join(map(str, path))
        return None

    NnxMLP.__call__ = noting
    try:
        with (
            linen_calls("", record, offsets),
            nnx_calls((nnx.Linear, nnx.LayerNorm), name_of, record, offsets),
        ):
            return loss_fn(model.apply(variables, X))
    finally:
        NnxMLP.__call__ = original


def test_nnx_in_linen_sites_are_named_like_the_parameters(nnx_in_linen):
    model, variables = nnx_in_linen
    sites = bridge.probe(model, variables).sites(X)
    assert list(sites) == NNX_IN_LINEN_SITES
    assert variables["params"]["ToLinen_0"]["linear"]["kernel"].shape == (6, 8)


@pytest.mark.parametrize("mode", MODES)
def test_nnx_in_linen_matches_references(nnx_in_linen, mode):
    model, variables = nnx_in_linen
    before = numpy_snapshot(variables)
    probe = bridge.probe(model, variables)
    result = value_and_grad_in(mode, probe, loss_fn, (X,))
    recorded: dict = {}
    loss = _nnx_in_linen_loss(model, variables, record=recorded)
    np.testing.assert_allclose(result.loss, loss, rtol=1e-5)
    check_activations(result, recorded, NNX_IN_LINEN_SITES)
    check_activation_grads(
        result,
        NNX_IN_LINEN_SITES,
        lambda offsets: _nnx_in_linen_loss(model, variables, offsets=offsets),
    )
    plain = jax.grad(lambda p: loss_fn(model.apply({"params": p}, X)))(
        variables["params"]
    )
    assert_tree_allclose(result.grads, plain, rtol=1e-4, atol=1e-6)
    assert_tree_equal(numpy_snapshot(variables), before)


@NEEDS_CAPTURE
def test_nnx_in_linen_inner_activations_match_nnx_capture(nnx_in_linen):
    """NNX's own recording of the module, rebuilt by hand from the Linen
    variables and called on the ToLinen's input."""
    model, variables = nnx_in_linen
    result = bridge.probe(model, variables).apply(X)
    inner = NnxMLP(6, 3, rngs=nnx.Rngs(0))
    nnx.update(inner, variables["params"]["ToLinen_0"])
    captured = captured_activations(inner, (result.activations["Dense_0"],), {})
    assert set(captured) == {"linear", "norm", "out"}
    for site, value in captured.items():
        np.testing.assert_allclose(
            result.activations[f"ToLinen_0/{site}"], value, rtol=1e-5, atol=1e-6
        )


def test_a_to_linen_probed_alone_has_its_nnx_submodules_as_sites():
    model = nnx.bridge.ToLinen(NnxMLP, args=(4, 3))
    variables = model.init(jax.random.key(0), X)
    assert list(bridge.probe(model, variables).sites(X)) == ["linear", "norm", "out"]


# -- Haiku inside NNX and inside Linen ----------------------------------------------


def _haiku_mlp(x):
    return hk.nets.MLP([8, 3])(x)


HAIKU_MLP = hk.without_apply_rng(hk.transform(_haiku_mlp))
HAIKU_SITES = ["mlp", "mlp/~/linear_0", "mlp/~/linear_1"]


def _values(tree):
    return jax.tree.map(get_value, tree, is_leaf=lambda v: isinstance(v, nnx.Variable))


class HaikuBlock(nnx.Module):
    def __init__(self, params):
        self.params = nnx.data(jax.tree.map(nnx.Param, params))

    def __call__(self, x):
        return HAIKU_MLP.apply(_values(self.params), x)


class NnxWithHaiku(nnx.Module):
    def __init__(self, rngs):
        self.pre = nnx.Linear(4, 6, rngs=rngs)
        self.block = HaikuBlock(HAIKU_MLP.init(jax.random.key(2), jnp.ones((1, 6))))
        self.head = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(self.block(self.pre(x)))


HAIKU_IN_NNX_SITES = ["pre", "block", *(f"block/{s}" for s in HAIKU_SITES), "head"]


def _haiku_in_nnx_loss(model, record=None, offsets=None):
    clone = nnx.clone(model)
    with (
        _nnx_outer_calls(clone, record, offsets),
        haiku_calls("block/", record, offsets),
    ):
        return loss_fn(clone(X))


@pytest.mark.parametrize("mode", MODES)
def test_haiku_in_nnx_matches_references(mode):
    model = NnxWithHaiku(nnx.Rngs(0))
    probe = bridge.probe(model)
    assert list(probe.sites(X)) == HAIKU_IN_NNX_SITES
    result = value_and_grad_in(mode, probe, loss_fn, (X,))
    recorded: dict = {}
    np.testing.assert_allclose(
        result.loss, _haiku_in_nnx_loss(model, record=recorded), rtol=1e-5
    )
    check_activations(result, recorded, HAIKU_IN_NNX_SITES)
    check_activation_grads(
        result,
        HAIKU_IN_NNX_SITES,
        lambda offsets: _haiku_in_nnx_loss(model, offsets=offsets),
    )
    plain = nnx.grad(lambda m: loss_fn(m(X)))(nnx.clone(model))
    assert_tree_allclose(result.grads, plain, rtol=1e-4, atol=1e-6)
    assert result.grads["block"]["params"]["mlp/~/linear_0"]["w"].shape == (6, 8)


class HaikuInLinen(nn.Module):
    @nn.compact
    def __call__(self, x):
        params = self.param("haiku", lambda key: HAIKU_MLP.init(key, x))
        return HAIKU_MLP.apply(params, x)


class LinenWithHaiku(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(HaikuInLinen()(nn.Dense(6)(x)))


#: Linen numbers modules in construction order: the head is `Dense_0`.
HAIKU_IN_LINEN_SITES = [
    "Dense_1",
    "HaikuInLinen_0",
    *(f"HaikuInLinen_0/{s}" for s in HAIKU_SITES),
    "Dense_0",
]


def _haiku_in_linen_loss(model, params, record=None, offsets=None):
    with (
        linen_calls("", record, offsets),
        haiku_calls("HaikuInLinen_0/", record, offsets),
    ):
        return loss_fn(model.apply({"params": params}, X))


@pytest.mark.parametrize("mode", MODES)
def test_haiku_in_linen_matches_references(mode):
    model = LinenWithHaiku()
    variables = model.init(jax.random.key(0), X)
    probe = bridge.probe(model, variables)
    assert list(probe.sites(X)) == HAIKU_IN_LINEN_SITES
    result = value_and_grad_in(mode, probe, loss_fn, (X,))
    params = variables["params"]
    recorded: dict = {}
    np.testing.assert_allclose(
        result.loss, _haiku_in_linen_loss(model, params, record=recorded), rtol=1e-5
    )
    check_activations(result, recorded, HAIKU_IN_LINEN_SITES)
    check_activation_grads(
        result,
        HAIKU_IN_LINEN_SITES,
        lambda offsets: _haiku_in_linen_loss(model, params, offsets=offsets),
    )
    plain = jax.grad(lambda p: loss_fn(model.apply({"params": p}, X)))(params)
    assert_tree_allclose(result.grads, plain, rtol=1e-4, atol=1e-6)


# -- Equinox and Haiku hosts (their adapters install the guests) --------------------


class Affine(eqx.Module):
    """A batched dense layer, so the model needs no `jax.vmap` of its own."""

    weight: jax.Array
    bias: jax.Array

    def __call__(self, x):
        return x @ self.weight + self.bias


class EqxHaikuBlock(eqx.Module):
    params: dict

    def __call__(self, x):
        return HAIKU_MLP.apply(self.params, x)


class LinenTail(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(nn.relu(nn.Dense(5)(x)))


LINEN_TAIL = LinenTail()


class EqxLinenBlock(eqx.Module):
    variables: dict

    def __call__(self, x):
        return LINEN_TAIL.apply(self.variables, x)


class EqxWithGuests(eqx.Module):
    pre: Affine
    haiku: EqxHaikuBlock
    linen: EqxLinenBlock

    def __call__(self, x):
        return self.linen(self.haiku(self.pre(x)))


EQX_SITES = [
    "pre",
    "haiku",
    *(f"haiku/{s}" for s in HAIKU_SITES),
    "linen",
    "linen/Dense_1",
    "linen/Dense_0",
]


def _eqx_with_guests():
    keys = jax.random.split(jax.random.key(0), 3)
    return EqxWithGuests(
        Affine(jax.random.normal(keys[0], (4, 6)) * 0.5, jnp.zeros((1, 6))),
        EqxHaikuBlock(HAIKU_MLP.init(keys[1], jnp.ones((1, 6)))),
        EqxLinenBlock(LINEN_TAIL.init(keys[2], jnp.ones((1, 3)))),
    )


class _Offset(eqx.Module):
    """The test's own offset at an Equinox module's output (`eqx.tree_at`)."""

    module: eqx.Module
    delta: jax.Array

    def __call__(self, x):
        return self.module(x) + self.delta


def _eqx_loss(model, record=None, offsets=None):
    offsets = dict(offsets or {})
    for name in ("pre", "haiku", "linen"):
        if name in offsets:
            model = eqx.tree_at(
                lambda m, n=name: getattr(m, n),
                model,
                _Offset(getattr(model, name), offsets[name][0]),
            )
    with (
        haiku_calls("haiku/", record, offsets),
        linen_calls("linen/", record, offsets),
    ):
        out = model(X)
    if record is not None:
        h = model.pre(X)
        record.update(pre=h, haiku=model.haiku(h), linen=out)
    return loss_fn(out)


@pytest.mark.parametrize("mode", MODES)
def test_haiku_and_linen_in_equinox_match_references(mode):
    model = _eqx_with_guests()
    probe = bridge.probe(model)
    assert list(probe.sites(X)) == EQX_SITES
    result = value_and_grad_in(mode, probe, loss_fn, (X,))
    recorded: dict = {}
    np.testing.assert_allclose(
        result.loss, _eqx_loss(model, record=recorded), rtol=1e-5
    )
    check_activations(result, recorded, EQX_SITES)
    check_activation_grads(
        result, EQX_SITES, lambda offsets: _eqx_loss(model, offsets=offsets)
    )
    plain = eqx.filter_grad(lambda m: loss_fn(m(X)))(model)
    assert_tree_allclose(result.grads, plain, rtol=1e-4, atol=1e-6)


class LinenInHaiku(hk.Module):
    """A Linen model inside a Haiku module: its variables are Haiku parameters."""

    def __call__(self, x):
        shapes = jax.eval_shape(LINEN_TAIL.init, jax.random.key(0), x)
        variables = jax.tree_util.tree_map_with_path(
            lambda path, s: hk.get_parameter(
                jax.tree_util.keystr(path),
                s.shape,
                s.dtype,
                init=hk.initializers.RandomNormal(0.5),
            ),
            shapes,
        )
        return LINEN_TAIL.apply(variables, x)


def _haiku_with_linen(x):
    return LinenInHaiku(name="tail")(jax.nn.relu(hk.Linear(3)(x)))


HAIKU_HOST = hk.transform(_haiku_with_linen)
HAIKU_HOST_SITES = ["linear", "tail", "tail/Dense_1", "tail/Dense_0"]


def _haiku_host_loss(params, record=None, offsets=None):
    with (
        haiku_calls("", record, offsets),
        linen_calls("tail/", record, offsets),
    ):
        return loss_fn(HAIKU_HOST.apply(params, None, X))


@pytest.mark.parametrize("mode", MODES)
def test_linen_in_haiku_matches_references(mode):
    params = HAIKU_HOST.init(jax.random.key(0), X)
    probe = bridge.probe(HAIKU_HOST, params)
    assert list(probe.sites(X)) == HAIKU_HOST_SITES
    result = value_and_grad_in(mode, probe, loss_fn, (X,))
    recorded: dict = {}
    np.testing.assert_allclose(
        result.loss, _haiku_host_loss(params, record=recorded), rtol=1e-5
    )
    check_activations(result, recorded, HAIKU_HOST_SITES)
    check_activation_grads(
        result,
        HAIKU_HOST_SITES,
        lambda offsets: _haiku_host_loss(params, offsets=offsets),
    )
    plain = jax.grad(_haiku_host_loss)(params)
    assert_tree_allclose(result.grads, plain, rtol=1e-4, atol=1e-6)


# -- what raises -----------------------------------------------------------------


class ScannedBlock(nnx.Module):
    def __init__(self, rngs):
        self.enc = nnx.bridge.ToNNX(LinenMLP(), rngs=rngs)
        nnx.bridge.lazy_init(self.enc, jnp.ones((1, 3)))

    def __call__(self, x):
        return self.enc(x)


class ScannedStack(nnx.Module):
    def __init__(self, rngs):
        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return ScannedBlock(rngs)

        self.blocks = make(rngs)
        self.head = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def body(block, x):
            return block(x)

        return self.head(body(self.blocks, x))


def test_linen_inside_nnx_scan_is_a_site_of_every_layer():
    model = ScannedStack(nnx.Rngs(0))
    x = X[:, :3]
    probe = bridge.probe(model)
    sites = probe.sites(x)
    assert "blocks/enc/Dense_0" in sites
    # The NNX sites are as before: the ToNNX holds every iteration.
    result = probe.value_and_grad(loss_fn, x, at=["blocks/enc", "head"])
    assert result.activation_grads["blocks/enc"].shape == (2, 5, 3)
    # A Linen layer inside the ToNNX inside nnx.scan is read from the
    # computation: every layer's value and gradient.
    dense = nnx.state(model)["blocks"]["enc"]["Dense_0"]
    plain = nnx.grad(lambda m: loss_fn(m(x)))(nnx.clone(model))
    for mode in ("eager", "jit"):
        step = lambda p, x: p.value_and_grad(  # noqa: E731
            loss_fn, x, at="blocks/enc/Dense_0", with_inputs=True
        )
        res = (jax.jit(step) if mode == "jit" else step)(probe, x)
        assert_stacked_dense_site(
            res,
            "blocks/enc/Dense_0",
            get_value(dense["kernel"]),
            get_value(dense["bias"]),
            get_value(plain["blocks"]["enc"]["Dense_0"]["bias"]),
        )


class LinenScanBody(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.relu(nn.Dense(4)(x)), None


class LinenScanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        scan = nn.scan(
            LinenScanBody,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=2,
        )
        x, _ = scan()(x, None)
        return nn.Dense(4)(x)


def test_a_linen_lifted_transform_inside_to_nnx_is_a_site_of_every_layer():
    model = nnx.bridge.ToNNX(LinenScanned(), rngs=nnx.Rngs(0))
    holder = nnx.Sequential(model, nnx.Linear(4, 2, rngs=nnx.Rngs(1)))
    nnx.bridge.lazy_init(holder, X)
    probe = bridge.probe(holder)
    # A re-traced scan body keeps its names: no `#1`.
    assert list(probe.sites(X)) == [
        "layers/0",
        "layers/0/ScanLinenScanBody_0",
        "layers/0/ScanLinenScanBody_0/Dense_0",
        "layers/0/Dense_0",
        "layers/1",
    ]
    result = probe.value_and_grad(loss_fn, X, at=["layers/0/Dense_0", "layers/1"])
    assert set(result.activation_grads) == {"layers/0/Dense_0", "layers/1"}
    site = "layers/0/ScanLinenScanBody_0/Dense_0"
    res = probe.value_and_grad(loss_fn, X, at=site, with_inputs=True)
    dense = nnx.state(holder)["layers"][0]["ScanLinenScanBody_0"]["Dense_0"]
    plain = nnx.grad(lambda m: loss_fn(m(X)))(nnx.clone(holder))
    assert_stacked_dense_site(
        res,
        site,
        get_value(dense["kernel"]),
        get_value(dense["bias"]),
        get_value(plain["layers"][0]["ScanLinenScanBody_0"]["Dense_0"]["bias"]),
    )


class ToLinenScanBody(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nnx.bridge.ToLinen(NnxMLP, args=(4, 4))(x), None


class LinenScanOfToLinen(nn.Module):
    @nn.compact
    def __call__(self, x):
        scan = nn.scan(
            ToLinenScanBody,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=3,
        )
        x, _ = scan()(x, None)
        return nn.Dense(2)(x)


def test_nnx_inside_to_linen_inside_nn_scan_is_a_site_of_every_layer():
    model = LinenScanOfToLinen()
    variables = model.init(jax.random.key(0), X)
    probe = bridge.probe(model, variables)
    with warnings.catch_warnings():
        # ToLinen warns about variables its module lacks: bridge's are given it.
        warnings.simplefilter("error")
        sites = probe.sites(X)
        result = probe.value_and_grad(loss_fn, X, at="ScanToLinenScanBody_0/ToLinen_0")
    assert "ScanToLinenScanBody_0/ToLinen_0" in sites
    # The ToLinen itself is a Linen site inside nn.scan: every iteration.
    assert "ScanToLinenScanBody_0/ToLinen_0/linear" in sites
    assert result.activation_grads["ScanToLinenScanBody_0/ToLinen_0"].shape == (3, 5, 4)
    plain = jax.grad(lambda p: loss_fn(model.apply({"params": p}, X)))(
        variables["params"]
    )
    assert_tree_allclose(result.grads, plain, rtol=1e-4, atol=1e-6)
    site = "ScanToLinenScanBody_0/ToLinen_0/linear"
    res = probe.value_and_grad(loss_fn, X, at=site, with_inputs=True)
    layer = variables["params"]["ScanToLinenScanBody_0"]["ToLinen_0"]["linear"]
    assert_stacked_dense_site(
        res,
        site,
        layer["kernel"],
        layer["bias"],
        plain["ScanToLinenScanBody_0"]["ToLinen_0"]["linear"]["bias"],
    )


class NnxWithEquinox(nnx.Module):
    def __init__(self, rngs):
        self.pre = nnx.Linear(4, 4, rngs=rngs)
        self.head = nnx.data(eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0)))

    def __call__(self, x):
        return jax.vmap(self.head)(bridge.tap("features", self.pre(x)))


def test_an_equinox_module_inside_nnx_is_no_site_and_selecting_inside_raises():
    probe = bridge.probe(NnxWithEquinox(nnx.Rngs(0)))
    assert list(probe.sites(X)) == ["pre", "features"]
    for at in ("head", "head/layers/0", ["pre", "head/layers/*"]):
        with pytest.raises(ValueError, match=r"'head', an Equinox module held by"):
            probe.value_and_grad(loss_fn, X, at=at)
    with pytest.raises(ValueError, match="cannot see the calls of an Equinox module"):
        probe.apply(X, patch={"head/layers/1": jnp.zeros_like})


def test_an_nnx_probe_with_new_weights_still_knows_its_equinox_modules():
    from bridge.adapters.nnx import porting

    probe = porting.with_weights(bridge.probe(NnxWithEquinox(nnx.Rngs(0))), [])
    assert list(probe.sites(X)) == ["pre", "features"]
    with pytest.raises(ValueError, match=r"'head', an Equinox module held by"):
        probe.value_and_grad(loss_fn, X, at="head/layers/0")


def _haiku_stacked(x):
    @hk.experimental.layer_stack(2)
    def layer(x):
        return jax.nn.relu(hk.Linear(6)(x))

    return layer(hk.Linear(6)(x))


HAIKU_STACKED = hk.without_apply_rng(hk.transform(_haiku_stacked))


class NnxWithHaikuStack(nnx.Module):
    def __init__(self):
        self.params = nnx.data(
            jax.tree.map(nnx.Param, HAIKU_STACKED.init(jax.random.key(0), X))
        )

    def __call__(self, x):
        return HAIKU_STACKED.apply(_values(self.params), x)


def test_a_haiku_transform_inside_a_guest_is_a_site_of_every_layer():
    probe = bridge.probe(NnxWithHaikuStack())
    # Named like their parameters: `__layer_stack_no_per_layer/linear`.
    assert list(probe.sites(X)) == ["linear", "__layer_stack_no_per_layer/linear"]
    result = probe.value_and_grad(loss_fn, X, at="linear")
    assert result.activation_grads["linear"].shape == (5, 6)
    site = "__layer_stack_no_per_layer/linear"
    res = probe.value_and_grad(loss_fn, X, at=site, with_inputs=True)
    model = NnxWithHaikuStack()
    layer = _values(model.params)[site]
    plain = nnx.grad(lambda m: loss_fn(m(X)))(model)
    assert_stacked_dense_site(
        res, site, layer["w"], layer["b"], get_value(plain["params"][site]["b"])
    )


class HaikuScanBody(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        params = self.param("haiku", lambda key: HAIKU_MLP.init(key, x))
        return x + HAIKU_MLP.apply(params, x)[..., :1], None


class LinenScanOfHaiku(nn.Module):
    @nn.compact
    def __call__(self, x):
        scan = nn.scan(
            HaikuScanBody,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=2,
        )
        return nn.Dense(2)(scan()(x, None)[0])


def test_a_guest_inside_the_hosts_lifted_transform_is_a_site_of_every_layer():
    model = LinenScanOfHaiku()
    variables = model.init(jax.random.key(0), X)
    probe = bridge.probe(model, variables)
    # One site per call, not one per trace of the scan body.
    assert list(probe.sites(X)) == [
        "ScanHaikuScanBody_0",
        *(f"ScanHaikuScanBody_0/{s}" for s in HAIKU_SITES),
        "Dense_0",
    ]
    result = probe.value_and_grad(loss_fn, X, at=["ScanHaikuScanBody_0", "Dense_0"])
    assert result.activation_grads["ScanHaikuScanBody_0"][0].shape == (2, 5, 4)
    # The Haiku module inside nn.scan is read from the computation: each
    # layer's value and gradient, against the layers unrolled by hand.
    res = probe.value_and_grad(loss_fn, X, at="ScanHaikuScanBody_0/mlp")
    params = variables["params"]

    def unrolled(params, offsets):
        h, outputs = X, []
        for i in range(2):
            layer = jax.tree.map(lambda a, i=i: a[i], params["ScanHaikuScanBody_0"])
            out = HAIKU_MLP.apply(layer["haiku"], h) + offsets[i]
            outputs.append(out)
            h = h + out[..., :1]
        dense = params["Dense_0"]
        return loss_fn(h @ dense["kernel"] + dense["bias"][None]), jnp.stack(outputs)

    value = res.activations["ScanHaikuScanBody_0/mlp"]
    (loss, outputs), grad = jax.value_and_grad(unrolled, argnums=1, has_aux=True)(
        params, jnp.zeros(value.shape)
    )
    np.testing.assert_allclose(res.loss, loss, rtol=1e-6)
    np.testing.assert_allclose(value, outputs, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        res.activation_grads["ScanHaikuScanBody_0/mlp"], grad, rtol=1e-5, atol=1e-7
    )
