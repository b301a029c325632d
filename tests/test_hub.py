"""Hugging Face Flax model objects that keep collections in `params`.

`FlaxResNetModel` keeps `{"params": ..., "batch_stats": ...}` in its
`params`: those are the variables its module is applied with. The
reference is the module's own `apply` with `model.params`, with
`jax.value_and_grad` for the gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bridge

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.resnet.modeling_flax_resnet")

#: Transformers' Flax code broadcasts by rank promotion (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("allow_rank_promotion")

_SHAPE = (1, 16, 16, 3)  # NHWC: what the module takes (the object transposes NCHW)


def _config():
    return transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic"
    )


@pytest.fixture(scope="module")
def resnet():
    """A `FlaxResNetModel` whose running statistics are not at their init
    values, and NHWC images."""
    with jax.numpy_rank_promotion("allow"):
        model = transformers.FlaxResNetModel(_config(), input_shape=_SHAPE, seed=0)
    keys = iter(jax.random.split(jax.random.key(1), 1000))
    model.params = {
        "params": model.params["params"],
        "batch_stats": jax.tree.map(
            lambda s: s + 0.3 * jax.random.uniform(next(keys), s.shape),
            model.params["batch_stats"],
        ),
    }
    images = np.random.default_rng(2).normal(size=(2, 16, 16, 3)).astype(np.float32)
    return model, images


def _loss(outputs):
    return jnp.mean(jnp.sin(outputs.pooler_output))


def _reference(model, images, **kwargs):
    """`(loss, parameter gradients, new batch_stats)` from the module's own
    apply with `model.params`."""
    mutable = kwargs.pop("mutable", False)

    def loss(params):
        variables = {**model.params, "params": params}
        out = model.module.apply(variables, images, mutable=mutable, **kwargs)
        outputs, state = out if mutable else (out, None)
        return _loss(outputs), state

    (value, state), grads = jax.value_and_grad(loss, has_aux=True)(
        model.params["params"]
    )
    return value, grads, state


def _close(a, b):
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), a, b
    )


def test_an_object_keeping_collections_in_params_is_probed_with_them(resnet):
    model, images = resnet
    before = jax.tree.map(np.asarray, model.params)
    probe = bridge.probe(model)
    sites = probe.sites(images)
    assert "embedder/embedder/normalization" in sites
    value, grads, _ = _reference(model, images)
    res = jax.jit(lambda p, x: p.value_and_grad(_loss, x))(probe, images)
    _close(res.loss, value)
    _close(res.grads, grads)
    assert res.state is None
    # The running statistics are the ones used: a site after a BatchNorm.
    norm = "embedder/embedder/normalization"
    direct = model.module.apply(
        model.params,
        images,
        capture_intermediates=lambda m, _: m.scope.path == tuple(norm.split("/")),
    )[1]["intermediates"]["embedder"]["embedder"]["normalization"]["__call__"][0]
    _close(probe.apply(images, at=norm).activations[norm], direct)
    # Nothing of the object changed.
    _close(model.params, before)


def test_training_mode_updates_the_running_statistics_as_apply_does(resnet):
    model, images = resnet
    step = jax.jit(
        lambda p, x: p.value_and_grad(
            _loss, x, deterministic=False, mutable=["batch_stats"]
        )
    )
    res = step(bridge.probe(model), images)
    value, grads, state = _reference(
        model, images, deterministic=False, mutable=["batch_stats"]
    )
    _close(res.loss, value)
    _close(res.grads, grads)
    _close(res.state, state)


def test_collections_given_beside_the_object_are_the_ones_used(resnet):
    model, images = resnet
    halved = jax.tree.map(lambda p: p * 0.5, model.params)
    probe = bridge.probe(model, halved)
    expected = model.module.apply(halved, images).pooler_output
    _close(probe.apply(images).outputs.pooler_output, expected)
    # Taken out, it is the Linen module with those collections.
    module, variables = probe.unwrap()
    assert module is model.module and set(variables) == {"params", "batch_stats"}
    _close(module.apply(variables, images).pooler_output, expected)


def test_collections_one_level_too_deep_or_missing_are_refused(resnet):
    model, _ = resnet
    with pytest.raises(ValueError, match=r"one level too deep: pass them as the"):
        bridge.probe(model, {"params": model.params})
    with pytest.raises(ValueError, match=r"lacks \['batch_stats'\]"):
        bridge.probe(model, {"params": model.params["params"]})
    for bad in ({"params": model.params}, {"params": model.params["params"]}):
        with pytest.raises(bridge.BridgeError):
            bridge.probe(model, bad)


def test_an_object_without_parameters_is_told_to_pass_init_weights(resnet):
    model, images = resnet
    with jax.numpy_rank_promotion("allow"):
        bare = transformers.FlaxResNetModel(
            _config(), input_shape=_SHAPE, _do_init=False
        )
    with pytest.raises(
        ValueError,
        match=r"holds no parameters .*bridge\.probe\(model, variables\) with "
        r"variables = model\.init_weights",
    ) as info:
        bridge.probe(bare)
    assert isinstance(info.value, bridge.BridgeError)
    res = bridge.probe(bare, model.params).value_and_grad(_loss, images)
    value, grads, _ = _reference(model, images)
    _close(res.loss, value)
    _close(res.grads, grads)
