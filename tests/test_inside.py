"""`bridge.probe(model, inside=...)`: every value a module's code assigns.

Each library's attention, written as its users write it, probed with
`inside=` and checked against references that do not use bridge: the same
computation written by hand with an offset `delta` added at the value,
differentiated with `jax.grad` / `jax.jvp` (torch: autograd) at `delta = 0`;
library-shipped code through the library's own function with the offset
inserted by the test (`monkeypatch`), eager and jitted.
"""

from __future__ import annotations

import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bridge

RTOL, ATOL = 1e-5, 1e-6
SEQ, WIDTH = 5, 8
X = np.random.default_rng(0).normal(size=(2, SEQ, WIDTH)).astype(np.float32)
WEIGHTS = np.random.default_rng(1).normal(size=(2, SEQ, WIDTH)).astype(np.float32)


def _loss(outputs):
    return (outputs * WEIGHTS).sum()


def _close(actual, expected, rtol=RTOL):
    actual, expected = np.asarray(actual), np.asarray(expected)
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=ATOL * scale)


# -- one attention head, by hand: the reference ---------------------------------


def _head(wq, wk, wv, x, delta=0.0):
    """The computation the modules below write, with `delta` added to the
    attention pattern: `(scores, pattern, mixed)`."""
    scores = jnp.einsum("bqd,bkd->bqk", x @ wq, x @ wk) / np.sqrt(WIDTH)
    pattern = jax.nn.softmax(scores) + delta
    mixed = jnp.einsum("bqk,bkd->bqd", pattern, x @ wv)
    return scores, pattern, mixed


def _reference(wq, wk, wv):
    """`(scores, pattern, d loss / d pattern)` with `jax.grad` of the
    offset, and the directional derivative by `jax.jvp` as a second check."""
    scores, pattern, _ = _head(wq, wk, wv, X)

    def loss(delta):
        return _loss(_head(wq, wk, wv, X, delta)[2])

    zero = jnp.zeros_like(pattern)
    grad = jax.grad(loss)(zero)
    direction = np.random.default_rng(2).normal(size=pattern.shape)
    _, tangent = jax.jvp(loss, (zero,), (jnp.asarray(direction, jnp.float32),))
    np.testing.assert_allclose(
        float(tangent), float(jnp.sum(grad * direction)), rtol=1e-4
    )
    return scores, pattern, grad


class LinenHead(nn.Module):
    @nn.compact
    def __call__(self, x):
        query = nn.Dense(WIDTH, use_bias=False, name="wq")(x)
        key = nn.Dense(WIDTH, use_bias=False, name="wk")(x)
        value = nn.Dense(WIDTH, use_bias=False, name="wv")(x)
        scores = jnp.einsum("bqd,bkd->bqk", query, key) / np.sqrt(WIDTH)
        pattern = jax.nn.softmax(scores)
        mixed = jnp.einsum("bqk,bkd->bqd", pattern, value)
        return mixed


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        return LinenHead(name="head")(x)


@pytest.fixture(scope="module")
def linen_model():
    model = LinenModel()
    variables = model.init(jax.random.key(0), X)
    params = variables["params"]["head"]
    kernels = [params[name]["kernel"] for name in ("wq", "wk", "wv")]
    return model, variables, kernels


@pytest.mark.parametrize("jit", [False, True])
def test_linen_locals_are_sites_with_gradients(linen_model, jit):
    model, variables, kernels = linen_model
    probe = bridge.probe(model, variables, inside=LinenHead)
    names = list(probe.sites(X))
    for local in ("query", "key", "value", "scores", "pattern", "mixed"):
        assert f"head/{local}" in names
    # Call order: a local after the submodule calls before it.
    assert names.index("head/wk") < names.index("head/key") < names.index("head/scores")

    def step(x):
        return probe.value_and_grad(_loss, x, at=["head/scores", "head/pattern"])

    res = (jax.jit(step) if jit else step)(X)
    scores, pattern, grad = _reference(*kernels)
    _close(res.activations["head/scores"], scores)
    _close(res.activations["head/pattern"], pattern)
    _close(res.activation_grads["head/pattern"], grad)
    want_loss = _loss(_head(*kernels, X)[2])
    _close(res.loss, want_loss)


