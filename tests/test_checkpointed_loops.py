"""Sites inside Equinox's while loops with a bound (DESIGN.md, "Sites inside
control flow"): `equinox.internal.while_loop(kind="checkpointed",
max_steps=n)` and `kind="bounded"` (a nest of `lax.scan`s of `lax.cond`s,
rounds of `base` steps), and diffrax's ODE solves that run on them
(`RecursiveCheckpointAdjoint`, `DirectAdjoint`).

A site there holds every step, `(max_steps, *value shape)`, zeros for the
steps that did not run, and `res.ran[path]` says which did. The references
never use bridge: the same loop unrolled to `max_steps` in Python, each step
applied where the loop's condition holds (`jnp.where`) with an offset added
by hand at the site, differentiated by `jax.grad` and pushed forward by
`jax.jvp` (the checkpointed loop itself has no forward mode).
"""

from __future__ import annotations

import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import jaxpr_traces_record_their_parent

import bridge

# The Equinox adapter reads the traces around a call in these loops (the
# core's one fallback), which jax links from 0.6.2; before, the call is
# listed and refused, naming that.
pytestmark = pytest.mark.skipif(
    not jaxpr_traces_record_their_parent(),
    reason="sites inside Equinox's while loops: jax >= 0.6.2",
)

MAX_STEPS = 6
WIDTH = 3

#: The loops `Relax` runs: the checkpointed kind, and the bounded kind in one
#: round of 16 steps and in nested rounds of 2 (`jax.checkpoint` around all
#: but the lowest).
LOOPS = {
    "checkpointed": {"kind": "checkpointed"},
    "bounded": {"kind": "bounded"},
    "bounded-base-2": {"kind": "bounded", "base": 2},
}


class Relax(eqx.Module):
    """Iterates `h <- h + 0.5 tanh(cell(h))` while `|h|` is below a bound
    and fewer than `MAX_STEPS` steps ran, then `head(h)`: how many steps run
    depends on the example."""

    cell: eqx.nn.Linear
    head: eqx.nn.Linear
    loop: dict = eqx.field(static=True)

    def __init__(self, key, loop=None, max_steps=MAX_STEPS):
        cell, head = jax.random.split(key)
        self.cell = eqx.nn.Linear(WIDTH, WIDTH, key=cell)
        self.head = eqx.nn.Linear(WIDTH, 2, key=head)
        self.loop = {"max_steps": max_steps, **(loop or LOOPS["checkpointed"])}

    def step(self, h, offset=0.0):
        """One step: the new `h` and the `cell` site's value."""
        value = self.cell(h) + offset
        return h + 0.5 * jnp.tanh(value), value

    @staticmethod
    def going_on(h):
        return jnp.sum(h**2) < 4.0

    def __call__(self, x):
        def body(carry):
            return self.step(carry)[0]

        return self.head(eqxi.while_loop(self.going_on, body, x, **self.loop))

    def unrolled(self, x, offsets):
        """The reference: `(output, values, ran)` of one example, with
        `offsets[k]` added at the site on step `k`."""
        h, values, ran = x, [], []
        running = jnp.array(True)
        for k in range(self.loop["max_steps"]):
            running = running & self.going_on(h)
            new, value = self.step(h, offsets[k])
            h = jnp.where(running, new, h)
            values.append(jnp.where(running, value, 0.0))
            ran.append(running)
        return self.head(h), jnp.stack(values), jnp.stack(ran)


def loss_fn(outputs):
    return jnp.sum(outputs**2)


def inputs():
    return 0.9 * jax.random.normal(jax.random.key(1), (5, WIDTH))


@pytest.fixture(scope="module", params=list(LOOPS))
def relax(request):
    """`Relax` in each kind of loop, and its inputs."""
    return Relax(jax.random.key(0), LOOPS[request.param]), inputs()


@pytest.fixture(scope="module")
def base():
    """`Relax` in the checkpointed loop, and its inputs."""
    return Relax(jax.random.key(0)), inputs()


def reference(model, x, offsets):
    """Per example (offsets `(batch, max_steps, width)`): the loss's gradient
    with respect to the offsets, the values and where the site ran."""

    def loss(offsets):
        outputs, values, ran = jax.vmap(model.unrolled)(x, offsets)
        return loss_fn(outputs), (values, ran)

    (_, (values, ran)), grads = jax.value_and_grad(loss, has_aux=True)(offsets)
    return grads, values, ran


def steps_first(a):
    return jnp.swapaxes(a, 0, 1)


