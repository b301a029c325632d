"""A site bridge cannot express never blocks the others, in every library.

Each case is an unexpressible call (inside a `while_loop`; branches and
loops of static bounds are sites, `tests/test_control_flow.py`, and so are
scans and vmaps that broadcast their parameters, tested here too)
between ordinary layers, a head after it. `sites()` lists it with its whole
shape (the model's own mapped axes in front, a scan's iterations first);
selecting or patching it raises a `bridge.BridgeError` naming the innermost
transform that holds it; `at=None` leaves it out, and every other site's
values and gradients equal independent references (plain `jax.grad` for the
parameters, the bias identity or a gradient taken by hand for the
activations), eager and under `jax.jit`. Reverse-mode differentiation
through a `while_loop` is JAX's own limit: a model with one is checked
forward (`probe.apply`).

Linen's `nn.scan` that broadcasts `params` (`nn.RNN`'s) was such a case;
now a call in its body is a site per step, `(steps, batch, ...)`, on every
supported jax (read from the computation JAX builds), checked against the
steps unrolled in Python by hand: values, gradients of an offset per step and
of one offset shared by every step, patches per step, beside the same checks
of every other site.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.lax import scan as uncounted_scan

import bridge


def loss_fn(y):
    return jnp.mean(jnp.sin(y) + y**2)


def assert_close(actual, expected):
    """Equal at the tensor's own scale, on any CPU."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape, (a.shape, b.shape)
        scale = float(np.max(np.abs(b))) if b.size else 0.0
        error = float(np.max(np.abs(a - b))) if b.size else 0.0
        assert error <= 1e-5 * scale + 1e-6, (error, scale)


def shapes(struct):
    return jax.tree.map(lambda s: tuple(s.shape), struct)


def both_ways(run, *args, leaves_out=()):
    """`run(*args)` eager and under `jax.jit`, each of whose `at=None` leaves
    out the sites bridge cannot probe with a `BridgeWarning` naming
    `leaves_out`."""
    results = []
    for way in (run, jax.jit(run)):
        with helpers.leaves_out(*leaves_out):
            results.append(way(*args))
    return results


def assert_refused(probe, args, site, message, kwargs=None):
    """Selecting or patching `site` raises, naming the transform."""
    kwargs = kwargs or {}
    with pytest.raises(bridge.BridgeError, match=message):
        probe.value_and_grad(loss_fn, *args, at=site, **kwargs)
    with pytest.raises(bridge.BridgeError, match=message):
        probe.apply(*args, at=site, **kwargs)
    with pytest.raises(bridge.BridgeError, match=message):
        probe.apply(*args, patch={site: lambda v: v}, **kwargs)


def bias_sum(grad, leading):
    """d loss / d bias from a dense layer's output gradient: summed over the
    `leading` axes."""
    return grad.sum(axis=tuple(range(leading)))


# -- Flax Linen ------------------------------------------------------------------

nn = pytest.importorskip("flax.linen")


class LinenRNN(nn.Module):
    """`nn.RNN` scans its cell with `variable_broadcast='params'`."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, name="embed")(x)
        h = nn.RNN(nn.OptimizedLSTMCell(5, name="cell"), name="rnn")(h)
        return nn.Dense(2, name="head")(h)


class _Recurrent(nn.Module):
    @nn.compact
    def __call__(self, c, x):
        c = nn.tanh(nn.Dense(4, name="mix")(c) + x)
        return c, c


class _Layer(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return nn.tanh(nn.Dense(4, name="dense")(h)), None


class LinenScans(nn.Module):
    """A scan that broadcasts its parameters beside one that slices them."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, name="embed")(x)
        recurrent = nn.scan(
            _Recurrent,
            variable_broadcast="params",
            split_rngs={"params": False},
            in_axes=1,
            out_axes=1,
        )
        _, h = recurrent(name="recurrent")(jnp.zeros((x.shape[0], 4)), h)
        stack = nn.scan(
            _Layer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=2,
        )
        h, _ = stack(name="stack")(h, None)
        return nn.Dense(2, name="head")(h)


