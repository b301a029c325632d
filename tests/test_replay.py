"""A run evaluates discovery's trace: the model's Python runs once per call
structure.

Discovery traces the model to a jaxpr and marks every site. A run whose
selected and patched sites are all acted on correctly at their markers
evaluates that jaxpr with the epsilons and patches planted there
(`bridge._session.computation.Replay`) instead of running the model's Python,
the adapter's routes and the session again: a `jax.jit` of a probed step
lowers at about the cost of plain `jax.value_and_grad`'s. Checked here, in
every library: the model's Python runs once for discovery and never again for
`value_and_grad`, `apply` or a new `jax.jit` of the same step; the values,
gradients and patches are those of the model written again by hand with an
offset at the site; the cases a marker cannot serve take the model's run;
the compiled program carries nothing of discovery's trace context.
"""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import close, nnx_supported

import bridge
from bridge._probe import discovery_cache

X = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
CALLS = {"python": 0}


def loss_fn(out):
    return jnp.sum(jnp.sin(out) ** 2)


# -- one model per library: two dense layers, a count of its Python's runs ---------


class EqxModel(eqx.Module):
    first: eqx.nn.Linear
    second: eqx.nn.Linear

    def __init__(self, key):
        a, b = jax.random.split(key)
        self.first = eqx.nn.Linear(4, 5, key=a)
        self.second = eqx.nn.Linear(5, 2, key=b)

    def __call__(self, x):
        CALLS["python"] += 1
        return jax.vmap(self.second)(jnp.tanh(jax.vmap(self.first)(x)))


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        CALLS["python"] += 1
        return nn.Dense(2, name="second")(jnp.tanh(nn.Dense(5, name="first")(x)))


class NnxModel(nnx.Module):
    def __init__(self, rngs):
        self.first = nnx.Linear(4, 5, rngs=rngs)
        self.second = nnx.Linear(5, 2, rngs=rngs)

    def __call__(self, x):
        CALLS["python"] += 1
        return self.second(jnp.tanh(self.first(x)))


def _haiku(x):
    CALLS["python"] += 1
    first = hk.Linear(5, name="first")
    second = hk.Linear(2, name="second")
    return second(jnp.tanh(first(x)))


def forward_first(x, layer, kernel, bias):
    return x @ layer[kernel] + layer[bias][None]


def make(library: str):
    """`(probe, forward(x, offset at 'first'), site name of the first layer)`;
    `forward.first(x)` is the first layer's output, written by hand."""
    key = jax.random.key(0)
    if library == "equinox":
        model = EqxModel(key)

        def forward(x, offset):
            h = jax.vmap(model.first)(x) + offset
            return jax.vmap(model.second)(jnp.tanh(h))

        forward.first = jax.vmap(model.first)
        return bridge.probe(model), forward, "first"
    if library == "linen":
        module = LinenModel()
        variables = module.init(key, X)
        params = variables["params"]

        def forward(x, offset):
            h = x @ params["first"]["kernel"] + params["first"]["bias"][None] + offset
            second = params["second"]
            return jnp.tanh(h) @ second["kernel"] + second["bias"][None]

        forward.first = lambda x: forward_first(x, params["first"], "kernel", "bias")
        return bridge.probe(module, variables), forward, "first"
    if library == "nnx":
        if not nnx_supported():
            pytest.skip("NNX needs flax 0.12 (test_core)")
        model = NnxModel(nnx.Rngs(0))

        def forward(x, offset):
            h = model.first(x) + offset
            return model.second(jnp.tanh(h))

        forward.first = model.first
        return bridge.probe(model), forward, "first"
    if library == "keras":
        keras = pytest.importorskip("keras")

        class Counted(keras.layers.Layer):
            def call(self, x):
                CALLS["python"] += 1
                return x

        first = keras.layers.Dense(5, name="first")
        second = keras.layers.Dense(2, name="second")
        inputs = keras.Input((4,))
        outputs = second(keras.layers.Activation("tanh")(first(Counted()(inputs))))
        model = keras.Model(inputs, outputs)

        def forward(x, offset):
            h = first(x) + offset
            return second(jnp.tanh(h))

        forward.first = first
        return bridge.probe(model), forward, "first"
    transformed = hk.transform(_haiku)
    params = transformed.init(key, X)

    def forward(x, offset):
        first, second = params["first"], params["second"]
        h = x @ first["w"] + first["b"][None] + offset
        return jnp.tanh(h) @ second["w"] + second["b"][None]

    forward.first = lambda x: forward_first(x, params["first"], "w", "b")
    return bridge.probe(transformed, params), forward, "first"


