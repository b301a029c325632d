"""Sites inside branches, in every library: the library's own `cond` and
`switch` and JAX's `lax.cond` inside a module (DESIGN.md, "Sites inside
control flow").

Each model is `encoder`, then a branch between `left` (a Dense layer) and
`right` (a Dense layer, then tanh) taken per example (`h[0] > 0`), then
`head`; one example at a time, probed with `vmap=True`, so the branch taken
varies across the batch. The references never use bridge: the same model
with offsets added by hand inside the branches (`offset`), differentiated or
pushed forward with `jax.jvp` by plain JAX, and a variant that computes both
branches outside any `cond` and picks with `jnp.where`, which records each
branch's value.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
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

import bridge

# -- offsets added by hand --------------------------------------------------------

_FRAME: contextvars.ContextVar[tuple[dict, dict] | None] = contextvars.ContextVar(
    "control_flow_offsets", default=None
)


@contextlib.contextmanager
def offsets_added(offsets: dict[str, Any]):
    """Inside it, `offset(site, value)` adds `offsets[site]` and records the
    value (the recording is read only from the `both` variant, which runs
    outside any branch). Nested, it adds to the outer one's."""
    outer = _FRAME.get()
    recorded: dict[str, Any] = {} if outer is None else outer[1]
    if outer is not None:
        offsets = {**outer[0], **offsets}
    token = _FRAME.set((offsets, recorded))
    try:
        yield recorded
    finally:
        _FRAME.reset(token)


def offset(site: str, value: jax.Array) -> jax.Array:
    frame = _FRAME.get()
    if frame is None:
        return value
    offsets, recorded = frame
    if site in offsets:
        value = value + offsets[site]
    recorded[site] = value
    return value


def branch(kind: str, predicate, go_left, go_right, operand, own=None):
    """`go_left(operand)` where `predicate`, else `go_right(operand)`: with
    the library's own `cond`/`switch` (`own(kind, ...)`), JAX's (`lax`), or
    both computed and picked (`both`, the reference)."""
    if kind == "both":
        return jnp.where(predicate, go_left(operand), go_right(operand))
    if kind == "lax":
        return jax.lax.cond(predicate, go_left, go_right, operand)
    if kind == "lax_switch":
        index = predicate.astype(jnp.int32)
        return jax.lax.switch(index, [go_right, go_left], operand)
    return own(kind, predicate, go_left, go_right, operand)


# -- the four libraries -----------------------------------------------------------

IN, WIDTH, OUT, BATCH = 3, 4, 2, 6


@dataclasses.dataclass
class Case:
    """A model under probe and its plain-JAX references.

    `forward(kind, x, offsets)`: one example's outputs with `offsets` added by
    hand, the branch written as `kind`; `probe`: the model written as the
    case's kind, probed with `vmap=True`."""

    probe: Any
    forward: Callable[[str, jax.Array, dict], Any]


class LinenBranch(nn.Module):
    kind: str

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(WIDTH, name="encoder")(x)
        left, right = nn.Dense(WIDTH, name="left"), nn.Dense(WIDTH, name="right")
        if self.is_initializing():
            left(h), right(h)

        def own(kind, predicate, go_left, go_right, operand):
            if kind == "cond":
                return nn.cond(
                    predicate,
                    lambda _, v: go_left(v),
                    lambda _, v: go_right(v),
                    self,
                    operand,
                )
            return nn.switch(
                predicate.astype(jnp.int32),
                [lambda _, v: go_right(v), lambda _, v: go_left(v)],
                self,
                operand,
            )

        h = branch(
            self.kind,
            h[0] > 0,
            lambda v: offset("left", left(v)),
            lambda v: jnp.tanh(offset("right", right(v))),
            h,
            own,
        )
        return nn.Dense(OUT, name="head")(h)


def _linen(kind: str, vmap: bool = True, model: type | None = None) -> Case:
    model = model or LinenBranch
    x = jnp.ones((IN,))
    variables = model("both").init(jax.random.key(0), x)

    def forward(kind, x, offsets):
        with offsets_added(offsets):
            return model(kind).apply(variables, x)

    return Case(bridge.probe(model(kind), variables, vmap=vmap), forward)


def _nnx(kind: str, vmap: bool = True) -> Case:
    from flax import nnx

    class NnxBranch(nnx.Module):
        def __init__(self, kind, rngs):
            self.kind = kind
            self.encoder = nnx.Linear(IN, WIDTH, rngs=rngs)
            self.left = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
            self.right = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
            self.head = nnx.Linear(WIDTH, OUT, rngs=rngs)

        def __call__(self, x):
            h = self.encoder(x)

            def own(kind, predicate, go_left, go_right, operand):
                if kind == "cond":
                    return nnx.cond(
                        predicate,
                        lambda m, v: go_left(v, m),
                        lambda m, v: go_right(v, m),
                        self,
                        operand,
                    )
                return nnx.switch(
                    predicate.astype(jnp.int32),
                    [lambda m, v: go_right(v, m), lambda m, v: go_left(v, m)],
                    self,
                    operand,
                )

            h = branch(
                self.kind,
                h[0] > 0,
                lambda v, m=self: offset("left", m.left(v)),
                lambda v, m=self: jnp.tanh(offset("right", m.right(v))),
                h,
                own,
            )
            return self.head(h)

    # The same seed: the same parameters, whatever the kind.
    models = {k: NnxBranch(k, nnx.Rngs(0)) for k in ("both", *KINDS["nnx"])}

    split = {k: nnx.split(m) for k, m in models.items()}

    # nnx.cond and nnx.switch refuse a module under a plain jax.vmap (NNX's
    # trace-level check): the reference writes them with JAX's, the same
    # numbers, in a module merged in this trace.
    plain = {"cond": "lax", "switch": "lax_switch"}

    def forward(kind, x, offsets):
        with offsets_added(offsets):
            return nnx.merge(*split[plain.get(kind, kind)])(x)

    return Case(bridge.probe(models[kind], vmap=vmap), forward)


class EqxBranch(eqx.Module):
    kind: str = eqx.field(static=True)
    encoder: eqx.nn.Linear
    left: eqx.nn.Linear
    right: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, kind, key):
        keys = jax.random.split(key, 4)
        self.kind = kind
        self.encoder = eqx.nn.Linear(IN, WIDTH, key=keys[0])
        self.left = eqx.nn.Linear(WIDTH, WIDTH, key=keys[1])
        self.right = eqx.nn.Linear(WIDTH, WIDTH, key=keys[2])
        self.head = eqx.nn.Linear(WIDTH, OUT, key=keys[3])

    def __call__(self, x):
        h = self.encoder(x)
        h = branch(
            self.kind,
            h[0] > 0,
            lambda v: offset("left", self.left(v)),
            lambda v: jnp.tanh(offset("right", self.right(v))),
            h,
        )
        return self.head(h)


def _equinox(kind: str, vmap: bool = True) -> Case:
    # The same key: the same parameters, whatever the kind.
    models = {k: EqxBranch(k, jax.random.key(0)) for k in ("both", *KINDS["equinox"])}

    def forward(kind, x, offsets):
        with offsets_added(offsets):
            return models[kind](x)

    return Case(bridge.probe(models[kind], vmap=vmap), forward)


def _haiku_function(kind: str) -> Callable:
    def function(x):
        left, right = hk.Linear(WIDTH, name="left"), hk.Linear(WIDTH, name="right")
        h = hk.Linear(WIDTH, name="encoder")(x)
        if hk.running_init():
            left(h), right(h)

        def own(kind, predicate, go_left, go_right, operand):
            if kind == "cond":
                return hk.cond(predicate, go_left, go_right, operand)
            return hk.switch(predicate.astype(jnp.int32), [go_right, go_left], operand)

        h = branch(
            kind,
            h[0] > 0,
            lambda v: offset("left", left(v)),
            lambda v: jnp.tanh(offset("right", right(v))),
            h,
            own,
        )
        return hk.Linear(OUT, name="head")(h)

    return function


def _haiku(kind: str, vmap: bool = True) -> Case:
    params = hk.transform(_haiku_function("both")).init(
        jax.random.key(0), jnp.ones((IN,))
    )

    def forward(kind, x, offsets):
        with offsets_added(offsets):
            return hk.transform(_haiku_function(kind)).apply(params, None, x)

    return Case(
        bridge.probe(hk.transform(_haiku_function(kind)), params, vmap=vmap), forward
    )


