"""The core, independent of any library: registry, selection, errors, taps, threads.

A tiny third-party "library" (a chain of affine maps) is registered here the way
an outside adapter would be, so the core is tested without Flax, Haiku or
Equinox.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import nnx_supported

import bridge

EXECUTIONS: list[int] = []


class Affine:
    def __init__(self, name, w, b):
        self.name, self.w, self.b = name, w, b


class Chain:
    """A model of the toy library: affine layers, `tanh` between them."""

    def __init__(self, layers):
        self.layers = layers


@jax.tree_util.register_pytree_node_class
class ChainProbe(bridge.adapter_api.ProbeBase):
    """A third-party adapter: one method reporting calls to the session."""

    def __init__(self, model, params, vmap=False):
        self.model, self.params, self.vmap = model, params, vmap

    def tree_flatten(self):
        return (self.params,), (self.model, self.vmap)

    @classmethod
    def tree_unflatten(cls, static, children):
        return cls(static[0], children[0], static[1])

    def _trainable(self):
        return self.params

    def _run(self, params, args, kwargs, session):
        (x,) = args
        # Counts forward passes that really run; abstract evaluation runs none.
        jax.debug.callback(lambda: EXECUTIONS.append(1))
        for i, layer in enumerate(self.model.layers):
            call = session.enter(layer.name, None, layer, (x,))
            x = _affine(x, params[layer.name])
            x = session.exit(call, x)
            if i < len(self.model.layers) - 1:
                x = bridge.tap("hidden", jnp.tanh(x))
        return x, None


def _affine(x, params):
    bias = jnp.expand_dims(params["b"], tuple(range(x.ndim - 1)))
    return x @ params["w"] + bias


def chain_probe(model, *variables, vmap=False):
    if len(variables) != 1:
        raise TypeError("a Chain needs its params: bridge.probe(chain, params)")
    return ChainProbe(model, variables[0], vmap)


bridge.register_adapter(Chain, chain_probe, name="chain")


def make_chain(widths=(3, 4, 4, 2), batch=5):
    keys = jax.random.split(jax.random.key(0), len(widths))
    names = [f"affine_{i}" for i in range(len(widths) - 1)]
    params = {
        name: {
            "w": jax.random.normal(keys[i], (widths[i], widths[i + 1])),
            "b": jnp.full((widths[i + 1],), 0.1),
        }
        for i, name in enumerate(names)
    }
    layers = [Affine(name, None, None) for name in names]
    x = jax.random.normal(keys[-1], (batch, widths[0]))
    return bridge.probe(Chain(layers), params), params, x


def plain_chain(params, x):
    names = sorted(params)
    for i, name in enumerate(names):
        x = _affine(x, params[name])
        if i < len(names) - 1:
            x = jnp.tanh(x)
    return x


def loss(y):
    return jnp.mean(jnp.square(y - 1.0))


# -- the registry ----------------------------------------------------------------


def test_a_third_party_adapter_gets_the_whole_protocol():
    probe, params, x = make_chain()
    assert isinstance(probe, bridge.ActivationProbe)
    # The taps come after each layer's call has returned: they are at the root.
    assert list(probe.sites(x)) == [
        "affine_0",
        "hidden",
        "affine_1",
        "hidden#1",
        "affine_2",
    ]
    res = probe.value_and_grad(loss, x)
    expected_loss, expected_grads = jax.value_and_grad(
        lambda p: loss(plain_chain(p, x))
    )(params)
    np.testing.assert_allclose(res.loss, expected_loss, rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5),
        res.grads,
        expected_grads,
    )
    # The bias identity, and the chain rule through a tap: d/dh = d/dy @ W^T.
    for name in ("affine_0", "affine_1", "affine_2"):
        np.testing.assert_allclose(
            res.activation_grads[name].sum(0), res.grads[name]["b"], rtol=1e-5
        )
    np.testing.assert_allclose(
        res.activation_grads["hidden"],
        res.activation_grads["affine_1"] @ params["affine_1"]["w"].T,
        rtol=1e-5,
        atol=1e-7,
    )


def test_taps_outside_a_probe_return_the_very_object_at_no_cost():
    x = jnp.ones(3)
    assert bridge.tap("anything", x) is x
    jaxpr = jax.make_jaxpr(lambda x: bridge.tap("h", x))(x)
    assert not jaxpr.eqns


def test_later_registrations_take_precedence():
    class Special(Chain):
        pass

    made = []

    def special_probe(model, *variables, vmap=False):
        made.append(model)
        return chain_probe(model, *variables, vmap=vmap)

    bridge.register_adapter(Special, special_probe)
    _, params, _ = make_chain()
    model = Special([])
    bridge.probe(model, params)
    assert made == [model]


@pytest.mark.parametrize(
    ("matches", "factory", "message"),
    [
        (3, chain_probe, "`matches` must be a class"),
        ((Chain, 3), chain_probe, "`matches` must be a class"),
        (Chain, "no_colon", "`factory` must be a callable"),
    ],
)
def test_register_adapter_rejects_bad_arguments(matches, factory, message):
    with pytest.raises(TypeError, match=message):
        bridge.register_adapter(matches, factory)


def test_an_unsupported_model_names_the_libraries_and_how_to_pass_each():
    with pytest.raises(TypeError, match="cannot probe a model of type object") as info:
        bridge.probe(object())
    # A short first line, then one line per library, each with every fact.
    assert str(info.value).splitlines() == [
        "bridge.probe cannot probe a model of type object.",
        "Supported libraries, and how to pass a model of each:",
        "  Flax Linen: bridge.probe(module, variables) with variables = "
        "module.init(key, x)",
        "  Flax NNX: bridge.probe(module) with an nnx.Module",
        "  Equinox: bridge.probe(module), or bridge.probe(module, state) for a "
        "model with an eqx.nn.State",
        "  Haiku: bridge.probe(hk.transform(f), params), or "
        "bridge.probe(hk.transform_with_state(f), params, state)",
        "  PyTorch: bridge.probe(module) with a torch.nn.Module",
        "  Hugging Face: bridge.probe(model) with a Flax or PyTorch model object",
        "  Keras 3 (KERAS_BACKEND=jax): bridge.probe(model) with a built keras.Model",
        "A new library can be added with bridge.register_adapter.",
    ]
    # What the user probably meant comes second, on its own line.
    with pytest.raises(TypeError) as info:
        bridge.probe(Chain)
    assert str(info.value).splitlines()[:3] == [
        "bridge.probe cannot probe a model of type type.",
        "`model` is the class Chain itself: pass an instance, e.g. Chain(...).",
        "Supported libraries, and how to pass a model of each:",
    ]


def test_vmap_must_be_a_bool():
    _, params, _ = make_chain()
    with pytest.raises(TypeError, match="`vmap` must be True or False"):
        bridge.probe(Chain([]), params, vmap="yes")


def test_import_bridge_needs_no_model_library():
    script = textwrap.dedent(
        """
        import sys
        for name in ("flax", "haiku", "equinox", "torch"):
            sys.modules[name] = None  # importing it now raises ImportError
        import bridge
        assert not {"flax", "haiku", "equinox", "torch"} & {
            m for m, v in sys.modules.items() if v is not None
        }
        try:
            bridge.probe(object())
        except TypeError as error:
            assert "Supported libraries" in str(error)
        else:
            raise AssertionError("no error")
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# -- selection ---------------------------------------------------------------------


