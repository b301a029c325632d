"""A tap (or a module call) whose code JAX traces more than once for one call
is one site (DESIGN.md: a trace is not a call).

- `nnx.fori_loop` traces its body once in a `jax.eval_shape`, to learn its
  shapes, before JAX's loop traces it again: a tap there is one site
  holding every iteration, never a phantom `t#1` beside it;
- a `lax.scan` body whose carry starts as a Python `0` that the body turns
  into a float is traced twice, and JAX keeps the second trace: a tap there
  is one site, in each library, and so is a module the body closes over in
  Equinox. The computation reads the model's own `jax.lax.scan`, so the
  site holds every iteration, `(iterations, batch,
  width)`: each iteration's value and gradient its own, as in a scan traced
  once;
- a scan bound by name before the probe ran (`from jax.lax import scan` at
  import) counts no iterations, but it is the same `scan` in the
  computation JAX builds, where the core reads it: the same site of every
  iteration.

References do not use bridge: the model's own code with offsets added by
hand where a site is (the loop unrolled in Python for the tap in a loop; in
a scan, row `i` of the offsets at the iteration over `xs[i] == i`),
differentiated with `jax.grad`, and the values the scan returns as its
`ys`; the probe eagerly and under `jax.jit`.
"""

from __future__ import annotations

import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import nnx_supported
from jax.lax import scan as uncounted_scan

import bridge

STEPS, IN, WIDTH, OUT, BATCH = 3, 3, 4, 2, 5
X = jax.random.normal(jax.random.key(1), (BATCH, IN))
#: How a scan's or loop's carry `total` starts: a Python `0` (the body is
#: traced twice, as the body turns it into a float) or `0.0` (traced once).
STARTS = [pytest.param(0, id="traced-twice"), pytest.param(0.0, id="traced-once")]


def loss_fn(outputs):
    return jnp.mean(jnp.square(outputs - 0.3))


def assert_close(actual, expected, rtol=1e-5):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(float(np.max(np.abs(expected))), 1e-6)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


def both_ways(run, *args) -> list:
    """`run(*args)` eager and under `jax.jit`."""
    return [run(*args), jax.jit(run)(*args)]


def shapes(sites: dict) -> dict:
    return {name: site.shape for name, site in sites.items()}


# -- a tap inside nnx.fori_loop: one site, every iteration --------------------------


def _nnx_loop_model(kind: str, start):
    """encoder, then `STEPS` iterations of `h = tap("t", tanh(cell(h)))` (the
    carry's `total` summing each step's mean, started at `start`), then
    head: the loop is NNX's own (`own`), JAX's (`lax`) or unrolled in Python
    with `offsets[i]` added where the tap is (`unrolled`, the reference,
    which records each step's value in `values`)."""
    from flax import nnx

    class Loop(nnx.Module):
        def __init__(self, rngs):
            self.encoder = nnx.Linear(IN, WIDTH, rngs=rngs)
            self.cell = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
            self.head = nnx.Linear(WIDTH, OUT, rngs=rngs)

        def __call__(self, x, offsets=None, values=None):
            def step(i, cell, h, total):
                v = jnp.tanh(cell(h))
                if offsets is not None:
                    v = v + offsets[i]
                if values is not None:
                    values.append(v)
                v = bridge.tap("t", v)
                return v, total + jnp.mean(v)

            h, total = self.encoder(x), start
            if kind == "own":
                _, h, total = nnx.fori_loop(
                    0,
                    STEPS,
                    lambda i, c: (c[0], *step(i, c[0].cell, c[1], c[2])),
                    (self, h, total),
                )
            elif kind == "lax":
                h, total = jax.lax.fori_loop(
                    0, STEPS, lambda i, c: step(i, self.cell, *c), (h, total)
                )
            else:
                for i in range(STEPS):
                    h, total = step(i, self.cell, h, total)
            return self.head(h + total)

    return Loop(nnx.Rngs(0))


