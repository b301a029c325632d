"""Flax's lifted transforms call a function of their own as a method of the
module they are handed: `nn.RNN` scans its cell with a `scan_fn(cell, carry,
x)`, and every function form (`nn.scan(f)`, `nn.vmap(f)`, `nn.remat(f)`,
`nn.jit(f)`, `nn.map_variables(f)`, the branches of `nn.cond` and
`nn.switch`, the functions of `nn.while_loop`) runs `f` so, where
`nn.intercept_methods` sees `Cell_0.f`. Such a function is the transform's,
not a call of the module's: no site, while the module calls made in it are,
with their values, gradients and `#k` numbering. The class forms
(`nn.scan(Cell)`, ...) and lifted decorators on a method (`@nn.remat` on
`enc`, a site `enc`) list the module's own calls alone.

Every value and gradient is checked against Flax alone: an interceptor of the
test's own (`nn.intercept_methods`) keeps each call of the user's class in a
collection of Flax variables and adds a perturbation variable to it, as
Flax's `sow` and `perturb` do, and the gradients are `jax.grad` of those
perturbations. A loop or a map carries both collections where the test's
reference configuration of the model names them (`variable_axes`), so they
are per iteration; nothing else changes. Eager and under `jax.jit`. NNX's
transforms are checked to list the user's calls alone too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_tree_allclose,
    nnx_supported,
)

import bridge

WIDTH = 4
#: The collections of the test's own reference, carried per iteration.
REFERENCE_AXES = {"perturbations": 0, "intermediates": 0}


class Block(nn.Module):
    """The user's layer."""

    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(WIDTH)(x))


class Cell(nn.Module):
    """The user's recurrent cell: `(carry, x) -> (carry, y)`."""

    @nn.compact
    def __call__(self, carry, x):
        h = jnp.tanh(nn.Dense(WIDTH)(x) + nn.Dense(WIDTH, use_bias=False)(carry))
        return h, 2.0 * h


class StackedBlock(nn.Module):
    """A layer of a scanned stack: `(x, None) -> (x, None)`."""

    @nn.compact
    def __call__(self, x, _):
        return Block()(x), None


def _axes(mdl: nn.Module) -> dict:
    return REFERENCE_AXES if mdl.reference else {}


def _carry(h: jax.Array) -> jax.Array:
    return jnp.zeros((h.shape[0], WIDTH))


# -- the forms: `(model, h) -> h`, each calling the user's class -------------------


def rnn(mdl, h):
    """`nn.RNN`: Flax's `scan_fn` calls the cell, `params` broadcast."""
    return nn.RNN(nn.OptimizedLSTMCell(WIDTH), variable_axes=_axes(mdl))(h)


def _scanned(target, mdl):
    return nn.scan(
        target,
        variable_broadcast="params",
        split_rngs={"params": False},
        in_axes=1,
        out_axes=1,
        variable_axes=_axes(mdl),
    )


def scan_function(mdl, h):
    def step(cell, carry, x):
        return cell(carry, x)

    return _scanned(step, mdl)(Cell(), _carry(h), h)[1]


def scan_class(mdl, h):
    return _scanned(Cell, mdl)()(_carry(h), h)[1]


def _stacked(target, mdl):
    return nn.scan(
        target,
        variable_axes={"params": 0, **_axes(mdl)},
        split_rngs={"params": True},
        length=3,
    )


def stack_function(mdl, h):
    def layer(block, x, _):
        return block(x), None

    return _stacked(layer, mdl)(Block(), h, None)[0]


def stack_class(mdl, h):
    return _stacked(StackedBlock, mdl)()(h, None)[0]


def _mapped(target, mdl):
    """An ensemble: one member's parameters per row of the mapped axis."""
    return nn.vmap(
        target,
        variable_axes={"params": 0, **_axes(mdl)},
        split_rngs={"params": True},
        in_axes=0,
        out_axes=0,
    )


def _members(h):
    return jnp.stack([h, 2.0 * h])


def vmap_function(mdl, h):
    def member(block, x):
        return block(x)

    return _mapped(member, mdl)(Block(), _members(h)).sum(0)


def vmap_class(mdl, h):
    return _mapped(Block, mdl)()(_members(h)).sum(0)


