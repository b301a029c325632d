"""`bridge.compare`: two models' activations and activation gradients, pair by
pair, and where they part.

The planted bugs are known by construction: a LayerNorm epsilon, a wrong
nonlinearity, a backward pass that doubles a gradient (a `jax.custom_vjp`).
"""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from porting_models import IMAGES, TOKENS, LinenCNN, build, filled

import bridge


def loss_fn(outputs):
    return jnp.sum(outputs**2)


def _linen_cnn(module):
    variables = filled(jax.eval_shape(module.init, jax.random.key(0), IMAGES), 5)
    return bridge.probe(module, variables)


@jax.custom_vjp
def tanh_with_doubled_gradient(x):
    return jnp.tanh(x)


def _forward(x):
    return jnp.tanh(x), x


def _backward(x, cotangent):
    return (2.0 * cotangent * (1.0 - jnp.tanh(x) ** 2),)


tanh_with_doubled_gradient.defvjp(_forward, _backward)


def test_ported_models_agree_and_the_report_is_a_table():
    source = build("linen")
    ported = bridge.transfer(source, build("equinox"), IMAGES)
    report = bridge.compare(source, ported, loss_fn, IMAGES)
    assert report.first_divergence is None and report.agree
    assert [(row.site_a, row.site_b) for row in report.rows] == [
        ("Conv_0", "conv"),
        ("BatchNorm_0", "norm"),
        ("Dense_0", "hidden"),
        ("LayerNorm_0", "layer_norm"),
        ("Dense_1", "out"),
    ]
    # Equinox's channel-first convolution is brought to channel-last.
    assert report.rows[0].shape == (2, 6, 6, 4)
    assert report.rows[0].kind == "conv"
    # The losses are each model's own: the library's forward pass is the reference.
    expected = float(loss_fn(jax.jit(source.module.apply)(source.variables, IMAGES)))
    np.testing.assert_allclose(report.loss_a, expected, rtol=1e-5)
    np.testing.assert_allclose(report.loss_b, expected, rtol=1e-5)
    table = str(report).splitlines()
    assert "all pairs agree" in table[0]
    assert table[1].split()[:3] == ["#", "site", "A"]
    assert table[3].split()[:4] == ["0", "Conv_0", "conv", "conv"]
    # Aligned: every row's verdict starts in the same column.
    rows = table[3 : 3 + len(report.rows)]
    assert len({line.index(" ok") for line in rows}) == 1


def test_attention_head_axes_are_flattened_to_compare():
    source = build("linen", "attention")
    ported = bridge.transfer(source, build("haiku", "attention"), TOKENS)
    report = bridge.compare(source, ported, loss_fn, TOKENS)
    assert report.first_divergence is None
    query = report.rows[1]
    assert (query.site_a, query.site_b) == (
        "MultiHeadDotProductAttention_0/query",
        "multi_head_attention/query",
    )
    assert query.shape == (2, 5, 8)


def test_a_forward_bug_is_found_at_its_pair():
    """A LayerNorm epsilon of 1e-2 instead of 1e-5: the activations part at the
    LayerNorm; upstream, only the gradients differ."""
    reference = build("haiku")
    buggy = bridge.transfer(
        reference, _linen_cnn(LinenCNN(layer_norm_epsilon=1e-2)), IMAGES
    )
    report = bridge.compare(buggy, reference, loss_fn, IMAGES)
    first = report.first_divergence
    assert (first.site_a, first.site_b) == ("LayerNorm_0", "layer_norm")
    assert not first.activations_agree
    assert all(row.activations_agree for row in report.rows[:3])
    assert not report.rows[2].grads_agree  # upstream of the bug
    assert "first divergence: 'LayerNorm_0' (A) / 'layer_norm' (B)" in str(report)


@pytest.mark.slow
def test_a_wrong_nonlinearity_shows_at_the_next_parameterised_module():
    reference = build("nnx")
    buggy = bridge.transfer(
        reference, _linen_cnn(LinenCNN(activation=jax.nn.gelu)), IMAGES
    )
    report = bridge.compare(reference, buggy, loss_fn, IMAGES)
    first = report.first_divergence
    assert (first.site_a, first.site_b) == ("hidden", "Dense_0")
    assert report.rows[1].activations_agree  # the BatchNorm before the gelu


def test_a_gradient_only_bug_is_the_last_pair_whose_gradients_differ():
    """A backward pass that doubles the gradient through the tanh after the
    LayerNorm: every activation agrees; gradients differ at the LayerNorm and
    everything before it, not after."""
    reference = build("nnx")
    buggy = bridge.transfer(
        reference, _linen_cnn(LinenCNN(squash=tanh_with_doubled_gradient)), IMAGES
    )
    report = bridge.compare(buggy, reference, loss_fn, IMAGES)
    assert all(row.activations_agree for row in report.rows)
    assert [row.grads_agree for row in report.rows] == [False] * 4 + [True]
    first = report.first_divergence
    assert (first.site_a, first.site_b) == ("LayerNorm_0", "layer_norm")
    # Twice the reference's gradient: the difference is as large as it.
    np.testing.assert_allclose(first.grad_rel, 1.0, rtol=1e-5)
    assert "gradients" in str(report).splitlines()[0]


