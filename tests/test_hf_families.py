"""More Hugging Face families ported between their PyTorch and Flax twins.

Each from a tiny config (no download), each with what makes its port hard:
- ViT: the embeddings module owns `cls_token` and the position table itself
  while calling its patch convolution (NCHW in PyTorch, NHWC in Flax);
- Llama and Gemma: the families' own RMSNorm classes (Gemma's scale is
  `1 + weight`), no biases, rotary embeddings without weights;
- ResNet: convolutions and BatchNorms with running statistics, channel-first
  against channel-last, a strided 1x1 shortcut (`"SAME"` in Flax);
- OPT: a tied head the Flax model applies with the embedding's transpose,
  and a position embedding whose `__call__` calls `nn.Embed.__call__`;
- BERT's masked-LM head: a decoder tied to the word embeddings whose bias is
  its parent's.

References that do not use bridge: Hugging Face's `convert_pytorch_state_dict_
to_flax` (ResNet's, whose output this release keys differently from the
model, replaced by the layouts written out by hand) and the two models' own
outputs.
"""

from __future__ import annotations

import numpy as np
import pytest

import bridge

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.llama.modeling_flax_llama")
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
from transformers.modeling_flax_pytorch_utils import (  # noqa: E402
    convert_pytorch_state_dict_to_flax,
)

pytestmark = pytest.mark.usefixtures("allow_rank_promotion")

IDS = np.random.default_rng(0).integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
POSITIONS = np.broadcast_to(np.arange(SEQ), IDS.shape)


def _twins(torch_class, flax_class, config, seed, **kwargs):
    """`(torch model, Flax model, HF-converted params)`."""
    import jax

    torch.manual_seed(seed)
    torch_model = torch_class(config, **kwargs).eval()
    # A module fixture is set up before the function-scoped one allowing it.
    with jax.numpy_rank_promotion("allow"):
        flax_model = flax_class(config, seed=seed, **kwargs)
        converted = convert_pytorch_state_dict_to_flax(
            torch_model.state_dict(), flax_model
        )
    return torch_model, flax_model, converted


def _compare(torch_model, flax_model, params, loss, torch_inputs, flax_inputs):
    return bridge.compare(
        bridge.probe(torch_model),
        flax_probe(flax_model, params),
        loss,
        *torch_inputs,
        args_b=flax_inputs,
        rtol=RTOL,
        atol=ATOL,
    )


# -- ViT ------------------------------------------------------------------------

IMAGES = np.random.default_rng(1).normal(size=(BATCH, 3, 16, 16)).astype(np.float32)
_vit_loss = weighted_sum(
    np.random.default_rng(2).normal(size=(BATCH, 17, 32)).astype(np.float32), torch
)


@pytest.fixture(scope="module")
def vit():
    from transformers import FlaxViTModel, ViTConfig, ViTModel

    config = ViTConfig(
        image_size=16,
        patch_size=4,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
    )
    twins = _twins(ViTModel, FlaxViTModel, config, 3, add_pooling_layer=False)
    # PyTorch takes NCHW images, Flax's module NHWC.
    return (*twins, (torch.tensor(IMAGES),), (IMAGES.transpose(0, 2, 3, 1),))


def test_vit_embeddings_own_weights_move_as_hf_converter_moves_them(vit):
    torch_model, flax_model, converted, torch_inputs, flax_inputs = vit
    ported = bridge.transfer(
        bridge.probe(torch_model),
        flax_probe(flax_model, flax_model.params),
        *torch_inputs,
        args_b=flax_inputs,
    )
    assert_flat_equal(ported.variables["params"], converted)

    torch.manual_seed(4)
    fresh = type(torch_model)(torch_model.config, add_pooling_layer=False).eval()
    back = bridge.transfer(
        flax_probe(flax_model, converted),
        bridge.probe(fresh),
        *flax_inputs,
        args_b=torch_inputs,
    ).module
    for name, tensor in torch_model.state_dict().items():
        np.testing.assert_array_equal(
            back.state_dict()[name].numpy(), tensor.numpy(), err_msg=name
        )


def test_vit_compare_agrees_and_names_a_bug_in_the_cls_token(vit):
    torch_model, flax_model, converted, torch_inputs, flax_inputs = vit
    with torch.no_grad():
        want = torch_model(*torch_inputs).last_hidden_state.numpy()
    got = flax_model(IMAGES, params=converted).last_hidden_state
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)

    report = _compare(
        torch_model, flax_model, converted, _vit_loss, torch_inputs, flax_inputs
    )
    assert report.first_divergence is None, str(report)
    first = report.rows[0]
    assert (first.site_a, first.site_b) == ("embeddings", "embeddings")
    assert first.kind == "weights:cls_token,position_embeddings"
    assert report.rows[1].kind == "conv"  # the patch projection
    assert len(report.rows) == 19  # embeddings, patches, 2 x 8, final norm

    named = first_divergence_with_a_bug(
        torch_model,
        flax_model,
        converted,
        ("embeddings", "cls_token"),
        (0, 0, 5),
        _vit_loss,
        torch_inputs,
        flax_inputs,
    )
    assert named == ("embeddings", "embeddings")


