"""A `jax.lax.scan` whose body closes over a layer (an RNN cell applied at
every time step), in every library: one entry per iteration, stacked on a
leading axis in the order of the scan's `xs` (DESIGN.md, "Sites inside
control flow").

Each model runs a real recurrent cell of its library (`eqx.nn.GRUCell`,
`nn.GRUCell`, `nnx.GRUCell`, `hk.GRU`) over a sequence with the model's own
`jax.lax.scan`. The references never use bridge: the same model with an
offset added by hand to the cell's output at each step (`hand`), a step's
row taken by the step's index, which the model scans beside its inputs;
differentiated or pushed forward by plain JAX.

Linen's own `nn.scan` is read the same way: a branch inside a scanned
stack is a site per layer, against the stack unrolled by hand.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import nnx_supported
from jax.lax import scan as scan_bound_at_import

import bridge
from bridge._probe.discovery_cache import CACHE as DISCOVERIES

STEPS, IN, HIDDEN, BATCH = 4, 3, 5, 3

_OFFSETS: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "closed_over_offsets", default=None
)


@contextlib.contextmanager
def offsets_added(offsets: Any):
    token = _OFFSETS.set(offsets)
    try:
        yield
    finally:
        _OFFSETS.reset(token)


def hand(step: Any, out: Any) -> Any:
    """`out` plus row `step` of the offsets set by `offsets_added`."""
    offsets = _OFFSETS.get()
    if offsets is None:
        return out
    return jax.tree.map(lambda o, d: o + d[step], out, offsets)


def scan(kind: str, body: Callable, init: Any, xs: jax.Array) -> Any:
    """`body(h, (step, x))` over `xs` with the model's own loop, however the
    model spells it: `jax.lax.scan` forwards, in reverse (`reverse`), nested
    (`nested`: an outer scan of two halves, each an inner scan over its
    steps); the scan bound by `from jax.lax import scan` at import
    (`imported`); `jax.lax.map` of one step from `init` (`map`); a static
    `jax.lax.fori_loop` (`fori`)."""
    steps = jnp.arange(len(xs))
    if kind == "imported":
        return scan_bound_at_import(body, init, (steps, xs))[1]
    if kind == "map":
        return jax.lax.map(lambda step_x: body(init, step_x)[1], (steps, xs))
    if kind == "fori":

        def step(i, carry):
            h, ys = carry
            h, y = body(h, (i, xs[i]))
            return h, ys.at[i].set(y)

        return jax.lax.fori_loop(
            0, len(xs), step, (init, jnp.zeros((len(xs), HIDDEN)))
        )[1]
    if kind == "nested":
        pairs = (steps.reshape(2, -1), xs.reshape(2, -1, *xs.shape[1:]))
        return jax.lax.scan(lambda h, half: jax.lax.scan(body, h, half), init, pairs)[1]
    return jax.lax.scan(body, init, (steps, xs), reverse=kind == "reverse")[1]


# -- the four libraries -----------------------------------------------------------


class EqxRNN(eqx.Module):
    kind: str = eqx.field(static=True)
    cell: eqx.nn.GRUCell

    def __call__(self, xs):
        def body(h, step_x):
            step, x = step_x
            h = hand(step, self.cell(x, h))
            return h, h

        return scan(self.kind, body, jnp.zeros(HIDDEN), xs)


class LinenRNN(nn.Module):
    kind: str

    @nn.compact
    def __call__(self, xs):
        cell = nn.GRUCell(HIDDEN, name="cell")
        h = jnp.zeros(HIDDEN)
        if self.is_initializing():
            cell(h, xs[0])

        def body(h, step_x):
            step, x = step_x
            h, y = hand(step, cell(h, x))
            return h, y

        return scan(self.kind, body, h, xs)


def _haiku_rnn(kind: str) -> Callable:
    def function(xs):
        cell = hk.GRU(HIDDEN, name="cell")
        h = jnp.zeros(HIDDEN)
        if hk.running_init():
            cell(xs[0], h)

        def body(h, step_x):
            step, x = step_x
            y, h = hand(step, cell(x, h))
            return h, y

        return scan(kind, body, h, xs)

    return function


def build(library: str, kind: str) -> tuple[Any, Callable[[jax.Array], Any]]:
    """A probe of the model written with `kind` of scan (`vmap=True`), and
    `forward(xs)`: one sequence through the same model, outside bridge."""
    example = jnp.ones((STEPS, IN))
    if library == "equinox":
        model = EqxRNN(kind, eqx.nn.GRUCell(IN, HIDDEN, key=jax.random.key(0)))
        return bridge.probe(model, vmap=True), model
    if library == "linen":
        variables = LinenRNN(kind).init(jax.random.key(0), example)
        return (
            bridge.probe(LinenRNN(kind), variables, vmap=True),
            lambda xs: LinenRNN(kind).apply(variables, xs),
        )
    if library == "haiku":
        transformed = hk.without_apply_rng(hk.transform(_haiku_rnn(kind)))
        params = transformed.init(jax.random.key(0), example)
        return (
            bridge.probe(transformed, params, vmap=True),
            lambda xs: transformed.apply(params, xs),
        )
    from flax import nnx

    class NnxRNN(nnx.Module):
        def __init__(self, rngs):
            self.cell = nnx.GRUCell(IN, HIDDEN, rngs=rngs)

        def __call__(self, xs):
            def body(h, step_x):
                step, x = step_x
                h, y = hand(step, self.cell(h, x))
                return h, y

            return scan(kind, body, jnp.zeros(HIDDEN), xs)

    model = NnxRNN(nnx.Rngs(0))
    graph, state = nnx.split(model)
    return bridge.probe(model, vmap=True), lambda xs: nnx.merge(graph, state)(xs)


LIBRARIES = ["equinox", "linen", "haiku"] + (["nnx"] if nnx_supported() else [])


def loss_fn(outputs):
    return jnp.sum(jnp.sin(outputs) ** 2)


def sequences() -> jax.Array:
    return jax.random.normal(jax.random.key(1), (BATCH, STEPS, IN))


def cell_output_struct(probe, xs, kind: str) -> Any:
    """One step's cell output per example: the site's value less its steps'
    and the batch's axes."""
    leading = 3 if kind == "nested" else 2
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape[leading:], s.dtype),
        probe.sites(xs)["cell"],
    )


