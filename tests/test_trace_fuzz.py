"""A trace-pattern fuzzer: layers inside `jax.jit` (a cached trace),
`jax.checkpoint`, a `lax.scan` traced twice, `lax.cond`, `lax.switch`,
`lax.fori_loop` and `jax.vmap` (or the library's own), in all four libraries,
and Equinox's checkpointed while loop (`equinox.internal.while_loop`).

Hypothesis draws a stack of one to three layers (`fuzz_models.Layer`): a
module call, a `bridge.tap`, or both, each layer optionally inside one
transform of the model's own code, and which site to select (`at=None` or
one) and to patch (none, or one by a value or a function). Every site passes
through a hook the test owns (`fuzz_models.hook`), which shifts or replaces its
value; references come from it with plain JAX, never from bridge:

- `probe.sites` lists exactly the sites that run, in call order, with the
  shapes the hooks saw: no phantom `#1` for a body JAX traced twice, none
  missing for a trace JAX had cached;
- each site's activation is the value the hook saw, its activation gradient
  is `jax.grad` with respect to the hook's offset, and `vdot(gradient, delta)`
  is `jax.jvp` of the loss along an offset `delta` at that site alone (in a
  `fori_loop` or a while loop, per iteration: the hook's offset has a row
  per iteration);
- `res.ran` has an entry for each probed site inside a `cond`, a `switch` or
  a checkpointed while loop, and no other, equal to the hooks' record of
  whether its branch ran (in a while loop, per step and example: the
  reference is the loop unrolled to `max_steps`, `fuzz_models.unrolled_while`);
  where it did not, the site's value and gradient are the hook's zeros;
- parameter gradients and the loss are those of the unprobed model under
  `jax.grad` (with a patch, of the model whose hook replaced the value);
- a site bridge cannot express is still listed, and refused only when
  selected or patched, with a `BridgeError` naming the site and the transform
  that holds it (`REFUSABLE`: never a jit, never JAX's own vmap); with
  `at=None` it is left out and every other site is probed;
- no tracer escapes into the result.

A silent zero, a missing activation or a phantom site fails. Each jit layer's
function is traced once, before the probe (`Built.warm`): the probe meets a
cached trace, as a model's `init` or an earlier step leaves it.

`test_control_flow_patterns` draws only layers inside control flow, so that
CI's few examples always meet them, and `test_pinned` holds fixed models
(Equinox's checkpointed while loop) that CI meets on every run whatever the
draws. `test_reproduction` holds the smallest
models found to fail, one per kind of failure; one still open is a strict
xfail naming its reproducer, and the draws avoid it (`known_bug`).
`BRIDGE_FUZZ_EXAMPLES=200 pytest tests/test_trace_fuzz.py` runs more
examples; `BRIDGE_FUZZ_SHRINK=1` shrinks a failure (minutes).
"""

from __future__ import annotations

import os
import re
import warnings

import fuzz_models
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fuzz_models import (
    CONTROL_FLOW,
    WRAPS,
    Layer,
    Spec,
    build,
    layer_of,
    patch_function,
    patch_function_key,
    patch_key,
    ran_key,
    site_names,
    uses_jax,
    wraps_of,
)
from helpers import assert_tree_allclose, tree_vdot
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from reliability import ACTIVATIONS, LIBRARIES, loss_fn, random_values

import bridge

for _library in ("flax.linen", "flax.nnx", "equinox", "haiku"):
    # Imported now, not inside an example (see test_properties.py).
    pytest.importorskip(_library)

EXAMPLES = int(os.environ.get("BRIDGE_FUZZ_EXAMPLES", "2"))
#: Shrinking a failure costs minutes; `BRIDGE_FUZZ_SHRINK=1` asks for it.
SHRINK = os.environ.get("BRIDGE_FUZZ_SHRINK") == "1"