def assert_close(actual, expected, rtol=1e-5):
    actual, expected = np.asarray(actual), np.asarray(expected)
    scale = max(float(np.max(np.abs(expected))), 1e-6)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=rtol * scale)


@pytest.mark.parametrize(
    "jit", [pytest.param(False, marks=pytest.mark.slow), True], ids=["eager", "jit"]
)
def test_a_site_in_a_bounded_equinox_loop_holds_every_step(relax, jit):
    model, x = relax
    probe = bridge.probe(model, vmap=True)
    assert probe.sites(x)["cell"].shape == (MAX_STEPS, 5, WIDTH)

    def run(probe, x):
        return probe.value_and_grad(loss_fn, x, at=["cell"])

    res = (jax.jit(run) if jit else run)(probe, x)
    grads, values, ran = reference(model, x, jnp.zeros((5, MAX_STEPS, WIDTH)))
    ran = steps_first(ran)
    # Examples stop at different steps, one only at `max_steps`.
    assert len(set(np.asarray(ran.sum(0)).tolist())) > 2 and bool(ran[-1].any())
    np.testing.assert_array_equal(res.ran["cell"], ran)
    assert_close(res.activations["cell"], steps_first(values))
    assert_close(res.activation_grads["cell"], steps_first(grads))
    expected_loss = loss_fn(jax.vmap(model)(x))
    assert_close(res.loss, expected_loss)


def test_jvp_along_every_step_of_a_bounded_equinox_loop_site(relax):
    model, x = relax
    res = bridge.probe(model, vmap=True).value_and_grad(loss_fn, x, at=["cell"])
    direction = jax.random.normal(jax.random.key(2), (5, MAX_STEPS, WIDTH))

    def loss(offsets):
        return loss_fn(jax.vmap(model.unrolled)(x, offsets)[0])

    _, pushed = jax.jvp(loss, (jnp.zeros_like(direction),), (direction,))
    along = jnp.sum(res.activation_grads["cell"] * steps_first(direction))
    assert_close(along, pushed)


def test_parameter_gradients_through_a_bounded_equinox_loop_equal_plain_jax(relax):
    model, x = relax
    res = bridge.probe(model, vmap=True).value_and_grad(loss_fn, x, at=["cell"])
    params, static = eqx.partition(model, eqx.is_inexact_array)
    plain = jax.grad(lambda p: loss_fn(jax.vmap(eqx.combine(p, static))(x)))(params)
    for got, expected in zip(
        jax.tree.leaves(res.grads), jax.tree.leaves(plain), strict=True
    ):
        assert_close(got, expected)


def test_one_call_of_a_bounded_equinox_loop_without_vmap_has_a_ran_per_step(relax):
    model, x = relax
    res = bridge.probe(model).value_and_grad(loss_fn, x[0], at=["cell"])
    grads, values, ran = reference(model, x[:1], jnp.zeros((1, MAX_STEPS, WIDTH)))
    assert res.ran["cell"].shape == (MAX_STEPS,)
    np.testing.assert_array_equal(res.ran["cell"], ran[0])
    assert_close(res.activations["cell"], values[0])
    assert_close(res.activation_grads["cell"], grads[0])


def test_a_site_outside_the_loop_has_no_ran_entry(relax):
    model, x = relax
    res = bridge.probe(model, vmap=True).value_and_grad(loss_fn, x)
    assert set(res.activations) == {"cell", "head"}
    assert set(res.ran) == {"cell"}


# -- loops and solves bridge refuses, naming them -------------------------------


def test_a_bounded_loop_of_one_step_is_one_call_without_a_steps_axis(base):
    """`max_steps=1`: Equinox calls the body once, with no loop around it
    (for every example: one whose condition is false keeps its carry), so
    the site is one call's, as outside a loop."""
    _, x = base
    model = Relax(jax.random.key(0), LOOPS["bounded"], max_steps=1)
    res = bridge.probe(model, vmap=True).value_and_grad(loss_fn, x, at=["cell"])
    assert res.activations["cell"].shape == (5, WIDTH)
    assert "cell" not in res.ran
    grads, _, ran = reference(model, x, jnp.zeros((5, 1, WIDTH)))
    assert not bool(ran.all())  # an example whose body's value is unused
    assert_close(res.activations["cell"], jax.vmap(model.cell)(x))
    assert_close(res.activation_grads["cell"], grads[:, 0])
    assert_close(res.loss, loss_fn(jax.vmap(model)(x)))


class InWhile(Relax):
    """`Relax`'s loop inside a `lax.while_loop` of one step."""

    def __call__(self, x):
        def once(carry):
            i, h = carry
            return i + 1, Relax.__call__(self, h)[:1].sum() + h

        return jax.lax.while_loop(lambda c: c[0] < 1, once, (0, x))[1]


