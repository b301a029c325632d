"""Model zoo, Flax Linen: Hugging Face `transformers` Flax models nobody here wrote.

`FlaxGPT2LMHeadModel` and `FlaxBertForSequenceClassification` from tiny
configurations (random init, no download), probed at every site as
`bridge.probe(model.module, {"params": model.params})`, in evaluation and in
training mode (dropout from `rngs={"dropout": key}`), BERT also with its
`gradient_checkpointing` option (`nn.remat` around each layer).

Every number is checked against a reference that does not go through bridge:

- loss and parameter gradients: plain `jax.grad` of `module.apply`;
- activations: Flax's own `capture_intermediates=True`;
- activation gradients: `jax.jvp` (as `jax.jacfwd` over one scalar per site)
  of the loss with `t * delta` added to a site's output by this file's own
  `nn.intercept_methods` interceptor; `vdot(activation_grad, delta)` must
  equal the directional derivative.

The default tier runs the probe under `jax.jit`; its eager runs are the slow
tier (the references are jitted in both).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_activations_equal_recorded,
    assert_directional_derivatives,
    assert_sites_shaped_like_recorded,
    float_leaves,
    value_and_grad_in,
)

import bridge

transformers = pytest.importorskip("transformers")

BATCH, SEQ, VOCAB, LABELS = 2, 8, 100, 3


#: Transformers' Flax code broadcasts by rank promotion (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("allow_rank_promotion")


# -- the models ----------------------------------------------------------------


def _token_inputs(seed=0):
    ids = jax.random.randint(jax.random.key(seed), (BATCH, SEQ), 0, VOCAB)
    # The second sequence is padded: its last three tokens are masked out.
    mask = jnp.ones((BATCH, SEQ), jnp.int32).at[1, SEQ - 3 :].set(0)
    positions = jnp.broadcast_to(jnp.arange(SEQ), (BATCH, SEQ))
    return ids, mask, positions


def _gpt2(tie=True):
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        tie_word_embeddings=tie,
    )
    return transformers.FlaxGPT2LMHeadModel(config, input_shape=(1, SEQ), seed=0)


def _bert(gradient_checkpointing=False):
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        num_labels=LABELS,
    )
    return transformers.FlaxBertForSequenceClassification(
        config,
        input_shape=(1, SEQ),
        seed=0,
        gradient_checkpointing=gradient_checkpointing,
    )


def _next_token_loss(ids, mask):
    def loss_fn(out):
        logp = jax.nn.log_softmax(out.logits[:, :-1])
        picked = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
        weights = mask[:, 1:].astype(logp.dtype)
        return -jnp.sum(picked * weights) / jnp.sum(weights)

    return loss_fn


def _classification_loss(labels):
    def loss_fn(out):
        logp = jax.nn.log_softmax(out.logits)
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))

    return loss_fn


# name -> (model, args, model keywords, apply keywords, loss, jvp sites)
@functools.cache
def build(name):
    ids, mask, positions = _token_inputs()
    train = name.endswith("-train")
    apply_kwargs = {"rngs": {"dropout": jax.random.key(7)}} if train else {}
    if name.startswith("gpt2"):
        model = _gpt2()
        args = (ids, mask, positions)
        loss_fn = _next_token_loss(ids, mask)
        jvp_sites = (
            "transformer/h/0/attn/c_attn",
            "transformer/h/1",  # a tuple, `(hidden_states,)`
            "transformer/ln_f",
        )
    else:
        model = _bert(gradient_checkpointing="remat" in name)
        token_types = jnp.zeros_like(ids)
        args = (ids, mask, token_types, positions, None)
        labels = jnp.array([0, 2])
        loss_fn = _classification_loss(labels)
        jvp_sites = (
            "bert/embeddings/LayerNorm",
            "bert/encoder/layer/0/attention/self",
            "bert/pooler/dense",
        )
    return SimpleNamespace(
        module=model.module,
        variables={"params": model.params},
        args=args,
        model_kwargs={"deterministic": not train},
        apply_kwargs=apply_kwargs,
        loss_fn=loss_fn,
        jvp_sites=jvp_sites,
    )


VARIANTS = ["gpt2", "gpt2-train", "bert", "bert-remat-train"]


def _group(name):
    return pytest.param(name, marks=pytest.mark.xdist_group(f"zoo-linen-{name}"))


def _variants_and_modes():
    params = []
    for name in VARIANTS:
        group = pytest.mark.xdist_group(f"zoo-linen-{name}")
        params.append(pytest.param(name, "jit", marks=group, id=f"{name}-jit"))
        params.append(
            pytest.param(
                name, "eager", marks=[group, pytest.mark.slow], id=f"{name}-eager"
            )
        )
    return params


# -- the references: Flax and JAX alone, no bridge -------------------------------


def _call_name(context, counts):
    """This file's own site name for an intercepted call, or None for the root."""
    path = context.module.path
    if path == () or context.method_name == "setup":
        return None
    base = "/".join(path)
    if context.method_name != "__call__":
        base = f"{base}.{context.method_name}"
    index = counts.get(base, 0)
    counts[base] = index + 1
    return base if index == 0 else f"{base}#{index}"


