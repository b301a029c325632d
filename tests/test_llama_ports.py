"""A Hugging Face PyTorch Llama ported by hand to Equinox and to Flax NNX.

transformers 5 has no Flax models, so a JAX Llama is written by hand: the
ports are ``examples/llama_ports.py`` (Equinox token by token under
``jax.vmap``, NNX on a batch). The references are independent of bridge: a
hand-written mapping of the ``state_dict`` into each port, and the PyTorch
model's own logits. Then ``bridge.transfer`` both ways, ``bridge.compare``,
``probe.unwrap()``, and eight classic porting bugs, each a flag of the
port's config, each named by ``compare`` at its layer (the skipped module by
``transfer``'s count mismatch).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bridge

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("equinox")
pytest.importorskip("flax.nnx")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from flax import nnx  # noqa: E402
from llama_ports import (  # noqa: E402
    EqxLlama,
    LlamaPort,
    NnxLlama,
    hf_state,
    load_eqx,
    load_nnx,
)
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

LIBRARIES = ("equinox", "nnx")
BATCH, SEQ = 2, 8
TOLERANCES = {"rtol": 1e-4, "atol": 1e-5}
CONFIG = LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)

ATTENTION_OUT = "model.layers.0.self_attn.o_proj"
#: bug -> (the port's config changes, the PyTorch layer compare names first)
BUGS = {
    "interleaved rotary": ({"interleaved_rotary": True}, ATTENTION_OUT),
    "kv heads tiled": ({"kv_tiled": True}, ATTENTION_OUT),
    "epsilon 1e-6": ({"rms_norm_eps": 1e-6}, "model.layers.0.input_layernorm"),
    "no attention scale": ({"no_attention_scale": True}, ATTENTION_OUT),
    "SiLU on up": ({"silu_on_up": True}, "model.layers.0.mlp.down_proj"),
    "no causal mask": ({"no_causal_mask": True}, ATTENTION_OUT),
    "heads split last": ({"heads_last": True}, ATTENTION_OUT),
}
SKIPPED = "model.layers.0.post_attention_layernorm"


def _hf_llama(config):
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # RMSNorm scales away from 1, as trained ones are
        for name, tensor in model.named_parameters():
            if "norm" in name:
                tensor.uniform_(0.5, 1.5)
    return model


class Llama:
    """One PyTorch model, its inputs, logits and losses."""

    def __init__(self, config):
        self.config = config
        self.model = _hf_llama(config)
        ids = np.random.default_rng(1).integers(0, config.vocab_size, (BATCH, SEQ))
        self.ids = ids.astype(np.int32)
        self.tokens = torch.tensor(self.ids)
        with torch.no_grad():
            self.logits = self.model(self.tokens).logits.numpy()
        self.source = bridge.probe(self.model)
        targets = self.ids[:, 1:]

        def torch_loss(outputs):
            logits = outputs.logits[:, :-1]
            return torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                torch.tensor(targets, dtype=torch.long).reshape(-1),
            )

        def jax_loss(logits):
            logits = jax.nn.log_softmax(logits[:, :-1])
            return -jnp.take_along_axis(logits, targets[..., None], axis=-1).mean()

        self.losses = (torch_loss, jax_loss)

    def port(self, library, **changes):
        """A probe of a port with random weights."""
        port = LlamaPort.from_hf(self.config, **changes)
        if library == "equinox":
            return bridge.probe(EqxLlama(port, key=jax.random.key(3)), vmap=True)
        return bridge.probe(NnxLlama(port, nnx.Rngs(3)))

    def hand_loaded(self, library, **changes):
        """The port holding the weights, mapped by hand (no bridge)."""
        port = LlamaPort.from_hf(self.config, **changes)
        state = hf_state(self.model)
        if library == "equinox":
            return load_eqx(EqxLlama(port, key=jax.random.key(3)), state)
        return load_nnx(NnxLlama(port, nnx.Rngs(3)), state)

    def transfer(self, library, **changes):
        return bridge.transfer(
            self.source, self.port(library, **changes), self.tokens, args_b=(self.ids,)
        )

    def compare(self, ported):
        return bridge.compare(
            self.source,
            ported,
            self.losses,
            self.tokens,
            args_b=(self.ids,),
            **TOLERANCES,
        )


def _run(library, model, ids):
    return np.asarray(jax.vmap(model)(ids) if library == "equinox" else model(ids))


def _leaves(library, model):
    if library == "nnx":
        model = nnx.state(model, nnx.Param)
    return [np.asarray(leaf) for leaf in jax.tree.leaves(model)]


@pytest.fixture(scope="module")
def llama():
    return Llama(CONFIG)


@pytest.fixture(scope="module")
def tied_llama():
    config = copy.deepcopy(CONFIG)
    config.tie_word_embeddings = True
    return Llama(config)


@pytest.fixture(scope="module")
def ported(llama):
    """The correct port of each library, transferred once."""
    return {library: llama.transfer(library) for library in LIBRARIES}


@pytest.mark.parametrize("library", LIBRARIES)
def test_the_hand_mapped_port_gives_pytorchs_logits(llama, library):
    """The reference: weights mapped by hand, the port run without bridge."""
    logits = _run(library, llama.hand_loaded(library), llama.ids)
    np.testing.assert_allclose(logits, llama.logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("library", LIBRARIES)
def test_transfer_moves_the_hand_mapping_and_compare_agrees(llama, ported, library):
    probe = ported[library]
    (model,) = probe.unwrap()
    assert type(model) is (EqxLlama if library == "equinox" else NnxLlama)
    expected = _leaves(library, llama.hand_loaded(library))
    got = _leaves(library, model)
    assert len(got) == len(expected) == 2 + 9 * CONFIG.num_hidden_layers + 1
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(
        _run(library, model, llama.ids), llama.logits, rtol=1e-5, atol=1e-6
    )
    report = llama.compare(probe)
    assert report.first_divergence is None, report
    assert len(report.rows) == 21
    assert report.rows[0].site_a == "model.embed_tokens"
    assert report.rows[-1].site_a == "lm_head"


@pytest.mark.parametrize("library", LIBRARIES)
def test_transfer_back_into_pytorch(llama, ported, library):
    torch.manual_seed(1)
    fresh = LlamaForCausalLM(CONFIG).eval()
    back = bridge.transfer(
        ported[library], bridge.probe(fresh), llama.ids, args_b=(llama.tokens,)
    )
    (copied,) = back.unwrap()
    with torch.no_grad():
        logits = copied(llama.tokens).logits.numpy()
    np.testing.assert_allclose(logits, llama.logits, rtol=1e-6, atol=1e-7)
    for name, tensor in llama.model.state_dict().items():
        torch.testing.assert_close(copied.state_dict()[name], tensor)


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_tied_head(tied_llama, library):
    """The port's head reads the embedding; PyTorch's lm_head holds it."""
    assert tied_llama.model.lm_head.weight is tied_llama.model.model.embed_tokens.weight
    probe = tied_llama.transfer(library)
    (model,) = probe.unwrap()
    assert model.lm_head is None
    np.testing.assert_allclose(
        _run(library, model, tied_llama.ids), tied_llama.logits, rtol=1e-5, atol=1e-6
    )
    assert tied_llama.compare(probe).first_divergence is None
    back = bridge.transfer(
        probe,
        bridge.probe(LlamaForCausalLM(tied_llama.config).eval()),
        tied_llama.ids,
        args_b=(tied_llama.tokens,),
    )
    (copied,) = back.unwrap()
    assert copied.lm_head.weight is copied.model.embed_tokens.weight
    with torch.no_grad():
        logits = copied(tied_llama.tokens).logits.numpy()
    np.testing.assert_allclose(logits, tied_llama.logits, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bug", list(BUGS))
@pytest.mark.parametrize("library", LIBRARIES)
def test_compare_names_each_bug_at_its_layer(llama, library, bug):
    changes, site = BUGS[bug]
    # A porter's path: transfer into the buggy port (its parameters are
    # those of the correct one), then compare.
    report = llama.compare(llama.transfer(library, **changes))
    first = report.first_divergence
    assert first is not None, report
    assert (first.site_a, first.site_b) == (
        site,
        site.removeprefix("model.").replace(".", "/"),
    ), report
    # Clearly above the tolerance; the activations of every layer before it
    # agree (their gradients may not: the loss is downstream of the bug).
    assert max(first.activation_rel, first.grad_rel) > 5e-3
    index = [row.site_a for row in report.rows].index(site)
    assert all(row.activations_agree for row in report.rows[:index])
    if "rms_norm_eps" in changes:  # marked at every norm, whatever the numbers
        marked = [row.site_a for row in report.rows if "epsilon" in row.hyperparameters]
        assert len(marked) == 2 * CONFIG.num_hidden_layers + 1, marked


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_skipped_norm_is_named_by_the_count_mismatch(llama, library):
    """The port holds the post-attention norm but does not call it: an
    unpaired layer, which `transfer` (where a porter starts) refuses, naming
    it; `compare` of weights loaded by hand says the same."""
    with pytest.raises(ValueError, match="same number of parameterised") as raised:
        llama.transfer(library, skip_post_attention_norm=True)
    assert f"site '{SKIPPED}' (rmsnorm) of the source" in str(raised.value)
    assert "'layers/0/mlp/gate_proj' (dense) of the destination" in str(raised.value)
    model = llama.hand_loaded(library, skip_post_attention_norm=True)
    probe = (
        bridge.probe(model, vmap=True) if library == "equinox" else bridge.probe(model)
    )
    with pytest.raises(ValueError, match="same number of parameterised") as raised:
        llama.compare(probe)
    assert f"site '{SKIPPED}' (rmsnorm) of probe_a" in str(raised.value)