class LinenVmap(nn.Module):
    """`nn.vmap` broadcasting its parameters over the time axis."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, name="embed")(x)
        shared = nn.vmap(
            nn.Dense,
            variable_axes={"params": None},
            split_rngs={"params": False},
            in_axes=1,
            out_axes=1,
        )
        return nn.Dense(2, name="head")(jnp.tanh(shared(4, name="shared")(h)))


class LinenWhile(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, name="embed")(x)
        step = nn.Dense(4, name="step")
        if self.is_initializing():
            step(h)

        def body(module, carry):
            i, h = carry
            return i + 1, jnp.tanh(module(h))

        _, h = nn.while_loop(lambda _, c: c[0] < 3, body, step, (0, h))
        return nn.Dense(2, name="head")(h)


def _linen(module, x):
    variables = jax.jit(module.init)(jax.random.key(0), x)
    return bridge.probe(module, variables), variables["params"]


def _linen_plain(module, params, x):
    """The loss and parameter gradients of the plain model (compiled: an
    LSTM's eager gradient takes seconds)."""
    return jax.jit(
        jax.value_and_grad(lambda p: loss_fn(module.apply({"params": p}, x)))
    )(params)


def _keep(step, out):
    return out


def _added(offsets, per_step=True):
    """An edit adding `offsets`: row `step` at each step (`per_step`), else the
    one offset at every step."""
    return lambda step, out: jax.tree.map(
        lambda o, d: o + (d[step] if per_step else d), out, offsets
    )


def _row(value):
    """An edit replacing the output with row `step` of the stacked `value`."""
    return lambda step, out: jax.tree.map(lambda v: v[step], value)


def _dense(params, h):
    return nn.Dense(params["bias"].shape[-1]).apply({"params": params}, h)


def _rnn_by_hand(params, x, edits):
    """`LinenRNN`, its cell's steps unrolled (`_unrolled`)."""
    h = _dense(params["embed"], x)
    cell = nn.OptimizedLSTMCell(5)
    carry = cell.initialize_carry(jax.random.key(0), h[:, 0].shape)
    ys, seen = helpers.unrolled_linen_steps(
        lambda c, h: cell.apply({"params": params["cell"]}, c, h), carry, h, edits
    )
    return _dense(params["head"], ys), seen


def _scans_by_hand(params, x, edits):
    """`LinenScans`, its broadcasting scan's steps unrolled (`_unrolled`), then
    its stack's layers one by one."""
    h = _dense(params["embed"], x)
    h, seen = helpers.unrolled_linen_steps(
        lambda c, h: _Recurrent().apply({"params": params["recurrent"]}, c, h),
        jnp.zeros((x.shape[0], 4)),
        h,
        edits,
    )
    for layer in range(2):
        layer_params = {k: p[layer] for k, p in params["stack"]["dense"].items()}
        h = jnp.tanh(_dense(layer_params, h))
    return _dense(params["head"], h), seen


def _per_step_references(by_hand, params, x, names):
    """By hand, for each of `names`: its values per step; the gradient of the
    loss with an offset per step added there (`(steps, ...)`); and with one
    offset added at every step."""

    def hand_loss(edits):
        return loss_fn(by_hand(params, x, edits)[0])

    _, values = by_hand(params, x, dict.fromkeys(names, _keep))
    zeros = jax.tree.map(jnp.zeros_like, values)
    by_step = {
        name: jax.grad(lambda d, name=name: hand_loss({name: _added(d)}))(zeros[name])
        for name in names
    }
    shared = {
        name: jax.grad(lambda d, name=name: hand_loss({name: _added(d, False)}))(
            jax.tree.map(lambda z: z[0], zeros[name])
        )
        for name in names
    }
    return values, by_step, shared


def _assert_per_step(res, references, sites):
    """`res`'s values and gradients at each of `sites` (`{site: name}`) equal
    the references by hand per step; summed over the steps, its gradient is
    that of one offset added at every step."""
    values, by_step, shared = references
    for site, name in sites.items():
        assert_close(res.activations[site], values[name])
        assert_close(res.activation_grads[site], by_step[name])
        summed = jax.tree.map(lambda g: g.sum(0), res.activation_grads[site])
        assert_close(summed, shared[name])


def both_ways_whole(run, *args):
    """`run(*args)` eager and under `jax.jit`, leaving out no site (no
    `BridgeWarning`)."""
    results = []
    for way in (run, jax.jit(run)):
        with warnings.catch_warnings():
            warnings.simplefilter("error", bridge.BridgeWarning)
            results.append(way(*args))
    return results


def test_linen_rnn_cell_is_a_site_per_step_and_the_rest_probes():
    x = jax.random.normal(jax.random.key(1), (2, 3, 4))
    module = LinenRNN()
    probe, params = _linen(module, x)
    sites = probe.sites(x)
    # Every step's call, stacked: (steps, batch, features); carry, then output.
    assert shapes(sites["cell"]) == (((3, 2, 5), (3, 2, 5)), (3, 2, 5))
    # The optimized cell's `hi` hands out its (kernel, bias), at every step.
    assert shapes(sites["cell/hi"]) == ((3, 5, 5), (3, 5))
    references = _per_step_references(_rnn_by_hand, params, x, ["", "hi"])
    per_step = {"cell": "", "cell/hi": "hi"}
    loss, grads = _linen_plain(module, params, x)
    for res in both_ways_whole(lambda p, x: p.value_and_grad(loss_fn, x), probe, x):
        assert set(res.activations) == set(sites)  # nothing left out
        assert {"embed", "rnn", "head", "cell", "cell/hi"} <= set(sites)
        np.testing.assert_allclose(res.loss, loss, rtol=1e-6)
        assert_close(res.grads, grads)
        _assert_per_step(res, references, per_step)
        grad = res.activation_grads
        # `hi`'s (kernel, bias) at every step: the parameters, whose gradient
        # sums the steps'.
        hi, hi_params = grads["cell"]["hi"], params["cell"]["hi"]
        every_step = jax.tree.map(
            lambda p: jnp.broadcast_to(p, (3, *p.shape)),
            (hi_params["kernel"], hi_params["bias"]),
        )
        assert_close(res.activations["cell/hi"], every_step)
        assert_close(
            jax.tree.map(lambda g: g.sum(0), grad["cell/hi"]),
            (hi["kernel"], hi["bias"]),
        )
        # The sequence of the steps' outputs, batch first.
        assert_close(res.activations["rnn"], jnp.moveaxis(references[0][""][1], 0, 1))
        assert_close(bias_sum(grad["embed"], 2), grads["embed"]["bias"])
        assert_close(bias_sum(grad["head"], 2), grads["head"]["bias"])

        def after_rnn(h):
            return loss_fn(nn.Dense(2).apply({"params": params["head"]}, h))

        by_hand = jax.grad(after_rnn)(res.activations["rnn"])
        assert_close(grad["rnn"], by_hand)

    # The cell by type: its call alone (`nn.RNN`'s `scan_fn` around it is the
    # scan's function, no site), a site per step.
    def by_type(probe, x):
        return probe.value_and_grad(loss_fn, x, at=nn.OptimizedLSTMCell)

    for res in (by_type(probe, x), jax.jit(by_type)(probe, x)):
        assert set(res.activations) == {"cell"}
        _assert_per_step(res, references, {"cell": ""})

    # Patches per step: a function at the cell (each step's carry and output;
    # the next step reads the patched carry) and a stacked (kernel, bias) at
    # `hi`, each step's own.
    hi_value = helpers.random_like(sites["cell/hi"], seed=5)
    cases = [
        (
            {"cell": lambda out: jax.tree.map(lambda v: 2 * v - 0.5, out)},
            {"": lambda t, out: jax.tree.map(lambda v: 2 * v - 0.5, out), "hi": _keep},
        ),
        ({"cell/hi": hi_value}, {"": _keep, "hi": _row(hi_value)}),
    ]
    for patch, edits in cases:
        outputs, values = _rnn_by_hand(params, x, edits)

        def patched(probe, x, patch=patch):
            return probe.apply(x, at=["cell", "cell/hi"], patch=patch)

        for fwd in (patched(probe, x), jax.jit(patched)(probe, x)):
            assert_close(fwd.outputs, outputs)
            assert_close(fwd.activations["cell"], values[""])
            assert_close(fwd.activations["cell/hi"], values["hi"])


def test_linen_broadcast_scan_is_a_site_per_step_beside_a_sliced_scan():
    x = jax.random.normal(jax.random.key(1), (2, 3, 4))
    module = LinenScans()
    probe, params = _linen(module, x)
    sites = probe.sites(x)
    assert shapes(sites["recurrent/mix"]) == (3, 2, 4)  # (steps, batch, features)
    assert shapes(sites["stack/dense"]) == (2, 2, 3, 4)  # (layers, batch, ...)
    references = _per_step_references(_scans_by_hand, params, x, ["", "mix"])
    per_step = {"recurrent": "", "recurrent/mix": "mix"}
    loss, grads = _linen_plain(module, params, x)

    def run(probe, x):
        return probe.value_and_grad(loss_fn, x)

    for res in both_ways_whole(run, probe, x):
        assert set(res.activations) == {
            "embed",
            "recurrent",
            "recurrent/mix",
            "stack",
            "stack/dense",
            "head",
        }
        np.testing.assert_allclose(res.loss, loss, rtol=1e-6)
        assert_close(res.grads, grads)
        _assert_per_step(res, references, per_step)
        grad = res.activation_grads
        assert_close(bias_sum(grad["embed"], 2), grads["embed"]["bias"])
        # One bias for every step of the broadcasting scan...
        assert_close(
            bias_sum(grad["recurrent/mix"], 2), grads["recurrent"]["mix"]["bias"]
        )
        # ...and one bias per layer of the sliced stack.
        layers = grad["stack/dense"].sum(axis=(1, 2))
        assert_close(layers, grads["stack"]["dense"]["bias"])

    # A stacked patch value at `mix`: each step's own, the next step reading
    # the carry it made.
    mix_value = helpers.random_like(sites["recurrent/mix"], seed=6)
    outputs, values = _scans_by_hand(params, x, {"": _keep, "mix": _row(mix_value)})

    def patched(probe, x):
        return probe.apply(
            x, at=["recurrent", "recurrent/mix"], patch={"recurrent/mix": mix_value}
        )

    for fwd in (patched(probe, x), jax.jit(patched)(probe, x)):
        assert_close(fwd.outputs, outputs)
        assert_close(fwd.activations["recurrent"], values[""])
        assert_close(fwd.activations["recurrent/mix"], mix_value)


def test_linen_vmap_broadcasting_params_is_a_site_per_step():
    """One `nn.Dense` for every time step (`nn.vmap` with `params`
    broadcast): each step's call is a site, `(steps, batch, features)`, with
    per-step gradients against the model written by hand with an offset."""
    x = jax.random.normal(jax.random.key(1), (2, 3, 4))
    module = LinenVmap()
    probe, params = _linen(module, x)
    # The mapped (time) axis first, as the model's own mapped axes always are.
    assert shapes(probe.sites(x)["shared"]) == (3, 2, 4)

    def by_hand(offset):
        dense = functools.partial(nn.Dense(4).apply, {"params": params["shared"]})
        h = nn.Dense(4).apply({"params": params["embed"]}, x)
        shared = dense(h) + jnp.moveaxis(offset, 0, 1)
        return nn.Dense(2).apply({"params": params["head"]}, jnp.tanh(shared)), shared

    zeros = jnp.zeros((3, 2, 4))
    _, shared = by_hand(zeros)
    loss, grad = jax.value_and_grad(lambda o: loss_fn(by_hand(o)[0]))(zeros)
    _, grads = _linen_plain(module, params, x)
    for res in both_ways_whole(lambda p, x: p.value_and_grad(loss_fn, x), probe, x):
        np.testing.assert_allclose(res.loss, loss, rtol=1e-6)
        assert_close(res.activations["shared"], jnp.moveaxis(shared, 1, 0))
        assert_close(res.activation_grads["shared"], grad)
        assert_close(res.grads, grads)


def test_linen_while_loop_is_refused_and_the_rest_is_recorded():
    x = jax.random.normal(jax.random.key(1), (3, 4))
    module = LinenWhile()
    probe, params = _linen(module, x)
    assert shapes(probe.sites(x)["step"]) == (3, 4)
    # nn.while_loop is JAX's while_loop, which the core refuses.
    assert_refused(probe, (x,), "step", "jax.lax.while_loop.* around site 'step'.*scan")
    embed = nn.Dense(4).bind({"params": params["embed"]})(x)
    outputs = module.apply({"params": params}, x)
    for fwd in both_ways(lambda p, x: p.apply(x), probe, x, leaves_out=("step",)):
        assert set(fwd.activations) == {"embed", "head"}
        assert_close(fwd.activations["embed"], embed)
        assert_close(fwd.activations["head"], outputs)
        assert_close(fwd.outputs, outputs)


# -- Flax NNX --------------------------------------------------------------------

nnx = pytest.importorskip("flax.nnx")


class NnxModel(nnx.Module):
    """`embed`, then `inner` (and `other`) inside the transform `kind`, then
    `head`."""

    def __init__(self, kind, rngs):
        self.kind = kind
        self.embed = nnx.Linear(3, 4, rngs=rngs)
        self.inner = nnx.Linear(4, 4, rngs=rngs)
        self.other = nnx.Linear(4, 4, rngs=rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        h = self.embed(x)
        if self.kind == "scan":  # an RNN: one cell for every step
            cell = nnx.scan(
                lambda cell, c, x: (jnp.tanh(cell(c) + x),) * 2,
                in_axes=(None, nnx.Carry, 1),
                out_axes=(nnx.Carry, 1),
            )
            h = cell(self.inner, jnp.zeros_like(h[:, 0]), h)[1]
        elif self.kind == "vmap":  # one module for every step
            mapped = nnx.vmap(lambda m, h: m(h), in_axes=(None, 1), out_axes=1)
            h = mapped(self.inner, h)
        elif self.kind == "while":
            h = nnx.while_loop(
                lambda c: c[0] < 3,
                lambda c: (c[0] + 1, c[1], jnp.tanh(c[1](c[2]))),
                (0, self.inner, h),
            )[2]
        return self.head(jnp.tanh(h))


def _nnx_by_hand(model, kind, x, offsets):
    """`NnxModel(kind)` written by hand, `inner`'s value at each step (or
    for each mapped step) shifted by `offsets[step]`."""
    h = model.embed(x)
    values = []
    if kind == "scan":
        carry = jnp.zeros_like(h[:, 0])
        for step in range(h.shape[1]):
            values.append(model.inner(carry) + offsets[step])
            carry = jnp.tanh(values[-1] + h[:, step])
        h = jnp.stack([jnp.tanh(v + h[:, i]) for i, v in enumerate(values)], 1)
    else:
        values = [model.inner(h[:, step]) + offsets[step] for step in range(3)]
        h = jnp.stack(values, 1)
    return model.head(jnp.tanh(h)), jnp.stack(values)


@pytest.mark.skipif(not helpers.nnx_supported(), reason="NNX needs flax 0.12")
@pytest.mark.parametrize("kind", ["scan", "vmap"])
def test_nnx_module_broadcast_by_its_transform_is_a_site_per_step(kind):
    """One module for every step of an `nnx.scan` (an RNN's cell) or every
    example of an `nnx.vmap` (`in_axes=None` for it): each call is a site,
    `(steps, batch, features)`, the mapped axis first, per-step gradients
    against the model written by hand with offsets."""
    x = jax.random.normal(jax.random.key(1), (5, 3, 3))
    model = NnxModel(kind, nnx.Rngs(0))
    probe = bridge.probe(model)
    assert shapes(probe.sites(x)["inner"]) == (3, 5, 4)
    zeros = jnp.zeros((3, 5, 4))
    _, values = _nnx_by_hand(model, kind, x, zeros)
    loss, grad = jax.value_and_grad(
        lambda o: loss_fn(_nnx_by_hand(model, kind, x, o)[0])
    )(zeros)
    _, grads = nnx.value_and_grad(lambda m: loss_fn(m(x)))(nnx.clone(model))
    for res in both_ways_whole(lambda p, x: p.value_and_grad(loss_fn, x), probe, x):
        np.testing.assert_allclose(res.loss, loss, rtol=1e-6)
        assert_close(res.activations["inner"], values)
        assert_close(res.activation_grads["inner"], grad)
        assert_close(res.grads, grads)


@pytest.mark.skipif(not helpers.nnx_supported(), reason="NNX needs flax 0.12")
def test_nnx_while_loop_is_refused_and_the_rest_is_recorded():
    x = jax.random.normal(jax.random.key(1), (5, 3))
    model = NnxModel("while", nnx.Rngs(0))
    probe = bridge.probe(model)
    assert shapes(probe.sites(x)["inner"]) == (5, 4)
    # nnx.while_loop is JAX's while_loop, which the core refuses.
    assert_refused(
        probe, (x,), "inner", "jax.lax.while_loop.* around site 'inner'.*scan"
    )
    outputs = nnx.clone(model)(x)
    for fwd in both_ways(lambda p, x: p.apply(x), probe, x, leaves_out=("inner",)):
        assert set(fwd.activations) == {"embed", "head"}
        assert_close(fwd.activations["embed"], model.embed(x))
        assert_close(fwd.outputs, outputs)


# -- Haiku -------------------------------------------------------------------------

hk = pytest.importorskip("haiku")


def _haiku_model(kind):
    def forward(x):
        h = hk.Linear(4, name="embed")(x)
        inner, other = hk.Linear(4, name="inner"), hk.Linear(4, name="other")
        if hk.running_init():  # every branch's and loop's parameters
            h = inner(h) + other(h)
        elif kind == "vmap":  # one module for every example
            h = hk.vmap(inner, split_rng=False)(h)
        elif kind == "while":
            h = hk.while_loop(
                lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(inner(c[1]))), (0, h)
            )[1]
        return hk.Linear(2, name="head")(jnp.tanh(h))

    return hk.without_apply_rng(hk.transform(forward))


def test_haiku_vmap_is_the_models_own_vmap_a_site_per_example():
    """`hk.vmap` is JAX's `vmap` around the module (Haiku threads its state
    beside it): a call there is a site holding every mapped example, whose
    gradient is each example's own, against the model written by hand."""
    x = jax.random.normal(jax.random.key(1), (5, 3))
    transformed = _haiku_model("vmap")
    params = transformed.init(jax.random.key(0), x)
    probe = bridge.probe(transformed, params)
    assert shapes(probe.sites(x)["inner"]) == (5, 4)

    def dense(name, h):
        return h @ params[name]["w"] + params[name]["b"][None]

    inner = dense("inner", dense("embed", x))

    def by_hand(offset):
        return loss_fn(dense("head", jnp.tanh(inner + offset)))

    loss, grad = jax.value_and_grad(by_hand)(jnp.zeros((5, 4)))
    for res in both_ways_whole(lambda p, x: p.value_and_grad(loss_fn, x), probe, x):
        np.testing.assert_allclose(res.loss, loss, rtol=1e-6)
        assert_close(res.activations["inner"], inner)
        assert_close(res.activation_grads["inner"], grad)


def test_haiku_while_loop_is_refused_and_the_rest_is_recorded():
    x = jax.random.normal(jax.random.key(1), (5, 3))
    transformed = _haiku_model("while")
    params = transformed.init(jax.random.key(0), x)
    probe = bridge.probe(transformed, params)
    assert shapes(probe.sites(x)["inner"]) == (5, 4)
    # hk.while_loop is JAX's while_loop, which the core refuses.
    assert_refused(
        probe, (x,), "inner", "jax.lax.while_loop.* around site 'inner'.*scan"
    )
    outputs = transformed.apply(params, x)
    for fwd in both_ways(lambda p, x: p.apply(x), probe, x, leaves_out=("inner",)):
        assert set(fwd.activations) == {"embed", "head"}
        assert_close(fwd.outputs, outputs)
        assert_close(fwd.activations["head"], outputs)


# -- Equinox -------------------------------------------------------------------------

eqx = pytest.importorskip("equinox")


def _rk4(field, y0, dt=0.1, steps=4):
    """Fixed-step RK4 in a `lax.while_loop`, as ODE solvers loop."""

    def step(carry):
        i, y = carry
        k1 = field(y)
        k2 = field(y + dt / 2 * k1)
        k3 = field(y + dt / 2 * k2)
        k4 = field(y + dt * k3)
        return i + 1, y + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)

    return jax.lax.while_loop(lambda c: c[0] < steps, step, (0, y0))[1]