# A failing Hypothesis test makes its pytest plugin touch a deprecated name
# while it reports; the suite's `error` filter would turn that into an
# INTERNALERROR that hides the failure.
pytestmark = pytest.mark.filterwarnings(
    "ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning"
)

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate] + ([Phase.shrink] if SHRINK else []),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def layers_in(wraps):
    """Layers, each inside one of `wraps`."""
    return st.builds(
        Layer,
        module=st.booleans(),
        tap=st.booleans(),
        width=st.integers(1, 4),
        act=st.sampled_from(sorted(ACTIVATIONS)),
        wrap=st.sampled_from(wraps),
        native=st.booleans(),
        iterations=st.integers(1, 2),
        retrace=st.booleans(),
    ).filter(lambda layer: layer.module or layer.tap)


def specs_of(layers, max_layers):
    return st.builds(
        Spec,
        layers=st.lists(layers, min_size=1, max_size=max_layers).map(tuple),
        in_dim=st.integers(1, 4),
        batch=st.integers(1, 3),
        out=st.integers(1, 3),
    )


def specs(library):
    """Models of one to three layers, each in any wrap `library` has."""
    return specs_of(layers_in(wraps_of(library, WRAPS)), 3)


def control_flow_specs(library):
    """Every layer inside a `cond`, a `switch`, a `fori_loop` (or Equinox's
    checkpointed while loop)."""
    return specs_of(layers_in(wraps_of(library, CONTROL_FLOW)), 2)


#: `at=`: `None` (every site), or the index of one site (modulo their number).
selections = st.one_of(st.none(), st.integers(0, 8))
#: `patch=`: none, or `(index of a site, "value" | "function")`.
patches = st.one_of(
    st.none(), st.tuples(st.integers(0, 8), st.sampled_from(["value", "function"]))
)


# -- references, from the test's own hooks ---------------------------------------


def site_structs(built):
    """Each site's shape and dtype, as the hooks saw it."""
    recorded = jax.eval_shape(
        lambda p, x: built.forward(p, x, {})[1], built.params, built.x
    )
    return {name: recorded[name] for name in built.names if name in recorded}


def reference(built, patch_values, deltas):
    """Loss, parameter gradients, the hooks' values (and, under `ran_key`,
    whether a branch's sites ran), the gradient with respect to a zero offset
    at every site, and `jax.jvp` of the loss along each `deltas[name]` alone
    (one tangent per site, `jax.jacfwd`)."""
    structs = site_structs(built)
    order = sorted(deltas)

    @jax.jit
    def run(params, x, patch_values, deltas):
        def loss_of(params, offsets):
            outputs, recorded = built.forward(params, x, {**patch_values, **offsets})
            return loss_fn(outputs), recorded

        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), structs)
        (loss, recorded), (grads, offset_grads) = jax.value_and_grad(
            loss_of, argnums=(0, 1), has_aux=True
        )(params, zeros)

        def along(t):
            offsets = {name: t[k] * deltas[name] for k, name in enumerate(order)}
            return loss_of(params, offsets)[0]

        directional = jax.jacfwd(along)(jnp.zeros(len(order), jnp.float32))
        return {
            "loss": loss,
            "grads": grads,
            "activations": recorded,
            "activation_grads": offset_grads,
            "directional": dict(zip(order, directional, strict=True)),
        }

    return run(built.params, built.x, patch_values, deltas)


# -- what bridge may refuse ---------------------------------------------------------


#: The transforms inside which bridge may refuse a site, with a `BridgeError`
#: that names the site and the transform (one of these words): a library's
#: own scan (where the site's epsilon has no route: a tap, parameters every
#: step shares), a checkpoint, and a library's own vmap that broadcasts the
#: parameters (`nn.vmap`, `nnx.vmap`, `hk.vmap`). Never a `jax.jit` (the
#: contract: traced through), never a `jax.vmap` (the contract: the site
#: holds the mapped value), never a `cond`, a `switch`, a `fori_loop` of
#: static bounds or the model's own `lax.scan` (the contract: every branch's
#: sites are sites, a loop's hold every iteration; the model's scan counts
#: its iterations while a probe runs), never a site outside any transform.
REFUSABLE = {
    "scan": ("scan",),
    "checkpoint": ("checkpoint", "remat"),
    "vmap": ("vmap",),
}