@pytest.mark.skipif(not nnx_supported(), reason="needs Flax NNX")
@pytest.mark.parametrize("start", STARTS)
@pytest.mark.parametrize("kind", ["own", "lax"])
def test_a_tap_in_an_nnx_fori_loop_is_one_site_of_every_iteration(kind, start):
    """Listed once, `(iterations, batch, width)`; each iteration's value (the
    unrolled model's) and gradient (the hand offset's), eager and jitted."""
    model = _nnx_loop_model(kind, start)
    probe = bridge.probe(model)
    assert shapes(probe.sites(X)) == {
        "encoder": (BATCH, WIDTH),
        "cell": (STEPS, BATCH, WIDTH),
        "t": (STEPS, BATCH, WIDTH),
        "head": (BATCH, OUT),
    }
    reference = _nnx_loop_model("unrolled", start)
    values = []
    reference(X, values=values)

    def hand_loss(offsets):
        return loss_fn(reference(X, offsets))

    zeros = jnp.zeros((STEPS, BATCH, WIDTH))
    loss, offset_grads = jax.value_and_grad(hand_loss)(zeros)
    for result in both_ways(lambda p, x: p.value_and_grad(loss_fn, x), probe, X):
        assert_close(result.loss, loss)
        assert_close(result.activations["t"], jnp.stack(values))
        assert_close(result.activation_grads["t"], offset_grads)
    # The tap alone, selected: the same gradient.
    alone = probe.value_and_grad(loss_fn, X, at="t")
    assert list(alone.activation_grads) == ["t"]
    assert_close(alone.activation_grads["t"], offset_grads)


# -- a tap inside a lax.scan traced twice: one site of every iteration ---------------


def _plus(offsets, site, value, step=None):
    """`value`, plus `offsets[site]` (its row `step` where given) where the
    reference adds an offset at `site`."""
    if offsets is None or site not in offsets:
        return value
    return value + (offsets[site] if step is None else offsets[site][step])


def _scan_step(cell, offsets):
    """A scan body over `xs == arange(STEPS)`: `h = tap("t", tanh(cell(h)))`,
    its carry's `total` summing each step's mean; with `offsets` (the
    reference), row `i` of `offsets["cell"]` and `offsets["t"]` added to the
    cell's output and to the tap's input at the iteration over `i`. Its `ys`
    are each iteration's cell output and tap value."""

    def step(carry, i):
        h, total = carry
        c = _plus(offsets, "cell", cell(h), i)
        h = bridge.tap("t", _plus(offsets, "t", jnp.tanh(c), i))
        return (h, total + jnp.mean(h)), {"cell": c, "t": h}

    return step


def _scanned(cell, h, start, offsets, counted):
    """`h + total` after the scan, and its `ys`. `counted`: the scan is
    `jax.lax.scan` looked up as the model runs (the one a probe counts);
    otherwise the one bound at this module's import (never counted)."""
    scan = jax.lax.scan if counted else uncounted_scan
    body = _scan_step(cell, offsets)
    (h, total), steps = scan(body, (h, start), jnp.arange(STEPS))
    return h + total, steps


def _returned(offsets, outputs, encoded, steps):
    """The model's outputs; with `offsets` (the reference), also its
    encoder's output and the scan's `ys`."""
    return outputs if offsets is None else (outputs, encoded, steps)


# Each builder gives the probe of a model encoder -> scan -> head, and its
# reference `forward(x, offsets) -> (outputs, encoded, steps)`: the model on
# a batch with `offsets["encoder"]` and `offsets["head"]` (`(batch, ...)`)
# added by hand to the outputs of its encoder and its head, and
# `offsets["t"]` (and `offsets["cell"]`, `(steps, batch, ...)`) in the scan
# as `_scan_step` says; its encoder's output, and `steps`: `{"t", "cell"}`,
# each iteration's values `(steps, batch, ...)`.


def _nnx_scan(start, counted=True):
    from flax import nnx

    class Scanned(nnx.Module):
        def __init__(self, rngs):
            self.encoder = nnx.Linear(IN, WIDTH, rngs=rngs)
            self.head = nnx.Linear(WIDTH, OUT, rngs=rngs)

        def __call__(self, x, offsets=None):
            encoded = _plus(offsets, "encoder", self.encoder(x))
            h, steps = _scanned(jnp.sin, encoded, start, offsets, counted)
            outputs = _plus(offsets, "head", self.head(h))
            return _returned(offsets, outputs, encoded, steps)

    model = Scanned(nnx.Rngs(0))
    return bridge.probe(model), model


