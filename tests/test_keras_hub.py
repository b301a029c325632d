"""KerasHub's GPT-2 backbone: probed at every block, and ported from Hugging
Face's PyTorch GPT-2.

Everything is checked against references independent of bridge: Keras's own
functional graph (a `keras.Model` over the blocks' outputs), a twin of the
backbone with an offset input added after each block (its gradient with
respect to the offsets, by `jax.grad` through Keras's `stateless_call`),
`jax.grad` through the backbone's `stateless_call`, and PyTorch's own
`GPT2Model` with a weight map written by hand.

Small configurations, random weights, no download. Keras's layers broadcast
by rank promotion (a `(units,)` bias onto `(batch, units)`), which the suite
refuses elsewhere: every test here allows it.
"""

from __future__ import annotations

import os

os.environ["KERAS_BACKEND"] = "jax"  # before any import of Keras

import jax
import jax.numpy as jnp
import numpy as np
import pytest

keras = pytest.importorskip("keras")
keras_hub = pytest.importorskip("keras_hub")

import bridge  # noqa: E402

pytestmark = pytest.mark.usefixtures("allow_rank_promotion")

VOCABULARY, LAYERS, HEADS, HIDDEN, INTERMEDIATE, LENGTH = 50, 2, 2, 16, 32, 8
BATCH = 2
BLOCKS = [f"transformer_layer_{n}" for n in range(LAYERS)]