LIBRARIES = ["equinox", "linen", "nnx", "haiku", "keras"]


@pytest.fixture(autouse=True)
def _keras_broadcasts(request):
    """Keras's own layers broadcast by rank promotion (`Dense` adds a
    `(units,)` bias to `(batch, units)`), as in the conformance suite."""
    params = getattr(request.node, "callspec", None)
    keras_case = params is not None and params.params.get("library") == "keras"
    with jax.numpy_rank_promotion("allow" if keras_case else "raise"):
        yield


@pytest.mark.parametrize("library", LIBRARIES)
def test_the_models_python_runs_once_per_call_structure(library):
    probe, _, site = make(library)
    CALLS["python"] = 0
    probe.value_and_grad(loss_fn, X, at=site)
    probe.apply(X, at=site)
    step = lambda x: probe.value_and_grad(loss_fn, x, at=site)  # noqa: E731
    jax.jit(step).lower(X)
    jax.jit(lambda x: step(x)).lower(X)  # a new function: JAX caches nothing
    assert CALLS["python"] == 1  # discovery's trace, evaluated by every run


@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_replayed_run_equals_the_model_with_an_offset_by_hand(library, jit):
    probe, forward, site = make(library)
    patch = lambda value: 2.0 * value  # noqa: E731

    def step(x):
        return (
            probe.value_and_grad(loss_fn, x, at=site),
            probe.apply(x, at=site, patch={site: patch}),
        )

    result, patched = (jax.jit(step) if jit else step)(X)
    zero = jnp.zeros((3, 5))
    value, gradient = jax.value_and_grad(lambda o: loss_fn(forward(X, o)))(zero)
    close(result.loss, value)
    close(result.activation_grads[site], gradient)
    # A tangent along every element of the site, by `jax.jvp`.
    along = jax.jvp(lambda o: loss_fn(forward(X, o)), (zero,), (jnp.ones_like(zero),))
    close(jnp.sum(result.activation_grads[site]), along[1])
    # The site's value doubled by the patch is the offset that adds it again.
    close(patched.outputs, forward(X, result.activations[site]))
    close(patched.activations[site], 2.0 * result.activations[site])


@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_run_recording_inputs_reads_them_at_their_marker(library, jit):
    """A run recording inputs (`with_inputs=True`, what K-FAC-style
    curvature asks) evaluates discovery's trace too: its discovery marks
    every call's inputs where they are, the layer's in the model's own
    `jax.vmap` (Equinox's) included, and the run reads them there."""
    probe, forward, _ = make(library)
    discovery_cache.CACHE.clear()  # the other case's discovery would serve
    CALLS["python"] = 0

    def step(x):
        return probe.value_and_grad(
            loss_fn, x, at=["first", "second"], with_inputs=True
        )

    result = (jax.jit(step) if jit else step)(X)
    jax.jit(lambda x: step(x)).lower(X)
    assert CALLS["python"] == 1
    close(result.inputs["first"][0], X)
    close(result.inputs["second"][0], jnp.tanh(forward.first(X)))
    # The gradient at the first layer's output, by hand, beside the inputs.
    zero = jnp.zeros((3, 5))
    close(
        result.activation_grads["first"],
        jax.grad(lambda o: loss_fn(forward(X, o)))(zero),
    )


