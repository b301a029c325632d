"""`inside=` on Hugging Face's GPT-2 attention, Flax and PyTorch.

The attention pattern (TransformerLens's `hook_pattern`) and its gradient,
which `output_attentions=True` cannot give (the returned copy feeds nothing).
References that do not use bridge: for Flax, transformers' own module with an
offset added to `dot_product_attention_weights`' result by the test
(`monkeypatch`), differentiated by `jax.grad`; for PyTorch, the pattern from
`output_attentions=True` and its gradient from autograd through the
attention's output, caught by a forward pre-hook on `c_proj`
(`d loss / d pattern = d loss / d output @ valueᵀ`, per head). Both twins
carry the same weights (Hugging Face's converter), so the two libraries'
patterns and gradients agree through the same call.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bridge

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.models.gpt2.modeling_flax_gpt2")
from hf_pairs import BATCH, SEQ, VOCAB  # noqa: E402
from transformers import FlaxGPT2Model, GPT2Config, GPT2Model  # noqa: E402
from transformers.modeling_flax_pytorch_utils import (  # noqa: E402
    convert_pytorch_state_dict_to_flax,
)
from transformers.models.gpt2 import modeling_flax_gpt2, modeling_gpt2  # noqa: E402

pytestmark = pytest.mark.usefixtures("allow_rank_promotion")

HEADS, WIDTH = 4, 32
IDS = np.random.default_rng(0).integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
FLAX_INPUTS = (IDS, np.ones_like(IDS), np.broadcast_to(np.arange(SEQ), IDS.shape))
WEIGHTS = np.random.default_rng(1).normal(size=(BATCH, SEQ, WIDTH)).astype(np.float32)
#: Flax: scores, scores + causal bias, the softmax (the value returned).
FLAX_PATTERN = "h/0/attn/dot_product_attention_weights/attn_weights#2"


def _flax_loss(outputs):
    return (outputs.last_hidden_state * WEIGHTS).sum()


def _torch_loss(outputs):
    return (outputs.last_hidden_state * torch.tensor(WEIGHTS)).sum()


@pytest.fixture(scope="module")
def gpt2():
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=WIDTH,
        n_layer=2,
        n_head=HEADS,
        attn_implementation="eager",  # PyTorch's fused kernel has no pattern
    )
    torch.manual_seed(0)
    torch_model = GPT2Model(config).eval()
    with jax.numpy_rank_promotion("allow"):
        flax_model = FlaxGPT2Model(config, seed=1)
        params = convert_pytorch_state_dict_to_flax(
            torch_model.state_dict(), flax_model
        )
    return torch_model, flax_model, params


def _grad_by_offset(monkeypatch, owner, layer, apply, pattern):
    """The reference: d loss / d pattern of `layer`, with the offset inserted
    by the test, `owner.dot_product_attention_weights` returning its value
    plus `delta` at its `layer`-th call, differentiated at `delta = 0`."""
    original = owner.dot_product_attention_weights

    def loss(delta):
        calls = []

        def offset(*args, **kwargs):
            calls.append(None)
            value = original(*args, **kwargs)
            return value + delta if len(calls) == layer + 1 else value

        with monkeypatch.context() as patched:
            patched.setattr(owner, "dot_product_attention_weights", offset)
            return _flax_loss(apply())

    return jax.grad(loss)(jnp.zeros_like(pattern))


def _flax_probe(flax_model, params):
    return bridge.probe(
        flax_model.module,
        {"params": params},
        inside=[modeling_flax_gpt2.FlaxGPT2Attention, nn.dot_product_attention_weights],
    )


@pytest.mark.parametrize("jit", [False, True])
def test_flax_gpt2_pattern_and_its_gradient(gpt2, monkeypatch, jit):
    _, flax_model, params = gpt2
    probe = _flax_probe(flax_model, params)
    names = list(probe.sites(*FLAX_INPUTS))
    # The attention's own locals, and the function's.
    assert "h/0/attn/qkv_out" in names and FLAX_PATTERN in names

    def step(*inputs):
        return probe.value_and_grad(_flax_loss, *inputs, at=FLAX_PATTERN)

    result = (jax.jit(step) if jit else step)(*FLAX_INPUTS)
    pattern = result.activations[FLAX_PATTERN]
    assert pattern.shape == (BATCH, HEADS, SEQ, SEQ)
    np.testing.assert_allclose(pattern.sum(-1), 1.0, rtol=1e-5)
    assert np.all(np.asarray(pattern)[..., 0, 1:] == 0)  # causal

    grad = _grad_by_offset(
        monkeypatch,
        modeling_flax_gpt2,
        0,
        lambda: flax_model.module.apply({"params": params}, *FLAX_INPUTS),
        pattern,
    )
    got = result.activation_grads[FLAX_PATTERN]
    np.testing.assert_allclose(got, grad, rtol=1e-5, atol=1e-6 * np.abs(grad).max())
    assert np.abs(grad).max() > 1e-3  # a gradient, not output_attentions' zeros


def _torch_reference(torch_model):
    """Layer 0's pattern, from `output_attentions=True`, and the loss's
    gradient with respect to it, from autograd through the attention output
    (before `c_proj`) and the values, caught by hooks."""
    caught = {}
    attention = torch_model.h[0].attn

    def before_projection(module, args):
        args[0].retain_grad()
        caught["merged"] = args[0]

    def values(module, args, output):
        caught["value"] = output.split(WIDTH, dim=2)[2]

    hooks = [
        attention.c_proj.register_forward_pre_hook(before_projection),
        attention.c_attn.register_forward_hook(values),
    ]
    try:
        outputs = torch_model(torch.tensor(IDS), output_attentions=True)
        _torch_loss(outputs).backward()
    finally:
        for hook in hooks:
            hook.remove()
    size = WIDTH // HEADS
    grad_out = caught["merged"].grad.reshape(BATCH, SEQ, HEADS, size)
    value = caught["value"].detach().reshape(BATCH, SEQ, HEADS, size)
    grad = torch.einsum("bqhd,bkhd->bhqk", grad_out, value)
    return outputs.attentions[0].detach().numpy(), grad.numpy()


def test_torch_gpt2_pattern_agrees_with_autograd_and_with_flax(gpt2):
    torch_model, flax_model, params = gpt2
    probe = bridge.probe(
        torch_model,
        inside=[modeling_gpt2.GPT2Attention, modeling_gpt2.eager_attention_forward],
    )
    # `attn_weights` in eager_attention_forward: the scores, scaled, causally
    # masked, plus the attention mask, then the softmax (#4), cast, dropout.
    site = "h.0.attn/eager_attention_forward/attn_weights#4"
    names = list(probe.sites(torch.tensor(IDS)))
    assert names.index(site) < names.index("h.0.attn.attn_dropout")
    result = probe.value_and_grad(_torch_loss, torch.tensor(IDS), at=site)
    pattern, grad = _torch_reference(torch_model)
    np.testing.assert_allclose(result.activations[site].numpy(), pattern, rtol=1e-5)
    got = result.activation_grads[site].numpy()
    np.testing.assert_allclose(got, grad, rtol=1e-4, atol=1e-6 * np.abs(grad).max())

    # The same numbers from the Flax twin through the same call.
    flax_result = _flax_probe(flax_model, params).value_and_grad(
        _flax_loss, *FLAX_INPUTS, at=FLAX_PATTERN
    )
    np.testing.assert_allclose(
        flax_result.activations[FLAX_PATTERN], pattern, rtol=1e-4, atol=1e-6
    )
    np.testing.assert_allclose(
        flax_result.activation_grads[FLAX_PATTERN],
        grad,
        rtol=1e-3,
        atol=1e-4 * np.abs(grad).max(),
    )


def test_flax_bert_self_attention_pattern(monkeypatch):
    from transformers import BertConfig, FlaxBertModel
    from transformers.models.bert import modeling_flax_bert

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        intermediate_size=64,
        max_position_embeddings=16,
    )
    model = FlaxBertModel(config, seed=2)
    inputs = (IDS, np.ones_like(IDS), np.zeros_like(IDS), FLAX_INPUTS[2], None)
    probe = bridge.probe(
        model.module,
        {"params": model.params},
        inside=[
            modeling_flax_bert.FlaxBertSelfAttention,
            nn.dot_product_attention_weights,
        ],
    )
    # Not causal: the scores, plus the padding bias, then the softmax.
    site = "encoder/layer/1/attention/self/dot_product_attention_weights/attn_weights#2"
    result = jax.jit(lambda *xs: probe.value_and_grad(_flax_loss, *xs, at=site))(
        *inputs
    )
    want = model(*inputs[:4], output_attentions=True).attentions[1]
    np.testing.assert_allclose(result.activations[site], want, rtol=1e-5, atol=1e-7)

    grad = _grad_by_offset(
        monkeypatch,
        modeling_flax_bert,
        1,
        lambda: model.module.apply({"params": model.params}, *inputs),
        want,
    )
    got = result.activation_grads[site]
    np.testing.assert_allclose(got, grad, rtol=1e-5, atol=1e-6 * np.abs(grad).max())