BUILDERS = {"linen": _linen, "equinox": _equinox, "haiku": _haiku}
if nnx_supported():
    BUILDERS["nnx"] = _nnx

#: The branches each library writes: its own `cond` and `switch`, and JAX's.
KINDS = {
    "linen": ("cond", "switch", "lax", "lax_switch"),
    "nnx": ("cond", "switch", "lax", "lax_switch"),
    "equinox": ("lax", "lax_switch"),
    "haiku": ("cond", "switch", "lax", "lax_switch"),
}
CASES = [
    pytest.param(library, kind, id=f"{library}-{kind}")
    for library in BUILDERS
    for kind in KINDS[library]
]


def loss_fn(outputs):
    return jnp.mean(jnp.square(outputs - 0.3))


def inputs() -> jax.Array:
    """A batch whose examples take both branches."""
    x = jax.random.normal(jax.random.key(1), (BATCH, IN))
    return x


def hand_loss(case: Case, kind: str, x: jax.Array, offsets: dict) -> jax.Array:
    outputs = jax.vmap(lambda x, o: case.forward(kind, x, o))(x, offsets)
    return loss_fn(outputs)


def branch_values(case: Case, x: jax.Array) -> dict:
    """Every example's value of both branch sites, computed outside any
    branch (the `both` variant)."""

    def one(x):
        with offsets_added({}) as recorded:
            case.forward("both", x, {})
        return recorded

    return jax.vmap(one)(x)


def takes_left(case: Case, x: jax.Array) -> np.ndarray:
    """Which examples take `left`: those whose outputs move when the left
    branch's value does."""

    def one(x):
        base = case.forward("both", x, {})
        moved = case.forward("both", x, {"left": jnp.full((WIDTH,), 1e3)})
        return jnp.any(base != moved)

    return np.asarray(jax.vmap(one)(x))


def zero_offsets() -> dict:
    return {"left": jnp.zeros((BATCH, WIDTH)), "right": jnp.zeros((BATCH, WIDTH))}


def assert_close(actual, expected, rtol=1e-5):
    """Equal at the scale of `expected` (float32 rounding, not elementwise
    near zero)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(float(np.max(np.abs(expected))), 1e-6)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


def both_ways(run: Callable, *args) -> list:
    """`run(*args)` eager and under `jax.jit`."""
    return [run(*args), jax.jit(run)(*args)]


# -- the tests ----------------------------------------------------------------------


@pytest.mark.parametrize(("library", "kind"), CASES)
def test_every_branch_site_is_a_site_holding_every_example(library, kind):
    case = BUILDERS[library](kind)
    sites = case.probe.sites(inputs())
    # Call order: the branches in the order they are written (a switch
    # here lists `right` first).
    branches = ["right", "left"] if "switch" in kind else ["left", "right"]
    assert list(sites) == ["encoder", *branches, "head"]
    for name in ("left", "right"):
        assert sites[name].shape == (BATCH, WIDTH)


@pytest.mark.parametrize(("library", "kind"), CASES)
def test_a_branch_site_holds_the_branch_that_ran_and_zeros_elsewhere(library, kind):
    """At `at=None` (no warning: nothing is left out), eager and jitted: the
    value and gradient of the branch that ran, zeros where it did not, `ran`
    saying where; the gradients equal the hand-inserted offsets'."""
    case = BUILDERS[library](kind)
    x = inputs()
    left = takes_left(case, x)
    assert left.any() and not left.all(), "the batch must take both branches"
    values = branch_values(case, x)
    loss, offset_grads = jax.value_and_grad(lambda o: hand_loss(case, kind, x, o))(
        zero_offsets()
    )
    for res in both_ways(lambda p, x: p.value_and_grad(loss_fn, x), case.probe, x):
        assert set(res.ran) == {"left", "right"}
        np.testing.assert_array_equal(res.ran["left"], left)
        np.testing.assert_array_equal(res.ran["right"], ~left)
        assert res.ran["left"].dtype == jnp.bool_
        assert_close(res.loss, loss)
        for name, where in (("left", left), ("right", ~left)):
            expected = np.where(where[:, None], values[name], 0.0)
            assert_close(res.activations[name], expected)
            assert_close(res.activation_grads[name], offset_grads[name])
            assert not np.any(np.asarray(res.activation_grads[name])[~where])
        # Sites outside the branch: no `ran`, their own values.
        assert "encoder" in res.activations and "head" in res.activations


@pytest.mark.parametrize(("library", "kind"), CASES)
def test_jvp_along_a_branch_site_equals_its_gradient(library, kind):
    """`jax.jvp` of the hand-perturbed loss along random offsets at both
    branch sites equals the probe's gradients contracted with them."""
    case = BUILDERS[library](kind)
    x = inputs()
    keys = jax.random.split(jax.random.key(7), 2)
    direction = {
        "left": jax.random.normal(keys[0], (BATCH, WIDTH)),
        "right": jax.random.normal(keys[1], (BATCH, WIDTH)),
    }
    _, tangent = jax.jvp(
        lambda o: hand_loss(case, kind, x, o), (zero_offsets(),), (direction,)
    )
    res = case.probe.value_and_grad(loss_fn, x, at=["left", "right"])
    contracted = sum(
        jnp.vdot(res.activation_grads[name], direction[name])
        for name in ("left", "right")
    )
    assert_close(contracted, tangent, rtol=1e-4)


@pytest.mark.parametrize(("library", "kind"), CASES)
def test_a_patch_in_a_branch_applies_where_it_runs(library, kind):
    """Doubling `left` is the hand offset equal to its value, wherever the
    branch runs; the other examples are untouched."""
    case = BUILDERS[library](kind)
    x = inputs()
    values = branch_values(case, x)
    expected = jax.vmap(lambda x, o: case.forward(kind, x, o))(
        x, {"left": values["left"]}
    )
    for fwd in both_ways(
        lambda p, x: p.apply(x, at=["left"], patch={"left": lambda v: 2 * v}),
        case.probe,
        x,
    ):
        assert_close(fwd.outputs, expected)
        np.testing.assert_array_equal(fwd.ran["left"], takes_left(case, x))
        left = takes_left(case, x)[:, None]
        assert_close(fwd.activations["left"], np.where(left, 2 * values["left"], 0))


@pytest.mark.parametrize(("library", "kind"), CASES)
def test_inputs_of_a_branch_site_are_recorded_where_it_ran(library, kind):
    case = BUILDERS[library](kind)
    x = inputs()
    res = case.probe.value_and_grad(
        loss_fn, x, at=["encoder", "left"], with_inputs=True
    )
    left = takes_left(case, x)[:, None]
    (given,) = res.inputs["left"]
    assert_close(given, np.where(left, res.activations["encoder"], 0.0))


@pytest.mark.parametrize("library", list(BUILDERS))
def test_a_site_outside_branches_has_no_ran_entry(library):
    case = BUILDERS[library](KINDS[library][0])
    res = case.probe.value_and_grad(loss_fn, inputs(), at=["encoder", "head"])
    assert res.ran == {}
    assert case.probe.apply(inputs(), at="head").ran == {}


@pytest.mark.parametrize(("library", "kind"), CASES)
def test_one_call_in_a_branch_without_vmap_has_a_scalar_ran(library, kind):
    """One example, `vmap=False`: `ran` is one boolean; the branch not taken
    has zeros, the one taken the hand offset's gradient."""
    case = BUILDERS[library](kind, vmap=False)
    x = inputs()
    for example in x[:3]:
        offsets = {"left": jnp.zeros(WIDTH), "right": jnp.zeros(WIDTH)}
        want = jax.grad(lambda o, x=example: loss_fn(case.forward(kind, x, o)))(offsets)
        res = case.probe.value_and_grad(loss_fn, example, at=["left", "right"])
        assert res.ran["left"].shape == ()
        assert bool(res.ran["left"]) != bool(res.ran["right"])
        for name in ("left", "right"):
            assert_close(res.activation_grads[name], want[name])
            if not res.ran[name]:
                assert not np.any(np.asarray(res.activations[name]))
                assert not np.any(np.asarray(want[name]))


# -- fori_loop with static bounds: one entry per iteration ---------------------------

STEPS = 3