def vmap_broadcast(mdl, h):
    """`params` broadcast: a site per member all the same."""

    def member(block, x):
        return block(x)

    mapped = nn.vmap(
        member,
        variable_axes={"params": None, **_axes(mdl)},
        split_rngs={"params": False},
    )
    return mapped(Block(), _members(h)).sum(0)


def remat_function(mdl, h):
    def body(block, x):
        return block(x)

    return nn.remat(body)(Block(), h)


def remat_class(mdl, h):
    return nn.checkpoint(Block)()(h)


def jit_function(mdl, h):
    def body(block, x):
        return block(x)

    return nn.jit(body)(Block(), h)


def jit_class(mdl, h):
    return nn.jit(Block)()(h)


def _same(variables):
    return variables


def map_variables_function(mdl, h):
    def body(block, x):
        return block(x)

    return nn.map_variables(body, "params", _same, _same, init=mdl.is_initializing())(
        Block(), h
    )


def map_variables_class(mdl, h):
    return nn.map_variables(
        Block, "params", _same, _same, init=mdl.is_initializing()
    )()(h)


def cond(mdl, h):
    def taken(block, x):
        return block(x)

    def other(block, x):
        return -block(2.0 * x)

    return nn.cond(h.sum() > 0, taken, other, Block(), h)


def switch(mdl, h):
    def first(block, x):
        return block(x)

    def second(block, x):
        return -block(2.0 * x)

    def third(block, x):
        return block(x) * 3.0

    return nn.switch(jnp.int32(1), [first, second, third], Block(), h)


def while_loop(mdl, h):
    block = Block()
    if mdl.is_initializing():
        block(h)  # `nn.while_loop` creates no variables

    def more(block, carry):
        return carry[0] < 2

    def body(block, carry):
        return carry[0] + 1, block(carry[1])

    return nn.while_loop(more, body, block, (0, h))[1]


class Methods(nn.Module):
    """Lifted transforms as decorators on the module's own methods, and a
    method of its own handed to `nn.cond`: each method's call is a site."""

    @nn.compact
    def __call__(self, x):
        h = self.rematerialised(x) + self.jitted(x)
        return nn.cond(h.sum() > 0, Methods.left, Methods.right, self, h)

    @nn.remat
    def rematerialised(self, x):
        return nn.Dense(WIDTH, name="dense")(x)

    @nn.jit
    def jitted(self, x):
        return jnp.tanh(nn.Dense(WIDTH, name="jitted_dense")(x))

    def left(self, x):
        return nn.Dense(WIDTH, name="branch")(x)

    def right(self, x):
        return -nn.Dense(WIDTH, name="branch")(x)


def methods(mdl, h):
    return Methods()(h)


class Lifted(nn.Module):
    """`embed`, a lifted transform's form around the user's class, `head`.
    `reference`: loops and maps carry the test's reference collections too."""

    form: Callable
    reference: bool = False

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(WIDTH, name="embed")(x)
        return nn.Dense(3, name="head")(self.form(self, h))


class Form:
    """A form and what it lists: `sites` in call order; `user` the user's
    class and each of its calls' site with the function around it (the key
    the reference names it by)."""

    def __init__(
        self,
        form: Callable,
        sites: list[str],
        user: type,
        calls: dict[str, str],
        steps: bool = False,
        refused: str | None = None,
    ):
        self.form, self.sites, self.user, self.calls = form, sites, user, calls
        self.steps = steps  # `x` has a steps axis
        # The transform named where selecting the user's calls is refused.
        self.refused = refused

    def __repr__(self):
        return self.form.__name__


def _block(prefix: str, suffix: str = "") -> list[str]:
    return [f"{prefix}{suffix}", f"{prefix}/Dense_0{suffix}"]