# -- Llama and Gemma: the families' own RMSNorms --------------------------------


def _logits_loss(outputs):
    return (outputs.logits**2).sum()


def _decoder(family):
    from transformers import (
        FlaxGemmaForCausalLM,
        FlaxLlamaForCausalLM,
        GemmaConfig,
        GemmaForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
    )

    sizes = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    if family == "llama":
        config = LlamaConfig(**sizes)
        torch_model, flax_model, _ = _twins(
            LlamaForCausalLM, FlaxLlamaForCausalLM, config, 5
        )
    else:
        act = "gelu_pytorch_tanh"
        config = GemmaConfig(**sizes, head_dim=8, hidden_act=act, hidden_activation=act)
        torch_model, flax_model, _ = _twins(
            GemmaForCausalLM, FlaxGemmaForCausalLM, config, 6
        )
    # The norms start at 1 (Gemma's at 0, its scale 1 + 0): weights that
    # differ from their initial values tell a scale moved from one left alone.
    with torch.no_grad():
        for name, tensor in torch_model.named_parameters():
            if "norm" in name:
                tensor.uniform_(-0.5, 1.5)
    import jax

    with jax.numpy_rank_promotion("allow"):
        converted = convert_pytorch_state_dict_to_flax(
            torch_model.state_dict(), flax_model
        )
    flat = flatten_dict(converted)
    if config.tie_word_embeddings:  # Gemma's: no layer of its own in Flax
        del flat["lm_head", "kernel"]
    return torch_model, flax_model, unflatten_dict(flat)


@pytest.fixture(scope="module", params=["llama", "gemma"])
def decoder(request):
    return (request.param, *_decoder(request.param))


def test_decoder_rmsnorms_move_as_hf_converter_moves_them(decoder):
    family, torch_model, flax_model, converted = decoder
    ported = bridge.transfer(
        bridge.probe(torch_model),
        flax_probe(flax_model, flax_model.params),
        torch.tensor(IDS),
        args_b=(IDS, np.ones_like(IDS), POSITIONS),
    )
    # Gemma's `1 + weight` and back is exact: in float64.
    assert_flat_equal(ported.variables["params"], converted)


def test_decoder_compare_agrees_and_names_a_bug(decoder):
    family, torch_model, flax_model, converted = decoder
    flax_inputs = (IDS, np.ones_like(IDS), POSITIONS)
    with torch.no_grad():
        want = torch_model(torch.tensor(IDS)).logits.numpy()
    got = flax_model(*flax_inputs, params=converted).logits
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-4)

    report = _compare(
        torch_model,
        flax_model,
        converted,
        _logits_loss,
        (torch.tensor(IDS),),
        flax_inputs,
    )
    assert report.first_divergence is None, str(report)
    norms = [row for row in report.rows if "norm" in row.site_a]
    assert len(norms) == 5 and {row.kind for row in norms} == {"rmsnorm"}
    assert all(not row.hyperparameters for row in norms)  # epsilons equal
    assert (family == "gemma") == bool(report.tied)  # Gemma ties its head

    # One channel's scale off by 1e-3 of itself: named at its norm, well
    # above the float32 rounding the pairs agree within.
    named = first_divergence_with_a_bug(
        torch_model,
        flax_model,
        converted,
        ("model", "layers", "1", "post_attention_layernorm", "weight"),
        (7,),
        _logits_loss,
        (torch.tensor(IDS),),
        flax_inputs,
        relative=1e-3,
    )
    assert named == (
        "model.layers.1.post_attention_layernorm",
        "model/layers/1/post_attention_layernorm",
    )


# -- ResNet ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def resnet():
    import jax
    from transformers import FlaxResNetModel, ResNetConfig, ResNetModel

    config = ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic"
    )
    torch.manual_seed(7)
    torch_model = ResNetModel(config).eval()
    with torch.no_grad():  # running statistics and affine weights not at init
        for module in torch_model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 1.5)
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
    with jax.numpy_rank_promotion("allow"):
        flax_model = FlaxResNetModel(config, seed=8)
    images = np.random.default_rng(9).normal(size=(BATCH, 3, 32, 32))
    images = images.astype(np.float32)
    return torch_model, flax_model, images