def offset_row(site: str, step: Any, value: jax.Array) -> jax.Array:
    """`offset` for iteration `step` of a loop: adds row `step` of the offset;
    records the value where `step` is a Python int (the unrolled reference)."""
    frame = _FRAME.get()
    if frame is None:
        return value
    offsets, recorded = frame
    if site in offsets:
        value = value + offsets[site][step]
    if isinstance(step, int):
        recorded[f"{site}@{step}"] = value
    return value


def loop(kind: str, body: Callable, init: jax.Array, own=None) -> jax.Array:
    """`STEPS` iterations of `body(i, h)`: unrolled in Python (the
    reference), JAX's `fori_loop` or `scan`, or the library's own."""
    if kind == "unrolled":
        h = init
        for i in range(STEPS):
            h = body(i, h)
        return h
    if kind == "lax":
        return jax.lax.fori_loop(0, STEPS, body, init)
    if kind == "scan":
        # A scan whose body closes over the layer (an RNN over its inputs):
        # its xs here are the iterations' numbers, which the hand offsets
        # take their rows by; bridge counts the iterations itself.
        return jax.lax.scan(lambda h, i: (body(i, h), None), init, jnp.arange(STEPS))[0]
    return own(body, init)


class LinenLoop(nn.Module):
    kind: str

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(WIDTH, name="encoder")(x)
        cell = nn.Dense(WIDTH, name="cell")
        if self.is_initializing():
            cell(h)
        h = loop(self.kind, lambda i, h: jnp.tanh(offset_row("cell", i, cell(h))), h)
        return nn.Dense(OUT, name="head")(h)


def _linen_loop(kind: str) -> Case:
    variables = LinenLoop("unrolled").init(jax.random.key(0), jnp.ones((IN,)))

    def forward(kind, x, offsets):
        with offsets_added(offsets):
            return LinenLoop(kind).apply(variables, x)

    return Case(bridge.probe(LinenLoop(kind), variables, vmap=True), forward)


def _nnx_loop(kind: str) -> Case:
    from flax import nnx

    class NnxLoop(nnx.Module):
        def __init__(self, kind, rngs):
            self.kind = kind
            self.encoder = nnx.Linear(IN, WIDTH, rngs=rngs)
            self.cell = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
            self.head = nnx.Linear(WIDTH, OUT, rngs=rngs)

        def __call__(self, x):
            h = self.encoder(x)

            def own(body, init):
                return nnx.fori_loop(
                    0, STEPS, lambda i, c: (c[0], body(i, c[1])), (self, init)
                )[1]

            return self.head(
                loop(
                    self.kind,
                    lambda i, h: jnp.tanh(offset_row("cell", i, self.cell(h))),
                    h,
                    own,
                )
            )

    models = {k: NnxLoop(k, nnx.Rngs(0)) for k in ("unrolled", "lax", "own", "scan")}
    split = {k: nnx.split(m) for k, m in models.items()}

    def forward(kind, x, offsets):
        # nnx.fori_loop refuses a module under a plain jax.vmap: the
        # reference writes it with JAX's, in a module merged in this trace.
        with offsets_added(offsets):
            return nnx.merge(*split["lax" if kind == "own" else kind])(x)

    return Case(bridge.probe(models[kind], vmap=True), forward)


class EqxLoop(eqx.Module):
    kind: str = eqx.field(static=True)
    encoder: eqx.nn.Linear
    cell: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, kind, key):
        keys = jax.random.split(key, 3)
        self.kind = kind
        self.encoder = eqx.nn.Linear(IN, WIDTH, key=keys[0])
        self.cell = eqx.nn.Linear(WIDTH, WIDTH, key=keys[1])
        self.head = eqx.nn.Linear(WIDTH, OUT, key=keys[2])

    def __call__(self, x):
        h = self.encoder(x)
        body = lambda i, h: jnp.tanh(offset_row("cell", i, self.cell(h)))  # noqa: E731
        return self.head(loop(self.kind, body, h))


def _equinox_loop(kind: str) -> Case:
    models = {k: EqxLoop(k, jax.random.key(0)) for k in ("unrolled", kind)}

    def forward(kind, x, offsets):
        with offsets_added(offsets):
            return models[kind](x)

    return Case(bridge.probe(models[kind], vmap=True), forward)


def _haiku_loop_function(kind: str) -> Callable:
    def function(x):
        h = hk.Linear(WIDTH, name="encoder")(x)
        cell = hk.Linear(WIDTH, name="cell")
        if hk.running_init():
            cell(h)

        def own(body, init):
            return hk.fori_loop(0, STEPS, body, init)

        h = loop(kind, lambda i, h: jnp.tanh(offset_row("cell", i, cell(h))), h, own)
        return hk.Linear(OUT, name="head")(h)

    return function


def _haiku_loop(kind: str) -> Case:
    params = hk.transform(_haiku_loop_function("unrolled")).init(
        jax.random.key(0), jnp.ones((IN,))
    )

    def forward(kind, x, offsets):
        with offsets_added(offsets):
            return hk.transform(_haiku_loop_function(kind)).apply(params, None, x)

    return Case(
        bridge.probe(hk.transform(_haiku_loop_function(kind)), params, vmap=True),
        forward,
    )


LOOP_BUILDERS = {"linen": _linen_loop, "equinox": _equinox_loop, "haiku": _haiku_loop}
if nnx_supported():
    LOOP_BUILDERS["nnx"] = _nnx_loop
#: `scan`: a `lax.scan` closing over the layer (`test_closed_over_scans.py`).
LOOP_KINDS = {
    "linen": ("lax", "scan"),
    "nnx": ("lax", "own", "scan"),
    "equinox": ("lax", "scan"),
    "haiku": ("lax", "own", "scan"),
}
LOOP_CASES = [
    pytest.param(library, kind, id=f"{library}-{kind}")
    for library in LOOP_BUILDERS
    for kind in LOOP_KINDS[library]
]


def loop_offsets(value: float = 0.0) -> dict:
    return {"cell": jnp.full((BATCH, STEPS, WIDTH), value)}


@pytest.mark.parametrize(("library", "kind"), LOOP_CASES)
def test_a_site_in_a_fori_loop_holds_every_iteration(library, kind):
    """`(iterations, batch, *value)`, eager and jitted: each iteration's value
    (from the unrolled model) and gradient (the hand offset's, per
    iteration); summed over iterations, the gradient of one offset shared by
    every iteration; no `ran` (a loop of static bounds runs every step)."""
    case = LOOP_BUILDERS[library](kind)
    x = inputs()
    assert case.probe.sites(x)["cell"].shape == (STEPS, BATCH, WIDTH)

    def recorded(x):
        with offsets_added({}) as values:
            case.forward("unrolled", x, {})
        return jnp.stack([values[f"cell@{i}"] for i in range(STEPS)])

    values = jnp.moveaxis(jax.vmap(recorded)(x), 0, 1)
    loss, offset_grads = jax.value_and_grad(lambda o: hand_loss(case, kind, x, o))(
        loop_offsets()
    )
    shared = jax.grad(
        lambda s: hand_loss(
            case, kind, x, {"cell": jnp.broadcast_to(s[:, None], (BATCH, STEPS, WIDTH))}
        )
    )(jnp.zeros((BATCH, WIDTH)))
    for res in both_ways(lambda p, x: p.value_and_grad(loss_fn, x), case.probe, x):
        assert res.ran == {}
        assert_close(res.loss, loss)
        assert_close(res.activations["cell"], values)
        grads = res.activation_grads["cell"]
        assert_close(grads, jnp.moveaxis(offset_grads["cell"], 1, 0))
        assert_close(grads.sum(0), shared)


@pytest.mark.parametrize(("library", "kind"), LOOP_CASES)
def test_jvp_along_every_iteration_of_a_loop_site(library, kind):
    case = LOOP_BUILDERS[library](kind)
    x = inputs()
    direction = {"cell": jax.random.normal(jax.random.key(3), (BATCH, STEPS, WIDTH))}
    _, tangent = jax.jvp(
        lambda o: hand_loss(case, kind, x, o), (loop_offsets(),), (direction,)
    )
    res = case.probe.value_and_grad(loss_fn, x, at="cell")
    contracted = jnp.vdot(
        res.activation_grads["cell"], jnp.moveaxis(direction["cell"], 1, 0)
    )
    assert_close(contracted, tangent, rtol=1e-4)