def test_models_that_do_not_pair_are_refused():
    short = _linen_cnn(nn.Sequential([nn.Conv(4, (3, 3)), nn.Dense(5)]))
    with pytest.raises(
        ValueError,
        match=r"probe_a has 5 .* probe_b has 2 .*first pair that does not match is "
        r"site 'BatchNorm_0' \(batchnorm\) of probe_a and site 'layers_1' \(dense\)",
    ):
        bridge.compare(build("linen"), short, loss_fn, IMAGES)
    layers = [nn.Conv(4, (3, 3)), nn.Dense(4), nn.Dense(4), nn.LayerNorm(), nn.Dense(5)]
    swapped = _linen_cnn(nn.Sequential(layers))
    with pytest.raises(
        ValueError,
        match=r"site 'BatchNorm_0' \(nn.BatchNorm\) of probe_a with site 'layers_1' "
        r"\(nn.Dense\) of probe_b: their kinds differ",
    ):
        bridge.compare(build("linen"), swapped, loss_fn, IMAGES)
    with pytest.raises(TypeError, match="`loss_fn` must be a function"):
        bridge.compare(build("linen"), build("nnx"), "mse", IMAGES)
    with pytest.raises(TypeError, match="`probe_b` is a"):
        bridge.compare(build("linen"), object(), loss_fn, IMAGES)


class _PerPixelNorm(eqx.Module):
    """A channel-first conv, then a LayerNorm over each pixel's channels under
    the model's own nested vmaps: over W outside and H inside, or the other way."""

    conv: eqx.nn.Conv2d
    norm: eqx.nn.LayerNorm
    width_outside: bool = eqx.field(static=True)

    def __call__(self, image):  # (H, W, C)
        x = self.conv(jnp.transpose(image, (2, 0, 1)))  # (C, H, W)
        if self.width_outside:
            per_pixel = jax.vmap(jax.vmap(self.norm, 1, 1), 2, 2)
        else:
            per_pixel = jax.vmap(jax.vmap(self.norm, 1, 1), 1, 1)
        return jnp.tanh(per_pixel(x))


class _LinenPerPixelNorm(nn.Module):
    @nn.compact
    def __call__(self, image):  # (N, H, W, C)
        x = nn.Conv(4, (3, 3), padding=1)(image)
        return jnp.tanh(nn.LayerNorm(epsilon=1e-5)(x))


@pytest.mark.parametrize("width_outside", [True, False])
def test_a_norm_under_nested_vmaps_compares_in_the_layout_around_it(width_outside):
    """The Equinox norm's site holds its mapped axes first, `(N, W, H, C)` or
    `(N, H, W, C)` by the order of the vmaps; `compare` puts them back where
    the vmaps took them from, so either order agrees with Linen's `(N, H, W,
    C)`, pixel by pixel (H = 6 and W = 5 differ, so a wrong order could not
    even be compared)."""
    images = jax.random.normal(jax.random.key(3), (2, 6, 5, 3))
    linen = _LinenPerPixelNorm()
    variables = filled(jax.eval_shape(linen.init, jax.random.key(0), images), 2)
    keys = jax.random.split(jax.random.key(1))
    equinox = _PerPixelNorm(
        eqx.nn.Conv2d(3, 4, 3, padding=1, key=keys[0]),
        eqx.nn.LayerNorm(4, eps=1e-5),
        width_outside,
    )
    source = bridge.probe(linen, variables)
    ported = bridge.transfer(source, bridge.probe(equinox, vmap=True), images)
    report = bridge.compare(source, ported, loss_fn, images)
    assert report.first_divergence is None, str(report)
    assert [(row.site_a, row.site_b) for row in report.rows] == [
        ("Conv_0", "conv"),
        ("LayerNorm_0", "norm"),
    ]
    # The reference: Linen's own recording of its norm, against the Equinox
    # site moved by hand from its vmaps' layout.
    _, recorded = linen.apply(variables, images, capture_intermediates=True)
    expected = recorded["intermediates"]["LayerNorm_0"]["__call__"][0]
    held = ported.apply(images, at="norm").activations["norm"]
    by_hand = jnp.transpose(held, (0, 2, 1, 3)) if width_outside else held
    np.testing.assert_allclose(by_hand, expected, rtol=1e-5, atol=1e-5)