def scale_agree(actual, expected, rtol=1e-5, atol=1e-6):
    """`max|a - b| <= atol + rtol * max|b|`: float32 rounding judged at the
    tensor's own scale."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    difference = np.max(np.abs(actual - expected))
    bound = atol + rtol * np.max(np.abs(expected))
    assert difference <= bound, (difference, bound)


def backbone():
    with jax.numpy_rank_promotion("allow"):
        return keras_hub.models.GPT2Backbone(
            vocabulary_size=VOCABULARY,
            num_layers=LAYERS,
            num_heads=HEADS,
            hidden_dim=HIDDEN,
            intermediate_dim=INTERMEDIATE,
            max_sequence_length=LENGTH,
        )


@pytest.fixture(scope="module")
def gpt2():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCABULARY, (BATCH, LENGTH)).astype("int32")
    mask = np.ones((BATCH, LENGTH), "int32")
    mask[1, -3:] = 0  # the second sequence is padded
    inputs = {"token_ids": ids, "padding_mask": mask}
    target = rng.standard_normal((BATCH, LENGTH, HIDDEN)).astype(np.float32)
    return backbone(), inputs, target


def keras_loss(target):
    return lambda outputs: jnp.mean((outputs - target) ** 2)


# -- probed at every block, under jax.jit ----------------------------------------


def offset_twin(model):
    """The backbone's graph rebuilt from its own layers (as
    `GPT2Backbone.__init__` builds it) with an offset input added after each
    block: no bridge."""
    token_ids = keras.Input((LENGTH,), dtype="int32", name="token_ids")
    padding_mask = keras.Input((LENGTH,), dtype="int32", name="padding_mask")
    offsets = [keras.Input((LENGTH, HIDDEN), name=f"offset_{n}") for n in BLOCKS]
    tokens = model.get_layer("token_embedding")(token_ids)
    positions = model.get_layer("position_embedding")(tokens)
    x = model.get_layer("embeddings_add")((tokens, positions))
    x = model.get_layer("embeddings_dropout")(x)
    for name, offset in zip(BLOCKS, offsets, strict=True):
        x = model.get_layer(name)(x, decoder_padding_mask=padding_mask)
        x = keras.layers.Add()([x, offset])
    x = model.get_layer("layer_norm")(x)
    return keras.Model([token_ids, padding_mask, *offsets], x)


@pytest.fixture(scope="module")
def probed(gpt2):
    """The backbone probed at every block, under `jax.jit`."""
    model, inputs, target = gpt2
    loss_fn = keras_loss(target)
    probe = bridge.probe(model)
    with jax.numpy_rank_promotion("allow"):  # a module's fixture: no test's
        sites = probe.sites(inputs)
        run = jax.jit(lambda p, x: p.value_and_grad(loss_fn, x, at=BLOCKS))
        return sites, run(probe, inputs)


def test_every_block_is_probed_and_its_activation_is_keras_own(gpt2, probed):
    model, inputs, _ = gpt2
    sites, res = probed
    # Each block is a site, named as Keras names the layer, and so are the
    # layers inside it.
    assert [name for name in sites if name in BLOCKS] == BLOCKS
    assert f"{BLOCKS[-1]}/self_attention/query" in sites
    assert list(res.activations) == BLOCKS
    # Keras's own functional graph, up to each block.
    blocks = keras.Model(model.input, [model.get_layer(name).output for name in BLOCKS])
    for name, expected in zip(BLOCKS, blocks.predict_on_batch(inputs), strict=True):
        scale_agree(res.activations[name], expected)


def test_parameter_gradients_are_jax_grad_through_stateless_call(gpt2, probed):
    model, inputs, target = gpt2
    _, res = probed
    loss_fn = keras_loss(target)
    non_trainable = [v.value for v in model.non_trainable_variables]

    def loss_of(values):
        outputs, _ = model.stateless_call(values, non_trainable, inputs)
        return loss_fn(outputs)

    trainable = [v.value for v in model.trainable_variables]
    loss, grads = jax.jit(jax.value_and_grad(loss_of))(trainable)
    scale_agree(res.loss, loss)
    expected = {
        v.path: g for v, g in zip(model.trainable_variables, grads, strict=True)
    }
    assert set(res.grads) == set(expected)
    for path, grad in expected.items():
        scale_agree(res.grads[path], grad)


def test_activation_gradients_are_those_of_an_offset_at_each_block(gpt2, probed):
    """The gradient with respect to an offset added after each block in a twin
    of the graph (`jax.grad`), and along one direction per block
    (`jax.jvp`)."""
    model, inputs, target = gpt2
    _, res = probed
    loss_fn = keras_loss(target)
    twin = offset_twin(model)
    trainable = [v.value for v in twin.trainable_variables]
    non_trainable = [v.value for v in twin.non_trainable_variables]
    ids, mask = inputs["token_ids"], inputs["padding_mask"]

    def twin_loss(offsets):
        outputs, _ = twin.stateless_call(
            trainable, non_trainable, [ids, mask, *offsets]
        )
        return loss_fn(outputs)

    zeros = [jnp.zeros((BATCH, LENGTH, HIDDEN))] * LAYERS
    direction = np.random.default_rng(1).standard_normal((BATCH, LENGTH, HIDDEN))
    direction = jnp.asarray(direction, jnp.float32)

    @jax.jit
    def references():
        loss, grads = jax.value_and_grad(twin_loss)(zeros)
        along = [
            jax.jvp(
                twin_loss, (zeros,), ([direction * (n == k) for k in range(LAYERS)],)
            )[1]
            for n in range(LAYERS)
        ]
        return loss, grads, along

    loss, grads, along = references()
    scale_agree(loss, res.loss)  # the twin is the backbone
    for name, grad, derivative in zip(BLOCKS, grads, along, strict=True):
        scale_agree(res.activation_grads[name], grad)
        given = jnp.vdot(res.activation_grads[name], direction)
        scale_agree(given, derivative, rtol=1e-5, atol=1e-7)


# -- ported from Hugging Face's PyTorch GPT-2 ------------------------------------


@pytest.fixture(scope="module")
def hf_gpt2():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=VOCABULARY,
        n_positions=LENGTH,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        n_inner=INTERMEDIATE,
        activation_function="gelu_new",  # KerasHub's gelu, tanh-approximated
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2Model(config).eval()
    with torch.no_grad():  # off the initial ones and zeros: every weight counts
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return torch, model


def hand_mapped(state_dict):
    """`{Keras variable path: array}` of a Hugging Face GPT-2 state dict,
    written from the two models' code, no bridge. `c_attn` packs query, key
    and value, each `(in, heads * head_dim)` with head `h` at columns
    `h * head_dim:(h + 1) * head_dim`."""
    sd = {name: tensor.detach().numpy() for name, tensor in state_dict.items()}
    head = HIDDEN // HEADS
    found = {
        "token_embedding/embeddings": sd["wte.weight"],
        "position_embedding/embeddings": sd["wpe.weight"],
        "layer_norm/gamma": sd["ln_f.weight"],
        "layer_norm/beta": sd["ln_f.bias"],
    }
    for n in range(LAYERS):
        k, h = f"transformer_layer_{n}", f"h.{n}"
        attention = f"{k}/self_attention"
        for part, role in enumerate(("query", "key", "value")):
            columns = slice(part * HIDDEN, (part + 1) * HIDDEN)
            kernel = sd[f"{h}.attn.c_attn.weight"][:, columns]
            bias = sd[f"{h}.attn.c_attn.bias"][columns]
            found[f"{attention}/{role}/kernel"] = kernel.reshape(HIDDEN, HEADS, head)
            found[f"{attention}/{role}/bias"] = bias.reshape(HEADS, head)
        found[f"{attention}/attention_output/kernel"] = sd[
            f"{h}.attn.c_proj.weight"
        ].reshape(HEADS, head, HIDDEN)
        found[f"{attention}/attention_output/bias"] = sd[f"{h}.attn.c_proj.bias"]
        for keras_name, hf_name in (
            ("self_attention_layer_norm", "ln_1"),
            ("feedforward_layer_norm", "ln_2"),
        ):
            found[f"{k}/{keras_name}/gamma"] = sd[f"{h}.{hf_name}.weight"]
            found[f"{k}/{keras_name}/beta"] = sd[f"{h}.{hf_name}.bias"]
        for keras_name, hf_name in (
            ("feedforward_intermediate_dense", "c_fc"),
            ("feedforward_output_dense", "c_proj"),
        ):
            found[f"{k}/{keras_name}/kernel"] = sd[f"{h}.mlp.{hf_name}.weight"]
            found[f"{k}/{keras_name}/bias"] = sd[f"{h}.mlp.{hf_name}.bias"]
    return found


@pytest.fixture(scope="module")
def ported(gpt2, hf_gpt2):
    model, inputs, _ = gpt2
    torch, hf_model = hf_gpt2
    ids = torch.tensor(inputs["token_ids"], dtype=torch.long)
    mask = torch.tensor(inputs["padding_mask"], dtype=torch.long)
    hf_probe = bridge.probe(hf_model)
    with jax.numpy_rank_promotion("allow"):  # a module's fixture: no test's
        keras_port = bridge.transfer(
            hf_probe, bridge.probe(model), ids, args_b=(inputs,)
        )
    return hf_probe, keras_port, ids, mask


def test_transfer_from_hugging_face_writes_the_hand_map(gpt2, hf_gpt2, ported):
    model, inputs, _ = gpt2
    torch, hf_model = hf_gpt2
    _, keras_port, ids, mask = ported
    expected = hand_mapped(hf_model.state_dict())
    assert set(keras_port.trainable) == set(expected)
    for path, value in expected.items():
        np.testing.assert_array_equal(np.asarray(keras_port.trainable[path]), value)
    # ... and the port computes what PyTorch computes, padding mask and all.
    with torch.no_grad():
        hidden = hf_model(ids, attention_mask=mask).last_hidden_state.numpy()
    scale_agree(keras_port.apply(inputs).outputs, hidden)
    # The user's model keeps its own weights.
    for variable in model.trainable_variables:
        assert not np.array_equal(np.asarray(variable.value), expected[variable.path])


def test_transfer_to_hugging_face_gives_back_the_weights(gpt2, hf_gpt2, ported):
    _, inputs, _ = gpt2
    torch, hf_model = hf_gpt2
    transformers = pytest.importorskip("transformers")
    _, keras_port, ids, _ = ported
    torch.manual_seed(1)
    fresh = transformers.GPT2Model(hf_model.config).eval()
    back = bridge.transfer(keras_port, bridge.probe(fresh), inputs, args_b=(ids,))
    (moved,) = back.unwrap()
    original = hf_model.state_dict()
    for name, tensor in moved.state_dict().items():
        if name.endswith("attn.bias") or name.endswith("masked_bias"):
            continue  # buffers of older transformers, no weights
        np.testing.assert_array_equal(tensor.numpy(), original[name].numpy(), name)


def compare_losses(torch, target):
    def hf_loss(outputs):
        return torch.mean((outputs.last_hidden_state - torch.tensor(target)) ** 2)

    return hf_loss, keras_loss(target)


def test_compare_of_the_port_agrees_at_every_layer(gpt2, hf_gpt2, ported):
    _, inputs, target = gpt2
    torch, _ = hf_gpt2
    hf_probe, keras_port, ids, mask = ported
    report = bridge.compare(
        hf_probe,
        keras_port,
        compare_losses(torch, target),
        ids,
        attention_mask=mask,
        args_b=(inputs,),
        logits=False,
    )
    assert report.first_divergence is None, str(report)
    # Embeddings, five layers per block (the packed query, key and value
    # against Keras's three projections), the final norm.
    assert len(report.rows) == 2 + 6 * LAYERS + 1
    pairs = [(row.site_a, row.site_b) for row in report.rows]
    assert pairs[:4] == [
        ("wte", "token_embedding"),
        ("wpe", "position_embedding"),
        ("h.0.ln_1", "transformer_layer_0/self_attention_layer_norm"),
        ("h.0.attn.c_attn", "transformer_layer_0/self_attention/query+key+value"),
    ]
    assert pairs[6] == (
        "h.0.mlp.c_fc",  # Keras's Dense applies the gelu, PyTorch's act after it
        "transformer_layer_0/feedforward_intermediate_dense",
    )
    assert all(row.activation_rel < 1e-5 and row.grad_rel < 1e-5 for row in report.rows)


def _planted(probe, path, change):
    """`probe` with the value at `path` changed: a port with one bug."""

    def plant(key_path, value):
        return change(value) if key_path[-1].key == path else value

    return jax.tree_util.tree_map_with_path(plant, probe)


def _swap_heads(kernel):
    return kernel[:, ::-1, :]  # (in, heads, head_dim): the heads swapped


@pytest.mark.parametrize(
    ("path", "change", "site_a", "site_b"),
    [
        (
            "transformer_layer_1/feedforward_intermediate_dense/kernel",
            lambda kernel: kernel * 1.01,
            "h.1.mlp.c_fc",
            "transformer_layer_1/feedforward_intermediate_dense",
        ),
        (
            "transformer_layer_1/self_attention/value/kernel",
            _swap_heads,
            "h.1.attn.c_attn",
            "transformer_layer_1/self_attention/query+key+value",
        ),
    ],
    ids=["scaled_mlp_kernel", "value_heads_swapped"],
)
def test_compare_names_a_planted_bug(
    gpt2, hf_gpt2, ported, path, change, site_a, site_b
):
    _, inputs, target = gpt2
    torch, _ = hf_gpt2
    hf_probe, keras_port, ids, mask = ported
    buggy = _planted(keras_port, path, change)
    report = bridge.compare(
        hf_probe,
        buggy,
        compare_losses(torch, target),
        ids,
        attention_mask=mask,
        args_b=(inputs,),
        logits=False,
    )
    first = report.first_divergence
    assert (first.site_a, first.site_b) == (site_a, site_b), str(report)
    assert not first.activations_agree
    before = report.rows[: report.rows.index(first)]
    assert before and all(row.activations_agree for row in before)


def test_causal_lm_head_tied_to_the_token_embedding(gpt2, hf_gpt2):
    """KerasHub's `GPT2CausalLM` computes its logits with the token
    embedding called again (`reverse=True`), Hugging Face's
    `GPT2LMHeadModel` with an `lm_head` holding `wte`'s tensor: both are
    tied, left out of the pairing and compared with each other."""
    model, inputs, _ = gpt2
    torch, hf_model = hf_gpt2
    transformers = pytest.importorskip("transformers")
    with jax.numpy_rank_promotion("allow"):
        causal_lm = keras_hub.models.GPT2CausalLM(backbone=model, preprocessor=None)
    hf_lm = transformers.GPT2LMHeadModel(hf_model.config).eval()
    hf_lm.transformer.load_state_dict(hf_model.state_dict())
    ids = torch.tensor(inputs["token_ids"], dtype=torch.long)
    mask = torch.tensor(inputs["padding_mask"], dtype=torch.long)
    hf_probe = bridge.probe(hf_lm)
    port = bridge.transfer(hf_probe, bridge.probe(causal_lm), ids, args_b=(inputs,))
    with torch.no_grad():
        expected = hf_lm(ids, attention_mask=mask).logits.numpy()
    scale_agree(port.apply(inputs).outputs, expected)

    labels = inputs["token_ids"]

    def hf_loss(outputs):
        logits = outputs.logits.reshape(-1, VOCABULARY)
        return torch.nn.functional.cross_entropy(
            logits, torch.tensor(labels, dtype=torch.long).reshape(-1)
        )

    def keras_loss(logits):
        log_p = jax.nn.log_softmax(logits, -1)
        return -jnp.mean(jnp.take_along_axis(log_p, labels[..., None], -1))

    report = bridge.compare(
        hf_probe,
        port,
        (hf_loss, keras_loss),
        ids,
        attention_mask=mask,
        args_b=(inputs,),
    )
    assert report.first_divergence is None, str(report)
    last = report.rows[-1]
    assert (last.site_a, last.site_b, last.kind) == (
        "lm_head",
        "token_embedding#1",
        "tied",
    )
    assert len(report.tied) == 2
    assert report.top1_agreement == 1.0