def test_selection_by_glob_class_predicate_and_union():
    probe, _, x = make_chain()
    names = lambda **kw: list(probe.value_and_grad(loss, x, **kw).activation_grads)  # noqa: E731
    assert names(at="affine_*") == ["affine_0", "affine_1", "affine_2"]
    assert names(at=Affine) == ["affine_0", "affine_1", "affine_2"]
    assert names(at=(Affine,)) == ["affine_0", "affine_1", "affine_2"]
    assert names(at=lambda path, module: path.endswith("2")) == ["affine_2"]
    assert names(at=["affine_2", "affine_0"]) == ["affine_0", "affine_2"]
    # A pattern matches with or without the `#k` suffix of a repeated call.
    assert names(at="hidden") == ["hidden", "hidden#1"]
    assert names(at="hidden#1") == ["hidden#1"]


def test_a_selection_matching_nothing_names_the_closest_paths():
    probe, _, x = make_chain()
    with pytest.raises(
        ValueError, match=r"matches no site\. Closest paths: 'affine_1'"
    ):
        probe.value_and_grad(loss, x, at="afine_1")
    with pytest.raises(ValueError, match="matches no site"):
        probe.value_and_grad(loss, x, at=lambda path, module: False)


@pytest.mark.parametrize("at", [3, [3], {"affine_0": 1}, (Affine, 3)])
def test_at_of_a_wrong_type_is_refused(at):
    probe, _, x = make_chain()
    with pytest.raises(TypeError, match="`at` must be None"):
        probe.value_and_grad(loss, x, at=at)