def _haiku_scan(start, counted=True):
    def forward(x, offsets=None):
        encoded = _plus(offsets, "encoder", hk.Linear(WIDTH, name="encoder")(x))
        h, steps = _scanned(jnp.sin, encoded, start, offsets, counted)
        outputs = _plus(offsets, "head", hk.Linear(OUT, name="head")(h))
        return _returned(offsets, outputs, encoded, steps)

    model = hk.without_apply_rng(hk.transform(forward))
    params = model.init(jax.random.key(0), X)
    return bridge.probe(model, params), lambda x, o: model.apply(params, x, o)


class _EqxScan(eqx.Module):
    encoder: eqx.nn.Linear
    cell: eqx.nn.Linear
    head: eqx.nn.Linear
    # The carry's start by its type's name: JAX's treedef (which keys
    # bridge's discovery cache) holds static fields by equality, and `0 == 0.0`.
    start: str = eqx.field(static=True)
    #: Whether the scan body calls `cell` (a module it closes over: a site
    #: per iteration) rather than a plain function.
    calls_cell: bool = eqx.field(static=True)
    #: Whether the scan is the one a probe counts (see `_scanned`).
    counted: bool = eqx.field(static=True)

    def __call__(self, x, offsets=None):
        encoded = _plus(offsets, "encoder", self.encoder(x))
        start = {"int": 0, "float": 0.0}[self.start]
        cell = self.cell if self.calls_cell else jnp.sin
        h, steps = _scanned(cell, encoded, start, offsets, self.counted)
        outputs = _plus(offsets, "head", self.head(h))
        return _returned(offsets, outputs, encoded, steps)


def _equinox_scan(start, counted=True, calls_cell=False):
    keys = jax.random.split(jax.random.key(0), 3)
    model = _EqxScan(
        eqx.nn.Linear(IN, WIDTH, key=keys[0]),
        eqx.nn.Linear(WIDTH, WIDTH, key=keys[1]),
        eqx.nn.Linear(WIDTH, OUT, key=keys[2]),
        type(start).__name__,
        calls_cell,
        counted,
    )

    def forward(x, offsets):
        # One example at a time, as the probe (`vmap=True`) runs the model:
        # the per-iteration offsets and values have the batch second.
        axes = {site: 1 if site in IN_THE_SCAN else 0 for site in offsets}
        return jax.vmap(model, in_axes=(0, axes), out_axes=(0, 0, 1))(x, offsets)

    return bridge.probe(model, vmap=True), forward


SCAN_BUILDERS = {"haiku": _haiku_scan, "equinox": _equinox_scan}
if nnx_supported():
    SCAN_BUILDERS["nnx"] = _nnx_scan
SITES_AROUND = {"encoder": (BATCH, WIDTH), "head": (BATCH, OUT)}
#: The sites a scan body can hold, each `(iterations, batch, width)`.
IN_THE_SCAN = ("cell", "t")


@pytest.mark.parametrize("start", STARTS)
@pytest.mark.parametrize("library", list(SCAN_BUILDERS))
def test_a_tap_in_a_scan_traced_twice_is_one_site_of_every_iteration(library, start):
    """`t` alone (no phantom `t#1`), `(iterations, batch, width)`; each
    iteration's value (the model's own) and gradient (the hand offset's at
    that iteration), summed the shared offset's; the sites around the scan
    probe as usual; eager and jitted."""
    probe, forward = SCAN_BUILDERS[library](start)
    assert shapes(probe.sites(X)) == {
        "encoder": (BATCH, WIDTH),
        "t": (STEPS, BATCH, WIDTH),
        "head": (BATCH, OUT),
    }
    _check_every_iteration(probe, forward, ["t"])
    _check_the_sites_around(probe, forward)


@pytest.mark.parametrize("start", STARTS)
def test_an_equinox_module_in_a_scan_traced_twice_is_one_site_of_every_iteration(
    start,
):
    """A module the body of a scan traced twice closes over (not sliced by
    the scan) is one site beside the tap, as in a scan traced once, each
    iteration its own."""
    probe, forward = _equinox_scan(start, calls_cell=True)
    assert shapes(probe.sites(X)) == {
        "encoder": (BATCH, WIDTH),
        "cell": (STEPS, BATCH, WIDTH),
        "t": (STEPS, BATCH, WIDTH),
        "head": (BATCH, OUT),
    }
    _check_every_iteration(probe, forward, ["cell", "t"])
    _check_the_sites_around(probe, forward)