def may_refuse(library, layer):
    if layer is None or layer.wrap not in REFUSABLE:
        return False
    if layer.wrap == "scan" and uses_jax(library, layer):
        return False
    return layer.wrap != "vmap" or (layer.native and library != "equinox")


def assert_refusal(error, library, spec, site):
    """`error` is bridge refusing `site` as the contract allows: a
    `BridgeError` naming the site and the transform that holds it."""
    message = str(error)
    layer = layer_of(spec, library, site)
    where = "no transform" if layer is None or layer.wrap is None else layer.wrap
    if layer is not None and layer.native:
        where = f"the library's own {where}"
    assert isinstance(error, bridge.BridgeError), repr(error)
    assert may_refuse(library, layer), (
        f"site {site!r} (inside {where}) was refused, but bridge must probe it: "
        f"{message}"
    )
    assert site in message, f"the refusal does not name site {site!r}: {message}"
    words = REFUSABLE[layer.wrap]
    assert any(re.search(rf"\b{word}\b", message) for word in words), (
        f"the refusal of {site!r} does not name the {layer.wrap} around it: {message}"
    )


def refused_alone(built, site):
    """Whether selecting `site` alone is refused (asserting the refusal is one
    the contract allows); raised before any work, so run eagerly."""
    try:
        built.probe.value_and_grad(loss_fn, built.x, at=site)
    except bridge.BridgeError as error:
        assert_refusal(error, built.library, built.spec, site)
        return True
    return False


def value_and_grad(built, mode, at, patch):
    def run(probe):
        return probe.value_and_grad(loss_fn, built.x, at=at, patch=patch)

    return (jax.jit(run) if mode == "jit" else run)(built.probe)


# -- the check ----------------------------------------------------------------------


