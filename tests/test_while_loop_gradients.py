"""`value_and_grad` on a model with a `lax.while_loop` outside every selected
site, in every library.

JAX cannot differentiate backward through a while loop that carries a value
the gradient flows through; bridge says so in its own error, naming the
loop's line and the ways out, and `probe.apply` still gives the values. A
while loop that carries no such value (a counter) is differentiated, and so
is the way out the error names, Equinox's checkpointed loop. Each model is a
Dense layer `dense`, then `_refine`; the references are the model written
out by hand in NumPy, its gradient by the chain rule.
"""

from __future__ import annotations

import inspect
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import nnx_supported

import bridge

eqx = pytest.importorskip("equinox")
eqxi = pytest.importorskip("equinox.internal")
nn = pytest.importorskip("flax.linen")
hk = pytest.importorskip("haiku")

LIBRARIES = [
    library
    for library in ("linen", "nnx", "equinox", "haiku")
    if library != "nnx" or nnx_supported()
]
STEPS = 3
X = np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)
WEIGHTS = np.random.default_rng(1).normal(size=(2, 3)).astype(np.float32)


def _step(carry):
    index, hidden = carry
    return index + 1, hidden + 0.5 * jnp.tanh(hidden)


def _refine(hidden, loop):
    """`STEPS` steps `h + tanh(h) / 2`, by a `lax.while_loop` (`"while"`) or
    Equinox's checkpointed loop (`"checkpointed"`); or (`"counter"`)
    `hidden` times the count of a while loop that carries only the count."""
    if loop == "counter":
        count = jax.lax.while_loop(lambda index: index < STEPS, lambda i: i + 1, 0)
        return hidden * count
    if loop == "checkpointed":
        return eqxi.while_loop(
            lambda carry: carry[0] < STEPS,
            _step,
            (0, hidden),
            kind="checkpointed",
            max_steps=STEPS,
        )[1]
    return jax.lax.while_loop(lambda carry: carry[0] < STEPS, _step, (0, hidden))[1]


def _probe(library, loop):
    """The probe of `dense` then `_refine`, and `dense`'s `(kernel, bias)` as
    `x @ kernel + bias` uses them."""
    if library == "linen":

        class Refined(nn.Module):
            @nn.compact
            def __call__(self, x):
                return _refine(nn.Dense(3, name="dense")(x), loop)

        variables = Refined().init(jax.random.key(0), X)
        dense = variables["params"]["dense"]
        return bridge.probe(Refined(), variables), (dense["kernel"], dense["bias"])
    if library == "nnx":
        from flax import nnx

        class NnxRefined(nnx.Module):
            def __init__(self):
                self.dense = nnx.Linear(4, 3, rngs=nnx.Rngs(0))

            def __call__(self, x):
                return _refine(self.dense(x), loop)

        model = NnxRefined()
        return bridge.probe(model), (model.dense.kernel[...], model.dense.bias[...])
    if library == "equinox":

        class EqxRefined(eqx.Module):
            dense: eqx.nn.Linear

            def __call__(self, x):
                return _refine(self.dense(x), loop)

        model = EqxRefined(eqx.nn.Linear(4, 3, key=jax.random.key(0)))
        return bridge.probe(model, vmap=True), (model.dense.weight.T, model.dense.bias)

    def function(x):
        return _refine(hk.Linear(3, name="dense")(x), loop)

    transformed = hk.without_apply_rng(hk.transform(function))
    params = transformed.init(jax.random.key(0), X)
    dense = params["dense"]
    return bridge.probe(transformed, params), (dense["w"], dense["b"])


def _by_hand(kernel, bias, loop):
    """`(dense's value, outputs, d loss / d dense)`, in NumPy."""
    hidden = X @ np.asarray(kernel, np.float64) + np.asarray(bias, np.float64)
    if loop == "counter":
        return hidden, STEPS * hidden, STEPS * WEIGHTS
    outputs, derivative = hidden, np.ones_like(hidden)
    for _ in range(STEPS):
        derivative = derivative * (1.0 + 0.5 * (1.0 - np.tanh(outputs) ** 2))
        outputs = outputs + 0.5 * np.tanh(outputs)
    return hidden, outputs, derivative * WEIGHTS


def _loss(outputs):
    return (outputs * WEIGHTS).sum()


def _close(actual, expected):
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=1e-5, atol=1e-6)


