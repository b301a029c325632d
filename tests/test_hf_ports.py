"""Porting Hugging Face models between their PyTorch and Flax twins.

GPT-2 from a tiny config (no download): transformers' `Conv1D` (a Linear
with an `(in, out)` weight) and its `FlaxConv1D` (`(out, in)`), a tied LM
head (a layer in PyTorch holding the embedding's tensor, no layer in Flax),
and a position embedding PyTorch computes once for the batch, `(1, seq, d)`,
where the Flax model is given per-row positions, `(batch, seq, d)`. The
references are independent of bridge: Hugging Face's own converter for the
weights, the two models' own outputs for the numbers.
"""

from __future__ import annotations

import flax.linen as linen
import jax
import numpy as np
import pytest

import bridge

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.gpt2.modeling_flax_gpt2")
from flax.traverse_util import flatten_dict, unflatten_dict  # noqa: E402
from hf_pairs import (  # noqa: E402
    ATOL,
    BATCH,
    RTOL,
    SEQ,
    VOCAB,
    assert_flat_equal,
    first_divergence_with_a_bug,
    flax_probe,
    weighted_sum,
)
from transformers import (  # noqa: E402
    FlaxGPT2LMHeadModel,
    GPT2Config,
    GPT2LMHeadModel,
)
from transformers.modeling_flax_pytorch_utils import (  # noqa: E402
    convert_pytorch_state_dict_to_flax,
)

#: Transformers' Flax code broadcasts by rank promotion (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("allow_rank_promotion")


def _loss(outputs):
    # Plain arithmetic: the same function serves torch tensors and JAX arrays;
    # a sum keeps the activation gradients well above `ATOL`.
    return (outputs.logits**2).sum()