def _add_to_float_leaves(value, delta):
    deltas = iter(jax.tree.leaves(delta))
    return jax.tree.map(
        lambda x: x + next(deltas) if jnp.issubdtype(x.dtype, jnp.inexact) else x,
        value,
    )


def _captured(intermediates):
    """`capture_intermediates`' tree as `{site name: output}` (root left out)."""
    found = {}

    def walk(tree, path):
        for key, value in tree.items():
            if isinstance(value, tuple):  # one method's outputs, one per call
                if not path:
                    continue
                base = "/".join(path)
                if key != "__call__":
                    base = f"{base}.{key}"
                for index, output in enumerate(value):
                    found[base if index == 0 else f"{base}#{index}"] = output
            else:
                walk(value, (*path, key))

    walk(intermediates, ())
    return found


@functools.cache
def reference(name):
    """Plain loss, `jax.grad` of the parameters, and Flax's own intermediates."""
    m = build(name)

    @jax.jit
    def run(params):
        def loss(params):
            out, state = m.module.apply(
                {**m.variables, "params": params},
                *m.args,
                **m.model_kwargs,
                **m.apply_kwargs,
                capture_intermediates=True,
                mutable=["intermediates"],
            )
            return m.loss_fn(out), (state["intermediates"], out)

        return jax.value_and_grad(loss, has_aux=True)(params)

    (loss, (intermediates, out)), grads = run(m.variables["params"])
    activations = _captured(intermediates)
    if name.startswith("gpt2"):
        # The tied head is an `apply` of its own, which capture_intermediates
        # does not record; its output is the model's logits.
        activations["lm_head"] = out.logits
    plain = jax.jit(
        lambda p: m.loss_fn(
            m.module.apply({"params": p}, *m.args, **m.model_kwargs, **m.apply_kwargs)
        )
    )(m.variables["params"])
    return SimpleNamespace(
        loss=loss,
        plain_loss=plain,
        grads=grads,
        activations=activations,
        logits=out.logits,
    )


@functools.cache
def jvp_reference(name):
    """`(deltas, d loss(t) / d t_i)` with `t_i * delta_i` added at site i."""
    m = build(name)
    captured = reference(name).activations
    keys = jax.random.split(jax.random.key(11), len(m.jvp_sites))
    deltas = [
        [jax.random.normal(k, x.shape, x.dtype) for x in float_leaves(captured[s])]
        for s, k in zip(m.jvp_sites, keys, strict=True)
    ]
    seen: list[set] = []

    def loss_along(t):
        counts: dict[str, int] = {}

        def interceptor(next_fun, args, kwargs, context):
            site = _call_name(context, counts)
            out = next_fun(*args, **kwargs)
            if site in m.jvp_sites:
                i = m.jvp_sites.index(site)
                out = _add_to_float_leaves(
                    out, [t[i] * d.astype(d.dtype) for d in deltas[i]]
                )
            return out

        with nn.intercept_methods(interceptor):
            out = m.module.apply(
                m.variables, *m.args, **m.model_kwargs, **m.apply_kwargs
            )
        seen.append(set(counts))
        return m.loss_fn(out)

    directional = jax.jit(jax.jacfwd(loss_along))(jnp.zeros(len(m.jvp_sites)))
    # The interceptor saw each call once per trace, under the names Flax records.
    assert seen and all(s == seen[0] for s in seen)
    return deltas, directional