LSTM = ["ii", "hi", "if", "hf", "ig", "hg", "io", "ho"]
FORMS = [
    Form(
        rnn,
        [
            "embed",
            "RNN_0",
            "OptimizedLSTMCell_0",
            *(f"OptimizedLSTMCell_0/{gate}" for gate in LSTM),
            "head",
        ],
        nn.OptimizedLSTMCell,
        {"OptimizedLSTMCell_0": "scan_fn:"},
        steps=True,
    ),
    Form(
        scan_function,
        ["embed", "Cell_0", "Cell_0/Dense_0", "Cell_0/Dense_1", "head"],
        Cell,
        {"Cell_0": "step:"},
        steps=True,
    ),
    Form(
        scan_class,
        ["embed", "ScanCell_0", "ScanCell_0/Dense_0", "ScanCell_0/Dense_1", "head"],
        Cell,
        {"ScanCell_0": ":"},
        steps=True,
    ),
    Form(
        stack_function,
        ["embed", *_block("Block_0"), "head"],
        Block,
        {"Block_0": "layer:"},
    ),
    Form(
        stack_class,
        [
            "embed",
            "ScanStackedBlock_0",
            *_block("ScanStackedBlock_0/Block_0"),
            "head",
        ],
        Block,
        {"ScanStackedBlock_0/Block_0": ":"},
    ),
    Form(
        vmap_function,
        ["embed", *_block("Block_0"), "head"],
        Block,
        {"Block_0": "member:"},
    ),
    Form(
        vmap_class,
        ["embed", *_block("VmapBlock_0"), "head"],
        Block,
        {"VmapBlock_0": ":"},
    ),
    Form(
        vmap_broadcast,
        ["embed", *_block("Block_0"), "head"],
        Block,
        {"Block_0": "member:"},
    ),
    Form(
        remat_function,
        ["embed", *_block("Block_0"), "head"],
        Block,
        {"Block_0": "body:"},
    ),
    Form(
        remat_class,
        ["embed", *_block("CheckpointBlock_0"), "head"],
        Block,
        {"CheckpointBlock_0": ":"},
    ),
    Form(
        jit_function, ["embed", *_block("Block_0"), "head"], Block, {"Block_0": "body:"}
    ),
    Form(
        jit_class, ["embed", *_block("JitBlock_0"), "head"], Block, {"JitBlock_0": ":"}
    ),
    Form(
        map_variables_function,
        ["embed", *_block("Block_0"), "head"],
        Block,
        {"Block_0": "body:"},
    ),
    Form(
        map_variables_class,
        ["embed", *_block("Map_variablesBlock_0"), "head"],
        Block,
        {"Map_variablesBlock_0": ":"},
    ),
    Form(
        cond,
        ["embed", *_block("Block_0"), *_block("Block_0", "#1"), "head"],
        Block,
        {"Block_0": "taken:", "Block_0#1": "other:"},
    ),
    Form(
        switch,
        [
            "embed",
            *_block("Block_0"),
            *_block("Block_0", "#1"),
            *_block("Block_0", "#2"),
            "head",
        ],
        Block,
        {"Block_0": "first:", "Block_0#1": "second:", "Block_0#2": "third:"},
    ),
    Form(
        while_loop,
        ["embed", *_block("Block_0"), "head"],
        Block,
        {"Block_0": "body:"},
        refused="jax.lax.while_loop .* around site 'Block_0'",
    ),
    Form(
        methods,
        [
            "embed",
            "Methods_0",
            "Methods_0.rematerialised",
            "Methods_0/dense",
            "Methods_0.jitted",
            "Methods_0/jitted_dense",
            "Methods_0.left",
            "Methods_0/branch",
            "Methods_0.right",
            "Methods_0/branch#1",
            "head",
        ],
        Methods,
        {
            "Methods_0": ":",
            "Methods_0.rematerialised": ":rematerialised",
            "Methods_0.jitted": ":jitted",
            "Methods_0.left": ":left",
            "Methods_0.right": ":right",
        },
    ),
]


def loss_fn(y):
    return jnp.mean(jnp.square(y - 0.5))


def _inputs(form: Form) -> jax.Array:
    shape = (2, 3, 5) if form.steps else (2, 5)
    return jax.random.normal(jax.random.key(1), shape)


@functools.cache
def _built(form: Form) -> tuple[Lifted, Any, jax.Array]:
    model = Lifted(form.form)
    x = _inputs(form)
    return model, model.init(jax.random.key(0), x), x


# -- the reference: Flax alone ------------------------------------------------------