def hand_loss(forward, xs, offsets) -> jax.Array:
    """The loss with `offsets` (per example, per step) added by hand."""

    def one(xs, offsets):
        with offsets_added(offsets):
            return forward(xs)

    return loss_fn(jax.vmap(one)(xs, offsets))


def zero_offsets(struct) -> Any:
    return jax.tree.map(lambda s: jnp.zeros((BATCH, STEPS, *s.shape)), struct)


def as_steps_first(tree: Any, kind: str) -> Any:
    """Offsets `(batch, steps, ...)` laid out as the site: `(steps, batch,
    ...)`, a nested scan's steps as `(outer, inner)`."""

    def layout(leaf):
        leaf = jnp.moveaxis(leaf, 1, 0)
        if kind == "nested":
            leaf = leaf.reshape(2, -1, *leaf.shape[1:])
        return leaf

    return jax.tree.map(layout, tree)


def assert_close(actual, expected, rtol=2e-5):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        scale = float(jnp.max(jnp.abs(e))) or 1.0
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), atol=rtol * scale)


#: The same loop however spelled: the same sites, values and gradients.
KINDS = [
    "forward",
    "imported",
    "fori",
    # The costliest duplicates (a scan again, spelled otherwise): local runs.
    *(
        pytest.param(kind, marks=pytest.mark.slow)
        for kind in ("reverse", "nested", "map")
    ),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("library", LIBRARIES)
def test_a_cell_a_scan_closes_over_is_a_site_per_step(library, kind):
    """The site holds every step, in the order of the scan's `xs`: each
    step's gradient is the hand offset's at that step, eager and jitted;
    summed over the steps, the gradient of one offset shared by all."""
    probe, forward = build(library, kind)
    xs = sequences()
    struct = cell_output_struct(probe, xs, kind)
    steps = (2, STEPS // 2) if kind == "nested" else (STEPS,)
    for leaf in jax.tree.leaves(probe.sites(xs)["cell"]):
        assert leaf.shape == (*steps, BATCH, HIDDEN)
    loss, offset_grads = jax.value_and_grad(lambda o: hand_loss(forward, xs, o))(
        zero_offsets(struct)
    )
    shared = jax.grad(
        lambda s: hand_loss(
            forward,
            xs,
            jax.tree.map(
                lambda leaf: jnp.broadcast_to(leaf[:, None], (BATCH, STEPS, HIDDEN)), s
            ),
        )
    )(jax.tree.map(lambda s: jnp.zeros((BATCH, *s.shape)), struct))
    for run in (probe.value_and_grad, jax.jit(probe.value_and_grad, static_argnums=0)):
        res = run(loss_fn, xs)
        assert res.ran == {}
        assert_close(res.loss, loss)
        grads = res.activation_grads["cell"]
        assert_close(grads, as_steps_first(offset_grads, kind))
        summed = jax.tree.map(lambda g: g.reshape(STEPS, BATCH, HIDDEN).sum(0), grads)
        assert_close(summed, shared)


@pytest.mark.parametrize("library", LIBRARIES)
def test_jvp_along_every_step_of_a_scanned_cell(library):
    probe, forward = build(library, "reverse")
    xs = sequences()
    struct = cell_output_struct(probe, xs, "reverse")
    keys = iter(jax.random.split(jax.random.key(2), 8))
    direction = jax.tree.map(
        lambda s: jax.random.normal(next(keys), (BATCH, STEPS, *s.shape)), struct
    )
    _, tangent = jax.jvp(
        lambda o: hand_loss(forward, xs, o), (zero_offsets(struct),), (direction,)
    )
    res = probe.value_and_grad(loss_fn, xs, at="cell")
    contracted = sum(
        jnp.vdot(g, d)
        for g, d in zip(
            jax.tree.leaves(res.activation_grads["cell"]),
            jax.tree.leaves(as_steps_first(direction, "reverse")),
            strict=True,
        )
    )
    assert_close(contracted, tangent, rtol=1e-4)


@pytest.mark.parametrize("library", LIBRARIES)
def test_each_step_records_its_own_value(library):
    """A step's value is the cell's output at that step: the model's own
    outputs are the cells' (`y`, or `h` for Equinox), step by step."""
    probe, forward = build(library, "reverse")
    xs = sequences()
    res = probe.apply(xs, at="cell")
    outputs = jax.vmap(forward)(xs)  # (batch, steps, hidden)
    value = res.activations["cell"]
    recorded = value if library == "equinox" else value[1 if library != "haiku" else 0]
    assert_close(recorded, jnp.moveaxis(outputs, 1, 0))
    assert_close(res.outputs, outputs)


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_patch_per_step_replaces_that_step(library):
    """Patched at every step with the values of a run whose inputs differ,
    the outputs are that run's (each step's cell output is what the next
    step reads, so this is the whole sequence replaced)."""
    probe, _ = build(library, "forward")
    xs, others = sequences(), sequences() * 2.0
    theirs = probe.apply(others, at="cell")
    patched = probe.apply(xs, at="cell", patch={"cell": theirs.activations["cell"]})
    assert_close(patched.outputs, theirs.outputs)
    assert_close(patched.activations["cell"], theirs.activations["cell"])


#: The functions of JAX's that bridge once replaced while a probe ran (the
#: model's `jax.lax.scan`, counting its iterations; `jax.jit`'s cache miss,
#: running jitted functions inline), where this JAX has them.
_ONCE_REPLACED = [
    (module, name)
    for module, names in (
        (jax.lax, ("scan",)),
        (
            __import__("jax._src.pjit", fromlist=["pjit"]),
            ("_infer_params", "_run_python_pjit", "_python_pjit_helper"),
        ),
    )
    for name in names
    if hasattr(module, name)
]


class _Watching(EqxRNN):
    def __call__(self, xs):
        _SEEN.append([getattr(module, name) for module, name in _ONCE_REPLACED])
        return super().__call__(xs)


_SEEN: list = []


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_no_function_of_jax_is_replaced_while_a_probe_runs(mode):
    """Where a call runs, and a trace JAX cached, the core reads from the
    computation: the model's code meets JAX's own functions while a probe
    runs it, in discovery and in the run, and a site in its scan is still a
    site per iteration."""
    original = [getattr(module, name) for module, name in _ONCE_REPLACED]
    assert original  # `jax.lax.scan` at least
    model = _Watching("forward", eqx.nn.GRUCell(IN, HIDDEN, key=jax.random.key(0)))
    _SEEN.clear()
    # The other mode's discovery, cached, would run no Python of the model.
    DISCOVERIES.clear()

    def step(probe, xs):
        return probe.value_and_grad(loss_fn, xs)

    probe = bridge.probe(model, vmap=True)
    res = (jax.jit(step) if mode == "jit" else step)(probe, sequences())
    assert len(_SEEN) >= 1
    assert all(seen == original for seen in _SEEN)
    assert res.activations["cell"].shape == (STEPS, BATCH, HIDDEN)


# -- Linen's own nn.scan: a branch inside a scanned stack ---------------------------


class _LinenBranchBlock(nn.Module):
    """A block of a scanned stack: `left` or `tanh(right)` by `nn.cond` on
    the sign of the batch's first feature, which differs between layers."""

    @nn.compact
    def __call__(self, h, _):
        left, right = nn.Dense(4, name="left"), nn.Dense(4, name="right")
        if self.is_initializing():
            left(h), right(h)
        h = nn.cond(
            h[..., 0].sum() > 0,
            lambda _, v: left(v),
            lambda _, v: jnp.tanh(right(v)),
            self,
            h,
        )
        return h, None


class _LinenBranchStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, name="embed")(x)
        scan = nn.scan(
            _LinenBranchBlock,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=3,
        )
        h = scan(name="blocks")(h, None)[0]
        return nn.Dense(2, name="head")(h)


def test_a_branch_in_a_linen_scanned_stack_is_a_site_per_layer():
    """Each layer's branch sites hold that layer's value and gradient where
    its branch ran, zeros where it did not, and `ran` says which, eager and
    jitted: against the stack unrolled by hand, each branch computed and
    picked with `jnp.where`, offsets added per layer."""
    x = jax.random.normal(jax.random.key(1), (2, 4))
    model = _LinenBranchStack()
    variables = model.init(jax.random.key(0), x)
    params = variables["params"]
    probe = bridge.probe(model, variables)
    sites = ("blocks/left", "blocks/right")
    for site in sites:
        assert probe.sites(x)[site].shape == (3, 2, 4)

    def dense(p, h):
        return nn.Dense(4).apply({"params": p}, h)

    def unrolled(offsets):
        h = dense(params["embed"], x)
        values, taken = {site: [] for site in sites}, []
        for i in range(3):
            layer = jax.tree.map(lambda a, i=i: a[i], params["blocks"])
            left = dense(layer["left"], h)
            right = dense(layer["right"], h)
            went_left = h[..., 0].sum() > 0
            values["blocks/left"].append(left)
            values["blocks/right"].append(right)
            taken.append(went_left)
            h = jnp.where(
                went_left,
                left + offsets["blocks/left"][i],
                jnp.tanh(right + offsets["blocks/right"][i]),
            )
        out = nn.Dense(2).apply({"params": params["head"]}, h)
        return loss_fn(out), (values, jnp.stack(taken))

    zeros = {site: jnp.zeros((3, 2, 4)) for site in sites}
    (loss, (values, went_left)), grads = jax.value_and_grad(unrolled, has_aux=True)(
        zeros
    )
    assert 0 < int(went_left.sum()) < 3, "both branches must run in some layer"
    ran = {"blocks/left": went_left, "blocks/right": ~went_left}

    def run(probe, x):
        return probe.value_and_grad(loss_fn, x, at=list(sites))

    for res in (run(probe, x), jax.jit(run)(probe, x)):
        assert_close(res.loss, loss)
        for site in sites:
            np.testing.assert_array_equal(res.ran[site], ran[site])
            where = ran[site][:, None, None]
            assert_close(
                res.activations[site], jnp.where(where, jnp.stack(values[site]), 0)
            )
            assert_close(res.activation_grads[site], grads[site])