# -- the probe -------------------------------------------------------------------


@functools.cache
def probed(name, mode):
    m = build(name)

    probe = bridge.probe(m.module, m.variables)
    kwargs = {**m.model_kwargs, **m.apply_kwargs}
    return value_and_grad_in(mode, probe, m.loss_fn, m.args, kwargs)


def _sites(name):
    m = build(name)
    probe = bridge.probe(m.module, m.variables)
    return probe.sites(*m.args, **m.model_kwargs, **m.apply_kwargs)


# -- tests -----------------------------------------------------------------------

GPT2_BLOCK = [
    "",
    "/ln_1",
    "/attn",
    "/attn/c_attn",
    "/attn/c_proj",
    "/attn/resid_dropout",
    "/ln_2",
    "/mlp",
    "/mlp/c_fc",
    "/mlp/c_proj",
    "/mlp/dropout",
]
GPT2_SITES = [
    "transformer",
    "transformer/wte",
    "transformer/wpe",
    "transformer/dropout",
    "transformer/h",
    *(f"transformer/h/0{s}" for s in GPT2_BLOCK),
    *(f"transformer/h/1{s}" for s in GPT2_BLOCK),
    "transformer/ln_f",
]


@pytest.mark.xdist_group("zoo-linen-gpt2")
def test_gpt2_sites_are_its_scope_paths_in_call_order():
    sites = _sites("gpt2")
    # The tied LM head is `self.lm_head.apply(...)` with the embedding as its
    # kernel: an `apply` of the model's own, whose root module keeps its name.
    # It is the same site untied, where it is an ordinary submodule call.
    assert list(sites) == [*GPT2_SITES, "lm_head"]
    assert sites["lm_head"].shape == (BATCH, SEQ, VOCAB)
    assert sites["transformer/h/0/attn/c_attn"].shape == (BATCH, SEQ, 3 * 32)
    assert sites["transformer/h/0/mlp/c_fc"].shape == (BATCH, SEQ, 4 * 32)
    m = build("gpt2")
    untied = _gpt2(tie=False)
    untied_sites = bridge.probe(untied.module, {"params": untied.params}).sites(*m.args)
    assert list(untied_sites) == [*GPT2_SITES, "lm_head"]
    assert untied_sites["lm_head"].shape == (BATCH, SEQ, VOCAB)


@pytest.mark.xdist_group("zoo-linen-bert")
def test_bert_sites_are_its_scope_paths_in_call_order():
    sites = list(_sites("bert"))
    layer = [
        "",
        "/attention",
        "/attention/self",
        "/attention/self/query",
        "/attention/self/key",
        "/attention/self/value",
        "/attention/output",
        "/attention/output/dense",
        "/attention/output/dropout",
        "/attention/output/LayerNorm",
        "/intermediate",
        "/intermediate/dense",
        "/output",
        "/output/dense",
        "/output/dropout",
        "/output/LayerNorm",
    ]
    assert sites[:7] == [
        "bert",
        "bert/embeddings",
        "bert/embeddings/word_embeddings",
        "bert/embeddings/position_embeddings",
        "bert/embeddings/token_type_embeddings",
        "bert/embeddings/LayerNorm",
        "bert/embeddings/dropout",
    ]
    start = sites.index("bert/encoder/layer/0")
    assert sites[start : start + 2 * len(layer)] == [
        f"bert/encoder/layer/{i}{s}" for i in range(2) for s in layer
    ]
    assert sites[-4:] == ["bert/pooler", "bert/pooler/dense", "dropout", "classifier"]


