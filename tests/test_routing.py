"""The one fallback's router (`bridge._session.routing.blocked`): whether a
call inside Equinox's loops has a way to its site, from the rules of the
transforms around it. The adapters' behaviour inside each transform is the
conformance and fuzz suites'; this is the table itself, and the sentence a
refusal reads."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import nnx_supported

import bridge
from bridge.adapter_api import (
    JAX_RULES,
    LOOP_AMONG,
    UNBOUNDED_LOOP,
    Refused,
    blocked,
)

JIT, VMAP, COND, FORI = (JAX_RULES[n] for n in ("jit", "vmap", "cond", "fori_loop"))
WHILE, SCAN = JAX_RULES["while_body"], JAX_RULES["scan"]


@pytest.mark.parametrize(
    "enclosing",
    [(), (JIT, JIT), (VMAP,), (VMAP, JIT, VMAP), (COND,), (FORI, JIT, COND)],
    ids=repr,
)
def test_a_call_with_a_way_is_not_blocked(enclosing):
    # The probe's own trace, the model's vmaps only (read from the
    # computation), branches and loops of known bounds only.
    assert blocked("site", enclosing) is None


@pytest.mark.parametrize(
    "enclosing, blocker",
    [
        ((WHILE,), WHILE),
        ((VMAP, WHILE, COND), WHILE),  # a transform that blocks, before all
        ((COND, VMAP), COND),  # a branch among other transforms
        ((VMAP, FORI), FORI),
        ((SCAN,), SCAN),
        ((FORI, SCAN), SCAN),
    ],
    ids=repr,
)
def test_refusals_name_the_transform_that_blocks(enclosing, blocker):
    found = blocked("a/b", enclosing)
    assert isinstance(found, Refused)
    assert found.transform == blocker


def test_the_sentence_names_transform_site_reason_way_out_and_where():
    found = blocked("a/b", (VMAP, WHILE, JIT))
    assert found.sentence == (
        "bridge cannot see through jax.lax.while_loop around site 'a/b': "
        f"{UNBOUNDED_LOOP} (it runs inside jax.vmap inside jax.lax.while_loop "
        "inside a jax.jit inside the model). Select other sites with `at=` "
        "(`at=None` leaves it out), or write the loop as a jax.lax.scan of "
        "fixed length."
    )
    alone = blocked("a", (FORI, VMAP)).sentence
    assert LOOP_AMONG in alone and "jax.lax.fori_loop around site 'a'" in alone
    assert "(it runs inside" not in blocked("a", (WHILE,)).sentence
    # The same refusal of the call named otherwise (a second call, `a#1`).
    assert found.at("a/b#1").startswith(
        "bridge cannot see through jax.lax.while_loop around site 'a/b#1': "
    )


# -- the router in the adapters: a layer inside two of JAX's transforms ----------

NESTABLE = ("vmap", "scan", "checkpoint", "cond", "fori_loop", "jit", "while_loop")
#: How the router names each in a refusal.
SHOWN = {
    "vmap": "jax.vmap",
    "scan": "jax.lax.scan",
    "checkpoint": "jax.checkpoint",
    "cond": "jax.lax.cond",
    "fori_loop": "jax.lax.fori_loop",
    "jit": "a jax.jit inside the model",
    "while_loop": "jax.lax.while_loop",
}


def _wrapped(kind, f):
    if kind == "vmap":
        return lambda h: jax.vmap(f)(h[None])[0]
    if kind == "scan":  # closing over the layer
        return lambda h: jax.lax.scan(lambda c, _: (f(c), None), h, None, length=2)[0]
    if kind == "checkpoint":
        return jax.checkpoint(f)
    if kind == "cond":
        return lambda h: jax.lax.cond(jnp.sum(h) > -100.0, f, lambda h: h, h)
    if kind == "fori_loop":
        return lambda h: jax.lax.fori_loop(0, 2, lambda i, c: f(c), h)
    if kind == "jit":
        return jax.jit(f)
    return lambda h: jax.lax.while_loop(
        lambda c: c[0] < 2, lambda c: (c[0] + 1, f(c[1])), (0, h)
    )[1]


def _nested_model(library, inner, outer):
    def forward(dense, head, h):
        f = lambda h: jnp.tanh(dense(h))  # noqa: E731
        return head(_wrapped(outer, _wrapped(inner, f))(h))

    if library == "equinox":
        eqx = pytest.importorskip("equinox")

        class Nested(eqx.Module):
            dense: eqx.nn.Linear
            head: eqx.nn.Linear

            def __call__(self, x):
                return forward(self.dense, self.head, x)

        keys = jax.random.split(jax.random.key(0))
        return Nested(
            eqx.nn.Linear(3, 3, key=keys[0]), eqx.nn.Linear(3, 2, key=keys[1])
        )
    nnx = pytest.importorskip("flax.nnx")

    class Nested(nnx.Module):
        def __init__(self):
            self.dense = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
            self.head = nnx.Linear(3, 2, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return forward(self.dense, self.head, x)

    return Nested()


@pytest.mark.parametrize("library", ["equinox", "nnx"])
@pytest.mark.parametrize("outer", NESTABLE)
@pytest.mark.parametrize("inner", NESTABLE)
def test_a_layer_in_two_transforms_is_probed_or_refused_naming_one(
    library, inner, outer
):
    """Every pair of JAX's transforms around a layer: the site is listed,
    and selecting it either probes it or raises the router's sentence,
    naming the site and one of the two transforms (never another error)."""
    if library == "nnx" and not nnx_supported():
        pytest.skip("this flax has no NNX bridge probes")
    probe = bridge.probe(_nested_model(library, inner, outer), vmap=True)
    x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", bridge.BridgeWarning)
        assert "dense" in probe.sites(x)
    try:
        res = probe.value_and_grad(lambda y: jnp.sum(y**2), x, at=["dense"])
    except bridge.BridgeError as error:
        message = str(error)
        assert "site 'dense'" in message
        # (The core's while_loop sentence names a fori_loop of traced bounds
        # beside it: "jax.lax.while_loop or a ... around".)
        assert any(f"through {SHOWN[k]}" in message for k in (inner, outer))
        assert " around site 'dense'" in message
    else:
        assert res.activations["dense"].shape == res.activation_grads["dense"].shape


# -- JAX's own transform inside a library's scanned stack ---------------------

INSIDE_A_STACK = (
    "cond",
    "fori_loop",
    "while_loop",
    "checkpoint",
    "vmap",
    "scan",
    "jit",
)


def _stacked_model(library, kind):
    """A stack of two blocks in the library's own scan whose body calls a
    layer inside JAX's `kind` (and once before, so Linen and Haiku create
    its parameters outside it); the probe and that call's site."""
    x = jnp.ones((2, 3))
    if library == "nnx":
        nnx = pytest.importorskip("flax.nnx")

        class Block(nnx.Module):
            def __init__(self, rngs):
                self.lin = nnx.Linear(3, 3, rngs=rngs)

            def __call__(self, h):
                return _wrapped(kind, lambda h: jnp.tanh(self.lin(h)))(h)

        class Stack(nnx.Module):
            def __init__(self):
                @nnx.split_rngs(splits=2)
                @nnx.vmap(in_axes=(0,), out_axes=0)
                def make(rngs):
                    return Block(rngs)

                self.blocks = make(nnx.Rngs(0))

            def __call__(self, x):
                @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
                def step(h, block):
                    return block(h)

                return step(x, self.blocks)

        return bridge.probe(Stack()), "blocks/lin"
    if library == "haiku":
        hk = pytest.importorskip("haiku")

        def forward(x):
            def block(h):
                lin = hk.Linear(3, name="lin")
                lin(h)
                return _wrapped(kind, lambda h: jnp.tanh(lin(h)))(h)

            return hk.experimental.layer_stack(2)(block)(x)

        f = hk.transform(forward)
        site = "__layer_stack_no_per_layer/lin#1"
        return bridge.probe(f, f.init(jax.random.key(0), x)), site
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            lin = nn.Dense(3, name="lin")
            lin(h)
            return _wrapped(kind, lambda h: jnp.tanh(lin(h)))(h), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(
                Block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=2,
            )
            return scan(name="blocks")(x, None)[0]

    model = Stack()
    return bridge.probe(model, model.init(jax.random.key(0), x)), "blocks/lin#1"


