"""Discovery is reused across calls of the same structure, never across
structures, and reuse changes no number.

A discovery (`ProbeBase._discover_afresh`: one abstract trace of the
instrumented model) is counted by a spy. Calls of the same structure — a
second `jax.jit` compilation, `sites()` after `value_and_grad`, `apply` after
`sites()`, new parameter values of the same shapes — discover nothing more;
a new input shape, a changed static attribute or keyword discovers again.
Results are compared with the same call with reuse turned off
(`CACHE.maxsize = 0`), exactly, and with plain JAX references.
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose, assert_tree_equal, nnx_supported
from reliability import LIBRARIES, Spec, build, loss_fn, reference

import bridge
from bridge._probe.discovery_cache import (
    CACHE,
    Discovery,
    abstract_loss,
    is_plain,
    structure_key,
)
from bridge.adapter_api import ProbeBase

for _library in ("flax.linen", "flax.nnx", "equinox", "haiku"):
    pytest.importorskip(_library)

SPEC = Spec(layers=((4, "tanh"), (3, "sin")), repeats=2)


@pytest.fixture(autouse=True)
def fresh_cache():
    """Each test starts with an empty cache at its usual size."""
    size = CACHE.maxsize
    CACHE.clear()
    yield
    CACHE.maxsize = size
    CACHE.clear()


@pytest.fixture
def discoveries(monkeypatch):
    """The probe types of the discoveries made, one entry each."""
    made = []
    original = ProbeBase._discover_afresh

    def counted(self, *args, **kwargs):
        made.append(type(self).__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ProbeBase, "_discover_afresh", counted)
    return made


def step(probe, x):
    return probe.value_and_grad(loss_fn, x)


def uncached(run, *args, **kwargs):
    """`run(*args, **kwargs)` with reuse turned off (and nothing kept from it)."""
    size = CACHE.maxsize
    CACHE.maxsize = 0
    try:
        return run(*args, **kwargs)
    finally:
        CACHE.maxsize = size


def with_new_values(built):
    """The same model with other parameter values of the same shapes."""
    params = jax.tree.map(lambda p: p * 0.5 + 0.25, built.params)
    if built.library == "linen":
        probe = bridge.probe(built.model, {**built.variables[0], "params": params})
    elif built.library == "nnx":
        from flax import nnx

        graphdef, _, rest = nnx.split(built.model, nnx.Param, ...)
        probe = bridge.probe(nnx.merge(graphdef, params, rest))
    elif built.library == "equinox":
        import equinox as eqx

        static = eqx.partition(built.model, eqx.is_inexact_array)[1]
        probe = bridge.probe(eqx.combine(params, static), vmap=True)
    else:
        probe = bridge.probe(built.model, params)
    return dataclasses.replace(built, probe=probe, params=params)


def assert_matches_reference(result, built):
    expected = reference(built, {}, jit=False)
    np.testing.assert_allclose(result.loss, expected["loss"], rtol=1e-5)
    assert_tree_allclose(result.grads, expected["grads"], rtol=1e-5, atol=1e-6)
    assert sorted(result.activations) == sorted(built.names)  # jit sorts dicts
    for name in built.names:
        assert_tree_allclose(
            result.activations[name], expected["activations"][name], atol=1e-6
        )
        assert_tree_allclose(
            result.activation_grads[name],
            expected["activation_grads"][name],
            atol=1e-6,
        )


# -- reuse where the structure is the same ---------------------------------------


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_second_compilation_discovers_nothing(library, discoveries):
    built = build(library, SPEC)
    jax.jit(step).lower(built.probe, built.x).compile()
    assert len(discoveries) == 1
    # A new function object: JAX traces it again, the probe is rebuilt from
    # its leaves, and the discovery is reused.
    jax.jit(lambda p, x: step(p, x)).lower(built.probe, built.x).compile()
    assert len(discoveries) == 1
    assert CACHE.hits == 1


@pytest.mark.parametrize("library", LIBRARIES)
def test_sites_and_apply_after_value_and_grad_discover_nothing(library, discoveries):
    built = build(library, SPEC)
    result = step(built.probe, built.x)
    sites = built.probe.sites(built.x)
    forward = built.probe.apply(built.x, at="shared*")
    jax.jit(lambda p, x: p.sites(x) and x)(built.probe, built.x)  # inside jit too
    assert len(discoveries) == 1
    assert list(sites) == built.names
    assert list(forward.activations) == [n for n in built.names if "shared" in n]
    # Two requests, two compiled programs: float32 rounding apart.
    assert_tree_allclose(
        forward.outputs, built.probe.apply(built.x).outputs, rtol=1e-6, atol=1e-6
    )
    assert_tree_allclose(
        {n: result.activations[n] for n in forward.activations},
        forward.activations,
        rtol=1e-6,
        atol=1e-6,
    )


@pytest.mark.parametrize("library", LIBRARIES)
def test_new_values_of_the_same_shapes_discover_nothing(library, discoveries):
    built = build(library, SPEC)
    jitted = jax.jit(step)
    jitted(built.probe, built.x)
    other = with_new_values(built)
    again = step(other.probe, other.x)  # eager, another probe object
    jitted_again = jitted(other.probe, other.x)  # the compiled program
    assert len(discoveries) == 1
    assert_matches_reference(again, other)
    assert_matches_reference(jitted_again, other)
    assert_tree_equal(again, uncached(step, other.probe, other.x))


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("library", LIBRARIES)
def test_results_are_those_without_reuse(library, mode, discoveries):
    built = build(library, SPEC)

    def run(probe, x):
        # Under jit, a new function object each time: JAX traces it again
        # (its own cache is not hit), so the probe discovers or reuses.
        return (jax.jit(lambda p, x: step(p, x)) if mode == "jit" else step)(probe, x)

    without = uncached(run, built.probe, built.x)
    assert len(CACHE) == 0
    first = run(built.probe, built.x)  # discovers, and keeps it
    second = run(built.probe, built.x)  # reuses it
    assert len(discoveries) == 2  # the uncached call and the first
    assert_tree_equal(first, without)
    assert_tree_equal(second, without)


# -- a new discovery where the structure changes -----------------------------------


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_new_input_shape_discovers_once(library, discoveries):
    built = build(library, SPEC)
    step(built.probe, built.x)
    wider = jnp.concatenate([built.x, built.x + 1.0])  # batch 4 instead of 2
    sites = built.probe.sites(wider)
    assert len(discoveries) == 2
    assert all(s.shape[0] == 4 for s in jax.tree.leaves(sites))
    step(built.probe, wider)
    step(built.probe, built.x)
    assert len(discoveries) == 2
    # Another dtype is another structure too.
    built.probe.sites(built.x.astype(jnp.bfloat16))
    assert len(discoveries) == 3


def repeating(library, calls, seed=0):
    """A shared layer called `calls` times (a static attribute), then a head;
    `extra=` adds calls (a static keyword). Same parameters for any `calls`."""
    x = jnp.asarray(np.random.default_rng(seed).normal(size=(2, 3)), jnp.float32)
    if library == "linen":
        import flax.linen as nn

        class Repeat(nn.Module):
            calls: int

            @nn.compact
            def __call__(self, x, extra=0):
                shared = nn.Dense(3, name="shared")
                for _ in range(self.calls + extra):
                    x = jnp.tanh(shared(x))
                return nn.Dense(2, name="head")(x)

        variables = Repeat(1).init(jax.random.key(seed), x)
        return (lambda calls: bridge.probe(Repeat(calls), variables)), x
    if library == "nnx":
        from flax import nnx

        class RepeatNnx(nnx.Module):
            def __init__(self, calls, rngs):
                self.calls = calls
                self.shared = nnx.Linear(3, 3, rngs=rngs)
                self.head = nnx.Linear(3, 2, rngs=rngs)

            def __call__(self, x, extra=0):
                for _ in range(self.calls + extra):
                    x = jnp.tanh(self.shared(x))
                return self.head(x)

        return (lambda calls: bridge.probe(RepeatNnx(calls, nnx.Rngs(seed)))), x
    if library == "equinox":
        import equinox as eqx

        class RepeatEqx(eqx.Module):
            shared: eqx.nn.Linear
            head: eqx.nn.Linear
            calls: int = eqx.field(static=True)

            def __call__(self, x, extra=0):
                for _ in range(self.calls + extra):
                    x = jnp.tanh(self.shared(x))
                return self.head(x)

        keys = jax.random.split(jax.random.key(seed))
        model = RepeatEqx(
            eqx.nn.Linear(3, 3, key=keys[0]), eqx.nn.Linear(3, 2, key=keys[1]), 1
        )
        return (
            lambda calls: bridge.probe(
                dataclasses.replace(model, calls=calls), vmap=True
            )
        ), x
    import haiku as hk

    @functools.cache  # one transformed function per number of calls
    def transformed(calls):
        def forward(x, extra=0):
            shared = hk.Linear(3, name="shared")
            for _ in range(calls + extra):
                x = jnp.tanh(shared(x))
            return hk.Linear(2, name="head")(x)

        return hk.without_apply_rng(hk.transform(forward))

    params = transformed(1).init(jax.random.key(seed), x)
    return (lambda calls: bridge.probe(transformed(calls), params)), x


def names(calls):
    return ["shared", *(f"shared#{k}" for k in range(1, calls)), "head"]


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_changed_static_attribute_discovers_again(library, discoveries):
    # Linen: a module attribute; NNX: a plain attribute (in the graph
    # definition); Equinox: a static field; Haiku: the transformed function.
    make, x = repeating(library, 2)
    two, three = make(2), make(3)
    jitted = jax.jit(step)
    assert sorted(jitted(two, x).activations) == sorted(names(2))  # jit sorts dicts
    result = jitted(three, x)
    assert len(discoveries) == 2
    assert sorted(result.activations) == sorted(names(3))
    assert list(make(2).sites(x)) == names(2)  # an equal model: reused
    assert len(discoveries) == 2
    assert_tree_equal(result, uncached(jax.jit(lambda p, x: step(p, x)), three, x))


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_changed_static_keyword_discovers_again(library, discoveries):
    make, x = repeating(library, 1)
    probe = make(1)
    assert list(probe.sites(x, extra=1)) == names(2)
    assert list(probe.sites(x, extra=2)) == names(3)
    assert list(probe.sites(x, extra=1)) == names(2)
    assert len(discoveries) == 2
    result = probe.value_and_grad(loss_fn, x, extra=2)
    assert len(discoveries) == 2
    assert_tree_equal(
        result, uncached(lambda: probe.value_and_grad(loss_fn, x, extra=2))
    )


@pytest.mark.skipif(not nnx_supported(), reason="this flax has no NNX probes")
def test_nnx_train_and_eval_modes_are_different_structures(discoveries):
    # A mode flag is a static attribute of the graph definition: the same
    # sites, other numbers (the batch statistics), never the other mode's
    # discovery.
    from flax import nnx

    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)), jnp.float32)
    model = nnx.Sequential(
        nnx.Linear(3, 3, rngs=nnx.Rngs(0)), nnx.BatchNorm(3, rngs=nnx.Rngs(0))
    )
    train = bridge.probe(model)
    model.eval()
    evaluate = bridge.probe(model)
    for probe in (train, evaluate, train):
        result = jax.jit(lambda p, x: step(p, x))(probe, x)
        assert_tree_equal(result, uncached(jax.jit(lambda p, x: step(p, x)), probe, x))
    assert discoveries == ["NnxProbe"] * 5  # two modes, three uncached


def test_equinox_inference_mode_is_a_different_structure(discoveries):
    # `inference` is a non-array field: in the treedef, by value.
    import equinox as eqx

    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)), jnp.float32)
    mlp = eqx.nn.Sequential(
        [eqx.nn.Linear(3, 3, key=jax.random.key(0)), eqx.nn.Dropout(0.5)]
    )
    key = jax.random.key(1)
    for model in (mlp, eqx.nn.inference_mode(mlp), mlp):
        probe = bridge.probe(model, vmap=True)
        result = probe.value_and_grad(loss_fn, x, key=key)
        expected = uncached(probe.value_and_grad, loss_fn, x, key=key)
        assert_tree_equal(result, expected)
    assert discoveries == ["EquinoxProbe"] * 5  # two modes, three uncached


# -- lifted transforms: the adapters' origins are reused in later runs -------------


def scanned(library):
    """Three identical blocks under the library's own scan, and one example or
    batch of inputs: `(probe, x)`."""
    width, depth = 4, 3
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, width)), jnp.float32)
    if library == "linen":
        import flax.linen as nn

        class Block(nn.Module):
            @nn.compact
            def __call__(self, x, _):
                return x + nn.Dense(width)(jnp.tanh(nn.LayerNorm()(x))), None

        class Stack(nn.Module):
            @nn.compact
            def __call__(self, x):
                scan = nn.scan(
                    Block,
                    variable_axes={"params": 0},
                    split_rngs={"params": True},
                    length=depth,
                )
                return scan()(x, None)[0]

        module = Stack()
        return bridge.probe(module, module.init(jax.random.key(0), x)), x
    if library == "nnx":
        from flax import nnx

        class BlockNnx(nnx.Module):
            def __init__(self, rngs):
                self.linear = nnx.Linear(width, width, rngs=rngs)

            def __call__(self, x):
                return x + self.linear(jnp.tanh(x))

        class StackNnx(nnx.Module):
            def __init__(self, rngs):
                @nnx.split_rngs(splits=depth)
                @nnx.vmap(in_axes=0, out_axes=0)
                def create(rngs):
                    return BlockNnx(rngs)

                self.blocks = create(rngs)

            def __call__(self, x):
                def forward(x, block):
                    return block(x)

                forward = nnx.scan(forward, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
                return forward(x, self.blocks)

        return bridge.probe(StackNnx(nnx.Rngs(0))), x
    if library == "equinox":
        import equinox as eqx

        class BlockEqx(eqx.Module):
            linear: eqx.nn.Linear

            def __init__(self, key):
                self.linear = eqx.nn.Linear(width, width, key=key)

            def __call__(self, x):
                return x + self.linear(jnp.tanh(x))

        class StackEqx(eqx.Module):
            layers: BlockEqx

            def __call__(self, x):
                dynamic, static = eqx.partition(self.layers, eqx.is_array)

                def body(h, layer):
                    return eqx.combine(layer, static)(h), None

                return jax.lax.scan(body, x, dynamic)[0]

        layers = eqx.filter_vmap(BlockEqx)(jax.random.split(jax.random.key(0), depth))
        return bridge.probe(StackEqx(layers), vmap=True), x
    import haiku as hk

    def forward(x):
        def block(x):
            return x + hk.Linear(width)(jnp.tanh(x))

        return hk.experimental.layer_stack(depth)(block)(x)

    transformed = hk.without_apply_rng(hk.transform(forward))
    return bridge.probe(transformed, transformed.init(jax.random.key(0), x)), x


@pytest.mark.parametrize("library", LIBRARIES)
def test_sites_inside_a_scan_reuse_their_discovery(library, discoveries):
    probe, x = scanned(library)
    key = probe._discovery_key((x,), {})
    first = jax.jit(step)(probe, x)
    stacked = [
        name
        for name, struct in probe.sites(x).items()
        if jax.tree.leaves(struct)[0].shape[0] == 3
    ]
    assert stacked, "no site inside the scan"
    second = jax.jit(lambda p, x: step(p, x))(probe, x)
    eager = step(probe, x)
    assert len(discoveries) == 1
    found = CACHE.get(key)
    assert found is not None and found.reusable
    assert all(is_plain(site.origin) for site in found.sites)
    assert_tree_equal(eager, uncached(step, probe, x))
    without = uncached(jax.jit(lambda p, x: step(p, x)), probe, x)
    assert_tree_equal(first, without)
    assert_tree_equal(second, without)


def _site_names_under(mode, probe, x):
    if mode == "disable_jit":
        with jax.disable_jit():
            return sorted(step(probe, x).activations)
    return sorted(jax.jit(lambda p, x: step(p, x))(probe, x).activations)


@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize("first", ["jit", "disable_jit"])
def test_disable_jit_is_part_of_the_structure(library, first):
    # `jax.disable_jit` changes what a trace sees (a scan runs as a Python
    # loop, one call per layer), so a discovery made in one mode is not the
    # other's: each mode lists what it lists in a fresh process, whichever
    # ran first.
    probe, x = scanned(library)
    modes = [first, "jit" if first == "disable_jit" else "disable_jit"]
    fresh = {mode: uncached(_site_names_under, mode, probe, x) for mode in modes}
    for mode in modes:
        assert _site_names_under(mode, probe, x) == fresh[mode], mode


# -- bridge.compare --------------------------------------------------------------


def test_compare_discovers_each_model_once(discoveries):
    spec = Spec(layers=((4, "tanh"),))
    linen, haiku = build("linen", spec), build("haiku", spec)
    report = bridge.compare(linen.probe, haiku.probe, loss_fn, linen.x)
    assert sorted(discoveries) == ["HaikuProbe", "LinenProbe"]
    assert [row.site_a for row in report.rows] == ["layer0", "head"]


# -- checks before any work still happen -------------------------------------------


@pytest.mark.parametrize("library", LIBRARIES)
def test_the_loss_is_checked_against_a_reused_discovery(library, discoveries):
    from reliability import EXECUTIONS

    built = build(library, dataclasses.replace(SPEC, watch=True))
    built.probe.sites(built.x)
    EXECUTIONS.clear()
    with pytest.raises(ValueError, match="must return a real floating-point scalar"):
        built.probe.value_and_grad(lambda y: jnp.zeros(3), built.x)
    with pytest.raises(ValueError, match="did not return a pair"):
        built.probe.value_and_grad(loss_fn, built.x, has_aux=True)
    with pytest.raises(ValueError, match="pass has_aux=True"):
        built.probe.value_and_grad(lambda y: (loss_fn(y), 1.0), built.x)
    assert EXECUTIONS == []  # raised before any work
    assert len(discoveries) == 1
    assert CACHE.hits == 3


# -- what is not kept --------------------------------------------------------------


class Opaque:
    """Not a pytree, not hashable by value: an object a model may take or
    return."""

    __hash__ = None

    def __init__(self, value):
        self.value = value


#: An origin that is not plain data: an object the trace may have made.
NOT_PLAIN = object()


@jax.tree_util.register_pytree_node_class
class ToyProbe(ProbeBase):
    """A third-party adapter: `x @ w` as one site, with an origin of its choice."""

    def __init__(self, w, origin=("toy",), opaque_output=False):
        self.w, self.origin, self.opaque_output = w, origin, opaque_output

    def tree_flatten(self):
        return (self.w,), (self.origin, self.opaque_output)

    @classmethod
    def tree_unflatten(cls, static, children):
        return cls(children[0], *static)

    def _trainable(self):
        return self.w

    def _run(self, w, args, kwargs, session):
        (x,) = args
        call = session.enter("dense", None, None, (x,), origin=self.origin)
        y = session.exit(call, x @ w)
        return (Opaque(y) if self.opaque_output else y), None


@jax.tree_util.register_pytree_node_class
class ReusingToyProbe(ToyProbe):
    reuses_discovery = True


def toy_inputs():
    return jnp.ones((2, 3)), jnp.arange(6.0).reshape(3, 2)


def test_a_third_party_adapter_discovers_afresh_unless_it_opts_in(discoveries):
    x, w = toy_inputs()
    for _ in range(2):
        ToyProbe(w).value_and_grad(lambda y: (y**2).sum(), x)
    assert len(discoveries) == 2 and len(CACHE) == 0
    for _ in range(2):
        result = ReusingToyProbe(w).value_and_grad(lambda y: (y**2).sum(), x)
    assert len(discoveries) == 3 and len(CACHE) == 1
    np.testing.assert_allclose(result.activation_grads["dense"], 2 * (x @ w))


def test_an_origin_that_is_not_plain_data_is_not_kept(discoveries):
    x, w = toy_inputs()
    probe = ReusingToyProbe(w, origin=NOT_PLAIN)
    for _ in range(2):
        probe.sites(x)
    assert len(discoveries) == 2 and len(CACHE) == 0


def test_outputs_that_cannot_leave_the_trace_are_checked_inside_it(discoveries):
    x, w = toy_inputs()
    probe = ReusingToyProbe(w, opaque_output=True)
    result = probe.value_and_grad(lambda out: (out.value**2).sum(), x)
    np.testing.assert_allclose(result.activation_grads["dense"], 2 * (x @ w))
    with pytest.raises(ValueError, match="real floating-point scalar"):
        probe.value_and_grad(lambda out: out.value, x)
    assert len(discoveries) == 2 and len(CACHE) == 0


def test_unhashable_inputs_discover_afresh():
    x, w = toy_inputs()
    probe = ReusingToyProbe(w)
    assert structure_key(probe, (x,), {"config": Opaque(1)}) is None
    assert structure_key(probe, (x,), {"config": 1}) is not None


def test_the_key_holds_no_array_values():
    x, w = toy_inputs()
    assert structure_key(ReusingToyProbe(w), (x,), {}) == structure_key(
        ReusingToyProbe(w + 1.0), (x * 2.0,), {}
    )
    assert structure_key(ReusingToyProbe(w), (x,), {}) != structure_key(
        ReusingToyProbe(w), (x[:1],), {}
    )
    assert structure_key(ReusingToyProbe(w), (x,), {"scale": 1}) != structure_key(
        ReusingToyProbe(w), (x,), {"scale": True}
    )


def test_plain_data():
    @dataclasses.dataclass(frozen=True)
    class Record:
        path: tuple
        shape: jax.ShapeDtypeStruct | None = None

    assert is_plain(Record(("a", 1), jax.ShapeDtypeStruct((2,), jnp.float32)))
    assert is_plain({"a": (None, 1.5, "b")})
    assert not is_plain(Record((jnp.zeros(2),)))
    assert not is_plain(object())
    assert not is_plain(lambda: None)


# -- bounded, and safe in threads --------------------------------------------------


def test_the_cache_is_bounded(discoveries):
    CACHE.maxsize = 2
    x, w = toy_inputs()
    probe = ReusingToyProbe(w)
    for batch in (1, 2, 3):
        probe.sites(jnp.ones((batch, 3)))
    assert len(CACHE) == 2 and len(discoveries) == 3
    probe.sites(jnp.ones((3, 3)))  # kept
    probe.sites(jnp.ones((1, 3)))  # the least recently used: dropped
    assert len(discoveries) == 4


def test_turned_off_it_keeps_nothing(discoveries):
    CACHE.maxsize = 0
    x, w = toy_inputs()
    for _ in range(2):
        ReusingToyProbe(w).sites(x)
    assert len(discoveries) == 2 and len(CACHE) == 0


def test_threads_share_one_discovery_and_get_their_own_numbers():
    built = build("linen", SPEC)
    others = [with_new_values(built), built]
    jitted = jax.jit(step)
    alone = [uncached(step, b.probe, b.x) for b in others]
    results = [[] for _ in others]
    errors = []
    barrier = threading.Barrier(len(others))

    def work(index):
        try:
            barrier.wait()
            for run in (step, jitted, step):
                results[index].append(run(others[index].probe, others[index].x))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(others))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for expected, got in zip(alone, results, strict=True):
        for result in got:
            assert_tree_allclose(result, expected, rtol=1e-5, atol=1e-7)
    assert len(CACHE) == 1


def test_a_discovery_records_its_sites_and_outputs():
    x, w = toy_inputs()
    probe = ReusingToyProbe(w)
    probe.sites(x)
    (found,) = CACHE._entries.values()
    assert isinstance(found, Discovery)
    assert [site.name for site in found.sites] == ["dense"]
    struct = abstract_loss(found.outputs, lambda y: y.sum())
    assert struct.shape == () and struct.dtype == jnp.float32