@eqx.filter_jit
def _filter_jit_solve(field, y0):
    """A hand-written ODE solve, as diffrax's `diffeqsolve` is built: the
    solver's loop inside a jit of its own (here `eqx.filter_jit`)."""
    return _rk4(field, y0)


def _jax_jit_solve(field, y0):
    """The same under `jax.jit`, the vector field applied to a batch of
    states by the solver's own `jax.vmap`."""
    return jax.jit(lambda y0: _rk4(jax.vmap(field), y0))(y0)


class NeuralOde(eqx.Module):
    encoder: eqx.nn.Linear
    field: eqx.nn.MLP
    head: eqx.nn.Linear

    def __init__(self, key, batched):
        keys = jax.random.split(key, 3)
        linear = eqx.nn.Linear if not batched else _Batched
        self.encoder = linear(4, 3, key=keys[0])
        self.field = eqx.nn.MLP(3, 3, 8, 1, activation=jnp.tanh, key=keys[1])
        self.head = linear(3, 2, key=keys[2])

    def __call__(self, x):
        solve = _jax_jit_solve if isinstance(self.head, _Batched) else _filter_jit_solve
        return self.head(solve(self.field, self.encoder(x)))


class _Batched(eqx.nn.Linear):
    """A Linear over a batch, as a model without `vmap=True` takes it."""

    def __call__(self, x):
        return jax.vmap(super().__call__)(x)