@pytest.mark.parametrize("name", [_group(n) for n in VARIANTS])
def test_sites_are_what_flax_capture_intermediates_records(name):
    assert_sites_shaped_like_recorded(_sites(name), reference(name).activations)


@pytest.mark.parametrize(("name", "mode"), _variants_and_modes())
def test_loss_and_parameter_gradients_equal_plain_jax_grad(name, mode):
    res, ref = probed(name, mode), reference(name)
    np.testing.assert_allclose(ref.loss, ref.plain_loss, rtol=1e-6)
    np.testing.assert_allclose(res.loss, ref.plain_loss, rtol=1e-5)
    assert jax.tree.structure(res.grads) == jax.tree.structure(ref.grads)
    for got, want in zip(
        jax.tree.leaves(res.grads), jax.tree.leaves(ref.grads), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("name", "mode"), _variants_and_modes())
def test_activations_equal_capture_intermediates(name, mode):
    assert_activations_equal_recorded(probed(name, mode), reference(name).activations)


@pytest.mark.parametrize(("name", "mode"), _variants_and_modes())
def test_activation_gradients_equal_jvp_of_a_hand_inserted_offset(name, mode):
    deltas, directional = jvp_reference(name)
    assert_directional_derivatives(
        probed(name, mode), build(name).jvp_sites, deltas, directional
    )


@pytest.mark.parametrize(
    ("name", "mode"),
    [p for p in _variants_and_modes() if p.values[0].startswith("gpt2")],
)
def test_the_tied_lm_head_gets_the_gradient_of_the_loss_at_the_logits(name, mode):
    res, ref = probed(name, mode), reference(name)
    loss_fn = build(name).loss_fn
    want = jax.grad(lambda logits: loss_fn(SimpleNamespace(logits=logits)))(ref.logits)
    np.testing.assert_allclose(res.activations["lm_head"], ref.logits, atol=1e-5)
    np.testing.assert_allclose(
        res.activation_grads["lm_head"], want, rtol=1e-4, atol=1e-8
    )


# -- the model object itself ------------------------------------------------------


@pytest.mark.xdist_group("zoo-linen-gpt2")
def test_a_hugging_face_flax_model_object_is_probed_as_its_module_and_params():
    """`bridge.probe(model)` with the `FlaxGPT2LMHeadModel` itself: the
    module's sites, and the numbers of the object's own call (no bridge)."""
    model = _gpt2()
    ids, mask, positions = _token_inputs()
    loss_fn = _next_token_loss(ids, mask)

    def own_loss(params):
        out = model(ids, attention_mask=mask, position_ids=positions, params=params)
        return loss_fn(out)

    probe = bridge.probe(model)
    res = jax.jit(lambda p: p.value_and_grad(loss_fn, ids, mask, positions))(probe)
    expected_loss, expected_grads = jax.value_and_grad(own_loss)(model.params)
    np.testing.assert_allclose(res.loss, expected_loss, rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(
            a, b, rtol=1e-4, atol=1e-5 * float(np.abs(b).max())
        ),
        res.grads,
        expected_grads,
    )
    by_hand = bridge.probe(model.module, {"params": model.params})
    # (a dict leaving `jax.jit` has its keys sorted)
    assert sorted(res.activations) == sorted(by_hand.sites(ids, mask, positions))
    # Variables given beside the object are the ones used.
    shifted = jax.tree.map(lambda p: p * 0.5, model.params)
    forward = bridge.probe(model, {"params": shifted}).apply(ids, mask, positions)
    np.testing.assert_allclose(
        forward.outputs.logits,
        model(ids, attention_mask=mask, position_ids=positions, params=shifted).logits,
        rtol=1e-5,
        atol=1e-6,
    )


def test_a_model_object_without_parameters_says_what_to_pass():
    config = _gpt2().config
    model = transformers.FlaxGPT2LMHeadModel(config, _do_init=False)
    with pytest.raises(
        ValueError, match=r"holds no parameters .*bridge\.probe\(model, \{'params'"
    ) as info:
        bridge.probe(model)
    assert isinstance(info.value, bridge.BridgeError)