def test_an_empty_selection_list_is_refused():
    probe, _, x = make_chain()
    with pytest.raises(ValueError, match="got an empty list"):
        probe.value_and_grad(loss, x, at=[])


# -- the loss ----------------------------------------------------------------------


def test_loss_errors_are_raised_before_any_flop():
    probe, _, x = make_chain()
    EXECUTIONS.clear()
    with pytest.raises(ValueError, match="must return a real floating-point scalar"):
        probe.value_and_grad(lambda y: y, x)
    with pytest.raises(ValueError, match="pass has_aux=True"):
        probe.value_and_grad(lambda y: (loss(y), y), x)
    with pytest.raises(ValueError, match="has_aux=True, but `loss_fn` did not return"):
        probe.value_and_grad(loss, x, has_aux=True)
    with pytest.raises(
        ValueError,
        match="scalar of dtype int32, and gradients need a real floating-point loss",
    ):
        probe.value_and_grad(lambda y: jnp.argmax(y), x)
    with pytest.raises(TypeError, match="`loss_fn` must be a function"):
        probe.value_and_grad(x, x)
    with pytest.raises(ValueError, match="matches no site"):
        probe.value_and_grad(loss, x, at="nothing")
    with pytest.raises(ValueError, match="does not fit"):
        probe.value_and_grad(loss, x, patch={"affine_0": jnp.ones(2)})
    assert EXECUTIONS == []
    probe.value_and_grad(loss, x)
    assert EXECUTIONS, "the counter does not see a forward pass"


def test_has_aux_returns_the_aux():
    probe, _, x = make_chain()
    res = probe.value_and_grad(lambda y: (loss(y), {"mean": y.mean()}), x, has_aux=True)
    np.testing.assert_allclose(
        res.aux["mean"], probe.apply(x).outputs.mean(), rtol=1e-5
    )


# -- vmap, patches, inputs -----------------------------------------------------------


def test_vmap_true_gives_per_example_sites_batch_first():
    probe, params, x = make_chain()
    single = ChainProbe(probe.model, params, vmap=True)
    res = single.value_and_grad(loss, x)
    full = probe.value_and_grad(loss, x)
    for name in full.activation_grads:
        np.testing.assert_allclose(
            res.activation_grads[name],
            full.activation_grads[name],
            rtol=1e-5,
            atol=1e-7,
        )
    assert single.sites(x)["affine_0"].shape == (5, 4)


def test_vmap_true_refuses_inputs_whose_leading_axes_differ():
    _, params, x = make_chain()
    single = ChainProbe(make_chain()[0].model, params, vmap=True)
    with pytest.raises(ValueError, match="leading axes must agree"):
        single.value_and_grad(lambda y: y[0].sum(), (x, x[:2]))
    with pytest.raises(ValueError, match="is a scalar"):
        single.value_and_grad(loss, jnp.float32(1.0))


def test_patch_replaces_a_value_and_refuses_one_that_does_not_fit():
    probe, _, x = make_chain()
    zeros = probe.apply(x, patch={"affine_2": lambda v: jnp.zeros_like(v)})
    np.testing.assert_array_equal(zeros.outputs, 0.0)
    res = probe.value_and_grad(loss, x, patch={"affine_0": jnp.ones((5, 4))})
    np.testing.assert_array_equal(res.activations["affine_0"], 1.0)
    # Nothing upstream of a constant patch gets a gradient.
    np.testing.assert_array_equal(res.grads["affine_0"]["w"], 0.0)
    with pytest.raises(ValueError, match="patch for site 'affine_0' does not fit"):
        probe.value_and_grad(loss, x, patch={"affine_0": jnp.ones((5, 3))})
    with pytest.raises(ValueError, match="patch for site 'affine_0' does not fit"):
        probe.apply(x, patch={"affine_0": lambda v: v[:, :2]})
    with pytest.raises(ValueError, match="patch key 'nope' matches no site"):
        probe.apply(x, patch={"nope": 0.0})
    with pytest.raises(TypeError, match="`patch` must map site paths"):
        probe.apply(x, patch=[1])