@pytest.mark.parametrize("start", STARTS)
@pytest.mark.parametrize("library", list(SCAN_BUILDERS))
def test_a_tap_in_a_scan_bound_at_import_is_one_site_of_every_iteration(library, start):
    """A scan bound before the probe ran (`from jax.lax import scan` at
    import) is the same `scan` in the computation JAX builds: the tap in its
    body is one site of every iteration, as in `jax.lax.scan`, against the
    hand offsets, eager and jitted; the sites around it probe as usual."""
    probe, forward = SCAN_BUILDERS[library](start, counted=False)
    assert shapes(probe.sites(X)) == {
        "encoder": (BATCH, WIDTH),
        "t": (STEPS, BATCH, WIDTH),
        "head": (BATCH, OUT),
    }
    _check_every_iteration(probe, forward, ["t"])
    _check_the_sites_around(probe, forward)


def test_an_equinox_module_in_a_scan_bound_at_import_is_one_site_of_every_iteration():
    """The module the body of a scan bound at import closes over: one site
    of every iteration beside the tap."""
    probe, forward = _equinox_scan(0, counted=False, calls_cell=True)
    assert shapes(probe.sites(X))["cell"] == (STEPS, BATCH, WIDTH)
    _check_every_iteration(probe, forward, ["cell", "t"])


def _check_every_iteration(probe, forward, sites):
    """Every site (all selected, eager and jitted; then each of `sites`
    alone): the loss, and each of `sites`' value per iteration (the scan's
    own `ys`) and gradient per iteration (the hand offset's at that
    iteration, by plain `jax.grad`), whose sum over the iterations is the
    gradient of one offset shared by every iteration."""
    per_step = (STEPS, BATCH, WIDTH)
    zeros = {site: jnp.zeros(per_step) for site in sites}
    _, _, values = forward(X, zeros)

    def hand_loss(offsets):
        return loss_fn(forward(X, offsets)[0])

    loss, offset_grads = jax.value_and_grad(hand_loss)(zeros)
    shared_grads = jax.grad(
        lambda shared: hand_loss(
            {site: jnp.broadcast_to(o, per_step) for site, o in shared.items()}
        )
    )({site: jnp.zeros(per_step[1:]) for site in sites})
    # The references differ where they should: every iteration's gradient
    # is its own, so the test can tell one step's from another's.
    for site in sites:
        assert not np.allclose(offset_grads[site][0], offset_grads[site][-1])
    for result in both_ways(lambda p, x: p.value_and_grad(loss_fn, x), probe, X):
        assert set(result.activation_grads) == set(probe.sites(X))
        _check_iterations(result, sites, loss, values, offset_grads, shared_grads)
    # Each site alone, selected: the same.
    for site in sites:
        alone = probe.value_and_grad(loss_fn, X, at=site)
        assert list(alone.activation_grads) == [site]
        _check_iterations(alone, [site], loss, values, offset_grads, shared_grads)


def _check_iterations(result, sites, loss, values, offset_grads, shared_grads):
    assert result.ran == {}
    assert_close(result.loss, loss)
    for site in sites:
        assert_close(result.activations[site], values[site])
        grads = result.activation_grads[site]
        assert_close(grads, offset_grads[site])
        assert_close(jnp.sum(grads, axis=0), shared_grads[site])


def _check_the_sites_around(probe, forward):
    """The values of `encoder` and `head` and their gradients: the hand
    offsets', differentiated by plain `jax.grad`; eager and jitted."""
    zeros = {site: jnp.zeros(shape) for site, shape in SITES_AROUND.items()}
    outputs, encoded, _ = forward(X, zeros)

    def hand_loss(offsets):
        return loss_fn(forward(X, offsets)[0])

    loss, offset_grads = jax.value_and_grad(hand_loss)(zeros)
    run = lambda p, x: p.value_and_grad(loss_fn, x, at=list(SITES_AROUND))  # noqa: E731
    for result in both_ways(run, probe, X):
        assert_close(result.loss, loss)
        assert_close(result.activations["encoder"], encoded)
        assert_close(result.activations["head"], outputs)
        for site in SITES_AROUND:
            assert_close(result.activation_grads[site], offset_grads[site])