@pytest.fixture(scope="module")
def gpt2():
    """`(torch model, Flax model with random weights, HF-converted params,
    torch ids, Flax inputs)`."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4
    )
    torch_model = GPT2LMHeadModel(config).eval()
    # A module fixture is set up before the function-scoped one allowing it.
    with jax.numpy_rank_promotion("allow"):
        flax_model = FlaxGPT2LMHeadModel(config, seed=1)
        converted = convert_pytorch_state_dict_to_flax(
            torch_model.state_dict(), flax_model
        )
    ids = np.random.default_rng(0).integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
    # The Flax module takes (input_ids, attention_mask, position_ids); the
    # torch model computes its positions itself, once for the whole batch.
    flax_inputs = (ids, np.ones_like(ids), np.broadcast_to(np.arange(SEQ), ids.shape))
    return torch_model, flax_model, converted, torch.tensor(ids), flax_inputs


def _without_head(converted):
    """HF's converter also writes the tied head's kernel, which the Flax model
    does not hold (it reads the embedding)."""
    flat = flatten_dict(converted)
    assert flat.pop(("lm_head", "kernel")).shape == (32, VOCAB)
    return unflatten_dict(flat)


def test_gpt2_torch_to_flax_gives_hf_converters_params(gpt2):
    torch_model, flax_model, converted, ids, flax_inputs = gpt2
    ported = bridge.transfer(
        bridge.probe(torch_model),
        flax_probe(flax_model, flax_model.params),
        ids,
        args_b=flax_inputs,
    )
    assert_flat_equal(ported.variables["params"], _without_head(converted))


def test_gpt2_flax_to_torch_keeps_the_head_tied(gpt2):
    torch_model, flax_model, converted, ids, flax_inputs = gpt2
    torch.manual_seed(1)
    fresh = GPT2LMHeadModel(torch_model.config).eval()
    ported = bridge.transfer(
        flax_probe(flax_model, _without_head(converted)),
        bridge.probe(fresh),
        *flax_inputs,
        args_b=(ids,),
    ).module
    assert ported.lm_head.weight is ported.transformer.wte.weight
    for name, tensor in torch_model.state_dict().items():
        np.testing.assert_array_equal(
            ported.state_dict()[name].numpy(), tensor.numpy(), err_msg=name
        )


def test_gpt2_compare_of_the_converted_pair_agrees(gpt2):
    torch_model, flax_model, converted, ids, flax_inputs = gpt2
    params = _without_head(converted)
    # The references: both models' own logits agree.
    with torch.no_grad():
        torch_logits = torch_model(ids).logits.numpy()
    flax_logits = flax_model(*flax_inputs, params=params).logits
    np.testing.assert_allclose(flax_logits, torch_logits, rtol=RTOL, atol=1e-5)

    report = bridge.compare(
        bridge.probe(torch_model),
        flax_probe(flax_model, params),
        _loss,
        ids,
        args_b=flax_inputs,
        rtol=RTOL,
        atol=ATOL,
    )
    assert report.first_divergence is None, str(report)
    assert len(report.rows) == 15  # 2 embeddings, 2 x 6 per block, ln_f
    assert [row.kind for row in report.rows[:2]] == ["embed", "embed"]
    assert report.rows[3].kind == "dense"  # Conv1D / FlaxConv1D
    # The position embedding: (1, 6, 32) in torch, compared broadcast.
    assert report.rows[1].site_a == "transformer.wpe"
    assert report.rows[1].shape == (BATCH, SEQ, 32)
    assert len(report.tied) == 1 and "'lm_head'" in report.tied[0]
    assert "transformer.wte" in report.tied[0]
    assert report.unpaired == ()
    assert "tied, not paired: site 'lm_head'" in str(report)
    np.testing.assert_allclose(report.loss_a, report.loss_b, rtol=RTOL)


def test_gpt2_compare_names_a_planted_bug(gpt2):
    torch_model, flax_model, converted, ids, flax_inputs = gpt2
    key = ("transformer", "h", "1", "mlp", "c_fc", "kernel")
    named = first_divergence_with_a_bug(
        torch_model,
        flax_model,
        _without_head(converted),
        key,
        (3, 5),
        _loss,
        (ids,),
        flax_inputs,
    )
    assert named == ("transformer.h.1.mlp.c_fc", "transformer/h/1/mlp/c_fc")


# -- a dead call: the Flax model calls a layer once more than PyTorch -----------


class _DeadCall(linen.Module):
    @linen.compact
    def __call__(self, x):
        first = linen.Dense(8, name="first")
        hidden = first(x)
        first(2.0 * x)  # computed, never used
        return linen.Dense(3, name="second")(jax.nn.relu(hidden))


def _torch_twin():
    torch.manual_seed(2)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
    )


def test_a_dead_call_on_one_side_is_reported_not_refused():
    x = np.random.default_rng(1).normal(size=(5, 4)).astype(np.float32)
    model = _DeadCall()
    flax_probe = bridge.probe(model, model.init(jax.random.key(0), x))
    torch_model = _torch_twin()
    ported = bridge.transfer(bridge.probe(torch_model), flax_probe, x)
    with torch.no_grad():
        want = torch_model(torch.tensor(x)).numpy()
    np.testing.assert_allclose(ported.apply(x).outputs, want, rtol=RTOL, atol=ATOL)

    def loss(outputs):
        return (outputs**2).mean()

    report = bridge.compare(
        bridge.probe(torch_model), ported, loss, x, rtol=RTOL, atol=ATOL
    )
    assert [(row.site_a, row.site_b) for row in report.rows] == [
        ("0", "first"),
        ("2", "second"),
    ]
    assert report.first_divergence is None, str(report)
    # Its output never reaches the loss: dead, from the jaxpr, never paired.
    assert report.unpaired == ()
    assert len(report.dead) == 1 and "'first#1'" in report.dead[0]
    assert "of probe_b" in report.dead[0]
    assert "dead (its output never reaches the loss), not paired: site 'first#1'" in (
        str(report)
    )


def test_counts_differing_by_a_first_call_still_raise():
    x = np.random.default_rng(1).normal(size=(5, 4)).astype(np.float32)
    torch_model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    model = _DeadCall()
    with pytest.raises(bridge.BridgeError, match="same number"):
        bridge.compare(
            bridge.probe(torch_model),
            bridge.probe(model, model.init(jax.random.key(0), x)),
            lambda outputs: (outputs**2).mean(),
            x,
        )


# -- BERT: the embeddings' children called in different orders ------------------
#
# PyTorch's `BertEmbeddings` calls the token-type table before the position
# table, Flax's the other way round: pairing in call order would raise, or,
# where both tables have one shape, swap them silently.


def _bert(type_vocab_size):
    """`(torch model, Flax model, HF-converted params, torch ids, Flax inputs)`."""
    from transformers import BertConfig, BertModel, FlaxBertModel

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        type_vocab_size=type_vocab_size,
    )
    torch.manual_seed(3)
    torch_model = BertModel(config).eval()
    with jax.numpy_rank_promotion("allow"):
        flax_model = FlaxBertModel(config, seed=4)
        converted = convert_pytorch_state_dict_to_flax(
            torch_model.state_dict(), flax_model
        )
    rng = np.random.default_rng(5)
    ids = rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
    types = rng.integers(0, type_vocab_size, (BATCH, SEQ)).astype(np.int32)
    positions = np.broadcast_to(np.arange(SEQ), ids.shape)
    torch_inputs = (torch.tensor(ids), torch.ones(BATCH, SEQ), torch.tensor(types))
    flax_inputs = (ids, np.ones_like(ids), types, positions)
    return torch_model, flax_model, converted, torch_inputs, flax_inputs


@pytest.fixture(scope="module")
def bert():
    return _bert(type_vocab_size=2)


@pytest.fixture(scope="module")
def bert_tied_shapes():
    # Position and token-type tables both (16, 32): only their names tell.
    return _bert(type_vocab_size=16)


_bert_loss = weighted_sum(
    np.random.default_rng(6).normal(size=(BATCH, SEQ, 32)).astype(np.float32), torch
)


@pytest.mark.parametrize("fixture", ["bert", "bert_tied_shapes"])
def test_bert_torch_to_flax_gives_hf_converters_params(fixture, request):
    torch_model, flax_model, converted, torch_inputs, flax_inputs = (
        request.getfixturevalue(fixture)
    )
    ported = bridge.transfer(
        bridge.probe(torch_model),
        flax_probe(flax_model, flax_model.params),
        *torch_inputs,
        args_b=flax_inputs,
    )
    # A swap of the two (16, 32) tables would fail here.
    assert_flat_equal(ported.variables["params"], converted)


@pytest.mark.parametrize("fixture", ["bert", "bert_tied_shapes"])
def test_bert_compare_of_the_converted_pair_agrees(fixture, request):
    torch_model, flax_model, converted, torch_inputs, flax_inputs = (
        request.getfixturevalue(fixture)
    )
    with torch.no_grad():
        torch_out = torch_model(*torch_inputs).last_hidden_state.numpy()
    flax_out = flax_model(*flax_inputs, params=converted).last_hidden_state
    np.testing.assert_allclose(flax_out, torch_out, rtol=RTOL, atol=ATOL)

    report = bridge.compare(
        bridge.probe(torch_model),
        flax_probe(flax_model, converted),
        _bert_loss,
        *torch_inputs,
        args_b=flax_inputs,
        rtol=RTOL,
        atol=ATOL,
    )
    assert report.first_divergence is None, str(report)
    assert len(report.rows) == 20  # 3 embeddings + LayerNorm, 2 x 8
    # The loss reads `last_hidden_state`: the pooler is dead on both sides.
    assert [dead.split(" (")[0] for dead in report.dead] == [
        "site 'pooler.dense'",
        "site 'pooler/dense'",
    ]
    assert [(row.site_a, row.site_b) for row in report.rows[1:3]] == [
        ("embeddings.token_type_embeddings", "embeddings/token_type_embeddings"),
        ("embeddings.position_embeddings", "embeddings/position_embeddings"),
    ]
    np.testing.assert_allclose(report.loss_a, report.loss_b, rtol=RTOL)


def test_bert_compare_names_a_planted_bug(bert):
    torch_model, flax_model, converted, torch_inputs, flax_inputs = bert
    key = ("embeddings", "token_type_embeddings", "embedding")
    named = first_divergence_with_a_bug(
        torch_model,
        flax_model,
        converted,
        key,
        (1, 5),
        _bert_loss,
        torch_inputs,
        flax_inputs,
    )
    assert named == (
        "embeddings.token_type_embeddings",
        "embeddings/token_type_embeddings",
    )


def test_a_tie_no_name_settles_raises_naming_the_sites():
    # Three tables under one parent, the odd-sized one called last in PyTorch
    # and first in Flax, named differently on each side: the two (4, 8)
    # tables are told apart by neither shape nor name.
    class Torch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first = torch.nn.Embedding(4, 8)
            self.second = torch.nn.Embedding(4, 8)
            self.third = torch.nn.Embedding(6, 8)

        def forward(self, ids):
            return self.first(ids) + self.second(ids) + self.third(ids)

    class Flax(linen.Module):
        @linen.compact
        def __call__(self, ids):
            wide = linen.Embed(6, 8, name="c")(ids)
            return (
                wide
                + linen.Embed(4, 8, name="a")(ids)
                + linen.Embed(4, 8, name="b")(ids)
            )

    ids = np.zeros((2, 3), np.int32)
    model = Flax()
    with pytest.raises(ValueError, match="same kind and shapes") as e:
        bridge.transfer(
            bridge.probe(Torch()),
            bridge.probe(model, model.init(jax.random.key(0), ids)),
            ids,
        )
    assert isinstance(e.value, bridge.BridgeError)
    assert "'first', 'second'" in str(e.value) and "'a', 'b'" in str(e.value)
    assert "configs in which their shapes differ" in str(e.value)


# -- a position table broadcast over a missing batch axis ------------------------


def test_a_value_broadcast_over_a_missing_leading_axis_is_compared_broadcast():
    # PyTorch looks the positions up once, `(seq, d)`, and broadcasts them in
    # the sum; the Flax port looks them up per row, `(batch, seq, d)`.
    class Torch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.positions = torch.nn.Embedding(SEQ, 8)
            self.head = torch.nn.Linear(8, 3)

        def forward(self, x):
            return self.head(x + self.positions(torch.arange(x.shape[1])))

    class Flax(linen.Module):
        @linen.compact
        def __call__(self, x):
            rows = np.broadcast_to(np.arange(SEQ), x.shape[:2])
            return linen.Dense(3, name="head")(x + linen.Embed(SEQ, 8)(rows))

    torch.manual_seed(4)
    torch_model = Torch()
    x = np.random.default_rng(7).normal(size=(BATCH, SEQ, 8)).astype(np.float32)
    model = Flax()
    ported = bridge.transfer(
        bridge.probe(torch_model),
        bridge.probe(model, model.init(jax.random.key(0), x)),
        x,
    )

    def loss(outputs):
        return (outputs**2).sum()

    report = bridge.compare(
        bridge.probe(torch_model), ported, loss, x, rtol=RTOL, atol=ATOL
    )
    assert report.first_divergence is None, str(report)
    assert report.rows[0].shape == (BATCH, SEQ, 8)
    # The reference for the gradient: PyTorch's own, of the (seq, d) table's
    # output, against the Flax per-row gradients summed over the batch.
    torch_result = bridge.probe(torch_model).value_and_grad(loss, torch.tensor(x))
    flax_result = ported.value_and_grad(loss, x)
    np.testing.assert_allclose(
        flax_result.activation_grads["Embed_0"].sum(0),
        torch_result.activation_grads["positions"].numpy(),
        rtol=RTOL,
        atol=ATOL,
    )
    assert (
        report.rows[0].grad_abs
        <= ATOL
        + RTOL * np.abs(torch_result.activation_grads["positions"].numpy()).max()
    )