@pytest.mark.parametrize(("library", "kind"), LOOP_CASES)
def test_a_patch_value_in_a_loop_applies_per_iteration(library, kind):
    """A patch value `(iterations, batch, *value)` replaces each iteration's
    value by its row: the hand offset that moves each value there."""
    case = LOOP_BUILDERS[library](kind)
    x = inputs()
    fwd = case.probe.apply(x, at="cell")
    patch = jax.random.normal(jax.random.key(4), fwd.activations["cell"].shape)
    # Patched, each iteration's value is its row; so is the input of the
    # next iteration, so the hand reference replaces the values one by one.
    patched = case.probe.apply(x, at="cell", patch={"cell": patch})
    assert_close(patched.activations["cell"], patch)

    def replaced(x, rows):
        # Offsets that move each value to its row, found iteration by
        # iteration on the unrolled model.
        found = jnp.zeros((STEPS, WIDTH))
        for i in range(STEPS):
            with offsets_added({"cell": found}) as values:
                case.forward("unrolled", x, {})
            found = found.at[i].set(rows[i] - (values[f"cell@{i}"] - found[i]))
        with offsets_added({"cell": found}):
            return case.forward("unrolled", x, {})

    expected = jax.vmap(replaced)(x, jnp.moveaxis(patch, 1, 0))
    assert_close(patched.outputs, expected)


# -- bridge.tap inside a branch -------------------------------------------------------


def _tapped_branch(h: jax.Array) -> jax.Array:
    """`tap("t", sin(h))` in the branch taken where `h[0] > 0`, `cos`
    otherwise."""
    return jax.lax.cond(h[0] > 0, lambda h: bridge.tap("t", jnp.sin(h)), jnp.cos, h)


class EqxTapped(eqx.Module):
    first: eqx.nn.Linear
    last: eqx.nn.Linear

    def __call__(self, x):
        return self.last(_tapped_branch(self.first(x)))


def _tapped_probes() -> dict[str, tuple[Any, Callable]]:
    """`{library: (probe with vmap=True, the model's one-example function
    with an offset added to the tap's value by hand)}`."""
    keys = jax.random.split(jax.random.key(0), 2)
    model = EqxTapped(
        eqx.nn.Linear(IN, WIDTH, key=keys[0]), eqx.nn.Linear(WIDTH, OUT, key=keys[1])
    )

    def haiku_function(x):
        h = _tapped_branch(hk.Linear(WIDTH, name="first")(x))
        return hk.Linear(OUT, name="last")(h)

    transformed = hk.without_apply_rng(hk.transform(haiku_function))
    params = transformed.init(jax.random.key(0), jnp.ones((IN,)))

    def by_hand(first, last):
        def one(x, offset):
            h = first(x)
            h = jnp.where(h[0] > 0, jnp.sin(h) + offset, jnp.cos(h))
            return last(h)

        return one

    def dense(p):
        return lambda x: x @ p["w"] + p["b"]

    return {
        "equinox": (bridge.probe(model, vmap=True), by_hand(model.first, model.last)),
        "haiku": (
            bridge.probe(transformed, params, vmap=True),
            by_hand(dense(params["first"]), dense(params["last"])),
        ),
    }


@pytest.mark.parametrize("library", ["equinox", "haiku"])
def test_a_tap_in_a_branch_is_a_site_where_the_branch_runs(library):
    probe, one = _tapped_probes()[library]
    x = inputs()
    assert probe.sites(x)["t"].shape == (BATCH, WIDTH)
    offsets = jnp.zeros((BATCH, WIDTH))
    grads = jax.grad(lambda o: loss_fn(jax.vmap(one)(x, o)))(offsets)
    moved = jax.vmap(one)(x, jnp.full((BATCH, WIDTH), 1e3))
    runs = np.asarray(jnp.any(moved != jax.vmap(one)(x, offsets), axis=-1))
    assert runs.any() and not runs.all()
    for res in both_ways(lambda p, x: p.value_and_grad(loss_fn, x), probe, x):
        np.testing.assert_array_equal(res.ran["t"], runs)
        assert_close(res.activation_grads["t"], grads)
        first = res.activations["first"]
        assert_close(res.activations["t"], np.where(runs[:, None], jnp.sin(first), 0))


# -- Haiku: a branch or a loop inside a layer stack or hk.scan ------------------------

#: Haiku's scans over layers: `hk.experimental.layer_stack`, slicing stacked
#: parameters, and `hk.scan`, sharing them (forwards and reversed).
HK_STACKS = ("layer_stack", "hk.scan", "hk.scan-reverse")
#: What their body runs its layers in, after `pre` (outside any of them): a
#: branch (Haiku's, JAX's) between `left` (tapped as `t`) and `right`, or a
#: loop applying `cell` `HK_INNER` times.
HK_BRANCHES = ("hk.cond", "hk.switch", "lax.cond", "lax.switch")
HK_LOOPS = ("lax.fori_loop", "lax.scan", "hk.fori_loop", "hk.scan")
HK_INNER = 2
#: In CI, each stack with one of Haiku's branches and one of JAX's, and
#: each kind of loop once across the two; the other pairs, the costliest
#: duplicates, in local runs (`-m slow`).
HK_DEFAULT_TIER = {
    ("layer_stack", "hk.cond"),
    ("layer_stack", "lax.switch"),
    ("layer_stack", "lax.fori_loop"),
    ("layer_stack", "hk.scan"),
    ("hk.scan", "hk.switch"),
    ("hk.scan", "lax.cond"),
    ("hk.scan", "lax.scan"),
    ("hk.scan", "hk.fori_loop"),
    ("hk.scan-reverse", "lax.cond"),
    ("hk.scan-reverse", "lax.scan"),
}
HK_CASES = [
    pytest.param(
        stack,
        inner,
        id=f"{stack}-{inner}",
        marks=() if (stack, inner) in HK_DEFAULT_TIER else pytest.mark.slow,
    )
    for stack, inners in (
        ("layer_stack", (*HK_BRANCHES, *HK_LOOPS)),
        ("hk.scan", (*HK_BRANCHES, *HK_LOOPS)),
        ("hk.scan-reverse", ("lax.cond", "lax.scan")),
    )
    for inner in inners
]


def _hk_loop(inner: str, step: Callable, h: jax.Array) -> jax.Array:
    if inner == "lax.fori_loop":
        return jax.lax.fori_loop(0, HK_INNER, lambda _, h: step(h), h)
    if inner == "hk.fori_loop":
        return hk.fori_loop(0, HK_INNER, lambda _, h: step(h), h)
    scan = jax.lax.scan if inner == "lax.scan" else hk.scan
    return scan(lambda h, _: (step(h), None), h, None, length=HK_INNER)[0]


def _hk_branch(inner: str, predicate, go_left, go_right, h):
    if inner == "hk.cond":
        return hk.cond(predicate, go_left, go_right, h)
    if inner == "lax.cond":
        return jax.lax.cond(predicate, go_left, go_right, h)
    switch = hk.switch if inner == "hk.switch" else jax.lax.switch
    return switch(predicate.astype(jnp.int32), [go_right, go_left], h)


def _hk_stacked(stack: str, inner: str) -> Callable:
    """`encoder`, `LAYERS` layers scanned by `stack`, each `pre` then the
    branch or loop `inner`, then `head`. The branch is taken where the
    layer's input has a positive first feature (summed over the batch):
    `left` makes it negative, `right` positive, so the branches alternate
    between layers."""

    def layers() -> tuple:
        names = ("cell",) if inner in HK_LOOPS else ("left", "right")
        return tuple(hk.Linear(WIDTH, name=n) for n in ("pre", *names))

    def body(made: tuple, h: jax.Array) -> jax.Array:
        if hk.running_init():  # every branch's and loop's parameters
            for layer in made:
                layer(h)
        pre, *rest = made
        u = jnp.tanh(pre(h))
        if inner in HK_LOOPS:
            (cell,) = rest
            return _hk_loop(inner, lambda h: jnp.tanh(cell(h)), u)
        left, right = rest
        return _hk_branch(
            inner,
            h[..., 0].sum() > 0,
            lambda v: -jnp.square(bridge.tap("t", left(v))),
            lambda v: jnp.square(jnp.tanh(right(v))),
            u,
        )

    def function(x):
        h = hk.Linear(WIDTH, name="encoder")(x)
        if stack == "layer_stack":
            h = hk.experimental.layer_stack(LAYERS)(lambda h: body(layers(), h))(h)
        else:
            made = layers()
            h = hk.scan(
                lambda h, _: (body(made, h), None),
                h,
                None,
                length=LAYERS,
                reverse=stack == "hk.scan-reverse",
            )[0]
        return hk.Linear(OUT, name="head")(h)

    return function