@pytest.mark.parametrize("vmap", [True, False], ids=["probe_vmap", "model_vmap"])
def test_equinox_ode_solver_sites_are_listed_batch_first_and_refused_naming_the_loop(
    vmap,
):
    x = jax.random.normal(jax.random.key(1), (5, 4))
    model = NeuralOde(jax.random.key(0), batched=not vmap)
    probe = bridge.probe(model, vmap=vmap)
    sites = probe.sites(x)
    # Batch first, the vector field's own per-neuron vmap after it; every RK4
    # stage of the loop's body is one call.
    assert shapes(sites["field"]) == (5, 3)
    assert shapes(sites["field/layers/0"]) == (5, 8)
    assert shapes(sites["field/activation"]) == (5, 8)
    assert shapes(sites["field#3"]) == (5, 3)
    # The loop is named, never the solver's jit around it.
    message = r"through jax.lax.while_loop.* around site 'field'"
    assert_refused(probe, (x,), "field", message)
    with pytest.raises(bridge.BridgeError) as refusal:
        probe.apply(x, at="field/activation#2")
    assert re.search(
        r"through jax.lax.while_loop.* around site 'field/activation#2'",
        str(refusal.value),
    )
    assert "through a jax.jit" not in str(refusal.value)
    # Every other site is recorded (reverse mode through a while_loop is
    # JAX's own limit: the run is checked forward).
    outputs = jax.vmap(model)(x) if vmap else model(x)
    encoded = jax.vmap(model.encoder)(x) if vmap else model.encoder(x)
    for fwd in both_ways(lambda p, x: p.apply(x), probe, x, leaves_out=("field",)):
        assert set(fwd.activations) == {"encoder", "head"}
        assert_close(fwd.activations["encoder"], encoded)
        assert_close(fwd.activations["head"], outputs)
        assert_close(fwd.outputs, outputs)