#: What bridge probes inside a library's stack: a `jax.jit` is traced
#: through, and a branch or a loop of known bounds inside it is one inside
#: loops of known bounds.
#: Every adapter reports every call plainly: the computation reads the
#: model's own transform in the stack's body, whichever library's stack.
PROBED_IN_A_STACK = {"jit", "cond", "fori_loop", "scan", "checkpoint", "vmap"}


@pytest.mark.parametrize("library", ["linen", "nnx", "haiku"])
@pytest.mark.parametrize("kind", INSIDE_A_STACK)
def test_jax_transform_inside_a_librarys_stack_is_weighed_by_the_router(library, kind):
    """The layer's site is listed; selecting it probes it
    (`PROBED_IN_A_STACK`) or raises the router's sentence naming JAX's
    transform inside the stack's body. The library's carrier alone would
    have carried it, and Flax or Haiku failed with their own tracer errors;
    a `lax.scan` of
    the model's own is told from the library's by the trace the layer's
    parameters belong to."""
    if library == "nnx" and not nnx_supported():
        pytest.skip("this flax has no NNX bridge probes")
    probe, site = _stacked_model(library, kind)
    x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", bridge.BridgeWarning)
        listed = probe.sites(x)[site]
    if kind in PROBED_IN_A_STACK:
        res = probe.value_and_grad(lambda y: jnp.sum(y**2), x, at=[site])
        # Every layer's calls, the stack's layers first: (2, [2,] 2, 3).
        assert res.activations[site].shape == listed.shape
        assert res.activations[site].shape[0] == 2
        assert res.activation_grads[site].shape == listed.shape
        if kind == "checkpoint":
            # Read from the computation (the body checkpointed again): each
            # layer's value is the same layer's first call's, on the same
            # input, which the library's own route records.
            first = site.removesuffix("#1")
            both = probe.value_and_grad(lambda y: jnp.sum(y**2), x, at=[first, site])
            np.testing.assert_allclose(
                both.activations[site], both.activations[first], rtol=1e-6
            )
        return
    with pytest.raises(
        bridge.BridgeValueError, match=rf"around site '{re.escape(site)}'"
    ):
        probe.value_and_grad(lambda y: jnp.sum(y**2), x, at=[site])