def _hk_names(stack: str, inner: str) -> dict[str, str]:
    """`{short name: site}`: inside a layer stack the sites are named like
    their parameters."""
    prefix = "__layer_stack_no_per_layer/" if stack == "layer_stack" else ""
    shorts = ("pre", "cell") if inner in HK_LOOPS else ("pre", "left", "t", "right")
    return {short: prefix + short for short in shorts}


def _hk_dense(p: dict, h: jax.Array) -> jax.Array:
    return h @ p["w"] + jnp.broadcast_to(p["b"], (*h.shape[:-1], p["b"].shape[-1]))


def _hk_by_hand(stack, inner, params, x, offsets, patch=None):
    """The stack unrolled in Python by plain JAX, `offsets[short][i]` (and
    `[i, j]` in a loop) added at iteration `i`'s sites, the branch computed
    both ways and picked with `jnp.where`; `patch(short, row, value)` gives
    the value a patched site goes on with. Returns the outputs, each site's
    values per iteration (offsets added, before any patch), and whether the
    branch took `left` per iteration."""
    names = _hk_names(stack, inner)
    patch = patch or (lambda short, row, value: value)

    def dense(short, i, h):
        p = params[names.get(short, short)]
        if stack == "layer_stack" and short in names:
            p = jax.tree.map(lambda a: a[i], p)
        return _hk_dense(p, h)

    h = dense("encoder", None, x)
    values = {short: [None] * LAYERS for short in names}
    taken = [None] * LAYERS
    order = range(LAYERS)[::-1] if stack == "hk.scan-reverse" else range(LAYERS)
    for i in order:  # row `i` is the iteration's entry of xs
        values["pre"][i] = dense("pre", i, h) + offsets["pre"][i]
        u = jnp.tanh(patch("pre", (i,), values["pre"][i]))
        if inner in HK_LOOPS:
            h = u
            cells = []
            for j in range(HK_INNER):
                cells.append(dense("cell", i, h) + offsets["cell"][i, j])
                h = jnp.tanh(patch("cell", (i, j), cells[-1]))
            values["cell"][i] = jnp.stack(cells)
            continue
        taken[i] = h[..., 0].sum() > 0
        values["left"][i] = dense("left", i, u) + offsets["left"][i]
        left = patch("left", (i,), values["left"][i])
        values["t"][i] = left + offsets["t"][i]
        values["right"][i] = dense("right", i, u) + offsets["right"][i]
        right = jnp.tanh(patch("right", (i,), values["right"][i]))
        t = patch("t", (i,), values["t"][i])
        h = jnp.where(taken[i], -jnp.square(t), jnp.square(right))
    outputs = dense("head", None, h)
    values = {short: jnp.stack(rows) for short, rows in values.items()}
    return outputs, values, None if inner in HK_LOOPS else jnp.stack(taken)


def _hk_probe(stack, inner, vmap=False):
    transformed = hk.without_apply_rng(hk.transform(_hk_stacked(stack, inner)))
    x = jax.random.normal(jax.random.key(1), (BATCH, IN))
    params = transformed.init(jax.random.key(0), x[0] if vmap else x)
    return bridge.probe(transformed, params, vmap=vmap), params, x


def _hk_zero_offsets(stack, inner, batch=(BATCH,)):
    def rows(short):
        return (LAYERS, HK_INNER) if short == "cell" else (LAYERS,)

    return {
        short: jnp.zeros((*rows(short), *batch, WIDTH))
        for short in _hk_names(stack, inner)
    }


def _hk_ran(inner, taken):
    """Where each site ran: a branch's sites where it took their side; no
    entry for the others."""
    if inner in HK_LOOPS:
        return {}
    return {"left": taken, "t": taken, "right": ~taken}


@pytest.mark.parametrize(("stack", "inner"), HK_CASES)
def test_haiku_a_branch_or_loop_in_a_stack_is_a_site_per_iteration(stack, inner):
    """Every site in the branch or loop holds each iteration's value and
    gradient, `(layers, [inner iterations,] batch, width)`, zeros where its
    branch did not run, and `ran` per iteration; `pre`, carried by Haiku's
    state, as before: against the stack unrolled by hand, eager and jitted."""
    probe, params, x = _hk_probe(stack, inner)
    names = _hk_names(stack, inner)
    zeros = _hk_zero_offsets(stack, inner)

    def hand_loss(offsets):
        outputs, values, taken = _hk_by_hand(stack, inner, params, x, offsets)
        return loss_fn(outputs), (values, taken)

    (loss, (values, taken)), grads = jax.value_and_grad(hand_loss, has_aux=True)(zeros)
    if taken is not None:
        assert 0 < int(taken.sum()) < LAYERS, "both branches must run somewhere"
    ran = _hk_ran(inner, taken)
    sites = probe.sites(x)
    for short, name in names.items():
        assert sites[name].shape == values[short].shape

    def run(probe, x):
        return probe.value_and_grad(loss_fn, x, at=list(names.values()))

    for res in both_ways(run, probe, x):
        assert_close(res.loss, loss)
        assert set(res.ran) == {names[short] for short in ran}
        for short, name in names.items():
            where = ran.get(short)
            expected = values[short]
            if where is not None:
                np.testing.assert_array_equal(res.ran[name], where)
                expected = jnp.where(where[:, None, None], expected, 0)
            assert_close(res.activations[name], expected)
            assert_close(res.activation_grads[name], grads[short])


@pytest.mark.parametrize(
    ("stack", "inner"),
    [
        ("layer_stack", "hk.cond"),
        ("hk.scan-reverse", "lax.switch"),
        ("layer_stack", "lax.fori_loop"),
        ("hk.scan", "lax.scan"),
    ],
)
def test_haiku_a_patch_in_a_stack_applies_per_iteration(stack, inner):
    """A patch value in the site's stacked shape replaces each iteration's
    value by its row where the site runs; a patch function applies to each
    iteration's value: against the stack unrolled by hand, eager and jitted."""
    probe, params, x = _hk_probe(stack, inner)
    short = "cell" if inner in HK_LOOPS else "left"
    site = _hk_names(stack, inner)[short]
    zeros = _hk_zero_offsets(stack, inner)
    rows = jax.random.normal(jax.random.key(4), zeros[short].shape)
    for given, hand in (
        (rows, lambda s, row, v: rows[row] if s == short else v),
        (lambda v: 2 * v, lambda s, row, v: 2 * v if s == short else v),
    ):
        expected, values, taken = _hk_by_hand(stack, inner, params, x, zeros, hand)
        want = 2 * values[short] if callable(given) else rows
        if taken is not None:
            assert 0 < int(taken.sum()) < LAYERS, "both branches must run somewhere"
            want = jnp.where(taken[:, None, None], want, 0)
        for fwd in both_ways(
            lambda p, x, given=given: p.apply(x, at=[site], patch={site: given}),
            probe,
            x,
        ):
            assert_close(fwd.outputs, expected)
            if taken is not None:
                np.testing.assert_array_equal(fwd.ran[site], taken)
            assert_close(fwd.activations[site], want)


@pytest.mark.parametrize(
    ("stack", "inner"), [("layer_stack", "hk.cond"), ("hk.scan", "lax.switch")]
)
def test_haiku_a_branch_in_a_stack_under_vmap_runs_per_iteration_and_example(
    stack, inner
):
    """With `vmap=True` the predicate is each example's: `ran` is
    `(layers, batch)`, values and gradients those of the stack unrolled by
    hand per example."""
    probe, params, x = _hk_probe(stack, inner, vmap=True)
    names = _hk_names(stack, inner)
    zeros = _hk_zero_offsets(stack, inner, batch=())

    def one(x, offsets):
        return _hk_by_hand(stack, inner, params, x, offsets)

    batched = jax.tree.map(lambda z: jnp.broadcast_to(z, (BATCH, *z.shape)), zeros)
    _, values, taken = jax.vmap(one)(x, batched)
    grads = jax.grad(lambda o: loss_fn(jax.vmap(one)(x, o)[0]))(batched)
    # Iterations first, then the probe's batch axis.
    values, taken, grads = jax.tree.map(
        lambda a: jnp.moveaxis(a, 0, 1), (values, taken, grads)
    )
    assert bool(taken.any()) and not bool(taken.all())
    ran = _hk_ran(inner, taken)
    for res in both_ways(
        lambda p, x: p.value_and_grad(loss_fn, x, at=list(names.values())), probe, x
    ):
        for short, name in names.items():
            expected = values[short]
            if short in ran:
                np.testing.assert_array_equal(res.ran[name], ran[short])
                expected = jnp.where(ran[short][..., None], expected, 0)
            assert_close(res.activations[name], expected)
            assert_close(res.activation_grads[name], grads[short])


