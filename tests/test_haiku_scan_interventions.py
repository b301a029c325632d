"""Patches and layer inputs at sites inside Haiku's layer stacks and scans.

A site inside `hk.experimental.layer_stack` or `hk.scan` holds every layer
(iteration) stacked, `(layers, *value shape)`. A patch value comes in that
shape and each layer takes its row; a patch function is applied per layer;
`with_inputs=True` stacks each layer's inputs. The reference is the same model
written unrolled, with the per-layer parameters sliced from the stacked ones,
patched by the test itself with `hk.intercept_methods` (its own call
counting), and differentiated with plain `jax.grad`: never bridge.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.haiku import Model, _inputs, call_name
from helpers import assert_tree_allclose, random_like
from test_haiku import (
    STACK,
    looped,
    nested,
    recurrent,
    recurrent_unrolled,
    stacked,
    unrolled,
    unrolled_params,
)

import bridge

LIN, OUT = f"{STACK}/lin", f"{STACK}/out"


def hand_patched(fn, params, args, kwargs, calls, patch=None, deltas=None):
    """Plain `apply` of the unrolled `fn`, patched by hand.

    `calls` maps a call of `fn` (named by `call_name`) to `(site, row)`: the
    bridge site it belongs to and its row there (`None` for a site outside
    any stack). That call's output is replaced by `patch[site]` (the row of a
    stacked value, or the function of the output), then `deltas[site][row]`
    is added. Returns `(outputs, values, inputs)`, the values and positional
    inputs of each site stacked over its rows in row order, as bridge gives
    them.
    """
    patch, deltas = patch or {}, deltas or {}
    counts: dict[str, int] = {}
    values: dict[str, dict] = {}
    inputs: dict[str, dict] = {}

    def pick(stacked_value, row):
        return stacked_value if row is None else stacked_value[row]

    def interceptor(next_fun, call_args, call_kwargs, context):
        name = call_name(context, counts)
        out = next_fun(*call_args, **call_kwargs)
        if name not in calls:
            return out
        site, row = calls[name]
        new = patch.get(site)
        if new is not None:
            out = new(out) if callable(new) else pick(new, row)
        if site in deltas:
            out = out + pick(deltas[site], row)
        values.setdefault(site, {})[row] = out
        inputs.setdefault(site, {})[row] = tuple(call_args)
        return out

    with hk.intercept_methods(interceptor):
        outputs = hk.without_apply_rng(hk.transform(fn)).apply(params, *args, **kwargs)
    return outputs, _by_site(values), _by_site(inputs)


def _by_site(rows: dict[str, dict]) -> dict[str, Any]:
    def stack(by_row):
        if None in by_row:
            return by_row[None]
        ordered = [by_row[row] for row in sorted(by_row)]
        return jax.tree.map(lambda *r: jnp.stack(r), *ordered)

    return {site: stack(by_row) for site, by_row in rows.items()}


@dataclasses.dataclass
class Stack:
    """A model with a stack of layers, and its unrolled twin for the reference.

    `patch_site` is a stacked site whose patch value moves what follows it.
    """

    fn: Callable
    unrolled: Callable
    to_unrolled: Callable  # the model's params -> the unrolled model's
    calls: dict[str, tuple[str, Any]]
    args: tuple
    kwargs: dict
    with_state: bool
    patch_site: str
    function_site: str

    @functools.cached_property
    def model(self) -> Model:
        return Model(self.fn, self.args, self.with_state, apply_rng=False, rng=None)

    def probe(self, vmap=False):
        model = self.model
        state = (model.state,) if self.with_state else ()
        return bridge.probe(model.transformed, model.params, *state, vmap=vmap)

    def reference(self, params, patch=None, deltas=None, args=None):
        return hand_patched(
            self.unrolled,
            self.to_unrolled(params),
            self.args if args is None else args,
            self.kwargs,
            self.calls,
            patch,
            deltas,
        )


def _layer_calls(layers: int = 3) -> dict[str, tuple[str, Any]]:
    # `unrolled` names its layers' modules `lin`, `lin_1`, `lin_2`.
    calls = {"embed": ("embed", None), "head": ("head", None)}
    for module in ("lin", "out"):
        for i in range(layers):
            calls[module if i == 0 else f"{module}_{i}"] = (f"{STACK}/{module}", i)
    return calls


def _step_calls(length: int, reverse: bool) -> dict[str, tuple[str, Any]]:
    # `recurrent_unrolled` calls one `cell` per step: `cell`, `cell#1`, ...;
    # a site's rows are in the order of `xs`, the reverse of the calls' there.
    calls = {"embed": ("embed", None)}
    for k in range(length):
        calls["cell" if k == 0 else f"cell#{k}"] = (
            "cell",
            length - 1 - k if reverse else k,
        )
    return calls


def _identity(params):
    return params


def _layer_stack(args, with_state):
    # `head` runs inside hk.remat.
    return Stack(
        fn=stacked,
        unrolled=unrolled,
        to_unrolled=unrolled_params,
        calls=_layer_calls(),
        args=args,
        kwargs={},
        with_state=with_state,
        patch_site=OUT,
        function_site=LIN,
    )


def _scan(args, with_state, reverse=False, unrolled_fn=recurrent_unrolled):
    return Stack(
        fn=recurrent,
        unrolled=unrolled_fn,
        to_unrolled=_identity,
        calls=_step_calls(3, reverse),
        args=args,
        kwargs={"reverse": True} if reverse else {},
        with_state=with_state,
        patch_site="cell",
        function_site="cell",
    )


STACKS = {
    "layer_stack": lambda: _layer_stack((_inputs(4, 8),), with_state=True),
    "hk.scan": lambda: _scan((_inputs(3, 8),), with_state=False),
    "hk.scan-reverse": lambda: _scan((_inputs(3, 8),), with_state=True, reverse=True),
}


@functools.cache
def _stack(kind: str) -> Stack:
    return STACKS[kind]()


#: Each kind of stack once eagerly and once under `jax.jit`.
KINDS_AND_MODES = [
    ("layer_stack", "eager"),
    ("layer_stack", "jit"),
    ("hk.scan", "eager"),
    ("hk.scan-reverse", "jit"),
]


def in_mode(mode, function, probe):
    return (jax.jit(function) if mode == "jit" else function)(probe)


def assert_values_close(actual, expected):
    assert_tree_allclose(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("kind", "mode"), KINDS_AND_MODES)
def test_a_stacked_patch_value_gives_each_layer_its_row(kind, mode):
    stack = _stack(kind)
    probe = stack.probe()
    site = stack.patch_site
    sites = probe.sites(*stack.args, **stack.kwargs)
    patch = {site: random_like(sites[site], seed=3)}
    if kind == "layer_stack":  # a value inside hk.remat, unstacked
        patch["head"] = random_like(sites["head"], seed=4)

    fwd = in_mode(
        mode,
        lambda probe: probe.apply(*stack.args, patch=patch, **stack.kwargs),
        probe,
    )
    outputs, reference, _ = jax.jit(lambda p: stack.reference(p, patch))(
        stack.model.params
    )
    assert_values_close(fwd.outputs, outputs)
    for name, value in patch.items():
        np.testing.assert_array_equal(fwd.activations[name], value)
    assert sorted(fwd.activations) == sorted(reference)
    for name, value in reference.items():
        assert_values_close(fwd.activations[name], value)


@pytest.mark.parametrize(("kind", "mode"), KINDS_AND_MODES)
def test_a_patch_function_is_applied_per_layer(kind, mode):
    stack = _stack(kind)
    patch = {stack.function_site: lambda v: 2.0 * jnp.sin(v)}
    if kind == "layer_stack":
        patch["head"] = lambda v: v - 1.0  # inside hk.remat

    fwd = in_mode(
        mode,
        lambda probe: probe.apply(*stack.args, patch=patch, **stack.kwargs),
        stack.probe(),
    )
    outputs, reference, _ = jax.jit(lambda p: stack.reference(p, patch))(
        stack.model.params
    )
    assert_values_close(fwd.outputs, outputs)
    for name, value in reference.items():
        assert_values_close(fwd.activations[name], value)


def _reference_gradients(stack, patch, loss_fn, deltas, args=None):
    """Loss, parameter gradients (in the stacked model's structure), activation
    gradients, activations and inputs of the hand-patched unrolled model."""

    def loss(params, deltas):
        outputs, values, inputs = stack.reference(params, patch, deltas, args)
        return loss_fn(outputs), (values, inputs)

    (value, (values, inputs)), (grads, activation_grads) = jax.jit(
        jax.value_and_grad(loss, (0, 1), has_aux=True)
    )(stack.model.params, deltas)
    return value, grads, activation_grads, values, inputs


def zeros_like_sites(sites):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sites)


def sin_loss(y):
    return jnp.sum(jnp.sin(y))


@pytest.mark.parametrize("patch_kind", ["value", "function"])
@pytest.mark.parametrize(("kind", "mode"), KINDS_AND_MODES)
def test_patched_gradients_and_inputs_equal_the_hand_patched_unrolled_model(
    kind, mode, patch_kind
):
    stack = _stack(kind)
    probe = stack.probe()
    sites = probe.sites(*stack.args, **stack.kwargs)
    site = stack.patch_site if patch_kind == "value" else stack.function_site
    patch = {
        site: random_like(sites[site], seed=4)
        if patch_kind == "value"
        else (lambda v: jnp.tanh(3.0 * v))
    }

    res = in_mode(
        mode,
        lambda probe: probe.value_and_grad(
            sin_loss, *stack.args, patch=patch, with_inputs=True, **stack.kwargs
        ),
        probe,
    )
    loss, grads, activation_grads, values, inputs = _reference_gradients(
        stack,
        patch,
        sin_loss,
        zeros_like_sites(sites),
    )
    np.testing.assert_allclose(res.loss, loss, rtol=1e-5)
    assert_tree_allclose(res.grads, grads, rtol=1e-4, atol=1e-5)
    assert sorted(res.activation_grads) == sorted(activation_grads)
    for name in activation_grads:
        assert_values_close(res.activations[name], values[name])
        assert_values_close(res.activation_grads[name], activation_grads[name])
        assert_values_close(res.inputs[name], inputs[name])
    # The patch moved something the gradient sees.
    assert float(jnp.abs(res.activation_grads[site]).sum()) > 1e-3


# -- with the probe's vmap=True


def recurrent_batched_unrolled(x):
    """`recurrent` on a batch `(batch, steps, features)`, unrolled."""
    cell = hk.Linear(8, name="cell")
    h = hk.Linear(8, name="embed")(x)
    carry = h[:, 0]
    for i in range(h.shape[1]):
        carry = jnp.tanh(cell(carry) + h[:, i])  # `cell`, `cell#1`, ...
    return carry


BATCHED = {
    # `(stack, batch)`: the model takes one example (the stack's args shape
    # its params), the reference the whole batch.
    "layer_stack": lambda: (
        _layer_stack((_inputs(8),), with_state=False),
        (_inputs(4, 8),),
    ),
    "hk.scan": lambda: (
        _scan(
            (_inputs(3, 8),), with_state=False, unrolled_fn=recurrent_batched_unrolled
        ),
        (_inputs(4, 3, 8),),
    ),
}


def _center(v):
    # Depends on every example: under vmap=True it must see the whole batch.
    return v - jnp.mean(v, axis=0, keepdims=True)


@pytest.mark.parametrize("kind", BATCHED)
def test_with_vmap_a_patch_value_and_function_take_the_batch_after_the_layers(kind):
    stack, batch = BATCHED[kind]()
    probe = stack.probe(vmap=True)
    sites = probe.sites(*batch)
    assert sites[stack.patch_site].shape[:2] == (3, 4)  # (layers, batch, ...)

    values = random_like(sites[stack.patch_site], seed=5)
    fwd = jax.jit(lambda probe: probe.apply(*batch, patch={stack.patch_site: values}))(
        probe
    )
    outputs, reference, _ = jax.jit(
        lambda p: stack.reference(p, {stack.patch_site: values}, args=batch)
    )(stack.model.params)
    assert_values_close(fwd.outputs, outputs)
    for name, value in reference.items():
        assert_values_close(fwd.activations[name], value)

    patch = {stack.function_site: _center}
    res = jax.jit(
        lambda probe: probe.value_and_grad(
            sin_loss, *batch, patch=patch, with_inputs=True
        )
    )(probe)
    loss, grads, activation_grads, values, inputs = _reference_gradients(
        stack,
        patch,
        sin_loss,
        zeros_like_sites(sites),
        args=batch,
    )
    np.testing.assert_allclose(res.loss, loss, rtol=1e-5)
    assert_tree_allclose(res.grads, grads, rtol=1e-4, atol=1e-5)
    for name in activation_grads:
        assert_values_close(res.activations[name], values[name])
        assert_values_close(res.activation_grads[name], activation_grads[name])
        assert_values_close(res.inputs[name], inputs[name])


# -- a stack in a stack, a patched site not selected


def nested_unrolled(x):
    for _ in range(4):  # `lin`, `lin_1`, ...: outer layer i, inner j is 2i + j
        x = jax.nn.relu(hk.Linear(8, name="lin")(x))
    return x


def nested_unrolled_params(params):
    lin = params[f"{STACK}/{STACK}/lin"]
    return {
        "lin" if k == 0 else f"lin_{k}": jax.tree.map(
            lambda v, k=k: v[k // 2, k % 2], lin
        )
        for k in range(4)
    }


def test_a_patch_in_a_layer_stack_in_a_layer_stack_takes_its_layers_row():
    site = f"{STACK}/{STACK}/lin"
    stack = Stack(
        fn=nested,
        unrolled=nested_unrolled,
        to_unrolled=nested_unrolled_params,
        calls={
            "lin" if k == 0 else f"lin_{k}": (site, (k // 2, k % 2)) for k in range(4)
        },
        args=(_inputs(4, 8),),
        kwargs={},
        with_state=True,
        patch_site=site,
        function_site=site,
    )
    probe = stack.probe()
    sites = probe.sites(*stack.args)
    assert sites[site].shape == (2, 2, 4, 8)
    scale = random_like(sites[site], seed=6)
    patch = {site: lambda v: v * scale[0, 0]}  # a function: applied per layer
    res = jax.jit(
        lambda probe: probe.value_and_grad(sin_loss, *stack.args, patch=patch)
    )(probe)
    deltas = {site: jnp.zeros((2, 2, 4, 8))}
    loss, grads, activation_grads, values, _ = _reference_gradients(
        stack, patch, sin_loss, deltas
    )
    np.testing.assert_allclose(res.loss, loss, rtol=1e-5)
    assert_tree_allclose(res.grads, grads, rtol=1e-4, atol=1e-5)
    assert_values_close(res.activation_grads[site], activation_grads[site])
    assert_values_close(res.activations[site], values[site].reshape(2, 2, 4, 8))

    values = random_like(sites[site], seed=7)
    fwd = probe.apply(*stack.args, patch={site: values})
    np.testing.assert_array_equal(fwd.activations[site], values)
    assert_values_close(fwd.outputs, jax.nn.relu(values[1, 1]))


@pytest.mark.parametrize(
    ("kind", "mode"), [("layer_stack", "eager"), ("hk.scan", "jit")]
)
def test_a_patch_value_reaches_a_stacked_site_that_is_not_selected(kind, mode):
    stack = _stack(kind)
    probe = stack.probe()
    site = stack.patch_site
    selected = "head" if kind == "layer_stack" else "embed"
    values = random_like(probe.sites(*stack.args, **stack.kwargs)[site], seed=8)
    res = in_mode(
        mode,
        lambda probe: probe.value_and_grad(
            sin_loss, *stack.args, at=selected, patch={site: values}, **stack.kwargs
        ),
        probe,
    )
    assert list(res.activations) == [selected]
    loss, grads, activation_grads, _, _ = _reference_gradients(
        stack,
        {site: values},
        sin_loss,
        {selected: jnp.zeros_like(res.activations[selected])},
    )
    np.testing.assert_allclose(res.loss, loss, rtol=1e-5)
    assert_tree_allclose(res.grads, grads, rtol=1e-4, atol=1e-5)
    assert_values_close(res.activation_grads[selected], activation_grads[selected])


# -- errors


@pytest.mark.parametrize("kind", ["layer_stack", "hk.scan"])
def test_a_patch_of_one_layers_shape_is_an_error_naming_the_stacked_shape(kind):
    stack = _stack(kind)
    probe = stack.probe()
    site = stack.patch_site
    struct = probe.sites(*stack.args)[site]
    one_layer = jnp.zeros(struct.shape[1:], struct.dtype)
    stacked_shape = str(tuple(struct.shape)).replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(
        ValueError, match=rf"patch for site '{site}' does not fit.*{stacked_shape}"
    ):
        probe.value_and_grad(sin_loss, *stack.args, patch={site: one_layer})
    with pytest.raises(ValueError, match=rf"patch for site '{site}' does not fit"):
        probe.apply(*stack.args, patch={site: lambda v: v[..., :2]})


def test_a_patch_inside_hk_fori_loop_applies_to_every_iteration():
    """The loop is `h = tanh(cell(h))` three times: a patch function zeroing
    `cell` gives zeros out; a patch value replaces each iteration's row, so
    the output is tanh of the last row."""
    x = _inputs(5, 8)
    model = Model(looped, (x,), True, apply_rng=False, rng=None)
    probe = bridge.probe(model.transformed, model.params, model.state)
    fwd = probe.apply(x, at="cell", patch={"cell": jnp.zeros_like})
    np.testing.assert_array_equal(fwd.outputs, 0.0)
    np.testing.assert_array_equal(fwd.activations["cell"], 0.0)
    rows = jax.random.normal(jax.random.key(3), (3, 5, 8))
    fwd = probe.apply(x, at="cell", patch={"cell": rows})
    np.testing.assert_allclose(fwd.outputs, jnp.tanh(rows[-1]), rtol=1e-6)
    np.testing.assert_allclose(fwd.activations["cell"], rows, rtol=1e-6)