def _resnet_by_hand(torch_model):
    """The Flax variables, written out from the PyTorch state dict by hand:
    OIHW kernels as HWIO, BatchNorm's weight as `scale`, its running
    statistics in `batch_stats`; `layer.0` is Flax's `layer/layer_0`."""
    found = {}
    for name, tensor in torch_model.state_dict().items():
        *path, leaf = name.split(".")
        path = [
            f"layer_{part}" if prev == "layer" else part
            for prev, part in zip(["", *path], path, strict=False)
        ]
        value = tensor.numpy()
        if leaf == "num_batches_tracked":
            continue
        if leaf == "weight" and value.ndim == 4:
            found[("params", *path, "kernel")] = value.transpose(2, 3, 1, 0)
        elif leaf in ("running_mean", "running_var"):
            found[("batch_stats", *path, leaf.removeprefix("running_"))] = value
        else:
            found[("params", *path, {"weight": "scale"}.get(leaf, leaf))] = value
    return unflatten_dict(found)


def test_resnet_transfer_and_compare(resnet):
    torch_model, flax_model, images = resnet
    nhwc = images.transpose(0, 2, 3, 1)
    ported = bridge.transfer(
        bridge.probe(torch_model),
        bridge.probe(flax_model.module, flax_model.params),
        torch.tensor(images),
        args_b=(nhwc,),
    )
    assert_flat_equal(ported.variables, _resnet_by_hand(torch_model))
    with torch.no_grad():
        want = torch_model(torch.tensor(images)).pooler_output.numpy()
    got = ported.apply(nhwc).outputs.pooler_output  # Flax's is NCHW too
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)

    report = bridge.compare(
        bridge.probe(torch_model),
        ported,
        lambda outputs: (outputs.pooler_output**2).sum(),
        torch.tensor(images),
        args_b=(nhwc,),
        rtol=RTOL,
        atol=ATOL,
    )
    assert report.first_divergence is None, str(report)
    assert [row.kind for row in report.rows[:2]] == ["conv", "batchnorm"]
    assert report.rows[-2].site_a == "encoder.stages.1.layers.0.shortcut.convolution"
    # The strided 1x1 shortcut: "SAME" pads nothing, whatever the input size.
    assert all(not row.hyperparameters for row in report.rows), str(report)


# -- OPT and BERT's masked-LM head: tied heads the Flax model applies itself ----


def test_opt_tied_head_and_nested_embed_call(allow_rank_promotion):
    from transformers import FlaxOPTForCausalLM, OPTConfig, OPTForCausalLM

    config = OPTConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        ffn_dim=64,
        num_attention_heads=2,
        max_position_embeddings=16,
        word_embed_proj_dim=32,
    )
    torch_model, flax_model, converted = _twins(
        OPTForCausalLM, FlaxOPTForCausalLM, config, 10
    )
    # The converter writes the head's kernel, which Flax's model never reads:
    # it applies its head with the embedding's transpose.
    assert ("lm_head", "kernel") in flatten_dict(converted)
    flax_inputs = (IDS, np.ones_like(IDS), POSITIONS)
    report = _compare(
        torch_model,
        flax_model,
        converted,
        _logits_loss,
        (torch.tensor(IDS),),
        flax_inputs,
    )
    assert report.first_divergence is None, str(report)
    assert len(report.rows) == 19
    assert len(report.tied) == 1 and "'model.decoder.embed_tokens'" in report.tied[0]
    # FlaxOPTLearnedPositionalEmbedding's `__call__` calls nn.Embed's.
    assert len(report.unpaired) == 1
    assert "'model/decoder/embed_positions#1'" in report.unpaired[0]


def test_bert_masked_lm_head_tied_with_its_parents_bias(allow_rank_promotion):
    from transformers import BertConfig, BertForMaskedLM, FlaxBertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
    )
    torch_model, flax_model, converted = _twins(
        BertForMaskedLM, FlaxBertForMaskedLM, config, 11
    )
    with torch.no_grad():  # a bias that is not zero, to be seen moving
        torch_model.cls.predictions.bias.uniform_(-1.0, 1.0)
    torch_inputs = (torch.tensor(IDS),)
    flax_inputs = (IDS, np.ones_like(IDS), np.zeros_like(IDS), POSITIONS, None)
    ported = bridge.transfer(
        bridge.probe(torch_model),
        flax_probe(flax_model, flax_model.params),
        *torch_inputs,
        args_b=flax_inputs,
    )
    np.testing.assert_array_equal(
        ported.variables["params"]["cls"]["predictions"]["bias"],
        torch_model.cls.predictions.bias.detach().numpy(),
    )
    report = bridge.compare(
        bridge.probe(torch_model),
        ported,
        _logits_loss,
        *torch_inputs,
        args_b=flax_inputs,
        rtol=RTOL,
        atol=ATOL,
    )
    assert report.first_divergence is None, str(report)
    assert len(report.tied) == 1 and "'cls.predictions.decoder'" in report.tied[0]
    predictions = [row for row in report.rows if row.site_a == "cls.predictions"]
    assert [row.kind for row in predictions] == ["weights:bias"]

    torch.manual_seed(12)
    fresh = BertForMaskedLM(config).eval()
    back = bridge.transfer(
        ported, bridge.probe(fresh), *flax_inputs, args_b=torch_inputs
    ).module
    assert (
        back.cls.predictions.decoder.weight
        is back.bert.embeddings.word_embeddings.weight
    )
    for name, tensor in torch_model.state_dict().items():
        np.testing.assert_array_equal(
            back.state_dict()[name].numpy(), tensor.numpy(), err_msg=name
        )