#: The model's own branch or loop around a whole layer stack or `hk.scan`.
HK_AROUND = ("lax.cond", "lax.fori_loop", "lax.scan")


def _hk_stack_inside(stack: str, around: str) -> Callable:
    """`encoder`, then `LAYERS` layers `lin` (then tanh) scanned by `stack`,
    run by the model's own `around` (`HK_INNER` times in a loop; in a
    branch where the first feature, summed over the batch, is positive,
    else `sin`), then `head`."""

    def function(x):
        if stack == "layer_stack":
            layers = hk.experimental.layer_stack(LAYERS)(
                lambda h: jnp.tanh(hk.Linear(WIDTH, name="lin")(h))
            )
        else:
            lin = hk.Linear(WIDTH, name="lin")

            def layers(h):
                step = lambda h, _: (jnp.tanh(lin(h)), None)  # noqa: E731
                return hk.scan(step, h, None, length=LAYERS)[0]

        h = hk.Linear(WIDTH, name="encoder")(x)
        if hk.running_init():  # the parameters, outside JAX's transform
            h = layers(h)
        elif around == "lax.cond":
            h = jax.lax.cond(h[..., 0].sum() > 0, layers, jnp.sin, h)
        elif around == "lax.fori_loop":
            h = jax.lax.fori_loop(0, HK_INNER, lambda _, h: layers(h), h)
        else:
            h = jax.lax.scan(lambda h, _: (layers(h), None), h, None, length=HK_INNER)
            h = h[0]
        return hk.Linear(OUT, name="head")(h)

    return function


@pytest.mark.parametrize("around", HK_AROUND)
@pytest.mark.parametrize("stack", ["layer_stack", "hk.scan"])
def test_haiku_a_stack_in_the_models_own_loop_is_a_site_per_iteration(stack, around):
    """A layer inside a layer stack or `hk.scan` that the model's own loop
    runs is a site per iteration and layer, `(iterations, layers, batch,
    width)`, in a branch `(layers, batch, width)` with `ran` per layer (Haiku's
    state, which does not reach inside JAX's loop, carried it before, and
    the values leaked out of the loop): against the model unrolled by hand,
    eager and jitted."""
    transformed = hk.without_apply_rng(hk.transform(_hk_stack_inside(stack, around)))
    x = jax.random.normal(jax.random.key(1), (BATCH, IN))
    params = transformed.init(jax.random.key(0), x)
    site = ("__layer_stack_no_per_layer/" if stack == "layer_stack" else "") + "lin"
    runs = 1 if around == "lax.cond" else HK_INNER

    def hand(offsets):
        def layers(h, rows):
            values = []
            for i in range(LAYERS):
                p = params[site]
                if stack == "layer_stack":
                    p = jax.tree.map(lambda a, i=i: a[i], p)
                values.append(_hk_dense(p, h) + rows[i])
                h = jnp.tanh(values[-1])
            return h, jnp.stack(values)

        h = _hk_dense(params["encoder"], x)
        if around == "lax.cond":
            taken = h[..., 0].sum() > 0
            ran, values = layers(h, offsets[0])
            h = jnp.where(taken, ran, jnp.sin(h))
        else:
            taken, values = None, []
            for k in range(HK_INNER):
                h, rows = layers(h, offsets[k])
                values.append(rows)
            values = jnp.stack(values)
        return loss_fn(_hk_dense(params["head"], h)), (values, taken)

    zeros = jnp.zeros((runs, LAYERS, BATCH, WIDTH))
    (loss, (values, taken)), grads = jax.value_and_grad(hand, has_aux=True)(zeros)
    if around == "lax.cond":
        grads = grads[0]
    probe = bridge.probe(transformed, params)
    assert probe.sites(x)[site].shape == values.shape

    def run(probe, x):
        return probe.value_and_grad(loss_fn, x, at=[site])

    for res in both_ways(run, probe, x):
        assert_close(res.loss, loss)
        if taken is None:
            assert res.ran == {}
        else:
            np.testing.assert_array_equal(res.ran[site], np.full(LAYERS, taken))
            values = jnp.where(taken, values, 0)
        assert_close(res.activations[site], values)
        assert_close(res.activation_grads[site], grads)


# -- a branch inside a scan over stacked layers (Equinox's tree route) ----------------

LAYERS = 3


class EqxScannedBranches(eqx.Module):
    """`LAYERS` stacked Linears scanned over; each layer is applied where
    `h[0] > 0`, negated otherwise."""

    layers: eqx.nn.Linear

    def __init__(self, key):
        self.layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(WIDTH, WIDTH, key=k))(
            jax.random.split(key, LAYERS)
        )

    def __call__(self, x):
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def step(h, arrays):
            layer = eqx.combine(arrays, static)
            return jax.lax.cond(
                h[0] > 0, lambda h: jnp.tanh(layer(h)), jnp.negative, h
            ), None

        return jax.lax.scan(step, x, dynamic)[0]


def test_a_branch_inside_a_scan_over_stacked_layers_runs_per_iteration():
    """Equinox: `ran` per layer and example, `(layers, batch)`; values and
    gradients those of the scan unrolled by hand with offsets."""
    model = EqxScannedBranches(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))

    def unrolled(x, offsets):
        taken, values = [], []
        h = x
        for i in range(LAYERS):
            layer = jax.tree.map(lambda a, i=i: a[i], model.layers)
            value = layer(h) + offsets[i]
            taken.append(h[0] > 0)
            values.append(value)
            h = jnp.where(h[0] > 0, jnp.tanh(value), -h)
        return h, (jnp.stack(taken), jnp.stack(values))

    offsets = jnp.zeros((BATCH, LAYERS, WIDTH))
    _, (taken, values) = jax.vmap(unrolled)(x, offsets)
    grads = jax.grad(lambda o: loss_fn(jax.vmap(unrolled)(x, o)[0]))(offsets)
    taken, values, grads = (jnp.moveaxis(a, 1, 0) for a in (taken, values, grads))
    assert bool(taken.any()) and not bool(taken.all())
    probe = bridge.probe(model, vmap=True)
    for res in both_ways(lambda p, x: p.value_and_grad(loss_fn, x), probe, x):
        np.testing.assert_array_equal(res.ran["layers"], taken)
        assert_close(res.activations["layers"], jnp.where(taken[..., None], values, 0))
        assert_close(res.activation_grads["layers"], grads)


# -- NNX: a branch inside an nnx.scan over stacked layers -----------------------------

#: How the body of the NNX stack's scan applies its layer: in a branch
#: (NNX's, JAX's; `tap` taps the layer's value in a `lax.cond` branch), or
#: twice in a loop of the model's own (`fori_loop`, `scan`).
NNX_STACK_BRANCHES = ("cond", "switch", "lax", "lax_switch", "tap")
NNX_STACK_LOOPS = ("fori_loop", "scan")
#: The iterations of a loop in the stack's body.
INNER = 2


