"""Penzai, a fifth library added through `bridge.register_adapter` alone.

The adapter is `examples/penzai_adapter.py`, written as a third party would:
nothing in `bridge/` or `adapters/` knows Penzai. Checked here against plain
JAX and Penzai's own tree surgery: sites of a small Llama-like transformer,
activation gradients against `jax.jvp` of the loss with an offset inserted by
`pz.select(...).insert_after(...)`, parameter gradients against `jax.grad`,
eagerly and under `jax.jit`, and `bridge.transfer`/`bridge.compare` with Flax
Linen.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("penzai")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from penzai import pz  # noqa: E402
from penzai.models.transformer.variants import llamalike_common  # noqa: E402

import bridge  # noqa: E402

# The adapter is an example module, loaded from its file (examples/ is not a
# package): importing it registers it, as a third party's import would.
_spec = importlib.util.spec_from_file_location(
    "penzai_adapter",
    Path(__file__).resolve().parent.parent / "examples" / "penzai_adapter.py",
)
penzai_adapter = sys.modules.setdefault(
    "penzai_adapter", importlib.util.module_from_spec(_spec)
)
if not hasattr(penzai_adapter, "PenzaiProbe"):
    _spec.loader.exec_module(penzai_adapter)

# -- the model --------------------------------------------------------------------

CONFIG = llamalike_common.LlamalikeTransformerConfig(
    num_kv_heads=2,
    query_head_multiplier=1,
    embedding_dim=8,
    projection_dim=4,
    mlp_hidden_dim=16,
    num_decoder_blocks=2,
    vocab_size=11,
    mlp_variant="swiglu",
    tie_embedder_and_logits=True,
)
TOKENS = pz.nx.wrap(jnp.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])).tag("batch", "seq")
TARGETS = jnp.array([[2, 3, 4, 5, 6], [7, 8, 9, 10, 0]])


def make_transformer():
    return llamalike_common.build_llamalike_transformer(
        CONFIG, init_base_rng=jax.random.key(0)
    )


def loss(logits):
    values = logits.unwrap("batch", "seq", "vocabulary")
    log_probs = jax.nn.log_softmax(values, axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, TARGETS[..., None], -1))


# Penzai's own accessors for three sites: the first block's output, the hidden
# activations of the second block's MLP, and the final norm.
SITES = {
    "body/sublayers/2": lambda m: m.body.sublayers[2],
    "body/sublayers/3/sublayers/1/delta/sublayers/1/sublayers/0": (
        lambda m: m.body.sublayers[3].sublayers[1].delta.sublayers[1].sublayers[0]
    ),
    "body/sublayers/4": lambda m: m.body.sublayers[4],
}


@pz.pytree_dataclass
class Offset(pz.nn.Layer):
    """Adds a constant: inserted after a layer by hand, to take a jvp."""

    delta: pz.nx.NamedArray

    def __call__(self, value, /, **side_inputs):
        return value + self.delta


def _leaf(named):
    (leaf,) = jax.tree.leaves(named)
    return leaf


# -- sites --------------------------------------------------------------------------


def test_sites_are_penzai_keypaths_in_call_order():
    model = make_transformer()
    sites = bridge.probe(model).sites(TOKENS)
    names = list(sites)
    # A container comes before the layers it calls; the blocks in order.
    assert names[:4] == [
        "body",
        "body/sublayers/0",
        "body/sublayers/1",
        "body/sublayers/2",
    ]
    assert names[-3:] == [
        "body/sublayers/4/sublayers/0",
        "body/sublayers/4/sublayers/1",
        "body/sublayers/5",
    ]
    for name in SITES:
        assert name in sites
    # Each site is Penzai's keypath of a layer, `/`-joined.
    selected = pz.select(model).at_instances_of(pz.nn.EmbeddingDecode)
    (key_path,) = selected.selected_by_path
    assert "/".join(bridge.adapter_api.key_name(k) for k in key_path) == names[-1]
    # Values are NamedArrays with the model's named axes.
    assert sites["body/sublayers/5"].named_shape == {
        "batch": 2,
        "seq": 5,
        "vocabulary": 11,
    }


def test_vmap_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="batch through named axes"):
        bridge.probe(make_transformer(), vmap=True)


# -- gradients ----------------------------------------------------------------------


def _plain_grads(model):
    unbound, params = pz.unbind_params(model, freeze=True)
    return jax.value_and_grad(lambda p: loss(pz.bind_variables(unbound, p)(TOKENS)))(
        params
    )


def _jvp_with_offset(model, accessor, direction):
    """d loss / d t of the model with `t * direction` added after one layer,
    by Penzai's own surgery, at t = 0."""

    def at(t):
        offset = Offset(jax.tree.map(lambda d: t * d, direction))
        patched = pz.select(model).at(accessor).insert_after(offset)
        return loss(patched(TOKENS))

    return jax.jvp(at, (0.0,), (1.0,))[1]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_gradients_match_jax_grad_and_a_jvp_through_penzai_surgery(jit):
    model = make_transformer()
    probe = bridge.probe(model)

    def run(probe, tokens):
        return probe.value_and_grad(loss, tokens, at=list(SITES))

    res = (jax.jit(run) if jit else run)(probe, TOKENS)

    expected_loss, expected_grads = _plain_grads(model)
    np.testing.assert_allclose(res.loss, expected_loss, rtol=1e-5)
    assert jax.tree.structure(res.grads) == jax.tree.structure(expected_grads)
    assert [g.label for g in res.grads] == [g.label for g in expected_grads]
    # jit against eager float32: an element near zero differs by rounding at
    # the scale of its array, not of itself.
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(
            a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max())
        ),
        res.grads,
        expected_grads,
    )
    assert list(res.activation_grads) == list(SITES)
    for i, (name, accessor) in enumerate(SITES.items()):
        grad = res.activation_grads[name]
        assert jax.tree.structure(grad) == jax.tree.structure(res.activations[name])
        direction = jax.tree.map(
            lambda v, i=i: jax.random.normal(jax.random.key(i), v.shape, v.dtype),
            res.activations[name],
        )
        expected = _jvp_with_offset(model, accessor, direction)
        np.testing.assert_allclose(
            jnp.vdot(_leaf(grad), _leaf(direction)), expected, rtol=1e-4, atol=1e-7
        )