@pytest.mark.parametrize(
    "path, offset",
    [
        ("transformers.models.llama.modeling_llama.LlamaRMSNorm", 0.0),
        ("transformers.models.t5.modeling_t5.T5LayerNorm", 0.0),
        ("transformers.models.gemma.modeling_gemma.GemmaRMSNorm", 1.0),
    ],
)
def test_hf_rmsnorm_ports_to_a_plain_linen_rmsnorm(path, offset):
    import importlib

    import flax.linen as linen
    import jax

    module_name, name = path.rsplit(".", 1)
    norm = getattr(importlib.import_module(module_name), name)(32, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 1.5)
    x = np.random.default_rng(13).normal(size=(BATCH, SEQ, 32)).astype(np.float32)
    target = linen.RMSNorm(epsilon=1e-5)
    ported = bridge.transfer(
        bridge.probe(norm),
        bridge.probe(target, target.init(jax.random.key(0), x)),
        x,
    )
    scale = ported.variables["params"]["scale"]
    np.testing.assert_allclose(scale, norm.weight.detach().numpy() + offset, rtol=1e-5)
    with torch.no_grad():
        want = norm(torch.tensor(x)).numpy()
    np.testing.assert_allclose(ported.apply(x).outputs, want, rtol=RTOL, atol=ATOL)


# -- BART: a logits bias PyTorch keeps as a buffer, Flax as a parameter ---------


def test_bart_final_logits_bias_buffer_moves_to_the_flax_parameter(
    allow_rank_promotion,
):
    """PyTorch's `final_logits_bias` is a buffer of the root module, Flax's
    a parameter: they pair by name. The decoder's embedding is tied to the
    shared one in PyTorch and a second call of it in Flax: compared with
    each other."""
    from transformers import (
        BartConfig,
        BartForConditionalGeneration,
        FlaxBartForConditionalGeneration,
    )

    config = BartConfig(
        vocab_size=VOCAB,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=16,
    )
    torch.manual_seed(14)
    torch_model = BartForConditionalGeneration(config).eval()
    with torch.no_grad():  # not zero, to be seen moving
        torch_model.final_logits_bias.uniform_(-1.0, 1.0)
    flax_model = FlaxBartForConditionalGeneration(config, seed=14)
    converted = convert_pytorch_state_dict_to_flax(torch_model.state_dict(), flax_model)
    decoder_ids = IDS[:, :5]
    torch_inputs = (torch.tensor(IDS),)
    torch_kwargs = {"decoder_input_ids": torch.tensor(decoder_ids)}
    flax_inputs = (
        IDS,
        np.ones_like(IDS),
        decoder_ids,
        np.ones_like(decoder_ids),
        POSITIONS,
        POSITIONS[:, :5],
    )
    ported = bridge.transfer(
        bridge.probe(torch_model),
        flax_probe(flax_model, flax_model.params),
        *torch_inputs,
        args_b=flax_inputs,
        kwargs_b={},
        **torch_kwargs,
    )
    # The converter also writes kernels of the tied embeddings and head,
    # which the Flax model does not hold.
    tied = {
        ("model", "encoder", "embed_tokens", "kernel"),
        ("model", "decoder", "embed_tokens", "kernel"),
        ("lm_head", "kernel"),
    }
    keys = [key for key in flatten_dict(converted) if key not in tied]
    assert_flat_equal(ported.variables["params"], converted, keys)
    assert ("final_logits_bias",) in keys

    report = bridge.compare(
        bridge.probe(torch_model),
        ported,
        _logits_loss,
        *torch_inputs,
        args_b=flax_inputs,
        kwargs_b={},
        rtol=RTOL,
        atol=ATOL,
        **torch_kwargs,
    )
    assert report.first_divergence is None, str(report)
    decoder_embedding = [row for row in report.rows if row.kind == "tied"]
    assert [(row.site_a, row.site_b) for row in decoder_embedding] == [
        ("model.decoder.embed_tokens", "model/shared#1")
    ]
    assert report.unpaired == () and len(report.tied) == 2
    assert report.top1_agreement == 1.0 and report.kl_divergence < 1e-9