def _nnx_scanned(kind: str):
    """`LAYERS` Linears built with `nnx.vmap`, sliced by `nnx.scan`; each
    layer applied (then tanh) where `h[0] > 0`, `h` negated otherwise (or
    applied `INNER` times in a loop)."""
    from flax import nnx

    class NnxScannedBranches(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=LAYERS)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return nnx.Linear(WIDTH, WIDTH, rngs=rngs)

            self.layers = make(rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def step(h, layer):
                def left(layer, v):
                    return jnp.tanh(layer(v))

                def right(layer, v):
                    return -v

                predicate = h[0] > 0
                if kind == "cond":
                    return nnx.cond(predicate, left, right, layer, h)
                if kind == "switch":
                    index = predicate.astype(jnp.int32)
                    return nnx.switch(index, [right, left], layer, h)
                if kind == "tap":
                    return jax.lax.cond(
                        predicate,
                        lambda v: jnp.tanh(bridge.tap("t", layer(v))),
                        jnp.negative,
                        h,
                    )
                if kind == "fori_loop":
                    return jax.lax.fori_loop(0, INNER, lambda _, v: left(layer, v), h)
                if kind == "scan":
                    return jax.lax.scan(
                        lambda v, _: (left(layer, v), None), h, None, length=INNER
                    )[0]
                return branch(
                    kind, predicate, lambda v: left(layer, v), jnp.negative, h
                )

            return step(x, self.layers)

    return NnxScannedBranches(nnx.Rngs(0))


def _nnx_unrolled(model, x, offsets, patch=None):
    """The NNX stack unrolled by hand: `offsets` (and `patch`, replacing the
    value) per layer (per layer and loop iteration, `(LAYERS, INNER, WIDTH)`,
    for a loop), the branch both computed and picked (`jnp.where`, so the
    branch not taken gets a zero gradient). The output, whether each layer's
    branch ran and each layer's value."""
    kernel, bias = model.layers.kernel[...], model.layers.bias[...]
    loop = offsets.ndim == 3
    taken, values = [], []
    h = x
    for i in range(LAYERS):
        if loop:
            for j in range(INNER):
                value = h @ kernel[i] + bias[i] + offsets[i, j]
                values.append(value)
                h = jnp.tanh(value)
            continue
        value = h @ kernel[i] + bias[i] + offsets[i]
        if patch is not None:
            value = patch[i]
        taken.append(h[0] > 0)
        values.append(value)
        h = jnp.where(h[0] > 0, jnp.tanh(value), -h)
    if loop:
        return h, None, jnp.stack(values).reshape(LAYERS, INNER, WIDTH)
    return h, jnp.stack(taken), jnp.stack(values)


#: One example whose layers take both branches.
NNX_STACK_X = jnp.array([0.9, -0.4, 0.3, 0.2])


@pytest.mark.skipif(not nnx_supported(), reason="this flax has no NNX bridge probes")
@pytest.mark.parametrize("kind", NNX_STACK_BRANCHES)
def test_nnx_a_branch_inside_an_nnx_scan_over_stacked_layers_runs_per_iteration(
    kind,
):
    """`ran`, values and gradients per layer, `(LAYERS, ...)`: those of the
    stack unrolled by hand with offsets, zeros where the branch did not run;
    eager and jitted."""
    model = _nnx_scanned(kind)
    x = NNX_STACK_X
    offsets = jnp.zeros((LAYERS, WIDTH))
    out, taken, values = _nnx_unrolled(model, x, offsets)
    grads = jax.grad(lambda o: loss_fn(_nnx_unrolled(model, x, o)[0]))(offsets)
    assert bool(taken.any()) and not bool(taken.all())
    sites = ("layers", "t") if kind == "tap" else ("layers",)
    probe = bridge.probe(model)
    assert {s: probe.sites(x)[s].shape for s in sites} == dict.fromkeys(
        sites, (LAYERS, WIDTH)
    )
    for res in both_ways(
        lambda p, x: p.value_and_grad(loss_fn, x, at=list(sites)), probe, x
    ):
        assert_close(res.loss, loss_fn(out))
        for site in sites:
            np.testing.assert_array_equal(res.ran[site], taken)
            assert_close(res.activations[site], jnp.where(taken[:, None], values, 0))
            assert_close(res.activation_grads[site], grads)


@pytest.mark.skipif(not nnx_supported(), reason="this flax has no NNX bridge probes")
@pytest.mark.parametrize("kind", ("cond", "lax"))
def test_nnx_a_patch_in_a_branch_inside_an_nnx_scan_applies_per_iteration(kind):
    """A stacked patch value `(LAYERS, WIDTH)`: each layer's row where its
    branch runs (which the patch itself decides from the second layer on)."""
    model = _nnx_scanned(kind)
    x = NNX_STACK_X
    patch = jnp.stack([jnp.full((WIDTH,), v) for v in (0.5, -0.7, 0.2)])
    out, taken, _ = _nnx_unrolled(model, x, jnp.zeros((LAYERS, WIDTH)), patch)
    assert bool(taken.any()) and not bool(taken.all())
    probe = bridge.probe(model)
    for fwd in both_ways(lambda p, x: p.apply(x, patch={"layers": patch}), probe, x):
        assert_close(fwd.outputs, out)
        np.testing.assert_array_equal(fwd.ran["layers"], taken)
        assert_close(fwd.activations["layers"], jnp.where(taken[:, None], patch, 0))


@pytest.mark.skipif(not nnx_supported(), reason="this flax has no NNX bridge probes")
@pytest.mark.parametrize("kind", NNX_STACK_LOOPS)
def test_nnx_a_loop_inside_an_nnx_scan_over_stacked_layers_is_a_site_per_iteration(
    kind,
):
    """A `fori_loop` or a `lax.scan` of the model's own in the stack's body:
    `(LAYERS, INNER, WIDTH)`, values and gradients those of the stack
    unrolled by hand; no `ran` entry (no branch)."""
    model = _nnx_scanned(kind)
    x = NNX_STACK_X
    offsets = jnp.zeros((LAYERS, INNER, WIDTH))
    out, _, values = _nnx_unrolled(model, x, offsets)
    grads = jax.grad(lambda o: loss_fn(_nnx_unrolled(model, x, o)[0]))(offsets)
    probe = bridge.probe(model)
    assert probe.sites(x)["layers"].shape == (LAYERS, INNER, WIDTH)
    for res in both_ways(
        lambda p, x: p.value_and_grad(loss_fn, x, at=["layers"]), probe, x
    ):
        assert_close(res.loss, loss_fn(out))
        assert "layers" not in res.ran
        assert_close(res.activations["layers"], values)
        assert_close(res.activation_grads["layers"], grads)


# -- a fori_loop JAX cannot reverse-differentiate ------------------------------------


def _traced_bounds_probe(library: str) -> tuple[Any, tuple]:
    """A probe of a model whose `fori_loop` gets its upper bound as an input
    (traced: JAX runs it as a `while_loop`), and its arguments."""
    x, steps = jnp.ones((2, IN)), jnp.int32(3)

    def body(layer):
        return lambda i, h: jnp.tanh(layer(h))

    if library == "equinox":

        class Looped(eqx.Module):
            cell: eqx.nn.Linear

            def __call__(self, x, steps):
                return jax.lax.fori_loop(0, steps, body(self.cell), x)

        model = Looped(eqx.nn.Linear(IN, IN, key=jax.random.key(0)))
        return bridge.probe(model), (x[0], steps)
    if library == "linen":

        class LinenLooped(nn.Module):
            @nn.compact
            def __call__(self, x, steps):
                cell = nn.Dense(IN, name="cell")
                if self.is_initializing():
                    cell(x)
                return jax.lax.fori_loop(0, steps, body(cell), x)

        variables = LinenLooped().init(jax.random.key(0), x, 3)
        return bridge.probe(LinenLooped(), variables), (x, steps)
    if library == "nnx":
        from flax import nnx

        class NnxLooped(nnx.Module):
            def __init__(self):
                self.cell = nnx.Linear(IN, IN, rngs=nnx.Rngs(0))

            def __call__(self, x, steps):
                return jax.lax.fori_loop(0, steps, body(self.cell), x)

        return bridge.probe(NnxLooped()), (x, steps)

    def function(x, steps):
        cell = hk.Linear(IN, name="cell")
        if hk.running_init():
            cell(x)
        return hk.fori_loop(0, steps, body(cell), x)

    transformed = hk.without_apply_rng(hk.transform(function))
    return bridge.probe(transformed, transformed.init(jax.random.key(0), x, 3)), (
        x,
        steps,
    )


@pytest.mark.parametrize("library", list(BUILDERS))
def test_a_fori_loop_with_traced_bounds_is_refused_naming_it(library):
    """JAX runs it as a `while_loop`, which it cannot reverse-differentiate:
    selecting or patching a site inside raises naming the fori_loop (never
    the while_loop JAX makes of it) and the way out, before any work."""
    probe, args = _traced_bounds_probe(library)
    message = r"fori_loop( with traced bounds)? around site 'cell'.*Python int bounds"
    with pytest.raises(bridge.BridgeValueError, match=message):
        probe.apply(*args, at="cell")
    with pytest.raises(bridge.BridgeValueError, match=message):
        probe.value_and_grad(jnp.sum, *args, patch={"cell": jnp.negative})


# -- a branch inside the model's own cached jax.jit ----------------------------------


@jax.jit
def _jitted_branch(model, h):
    return jax.lax.cond(
        h[0] > 0, lambda h: model.left(h), lambda h: jnp.tanh(model.right(h)), h
    )


class EqxJittedBranch(EqxBranch):
    def __call__(self, x):
        return self.head(_jitted_branch(self, self.encoder(x)))


def test_a_branch_inside_a_jit_the_model_traced_before_is_no_silent_zero():
    """The model's jitted helper holding the branch is traced once before
    the probe (JAX caches it): its sites still hold the branch that ran, and
    their gradients equal those of the same model written without the jit."""
    model = EqxJittedBranch("lax", jax.random.key(0))
    x = inputs()
    jax.vmap(model)(x)  # fills the helper's cache
    reference = EqxBranch("lax", jax.random.key(0))
    want = bridge.probe(reference, vmap=True).value_and_grad(loss_fn, x)
    for res in both_ways(
        lambda p, x: p.value_and_grad(loss_fn, x), bridge.probe(model, vmap=True), x
    ):
        assert set(res.ran) == {"left", "right"}
        for name in ("left", "right"):
            np.testing.assert_array_equal(res.ran[name], want.ran[name])
            assert_close(res.activations[name], want.activations[name])
            assert_close(res.activation_grads[name], want.activation_grads[name])
            assert np.any(np.asarray(res.activation_grads[name]))  # no silent zero


# -- Linen: a site in one branch only, called through the branch's module ---------


class LinenOneSided(nn.Module):
    """A branch of Linen's own `nn.cond` or `nn.switch` whose taken side calls
    a submodule through the module the branch is handed (`mdl.inner`, in
    the lifted transform's own scope) and taps its value; the other side has
    no site. `both` computes both sides and picks (the reference)."""

    kind: str

    def setup(self):
        self.encoder = nn.Dense(WIDTH)
        self.inner = nn.Dense(WIDTH)
        self.head = nn.Dense(OUT)

    def __call__(self, x):
        h = self.encoder(x)
        if self.is_initializing():
            self.inner(h)  # parameters made before the branch, as Flax asks

        def taken(mdl, v):
            value = jnp.tanh(offset("inner", mdl.inner(v)))
            return bridge.tap("t", offset("t", value))

        def other(mdl, v):
            return -v

        predicate = h[0] > 0
        if self.kind == "both":
            h = jnp.where(predicate, taken(self, h), other(self, h))
        elif self.kind == "cond":
            h = nn.cond(predicate, taken, other, self, h)
        else:
            index = predicate.astype(jnp.int32)
            h = nn.switch(index, [other, taken], self, h)
        return self.head(h)


ONE_SIDED = ("inner", "t")


def _linen_one_sided(kind: str) -> Case:
    return _linen(kind, model=LinenOneSided)


def _one_sided_reference(case: Case, kind: str, x: jax.Array):
    """Where the site's side runs (per example), each site's value computed
    outside any branch, and the loss and its gradients with respect to
    offsets added by hand at both sites."""
    values = branch_values(case, x)
    ran = np.asarray(
        jax.vmap(
            lambda x: jnp.any(
                case.forward("both", x, {})
                != case.forward("both", x, {"t": jnp.full((WIDTH,), 1e3)})
            )
        )(x)
    )
    zeros = {name: jnp.zeros((BATCH, WIDTH)) for name in ONE_SIDED}
    loss, grads = jax.value_and_grad(lambda o: hand_loss(case, kind, x, o))(zeros)
    return ran, values, loss, grads


@pytest.mark.parametrize("kind", ["cond", "switch"])
def test_linen_sites_in_one_branch_only_of_its_own_cond(kind):
    """A module call and a `bridge.tap` in one side only of `nn.cond` or
    `nn.switch`, eager and jitted: the side's value where it ran, zeros
    elsewhere, `ran` saying where, and the gradients of offsets added by
    hand (a run of the lifted route, writing bridge's collection in one
    branch only, failed)."""
    case = _linen_one_sided(kind)
    x = inputs()
    assert list(case.probe.sites(x)) == ["encoder", "inner", "t", "head"]
    ran, values, loss, grads = _one_sided_reference(case, kind, x)
    assert ran.any() and not ran.all(), "the batch must take both sides"
    for res in both_ways(lambda p, x: p.value_and_grad(loss_fn, x), case.probe, x):
        assert set(res.ran) == set(ONE_SIDED)
        assert_close(res.loss, loss)
        for name in ONE_SIDED:
            np.testing.assert_array_equal(res.ran[name], ran)
            assert_close(res.activations[name], np.where(ran[:, None], values[name], 0))
            assert_close(res.activation_grads[name], grads[name])
            assert np.any(np.asarray(res.activation_grads[name]))
            assert not np.any(np.asarray(res.activation_grads[name])[~ran])


@pytest.mark.parametrize("at", ["inner", "t"])
@pytest.mark.parametrize("kind", ["cond", "switch"])
def test_linen_one_site_in_one_branch_along_jvp(kind, at):
    """Selected alone (the module call, or the tap whose epsilon a run of
    the lifted route looked for in bridge's collection), eager and jitted:
    its gradient contracted with random offsets equals `jax.jvp` of the
    hand-perturbed loss along them."""
    case = _linen_one_sided(kind)
    x = inputs()
    direction = jax.random.normal(jax.random.key(7), (BATCH, WIDTH))
    zeros = {name: jnp.zeros((BATCH, WIDTH)) for name in ONE_SIDED}
    _, tangent = jax.jvp(
        lambda o: hand_loss(case, kind, x, o),
        (zeros,),
        ({**zeros, at: direction},),
    )
    assert abs(float(tangent)) > 0
    for res in both_ways(
        lambda p, x: p.value_and_grad(loss_fn, x, at=at), case.probe, x
    ):
        assert set(res.activations) == {at}
        assert_close(jnp.vdot(res.activation_grads[at], direction), tangent, 1e-4)


# -- a site whose value reaches an output but not the loss -----------------------


@pytest.mark.parametrize(("library", "kind"), LOOP_CASES)
def test_a_loop_site_the_loss_does_not_reach_is_recorded_all_the_same(library, kind):
    """The values leave through the step's own backward pass: one that the
    loss does not reach must still bring them (as `apply` does), with zero
    gradients, not zeros for values."""
    case = LOOP_BUILDERS[library](kind)
    x = inputs()

    def recorded(x):
        with offsets_added({}) as values:
            case.forward("unrolled", x, {})
        return jnp.stack([values[f"cell@{i}"] for i in range(STEPS)])

    values = jnp.moveaxis(jax.vmap(recorded)(x), 0, 1)
    assert float(jnp.abs(values).max()) > 0
    for res in both_ways(
        lambda p, x: p.value_and_grad(lambda y: jnp.float32(2.0), x), case.probe, x
    ):
        assert_close(res.loss, 2.0)
        assert_close(res.activations["cell"], values)
        assert not np.any(np.asarray(res.activation_grads["cell"]))


@pytest.mark.parametrize(("library", "kind"), CASES)
def test_a_branch_site_the_loss_does_not_reach_says_where_it_ran(library, kind):
    case = BUILDERS[library](kind)
    x = inputs()
    left = takes_left(case, x)
    values = branch_values(case, x)
    for res in both_ways(
        lambda p, x: p.value_and_grad(lambda y: jnp.float32(2.0), x), case.probe, x
    ):
        np.testing.assert_array_equal(res.ran["left"], left)
        np.testing.assert_array_equal(res.ran["right"], ~left)
        for name, where in (("left", left), ("right", ~left)):
            expected = np.where(where[:, None], values[name], 0.0)
            assert_close(res.activations[name], expected)
            assert not np.any(np.asarray(res.activation_grads[name]))


class _WithInfinity(eqx.Module):
    model: EqxLoop

    def __call__(self, x):
        return self.model(x), jnp.full((2,), jnp.inf)


def test_an_infinite_output_the_loss_ignores_leaves_the_loss_finite():
    model = _WithInfinity(EqxLoop("lax", jax.random.key(0)))
    probe = bridge.probe(model, vmap=True)
    x = inputs()
    plain = jnp.sum(jax.vmap(model)(x)[0] ** 2)
    for res in both_ways(
        lambda p, x: p.value_and_grad(lambda y: jnp.sum(y[0] ** 2), x), probe, x
    ):
        assert np.isfinite(float(res.loss))
        assert_close(res.loss, plain)