@pytest.mark.parametrize(
    ("loop", "named", "way_out"),
    [
        (
            {"kind": "checkpointed", "checkpoints": 3, "max_steps": None},
            r"equinox\.internal\.while_loop \(checkpointed, no max_steps\) "
            "around site 'cell': without `max_steps`",
            r"Select other sites with `at=`.* or give the loop `max_steps=`",
        ),
    ],
    ids=["checkpointed-without-max-steps"],
)
def test_a_loop_bridge_cannot_route_is_named_with_the_way_out(
    base, loop, named, way_out
):
    _, x = base
    model = Relax(jax.random.key(0), loop)
    probe = bridge.probe(model, vmap=True)
    # Listed without a steps axis: the loop's steps are not the site's.
    assert probe.sites(x)["cell"].shape == (5, WIDTH)
    with pytest.raises(bridge.BridgeError, match=named) as raised:
        probe.value_and_grad(loss_fn, x, at=["cell"])
    assert raised.match(way_out)
    # The site after the loop probes as usual.
    res = probe.value_and_grad(loss_fn, x, at=["head"])
    expected = jax.vmap(model)(x)
    assert_close(res.activations["head"], expected)
    grad = jax.grad(lambda o: loss_fn(o))(expected)
    assert_close(res.activation_grads["head"], grad)


def test_a_bounded_loop_inside_a_while_loop_is_refused_naming_the_while_loop(base):
    _, x = base
    model = InWhile(jax.random.key(0), LOOPS["bounded"])
    with pytest.raises(
        bridge.BridgeError,
        match=r"while_loop around site 'cell'.*runs inside "
        r'equinox\.internal\.while_loop \(kind="bounded"\) inside jax\.lax\.while_loop',
    ):
        bridge.probe(model, vmap=True).value_and_grad(loss_fn, x, at=["cell"])


class Solved(eqx.Module):
    """`head` of the root of `y - 0.5 tanh(cell(y)) = x`, found by
    optimistix's Newton solve, differentiated implicitly."""

    cell: eqx.nn.Linear
    head: eqx.nn.Linear

    def __call__(self, x):
        optx = pytest.importorskip("optimistix")

        def fn(y, args):
            return y - 0.5 * jnp.tanh(self.cell(y)) - x

        solver = optx.Newton(rtol=1e-6, atol=1e-6)
        root = optx.root_find(fn, solver, x, adjoint=optx.ImplicitAdjoint())
        return self.head(root.value)


@pytest.mark.slow  # an Optimistix solve compiled: the costliest refusal
def test_a_site_in_an_optimistix_solve_is_refused_naming_the_solve(base):
    pytest.importorskip("optimistix")
    model, x = base
    probe = bridge.probe(Solved(model.cell, model.head), vmap=True)
    with pytest.raises(
        bridge.BridgeError,
        match=r"cannot see through optimistix\.root_find around site 'cell'.*"
        "or call the layer outside the solve",
    ):
        probe.value_and_grad(loss_fn, x, at=["cell"])
    assert set(probe.value_and_grad(loss_fn, x, at=["head"]).activations) == {"head"}


# -- diffrax: a neural ODE's vector field, one entry per solver step ------------------

try:
    import diffrax
except ImportError:  # the loops' own tests above run without it
    diffrax = None

#: A test of a diffrax solve.
NEEDS_DIFFRAX = pytest.mark.skipif(diffrax is None, reason="diffrax is not installed")

ODE_STEPS = 8
DT = 0.125


class VectorField(eqx.Module):
    mlp: eqx.nn.MLP

    def __call__(self, t, y, args):
        return self.mlp(y)


class NeuralODE(eqx.Module):
    field: VectorField
    adjoint: object = eqx.field(static=True)

    def __init__(self, key, adjoint=None):
        self.adjoint = adjoint or diffrax.RecursiveCheckpointAdjoint()
        self.field = VectorField(
            eqx.nn.MLP(WIDTH, WIDTH, 8, 1, activation=jnp.tanh, key=key)
        )

    def __call__(self, y0):
        solution = diffrax.diffeqsolve(
            diffrax.ODETerm(self.field),
            diffrax.Euler(),
            t0=0.0,
            t1=ODE_STEPS * DT,
            dt0=DT,
            y0=y0,
            max_steps=ODE_STEPS,
            adjoint=self.adjoint,
        )
        return solution.ys[-1]

    def unrolled(self, y0, offsets):
        """Euler by hand, `offsets[k]` added to the field's last layer on
        step `k`: `(output, that layer's values)`."""
        y, values = y0, []
        mlp = self.field.mlp
        for k in range(ODE_STEPS):
            hidden = mlp.activation(mlp.layers[0](y))
            value = mlp.layers[1](hidden) + offsets[k]
            values.append(value)
            y = y + DT * value
        return y, jnp.stack(values)