def check(library, spec, mode, at=None, patch=None):
    """Probe a model of `spec` in `library` and check it against the hooks.

    `at`: `None`, or a site (a name, or an index into the sites). `patch`:
    `None`, or `(site, "value" | "function")`.
    """
    built = build(library, spec)
    names = built.names
    structs = site_structs(built)
    assert sorted(structs) == sorted(names)  # the test's own model

    # Listed: every site that runs, in call order, with its true shape.
    listed = built.probe.sites(built.x)
    assert list(listed) == names, f"sites listed {list(listed)}, ran {names}"
    for name in names:
        assert (listed[name].shape, listed[name].dtype) == (
            structs[name].shape,
            structs[name].dtype,
        ), f"site {name!r} listed as {listed[name]}, its value is {structs[name]}"

    if isinstance(at, int):
        at = names[at % len(names)]
    patched = None
    if patch is not None:
        patched, kind = patch
        patched = names[patched % len(names)] if isinstance(patched, int) else patched
    selected = names if at is None else [at]

    patch_arg, patch_values = None, {}
    if patched is not None and kind == "value":
        value = random_values(structs[patched], 7)
        patch_arg, patch_values = {patched: value}, {patch_key(patched): value}
    elif patched is not None:
        patch_arg = {patched: patch_function}
        # A marker the hook's transforms slice and map like the value.
        marker = jnp.zeros(structs[patched].shape, structs[patched].dtype)
        patch_values = {patch_function_key(patched): marker}

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", bridge.BridgeWarning)
            res = value_and_grad(built, mode, at, patch_arg)
    except bridge.BridgeError as error:
        if at is None and "leaves nothing to probe" in str(error):
            # Every site is one bridge cannot express: each is refused alone.
            assert all(refused_alone(built, name) for name in names), str(error)
            return "refused"
        # Only a site selected by name or patched may be refused here: one
        # that `at=None` selects is left out instead.
        culprits = [s for s in {at, patched} if s is not None and s in str(error)]
        assert culprits, f"refused, naming no selected or patched site: {error}"
        for site in culprits:
            assert_refusal(error, library, spec, site)
        return "refused"
    said = [str(w.message) for w in caught if w.category is bridge.BridgeWarning]

    leaked = [
        path
        for path, leaf in jax.tree_util.tree_leaves_with_path(res)
        if isinstance(leaf, jax.core.Tracer)
    ]
    assert not leaked, f"the result holds tracers that escaped their trace: {leaked}"
    got = set(res.activations)
    assert set(res.activation_grads) == got
    assert got <= set(selected), f"sites not selected: {sorted(got - set(selected))}"
    for name in selected:
        if name not in got:
            # At=None leaves out what bridge cannot express: it must say so
            # when the site is asked for alone.
            assert at is None and refused_alone(built, name), (
                f"selected site {name!r} is missing from the result"
            )
    # ... and says so when it leaves them out, never in silence.
    left_out = len(set(selected) - got)
    if left_out:
        assert any(f"leaves out {left_out} site(s)" in m for m in said), said
    else:
        assert not said, said

    deltas = {
        name: random_values(structs[name], i) for i, name in enumerate(sorted(got))
    }
    expected = reference(built, patch_values, deltas)

    recorded = expected["activations"]
    branched = {name for name in got if ran_key(name) in recorded}
    assert set(res.ran) == branched, (
        f"res.ran has {sorted(res.ran)}, the sites in a branch are {sorted(branched)}"
    )
    for name in sorted(branched):
        np.testing.assert_array_equal(
            res.ran[name], recorded[ran_key(name)], err_msg=f"ran of {name}"
        )

    np.testing.assert_allclose(res.loss, expected["loss"], rtol=1e-5, atol=1e-6)
    assert_tree_allclose(res.grads, expected["grads"], rtol=1e-4, atol=1e-6)
    for name in sorted(got):
        np.testing.assert_allclose(
            res.activations[name],
            expected["activations"][name],
            rtol=1e-5,
            atol=1e-6,
            err_msg=f"activation of {name}",
        )
        grad, want = res.activation_grads[name], expected["activation_grads"][name]
        assert not (np.all(np.asarray(grad) == 0) and np.any(np.asarray(want) != 0)), (
            f"silent zero: the gradient at {name} is zero, the reference's is not"
        )
        np.testing.assert_allclose(
            grad, want, rtol=1e-4, atol=1e-6, err_msg=f"activation gradient of {name}"
        )
        np.testing.assert_allclose(
            tree_vdot(grad, deltas[name]),
            expected["directional"][name],
            rtol=2e-4,
            atol=1e-6,
            err_msg=f"d loss/d {name} . delta against jax.jvp",
        )
    return "probed"


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("library", LIBRARIES)
@FUZZ
@given(data=st.data())
def test_trace_patterns(library, mode, data):
    fuzz(library, mode, data, specs(library))


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("library", LIBRARIES)
@FUZZ
@given(data=st.data())
def test_control_flow_patterns(library, mode, data):
    """As `test_trace_patterns`, every layer inside control flow: the few
    examples CI draws there meet each of them, whatever the draws of the
    other (a `switch` taking its layer's branch or another, a `fori_loop`
    with a row per iteration, the library's own or JAX's, Equinox's
    checkpointed while loop stopping at a different step per example)."""
    fuzz(library, mode, data, control_flow_specs(library))


def fuzz(library, mode, data, specs):
    """Draw a model of `specs` that runs into no open bug, a selection and a
    patch, and check them."""
    spec = data.draw(
        specs.filter(lambda spec: known_bug(library, spec) is None), label="spec"
    )
    at = data.draw(selections, label="at")
    patch = data.draw(
        patches.filter(lambda patch: known_bug(library, spec, patch) is None),
        label="patch",
    )
    check(library, spec, mode, at, patch)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("library", LIBRARIES)