def _reference_interceptor(form: Form) -> Callable:
    """Records and perturbs each call of the user's class, by the name it has
    in `form.calls`: `<function around it>:<method>` (the function a lifted
    transform was given, `scan_fn`, a branch; `""` for `__call__`). Each
    float leaf `i` of the call's output is a variable `<name>|<i>` of the
    module's `intermediates` (set to the value, zeros where a branch did not
    run) and of its `perturbations` (added to it, as Flax's `perturb` does).
    A call creates its siblings too, the names of the same module: the
    branches of a `cond` then create the same variables, as Flax requires."""
    wrappers = {name.partition(":")[0] for name in form.calls.values()} - {""}
    names: dict[tuple[str, ...], set[str]] = {}
    for site, name in form.calls.items():
        names.setdefault(_scope(site), set()).add(name)
    around: list[str] = []

    def interceptor(next_fun, args, kwargs, context):
        module, method = context.module, context.method_name
        if not isinstance(module, form.user) or module.path == () or method == "setup":
            # Not a call of the user's class (at `()`: Flax's check of `setup`).
            return next_fun(*args, **kwargs)
        if method in wrappers:
            around.append(method)
            try:
                return next_fun(*args, **kwargs)
            finally:
                around.pop()
        own = f"{around[-1] if around else ''}:{'' if method == '__call__' else method}"
        leaves, structure = jax.tree.flatten(next_fun(*args, **kwargs))
        for name in names[tuple(module.path)]:
            for i, leaf in enumerate(leaves):
                for collection in ("intermediates", "perturbations"):
                    if not module.has_variable(collection, f"{name}|{i}"):
                        module.put_variable(
                            collection, f"{name}|{i}", jnp.zeros_like(leaf)
                        )
        perturbed = []
        for i, leaf in enumerate(leaves):
            module.put_variable("intermediates", f"{own}|{i}", leaf)
            delta = module.get_variable("perturbations", f"{own}|{i}")
            perturbed.append(leaf + delta)
        return jax.tree.unflatten(structure, perturbed)

    return interceptor


def _scope(site: str) -> tuple[str, ...]:
    """`Block_0#1` -> `("Block_0",)`, `Methods_0.left` -> `("Methods_0",)`."""
    return tuple(site.partition(".")[0].partition("#")[0].split("/"))


def reference(form: Form) -> tuple[dict, dict, jax.Array]:
    """Each call of the user's class, by site: the leaves of its value and of
    the gradient of the loss with respect to it, from Flax's variables in
    the model's reference configuration; and the loss."""
    _, variables, x = _built(form)
    model = Lifted(form.form, reference=True)
    interceptor = _reference_interceptor(form)
    with nn.intercept_methods(interceptor):
        _, made = model.apply(variables, x, mutable=["perturbations", "intermediates"])
    zeros = jax.tree.map(jnp.zeros_like, made)

    def loss(perturbations):
        with nn.intercept_methods(interceptor):
            y, state = model.apply(
                {**variables, "perturbations": perturbations},
                x,
                mutable=["intermediates"],
            )
        return loss_fn(y), state["intermediates"]

    (value, captured), grads = jax.value_and_grad(loss, has_aux=True)(
        zeros["perturbations"]
    )

    def by_site(tree):
        found = {}
        for site, name in form.calls.items():
            node = tree
            for part in _scope(site):
                node = node[part]
            count = sum(key.startswith(f"{name}|") for key in node)
            found[site] = [node[f"{name}|{i}"] for i in range(count)]
        return found

    return by_site(captured), by_site(grads), value


# -- the tests ----------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS, ids=repr)
def test_a_lifted_transforms_own_function_is_no_site(form):
    model, variables, x = _built(form)
    probe = bridge.probe(model, variables)
    assert list(probe.sites(x)) == form.sites


PROBED = [form for form in FORMS if form.refused is None]