def test_under_vmap_true_a_patch_function_sees_the_whole_batch():
    probe, params, x = make_chain()
    single = ChainProbe(probe.model, params, vmap=True)

    def centre(v):  # needs every example: per-example it would give zeros
        return v - v.mean(axis=0, keepdims=True)

    batched = probe.value_and_grad(loss, x, patch={"affine_1": centre})
    mapped = single.value_and_grad(loss, x, patch={"affine_1": centre})
    assert not np.allclose(mapped.activations["affine_1"], 0.0)
    np.testing.assert_allclose(mapped.loss, batched.loss, rtol=1e-5)
    for name in batched.activation_grads:
        np.testing.assert_allclose(
            mapped.activation_grads[name],
            batched.activation_grads[name],
            rtol=1e-5,
            atol=1e-7,
        )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
        mapped.grads,
        batched.grads,
    )


def test_with_inputs_records_each_call_positional_arguments():
    probe, _, x = make_chain()
    res = probe.value_and_grad(loss, x, with_inputs=True)
    np.testing.assert_array_equal(res.inputs["affine_0"][0], x)
    np.testing.assert_allclose(
        res.inputs["affine_1"][0], jnp.tanh(res.activations["affine_0"]), rtol=1e-5
    )


# -- threads -----------------------------------------------------------------------


def test_two_probes_in_two_threads_keep_separate_sites():
    first, _, x1 = make_chain(widths=(3, 4, 2))
    second, _, x2 = make_chain(widths=(3, 6, 6, 6, 2), batch=7)
    expected = {
        id(first): first.value_and_grad(loss, x1),
        id(second): second.value_and_grad(loss, x2),
    }
    results, errors = {}, []
    barrier = threading.Barrier(2)

    def work(probe, x):
        try:
            barrier.wait()
            for _ in range(3):
                results[id(probe)] = probe.value_and_grad(loss, x)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [
        threading.Thread(target=work, args=(first, x1)),
        threading.Thread(target=work, args=(second, x2)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for key, res in results.items():
        assert list(res.activation_grads) == list(expected[key].activation_grads)
        for name, grad in res.activation_grads.items():
            np.testing.assert_allclose(grad, expected[key].activation_grads[name])


@pytest.mark.skipif(nnx_supported(), reason="this flax has the NNX bridge probes")
def test_an_nnx_model_on_a_flax_before_0_12_is_an_error_naming_the_range():
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    with pytest.raises(ImportError, match=r"supports flax 0\.12\.0 to .* Flax NNX"):
        bridge.probe(model).sites(jnp.ones((1, 2)))


def test_the_top_level_is_the_user_api_and_adapter_authors_have_their_module():
    user_api = {
        "ActivationProbe",
        "BridgeAssertionError",
        "BridgeError",
        "BridgeImportError",
        "BridgeNotImplementedError",
        "BridgeRuntimeError",
        "BridgeTypeError",
        "BridgeValueError",
        "BridgeWarning",
        "ComparisonReport",
        "ForwardResult",
        "LogitsComparison",
        "PairComparison",
        "ProbeResult",
        "SiteNorms",
        "SiteSource",
        "__version__",
        "adapter_api",
        "compare",
        "probe",
        "register_adapter",
        "site_sources",
        "tap",
        "testing",
        "transfer",
    }
    assert set(bridge.__all__) == user_api
    assert bridge.BridgeError is bridge.adapter_api.BridgeError
    # What adapter authors had; more is documented in `bridge.adapter_api`.
    assert set(bridge.adapter_api.__all__) >= {
        "Layer",
        "ProbeBase",
        "Session",
        "Site",
        "SiteOrigin",
        "key_name",
        "register_adapter",
    }
    # Adapter authors' names are not the user's: 0.1.0 is the first release.
    with pytest.raises(AttributeError, match="no attribute 'Site'"):
        bridge.Site  # noqa: B018


def test_a_traceback_names_the_public_error_class():
    # What a user reads is what a user can catch: `bridge.BridgeValueError`,
    # not the private module that defines it; and it pickles by that name.
    import pickle
    import traceback

    with pytest.raises(bridge.BridgeError) as caught:
        bridge.probe(object())
    line = traceback.format_exception_only(caught.type, caught.value)[-1]
    assert line.startswith(f"bridge.{caught.type.__name__}: "), line
    assert getattr(bridge, caught.type.__name__) is caught.type
    assert type(pickle.loads(pickle.dumps(caught.value))) is caught.type
    for name in bridge.__all__:
        if name.startswith("Bridge"):
            assert getattr(bridge, name).__module__ == "bridge", name