class EqxModel(eqx.Module):
    """`encoder`, then an RNN cell the scan closes over, then `head`: one
    example (probed with `vmap=True`). (`left` and `right` are the branches
    of `tests/test_control_flow.py`'s model.)

    `kind` "rnn" scans with `uncounted_scan`, JAX's own scan bound when this
    module was imported, which counts no iterations, but which is the same
    `scan` in the computation: `left` is a site per step there too.
    "counted_rnn" scans with the model's own `jax.lax.scan`, whose
    iterations bridge counts while a probe runs. `hand(step, output)`, where given,
    stands for `left`'s output at `step`: the references without bridge."""

    kind: str = eqx.field(static=True)
    encoder: eqx.nn.Linear
    left: eqx.nn.Linear
    right: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, kind, key):
        keys = jax.random.split(key, 4)
        self.kind = kind
        self.encoder = eqx.nn.Linear(3, 4, key=keys[0])
        self.left = eqx.nn.Linear(4, 4, key=keys[1])
        self.right = eqx.nn.Linear(4, 4, key=keys[2])
        self.head = eqx.nn.Linear(4, 2, key=keys[3])

    def __call__(self, x, hand: Callable | None = None):
        h = self.encoder(x)
        scan = jax.lax.scan if self.kind == "counted_rnn" else uncounted_scan
        if hand is None:
            step = lambda c, _: (jnp.tanh(self.left(c) + h), None)  # noqa: E731
            h = scan(step, h, None, length=3)[0]
        else:  # the steps' indices as `xs`, for `hand`
            step = lambda c, i: (jnp.tanh(hand(i, self.left(c)) + h), None)  # noqa: E731
            h = scan(step, h, jnp.arange(3))[0]
        return self.head(jnp.tanh(h))