@pytest.mark.parametrize("form", PROBED, ids=repr)
def test_the_users_calls_keep_their_values_and_gradients(form):
    """Selected by class, exactly the user's calls, each with Flax's value and
    gradient; eager and under `jax.jit`."""
    model, variables, x = _built(form)
    probe = bridge.probe(model, variables)
    values, grads, loss = reference(form)
    # The reference's configuration computes the model's numbers.
    np.testing.assert_allclose(loss, loss_fn(model.apply(variables, x)), rtol=1e-6)

    def run(probe, x):
        return probe.value_and_grad(loss_fn, x, at=form.user)

    for res in (run(probe, x), jax.jit(run)(probe, x)):
        # (a `jax.jit`'s output dict has its keys sorted)
        assert set(res.activations) == set(form.calls)
        np.testing.assert_allclose(res.loss, loss, rtol=1e-6)
        for site in form.calls:
            assert_tree_allclose(jax.tree.leaves(res.activations[site]), values[site])
            assert_tree_allclose(
                jax.tree.leaves(res.activation_grads[site]), grads[site]
            )


@pytest.mark.parametrize(
    "form", [form for form in FORMS if form.refused is not None], ids=repr
)
def test_a_call_bridge_cannot_see_through_is_refused_naming_its_transform(form):
    model, variables, x = _built(form)
    probe = bridge.probe(model, variables)
    with pytest.raises(bridge.BridgeError, match=form.refused):
        probe.value_and_grad(loss_fn, x, at=form.user)


NEEDS_NNX = pytest.mark.skipif(
    not nnx_supported(), reason="NNX probes need flax >= 0.12"
)


@NEEDS_NNX
@pytest.mark.parametrize("form", FORMS, ids=repr)
def test_a_linen_model_in_an_nnx_model_lists_no_function_of_a_transform(form):
    """The Linen model as a guest (`nnx.bridge.ToNNX`): its sites under the
    NNX attribute, as listed on their own."""
    from flax import nnx

    class Host(nnx.Module):
        def __init__(self, x):
            self.inner = nnx.bridge.ToNNX(Lifted(form.form), rngs=nnx.Rngs(0))
            nnx.bridge.lazy_init(self.inner, x)

        def __call__(self, x):
            return self.inner(x)

    x = _inputs(form)
    sites = bridge.probe(Host(x)).sites(x)
    assert list(sites) == ["inner", *(f"inner/{site}" for site in form.sites)]


# -- NNX's transforms run functions of their own too: none is a site ---------------


def _nnx_forms() -> dict[str, Callable]:
    from flax import nnx

    def scan(block, x):
        def body(carry, layer):
            return layer(carry)

        scanned = nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        return scanned(x, block)

    return {
        "scan": scan,
        "vmap": lambda block, x: nnx.vmap(lambda block, x: block(x), in_axes=(None, 0))(
            block, x
        ),
        "remat": lambda block, x: nnx.remat(lambda block, x: block(x))(block, x),
        "jit": lambda block, x: nnx.jit(lambda block, x: block(x))(block, x),
        "cond": lambda block, x: nnx.cond(
            x.sum() > 0, lambda b, x: b(x), lambda b, x: -b(2.0 * x), block, x
        ),
        "switch": lambda block, x: nnx.switch(
            jnp.int32(1), [lambda b, x: b(x), lambda b, x: -b(2.0 * x)], block, x
        ),
    }


@NEEDS_NNX
@pytest.mark.parametrize("kind", ["scan", "vmap", "remat", "jit", "cond", "switch"])
def test_nnx_transforms_list_the_users_calls_alone(kind):
    from flax import nnx

    class NnxBlock(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

        def __call__(self, x):
            return jnp.tanh(self.linear(x))

    class Host(nnx.Module):
        def __init__(self, rngs):
            if kind == "scan":  # a stack of three layers

                @nnx.split_rngs(splits=3)
                @nnx.vmap(in_axes=(0,), out_axes=0)
                def stack(rngs):
                    return NnxBlock(rngs)

                self.block = stack(rngs)
            else:
                self.block = NnxBlock(rngs)

        def __call__(self, x):
            return _nnx_forms()[kind](self.block, x)

    x = jax.random.normal(jax.random.key(1), (2, WIDTH))
    sites = list(bridge.probe(Host(nnx.Rngs(0))).sites(x))
    branches = 2 if kind in ("cond", "switch") else 1
    expected = ["block", "block/linear"]
    for k in range(1, branches):
        expected += [f"block#{k}", f"block/linear#{k}"]
    assert sites == expected