@NEEDS_DIFFRAX
@pytest.mark.parametrize("adjoint", ["RecursiveCheckpointAdjoint", "DirectAdjoint"])
def test_a_neural_odes_vector_field_site_holds_every_solver_step(adjoint):
    model = NeuralODE(jax.random.key(3), getattr(diffrax, adjoint)())
    y0 = jax.random.normal(jax.random.key(4), (4, WIDTH))
    probe = bridge.probe(model, vmap=True)
    site = "field/mlp/layers/1"
    res = jax.jit(lambda p, y: p.value_and_grad(loss_fn, y, at=[site]))(probe, y0)
    offsets = jnp.zeros((4, ODE_STEPS, WIDTH))

    def loss(offsets):
        outputs, values = jax.vmap(model.unrolled)(y0, offsets)
        return loss_fn(outputs), values

    (expected_loss, values), grads = jax.value_and_grad(loss, has_aux=True)(offsets)
    assert res.activations[site].shape == (ODE_STEPS, 4, WIDTH)
    assert bool(res.ran[site].all())
    assert_close(res.loss, expected_loss)
    assert_close(res.activations[site], steps_first(values))
    assert_close(res.activation_grads[site], steps_first(grads))


@NEEDS_DIFFRAX
def test_a_diffrax_solve_with_an_implicit_adjoint_is_refused_naming_it():
    model = NeuralODE(jax.random.key(3), diffrax.ImplicitAdjoint())
    y0 = jax.random.normal(jax.random.key(4), (4, WIDTH))
    with pytest.raises(
        bridge.BridgeError,
        match=r"cannot see through diffrax\.diffeqsolve \(adjoint=ImplicitAdjoint\)"
        r" around site 'field/mlp/layers/1'.*"
        r"adjoint=diffrax\.RecursiveCheckpointAdjoint",
    ):
        bridge.probe(model, vmap=True).value_and_grad(
            loss_fn, y0, at=["field/mlp/layers/1"]
        )


def test_a_patch_function_in_a_checkpointed_loop_under_vmap_is_refused_first(base):
    """A patch function sees the whole batch, gathered over the probe's
    vmap axis; the checkpointed loop's backward pass traces its body where
    that axis is unbound. A patch value, and `apply`, still work."""
    model, x = base
    probe = bridge.probe(model, vmap=True)
    with pytest.raises(
        bridge.BridgeNotImplementedError,
        match=r"patch for site 'cell': a patch function sees the whole batch.*"
        r"Give a patch value",
    ):
        probe.value_and_grad(loss_fn, x, patch={"cell": lambda v: v * 0.5})
    zeros = jnp.zeros((MAX_STEPS, *x.shape))
    res = probe.value_and_grad(loss_fn, x, at="head", patch={"cell": zeros})
    assert np.isfinite(float(res.loss))
    probe.apply(x, patch={"cell": lambda v: v * 0.5})


@pytest.mark.parametrize(
    "jit", [pytest.param(False, marks=pytest.mark.slow), True], ids=["eager", "jit"]
)
@pytest.mark.parametrize("loop", ["bounded", "bounded-base-2"])
def test_a_patch_function_in_a_bounded_loop_under_vmap_applies_at_every_step(loop, jit):
    """The bounded kind's nest is differentiated by JAX itself, with the
    probe's vmap axis bound: a patch function there applies at each step
    that runs, as an offset added by hand at every step does."""
    model, x = Relax(jax.random.key(0), LOOPS[loop]), inputs()
    probe = bridge.probe(model, vmap=True)

    def step(probe, x):
        return probe.value_and_grad(
            loss_fn, x, at=["cell"], patch={"cell": lambda v: v + 0.1}
        )

    res = (jax.jit(step) if jit else step)(probe, x)
    offsets = jnp.full((x.shape[0], MAX_STEPS, WIDTH), 0.1)
    grads, values, ran = reference(model, x, offsets)
    expected_loss = loss_fn(jax.vmap(model.unrolled)(x, offsets)[0])
    assert_close(res.loss, expected_loss)
    assert_close(res.activations["cell"], steps_first(values))
    assert_close(res.activation_grads["cell"], steps_first(grads))
    np.testing.assert_array_equal(res.ran["cell"], steps_first(ran))