@pytest.mark.parametrize("kind", ["counted_rnn", "rnn"])
def test_equinox_the_same_rnn_in_the_model_s_own_scan_probes_every_site(kind):
    """With the model's own `jax.lax.scan` (counted while a probe runs), or
    JAX's scan bound at import (the same `scan` in the computation, where
    the core reads it), `left` is a site per step: nothing is left out, each
    step's value is the cell's, each step's gradient that of an offset added
    there by hand."""
    x = jax.random.normal(jax.random.key(1), (5, 3))
    model = EqxModel(kind, jax.random.key(0))
    probe = bridge.probe(model, vmap=True)
    assert shapes(probe.sites(x)["left"]) == (3, 5, 4)  # (steps, batch, ...)

    def plain(model_and_offsets):
        model, offsets = model_and_offsets
        outputs = jax.vmap(lambda x, o: model(x, lambda i, out: out + o[i]))(x, offsets)
        return loss_fn(outputs)

    loss, (grads, offset_grads) = eqx.filter_value_and_grad(plain)(
        (model, jnp.zeros((5, 3, 4)))
    )

    def values(x):  # `left`'s output at each step of one example, by hand
        h = model.encoder(x)
        encoded, out = h, []
        for _ in range(3):
            out.append(model.left(h))
            h = jnp.tanh(out[-1] + encoded)
        return jnp.stack(out)

    def run(probe, x):
        return probe.value_and_grad(loss_fn, x)

    for way in (run, jax.jit(run)):
        with warnings.catch_warnings():
            warnings.simplefilter("error", bridge.BridgeWarning)  # none left out
            res = way(probe, x)
        assert set(res.activations) == {"encoder", "left", "head"}
        np.testing.assert_allclose(res.loss, loss, rtol=1e-6)
        assert_close(eqx.filter(res.grads, eqx.is_array), grads)
        grad = res.activation_grads
        assert_close(res.activations["left"], jnp.moveaxis(jax.vmap(values)(x), 1, 0))
        assert_close(grad["left"], jnp.moveaxis(offset_grads, 1, 0))
        # `left`'s bias, by the bias identity: summed over steps and batch.
        assert_close(bias_sum(grad["left"], 2), grads.left.bias)
        assert_close(bias_sum(grad["encoder"], 1), grads.encoder.bias)
        assert_close(bias_sum(grad["head"], 1), grads.head.bias)