def test_the_jitted_functions_inside_the_models_are_warm(library, native):
    """The fuzzer's `jit` layers test what they claim: after `Built.warm`,
    running the model at the same shapes traces none of them again."""
    layers = (Layer(module=True, tap=True, wrap="jit", native=native),) * 2
    built = build(library, Spec(layers=layers))
    before = len(fuzz_models.JIT_TRACES)
    assert before > 0
    built.warm()
    jax.eval_shape(built.plain, built.params, built.x)
    assert len(fuzz_models.JIT_TRACES) == before


# -- open bridge bugs ------------------------------------------------------------------

#: Bridge bugs the fuzzer found and that are still open, each with a
#: standalone reproducer. The fuzzer draws no model that runs into one
#: (`known_bug`); `test_reproduction` holds each as a strict xfail
#: (`_open_bug`): when it passes, drop it from here. None is open now.

#: Models the fuzzer must not draw: refused by design, not bugs. Under
#: `vmap=True` a patch function sees the whole batch (gathered over the
#: probe's vmap axis), and the checkpointed while loop's backward pass
#: (`_checkpointed_while_loop_bwd`) traces its body again where that axis is
#: unbound (JAX's `NameError`): bridge refuses it before any work.
PATCH_FUNCTION_IN_CHECKPOINTED_WHILE = (
    "a patch by a function of a site inside Equinox's checkpointed while loop "
    "under vmap=True: the loop's backward pass traces its body where the "
    "probe's vmap axis is unbound (JAX's NameError), so bridge refuses it "
    "before any work (tests/test_checkpointed_loops.py)"
)


def known_bug(library, spec, patch=None):
    """The open bridge bug (or refusal by design) a model of `spec` (with
    `patch`: `None`, or `(site, "value" | "function")`, the site a name or an
    index into the sites) runs into, or `None`."""
    if library == "equinox" and patch is not None and patch[1] == "function":
        site = patch[0]
        if isinstance(site, int):
            names = site_names(spec, library)
            site = names[site % len(names)]
        layer = layer_of(spec, library, site)
        if layer is not None and layer.wrap == "while_loop":
            return PATCH_FUNCTION_IN_CHECKPOINTED_WHILE
    return None


# -- minimal reproductions of what the fuzzer found ----------------------------------


def _one(**layer):
    return Spec(layers=(Layer(**layer),))


def _two(first, second):
    return Spec(layers=(Layer(**first), Layer(**second)))


TAP = {"module": False, "tap": True}
MODULE = {"module": True, "tap": False}


def _case(library, spec, id, mode="jit", at=None, patch=None, marks=()):
    return pytest.param(library, spec, mode, at, patch, id=id, marks=marks)


def _open_bug(library, spec, id, raises, **kwargs):
    """A reproduction of a bug still open (`known_bug`), a strict xfail."""
    reason = known_bug(library, spec, kwargs.get("patch"))
    assert reason is not None, id
    marks = pytest.mark.xfail(strict=True, raises=raises, reason=reason)
    return _case(library, spec, id, marks=marks, **kwargs)


NATIVE_VMAP = {**MODULE, "wrap": "vmap", "native": True}