def _refusal():
    """The error's start, naming the loop's line in `_refine`, and its ways
    out."""
    lines, first = inspect.getsourcelines(_refine)
    (line,) = [
        first + index
        for index, text in enumerate(lines)
        if "jax.lax.while_loop(lambda carry" in text
    ]
    return re.escape(
        "`value_and_grad`: JAX cannot differentiate backward through the while "
        f"loop at {__file__}:{line} (in _refine), "
        "a jax.lax.while_loop (or a jax.lax.fori_loop with traced bounds, which "
        "JAX runs as one) carrying a value the gradient flows through (from the "
        "parameters or a selected site): how many iterations run is known only "
        "when the model runs, so JAX keeps none to go back through. Ways out: "
        "probe.apply(x, at=...) gives the sites' values, without gradients; "
        "write the loop as a jax.lax.scan of fixed length; for a fori_loop, give "
        "it Python int bounds (JAX then makes it a scan, whose iterations bridge "
        "probes one by one); or Equinox's checkpointed loop, "
        'equinox.internal.while_loop(cond, body, init, kind="checkpointed", '
        "max_steps=n), which JAX differentiates backward and whose steps bridge "
        "probes."
    )


def _maybe_jit(function, jit):
    return jax.jit(function) if jit else function


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("library", LIBRARIES)
def test_a_while_loop_carrying_the_gradient_is_refused_naming_it(library, jit):
    probe, _ = _probe(library, "while")
    run = _maybe_jit(lambda x: probe.value_and_grad(_loss, x, at="dense"), jit)
    with pytest.raises(bridge.BridgeValueError, match=_refusal()) as error:
        run(X)
    assert isinstance(error.value, ValueError)
    # JAX's own error stays as the cause.
    assert str(error.value.__cause__).startswith(
        "Reverse-mode differentiation does not work for lax.while_loop"
    )
    # Every site selected (`at=None`): the same.
    with pytest.raises(bridge.BridgeValueError, match=_refusal()):
        _maybe_jit(lambda x: probe.value_and_grad(_loss, x), jit)(X)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("library", LIBRARIES)
def test_apply_gives_the_values_of_the_same_model(library, jit):
    probe, (kernel, bias) = _probe(library, "while")
    result = _maybe_jit(lambda x: probe.apply(x, at="dense"), jit)(X)
    hidden, outputs, _ = _by_hand(kernel, bias, "while")
    _close(result.activations["dense"], hidden)
    _close(result.outputs, outputs)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("loop", ["counter", "checkpointed"])
@pytest.mark.parametrize("library", LIBRARIES)
def test_a_loop_jax_differentiates_is_differentiated(library, loop, jit):
    """A while loop carrying only its count, and the way out the error
    names (Equinox's checkpointed loop): gradients as by hand."""
    probe, (kernel, bias) = _probe(library, loop)
    run = _maybe_jit(lambda x: probe.value_and_grad(_loss, x, at="dense"), jit)
    result = run(X)
    hidden, outputs, gradient = _by_hand(kernel, bias, loop)
    _close(result.activations["dense"], hidden)
    _close(result.activation_grads["dense"], gradient)
    np.testing.assert_allclose(result.loss, (outputs * WEIGHTS).sum(), rtol=1e-5)


def test_another_value_error_of_jax_passes_as_it_is():
    """Only JAX's while-loop refusal is bridge's: a loss that raises its own
    ValueError raises it unchanged."""
    probe, _ = _probe("linen", "counter")

    def loss(outputs):
        raise ValueError("the loss's own error")

    with pytest.raises(ValueError, match="^the loss's own error") as error:
        probe.value_and_grad(loss, X, at="dense")
    assert type(error.value) is ValueError


def test_a_library_module_with_an_odd_path_attribute_is_no_obstacle(monkeypatch):
    """Finding the model's line skips library frames by their package's
    directories; a library module whose `__path__` attribute is no list of
    directories (PyTorch's `torch._classes` answers every attribute with a
    namespace object, once PyTorch is imported) changes nothing."""

    class AnswersEveryAttribute(type(jax)):
        def __getattr__(self, name):
            return object()

    odd = AnswersEveryAttribute("jax._answers_every_attribute")
    monkeypatch.setitem(sys.modules, odd.__name__, odd)
    probe, _ = _probe("linen", "while")
    with pytest.raises(bridge.BridgeValueError, match=_refusal()):
        probe.value_and_grad(_loss, X, at="dense")