def test_probing_changes_neither_the_model_nor_its_numbers():
    model = make_transformer()
    before = [np.asarray(p.value.data_array) for p in pz.unbind_params(model)[1]]
    res = bridge.probe(model).value_and_grad(loss, TOKENS, patch=None)
    after = [np.asarray(p.value.data_array) for p in pz.unbind_params(model)[1]]
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(res.loss, loss(model(TOKENS)), rtol=1e-5)
    assert res.state is None


def test_an_unbound_model_and_its_frozen_parameters_probe_alike():
    model = make_transformer()
    unbound, params = pz.unbind_params(model, freeze=True)
    a = bridge.probe(model).value_and_grad(loss, TOKENS, at="body/sublayers/2")
    b = bridge.probe(unbound, params).value_and_grad(
        loss, TOKENS, at="body/sublayers/2"
    )
    np.testing.assert_allclose(
        _leaf(a.activation_grads["body/sublayers/2"]),
        _leaf(b.activation_grads["body/sublayers/2"]),
    )


def test_patch_flows_on_through_the_model():
    model = make_transformer()
    name = "body/sublayers/3/sublayers/1/delta/sublayers/1/sublayers/0"
    fwd = bridge.probe(model).apply(TOKENS, at=name, patch={name: lambda v: v * 0})
    ablated = (
        pz.select(model).at(SITES[name]).insert_after(pz.nn.Elementwise(jnp.zeros_like))
    )
    np.testing.assert_allclose(
        _leaf(fwd.outputs), _leaf(ablated(TOKENS)), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_array_equal(_leaf(fwd.activations[name]), 0.0)


# -- porting with Flax Linen --------------------------------------------------------


def _mlp_pair():
    nn = pytest.importorskip("flax.linen")

    class LinenMLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(6)(x)
            x = nn.LayerNorm(epsilon=1e-6)(x)
            x = jax.nn.relu(x)
            return nn.Dense(2)(x)

    key = jax.random.key(1)
    x = jax.random.normal(key, (4, 3))
    linen = LinenMLP()
    linen_probe = bridge.probe(linen, linen.init(jax.random.key(2), x))
    penzai_mlp = pz.nn.Sequential(
        [
            pz.nn.Affine.from_config(
                name="dense_0",
                init_base_rng=jax.random.key(3),
                input_axes={"features": 3},
                output_axes={"features": 6},
            ),
            pz.nn.LayerNorm.from_config(
                name="norm",
                init_base_rng=jax.random.key(3),
                across_axes={"features": 6},
                epsilon=1e-6,
            ),
            pz.nn.Elementwise(jax.nn.relu),
            pz.nn.Affine.from_config(
                name="dense_1",
                init_base_rng=jax.random.key(3),
                input_axes={"features": 6},
                output_axes={"features": 2},
            ),
        ]
    )
    named_x = pz.nx.wrap(x).tag("batch", "features")
    return linen_probe, bridge.probe(penzai_mlp), x, named_x


def _unwrap_loss(y):
    return jnp.mean(jnp.sin(y.unwrap("batch", "features")))


def test_transfer_from_linen_and_compare_through_the_registry():
    linen_probe, penzai_probe, x, named_x = _mlp_pair()
    ported = bridge.transfer(linen_probe, penzai_probe, x, args_b=(named_x,))
    assert isinstance(ported, penzai_adapter.PenzaiProbe)
    np.testing.assert_allclose(
        ported.apply(named_x).outputs.unwrap("batch", "features"),
        linen_probe.apply(x).outputs,
        rtol=1e-5,
        atol=1e-6,
    )
    report = bridge.compare(
        linen_probe,
        ported,
        (lambda y: jnp.mean(jnp.sin(y)), _unwrap_loss),
        x,
        args_b=(named_x,),
    )
    assert [row.site_b for row in report.rows] == [
        "sublayers/0",
        "sublayers/1",
        "sublayers/3",
    ]
    assert report.first_divergence is None, str(report)
    # And back: Penzai's weights into the Linen model.
    back = bridge.transfer(ported, linen_probe, named_x, args_b=(x,))
    np.testing.assert_allclose(
        back.apply(x).outputs,
        ported.apply(named_x).outputs.unwrap("batch", "features"),
        rtol=1e-5,
        atol=1e-6,
    )


def test_compare_finds_an_unported_model():
    linen_probe, penzai_probe, x, named_x = _mlp_pair()
    report = bridge.compare(
        linen_probe,
        penzai_probe,
        (lambda y: jnp.mean(jnp.sin(y)), _unwrap_loss),
        x,
        args_b=(named_x,),
    )
    assert report.first_divergence is not None
    assert report.first_divergence.site_b == "sublayers/0"


# -- inside=, through the registry ----------------------------------------------------


@pz.pytree_dataclass
class Gate(pz.nn.Layer):
    """A layer of the user's computing on plain arrays: its locals are sites
    with `inside=Gate`."""

    def __call__(self, value, /, **side_inputs):
        raw = value.unwrap("batch", "features")
        gated = jax.nn.sigmoid(raw) * raw
        return pz.nx.wrap(gated).tag("batch", "features")


@pz.pytree_dataclass
class OffsetGate(pz.nn.Layer):
    """`Gate` with `delta` added to `gated` by hand: the reference."""

    delta: jax.Array

    def __call__(self, value, /, **side_inputs):
        raw = value.unwrap("batch", "features")
        gated = jax.nn.sigmoid(raw) * raw + self.delta
        return pz.nx.wrap(gated).tag("batch", "features")


def _gated_mlp(gate):
    def affine(name, inputs, outputs):
        return pz.nn.Affine.from_config(
            name=name,
            init_base_rng=jax.random.key(5),
            input_axes={"features": inputs},
            output_axes={"features": outputs},
        )

    return pz.nn.Sequential([affine("in", 3, 6), gate, affine("out", 6, 2)])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_inside_through_the_penzai_adapter(jit):
    """`inside=` is the core's: the adapter (which knows nothing of it, and
    rebuilds its probe from its children alone) gets it through its pytree,
    under `jax.jit` too."""
    model = _gated_mlp(Gate())
    x = pz.nx.wrap(jax.random.normal(jax.random.key(6), (4, 3))).tag(
        "batch", "features"
    )
    probe = bridge.probe(model, inside=Gate)
    assert isinstance(probe, penzai_adapter.PenzaiProbe)
    sites = probe.sites(x)
    assert [n for n in sites if n.startswith("sublayers/1")] == [
        "sublayers/1",
        "sublayers/1/raw",
        "sublayers/1/gated",
    ]
    source = bridge.site_sources(probe, x)["sublayers/1/gated"]
    assert source.code == "gated = jax.nn.sigmoid(raw) * raw"
    site = "sublayers/1/gated"

    def run(probe, x):
        return probe.value_and_grad(_unwrap_loss, x, at=site)

    res = (jax.jit(run) if jit else run)(probe, x)
    raw = model.sublayers[0](x).unwrap("batch", "features")  # Penzai's own layer
    np.testing.assert_allclose(
        res.activations[site], jax.nn.sigmoid(raw) * raw, rtol=1e-5, atol=1e-6
    )
    direction = jax.random.normal(jax.random.key(7), raw.shape)

    def at(t):
        return _unwrap_loss(_gated_mlp(OffsetGate(t * direction))(x))

    loss_value, tangent = jax.jvp(at, (0.0,), (1.0,))
    np.testing.assert_allclose(res.loss, loss_value, rtol=1e-5)
    np.testing.assert_allclose(
        jnp.vdot(res.activation_grads[site], direction), tangent, rtol=1e-4, atol=1e-7
    )