def test_a_site_the_same_for_every_example_is_replayed_per_example():
    """Under `vmap=True` discovery traces one example and a run maps that
    trace over the batch: a value that does not depend on the example is
    broadcast there, and an epsilon per example added to it, so it replays
    with the value and the gradient of each example."""

    class Biased(eqx.Module):
        layer: eqx.nn.Linear
        shift: eqx.nn.Linear

        def __call__(self, x):
            CALLS["python"] += 1
            return self.layer(x) + self.shift(jnp.ones(3))

    model = Biased(
        eqx.nn.Linear(4, 2, key=jax.random.key(1)),
        eqx.nn.Linear(3, 2, key=jax.random.key(2)),
    )
    probe = bridge.probe(model, vmap=True)
    CALLS["python"] = 0
    for result in (
        probe.value_and_grad(loss_fn, X, at="shift"),
        jax.jit(lambda p, x: p.value_and_grad(loss_fn, x, at="shift"))(probe, X),
    ):
        assert CALLS["python"] == 1  # discovery's trace only
        by_hand = jax.vmap(
            jax.grad(
                lambda o, x: loss_fn(model.layer(x) + model.shift(jnp.ones(3)) + o)
            ),
            in_axes=(None, 0),
        )(jnp.zeros(2), X)
        close(result.activation_grads["shift"], by_hand)
        shift = model.shift(jnp.ones(3))
        close(result.activations["shift"], jnp.broadcast_to(shift, (len(X), 2)))


def test_the_compiled_program_carries_nothing_of_discoverys_trace_context():
    """Discovery traces under XLA metadata of its own (so that no trace JAX
    cached hides a call from it); a run that evaluates that trace keeps
    whole the jaxprs without a site (a scan body, a `custom_jvp` function),
    and must not carry the metadata into the program."""

    class Scanned(eqx.Module):
        layer: eqx.nn.Linear

        def __call__(self, x):
            h = self.layer(x)

            def body(carry, _):
                return jax.nn.relu(jnp.sin(carry)) * 2.0, None

            return jax.lax.scan(body, h, None, length=3)[0]

    probe = bridge.probe(Scanned(eqx.nn.Linear(4, 4, key=jax.random.key(0))))
    CALLS["python"] = 0
    text = (
        jax.jit(lambda x: probe.value_and_grad(loss_fn, x, at="layer"))
        .lower(X[0])
        .as_text()
    )
    assert "bridge_discovery" not in text
    assert "scan" in str(jax.make_jaxpr(lambda x: probe.apply(x, at="layer"))(X[0]))


@pytest.mark.parametrize("with_inputs", [False, True], ids=["values", "inputs"])
def test_a_scan_body_traced_twice_is_replayed_under_its_public_names(with_inputs):
    """A `lax.scan` whose carry starts as a Python `0` traces its body twice
    and keeps the second trace: discovery names the kept calls as if the
    first were not there (`cell`, not `cell#1`), and a run evaluates the kept
    trace, its markers given those names: the model's Python runs once, the
    values and per-step gradients are the loop's unrolled by hand with an
    offset, the inputs each step's."""

    class Recurrent(eqx.Module):
        cell: eqx.nn.Linear

        def __call__(self, xs):
            CALLS["python"] += 1

            def step(carry, x):
                h = jnp.tanh(self.cell(x + carry))
                return jnp.mean(h), h

            return jax.lax.scan(step, 0, xs)[1]

    model = Recurrent(eqx.nn.Linear(4, 4, key=jax.random.key(3)))

    def by_hand(offsets):
        carry, ys, values, inputs = 0.0, [], [], []
        for step in range(len(X)):
            inputs.append(X[step] + carry)
            values.append(model.cell(inputs[-1]) + offsets[step])
            ys.append(jnp.tanh(values[-1]))
            carry = jnp.mean(ys[-1])
        return loss_fn(jnp.stack(ys)), (jnp.stack(values), jnp.stack(inputs))

    (_, (values, inputs)), grads = jax.value_and_grad(by_hand, has_aux=True)(
        jnp.zeros((len(X), 4))
    )
    probe = bridge.probe(model)
    CALLS["python"] = 0

    def run(probe, x):
        return probe.value_and_grad(loss_fn, x, with_inputs=with_inputs)

    for result in (run(probe, X), jax.jit(run)(probe, X)):
        assert CALLS["python"] == 1  # discovery's trace only
        assert list(result.activations) == ["cell"]
        close(result.activations["cell"], values)
        close(result.activation_grads["cell"], grads)
        if with_inputs:
            close(result.inputs["cell"][0], inputs)