def test_a_patched_local_flows_on(linen_model):
    model, variables, kernels = linen_model
    probe = bridge.probe(model, variables, inside=LinenHead)
    mask = np.tril(np.ones((1, SEQ, SEQ), np.float32))
    res = probe.apply(X, patch={"head/pattern": lambda p: p * mask})
    _, pattern, _ = _head(*kernels, X)
    _, _, want = _head(*kernels, X, pattern * mask - pattern)
    _close(res.outputs, want)


def test_the_class_is_left_as_it_was_also_when_the_model_raises(linen_model):
    model, variables, _ = linen_model
    function = LinenHead.__call__
    while hasattr(function, "__wrapped__"):
        function = function.__wrapped__
    code = function.__code__
    probe = bridge.probe(model, variables, inside=LinenHead)
    probe.apply(X)
    assert function.__code__ is code
    with pytest.raises(Exception):  # noqa: B017 - any error of the model's
        probe.apply(X[..., :3])  # the kernels do not fit
    assert function.__code__ is code
    # A probe without `inside` has none of these sites, and costs nothing.
    plain = bridge.probe(model, variables)
    assert "head/pattern" not in list(plain.sites(X))


def test_another_thread_runs_the_model_untouched_meanwhile(linen_model):
    model, variables, _ = linen_model
    probe = bridge.probe(model, variables, inside=LinenHead)
    want = model.apply(variables, X)
    results, stop = [], threading.Event()

    def plain_calls():
        while not stop.is_set():
            results.append(np.asarray(model.apply(variables, X)))

    thread = threading.Thread(target=plain_calls)
    thread.start()
    try:
        for _ in range(3):
            probe.value_and_grad(_loss, X, at="head/pattern")
    finally:
        stop.set()
        thread.join()
    assert results
    for got in results:
        np.testing.assert_array_equal(got, want)


# -- library-shipped attention ---------------------------------------------------


def _offset_at_return(monkeypatch, owner, name, delta):
    """The reference's hand-made insertion: `owner.name` returns its value
    plus `delta` (the test's patch, not bridge's)."""
    original = getattr(owner, name)

    def offset(*args, **kwargs):
        return original(*args, **kwargs) + delta

    monkeypatch.setattr(owner, name, offset)


@pytest.mark.parametrize("jit", [False, True])
def test_linen_multi_head_attention_pattern(monkeypatch, jit):
    import flax.linen.attention as attention

    model = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=WIDTH)
    variables = model.init(jax.random.key(1), X)
    probe = bridge.probe(model, variables, inside=nn.dot_product_attention_weights)
    prefix = "dot_product_attention_weights"
    names = list(probe.sites(X))
    assert f"{prefix}/query" in names
    # The scores, then the softmax: one local assigned twice.
    assert names.index(f"{prefix}/attn_weights") < names.index(
        f"{prefix}/attn_weights#1"
    )
    pattern_site = f"{prefix}/attn_weights#1"

    def step(x):
        return probe.value_and_grad(_loss, x, at=pattern_site)

    res = (jax.jit(step) if jit else step)(X)
    pattern = res.activations[pattern_site]
    assert pattern.shape == (2, 2, SEQ, SEQ)  # (batch, heads, q, k)
    _close(pattern.sum(-1), np.ones((2, 2, SEQ)))

    def loss(delta):
        with monkeypatch.context() as patched:
            _offset_at_return(patched, attention, prefix, delta)
            return _loss(model.apply(variables, X))

    zero = jnp.zeros_like(pattern)
    _close(res.activation_grads[pattern_site], jax.grad(loss)(zero))
    # Left as it was: the offset reference above went through the original.
    assert nn.dot_product_attention_weights is attention.dot_product_attention_weights