#: The smallest models found to fail, one per kind of failure and library,
#: as `(library, spec, mode, at, patch)`.
REPRODUCTIONS = [
    # A tap inside a jitted function whose trace is cached is not listed.
    *(
        _case(lib, _one(**TAP, wrap="jit"), f"{lib}-tap-in-cached-jax.jit")
        for lib in ("linen", "nnx", "haiku")
    ),
    _case("nnx", _one(**TAP, wrap="jit", native=True), "nnx-tap-in-cached-nnx.jit"),
    # A tap inside a transform makes Equinox's `probe.sites` raise, which
    # blocks every other site.
    *(
        _case("equinox", _one(**TAP, wrap=wrap), f"equinox-tap-in-{name}-blocks-all")
        for wrap, name in (("jit", "jax.jit"), ("checkpoint", "jax.checkpoint"))
    ),
    # A module called inside a jitted function whose trace is cached is
    # refused, naming the jit (NNX's `jax.jit`: naming "an NNX transform with
    # graph=False").
    _case("equinox", _one(**MODULE, wrap="jit"), "equinox-module-in-cached-jax.jit"),
    _case("nnx", _one(**MODULE, wrap="jit"), "nnx-module-in-cached-jax.jit"),
    _case(
        "nnx", _one(**MODULE, wrap="jit", native=True), "nnx-module-in-cached-nnx.jit"
    ),
    # An NNX module handed to `jax.checkpoint` as an argument is refused,
    # naming "an NNX transform with graph=False", not the checkpoint.
    _case(
        "nnx",
        _one(**MODULE, wrap="checkpoint"),
        "nnx-module-argument-of-jax.checkpoint",
    ),
    # A scan body traced twice (its carry starts as a Python 0) lists each of
    # its sites twice, the second a phantom `#1` (Linen's `nn.scan`: `#2` too).
    *(
        _case(lib, _one(**MODULE, wrap="scan"), f"{lib}-module-in-retraced-scan")
        for lib in ("linen", "nnx", "equinox", "haiku")
    ),
    *(
        _case(lib, _one(**TAP, wrap="scan"), f"{lib}-tap-in-retraced-scan")
        for lib in ("haiku", "equinox")
    ),
    # A tap inside `nnx.fori_loop`, which traces its body once in a
    # `jax.eval_shape` before the loop: listed once, not a phantom `#1`.
    _case(
        "nnx",
        _one(**TAP, wrap="fori_loop", native=True),
        "nnx-tap-in-nnx.fori_loop",
    ),
    # A site inside a `lax.scan` (traced once) is listed with the shape of one
    # step, not with the steps stacked first (a module whose parameters every
    # step shares may be refused, but is listed with its true shape).
    _case(
        "linen",
        _one(**TAP, wrap="scan", retrace=False, iterations=4),
        "linen-tap-in-lax.scan-shape",
    ),
    _case(
        "nnx",
        _one(**MODULE, wrap="scan", retrace=False, iterations=4),
        "nnx-module-in-lax.scan-shape",
    ),
    _case(
        "haiku",
        _one(**TAP, wrap="scan", retrace=False, iterations=4),
        "haiku-tap-in-lax.scan-shape",
    ),
    # Equinox: a value patched downstream of a site inside `jax.checkpoint`
    # or a scan over stacked layers makes its activation all zeros (the
    # gradients, zero there, are right).
    _case(
        "equinox",
        _one(**MODULE, wrap="checkpoint"),
        "equinox-module-in-jax.checkpoint-zero-activation-when-patched-after",
        patch=("head", "value"),
    ),
    _case(
        "equinox",
        _one(**MODULE, wrap="scan", retrace=False),
        "equinox-module-in-lax.scan-zero-activation-when-patched-after",
        patch=("head", "value"),
    ),
    # NNX's `nnx.scan` over a stack of modules, its body traced twice:
    # `probe.sites` raises ("its values did not come out with the module's
    # parameters"), which blocks every site.
    _case(
        "nnx",
        _one(**MODULE, wrap="scan", native=True),
        "nnx-module-in-retraced-nnx.scan-blocks-all",
    ),
    # A tap inside `jax.checkpoint` or `lax.cond`, and an NNX module inside
    # `lax.cond`: the value escapes its trace (an UnexpectedTracerError under
    # `jax.jit`; eagerly, a DynamicJaxprTracer returned as the activation).
    *(
        _case(lib, _one(**TAP, wrap="checkpoint"), f"{lib}-tap-in-jax.checkpoint-leaks")
        for lib in ("linen", "nnx", "haiku")
    ),
    _case(
        "linen",
        _one(**TAP, wrap="checkpoint"),
        "linen-tap-in-jax.checkpoint-leaks-eagerly",
        mode="eager",
    ),
    _case("linen", _one(**TAP, wrap="cond"), "linen-tap-in-lax.cond-leaks"),
    _case(
        "nnx", _one(**MODULE, wrap="cond"), "nnx-module-in-lax.cond-leaks", mode="eager"
    ),
    # A site inside the model's own `jax.vmap` is listed with the shape of one
    # mapped example, not of the mapped value (the mapped axis first).
    *(
        _case(lib, _one(**MODULE, wrap="vmap"), f"{lib}-module-in-jax.vmap-shape")
        for lib in ("linen", "nnx", "haiku")
    ),
    # Linen: with an `nn.vmap` in the model, the sites inside other lifted
    # transforms are refused naming that vmap (an `nn.remat` before it, an
    # `nn.jit` after it), or left out of the listing (an `nn.jit` before it;
    # an `nn.scan` after an `nn.jit` does the same).
    _case(
        "linen",
        _two({**MODULE, "wrap": "checkpoint", "native": True}, NATIVE_VMAP),
        "linen-nn.remat-site-refused-naming-a-later-nn.vmap",
        at="layer0",
    ),
    _case(
        "linen",
        _two(NATIVE_VMAP, {**MODULE, "wrap": "jit", "native": True}),
        "linen-nn.jit-site-refused-naming-an-earlier-nn.vmap",
        at="layer1",
    ),
    _case(
        "linen",
        _two({**MODULE, "wrap": "jit", "native": True}, NATIVE_VMAP),
        "linen-nn.jit-site-lost-before-an-nn.vmap",
        mode="eager",
    ),
    # A Linen module called in one branch of `nn.cond` or `nn.switch` (the
    # others hold no site), and a tap in one, ran Linen's lifted route in a
    # run: its recordings left in one branch only, the tap's epsilon was
    # looked for in bridge's collection. Both take the session's
    # control-flow route, as in discovery.
    *(
        _case(
            "linen",
            _one(**layer, wrap=branch, native=True),
            f"linen-{what}-in-one-branch-of-nn.{branch}",
        )
        for layer, what in ((MODULE, "module"), (TAP, "tap"))
        for branch in ("cond", "switch")
    ),
    # A relu (a custom_jvp) in a `fori_loop` meeting the zeros of its previous
    # iteration: its rule, not `maximum`'s derivative, where the loop's values
    # leave through a backward pass that is differentiated again.
    *(
        _case(
            lib,
            _one(**TAP, act="relu", wrap="fori_loop", iterations=2),
            f"{lib}-relu-custom_jvp-in-lax.fori_loop",
        )
        for lib in ("linen", "equinox")
    ),
]


@pytest.mark.parametrize("library, spec, mode, at, patch", REPRODUCTIONS)
def test_reproduction(library, spec, mode, at, patch):
    check(library, spec, mode, at, patch)


WHILE = {"wrap": "while_loop", "iterations": 2}

#: Fixed models CI meets on every run, whatever the draws: a module and a tap
#: in Equinox's checkpointed while loop (three steps, the examples stopping
#: after zero to three, or by its bound), after a first loop of a tap alone,
#: the module's site patched by a value.
PINNED = [
    _case(
        "equinox",
        Spec(
            layers=(
                Layer(**TAP, **WHILE, act="sin"),
                Layer(module=True, tap=True, **WHILE),
            ),
            in_dim=4,
            batch=3,
        ),
        "equinox-module-and-tap-in-checkpointed-while_loop",
        patch=("layers/1", "value"),
    ),
]


@pytest.mark.parametrize("library, spec, mode, at, patch", PINNED)
def test_pinned(library, spec, mode, at, patch):
    check(library, spec, mode, at, patch)
