"""Port a Hugging Face PyTorch Llama to Equinox and to Flax NNX, by hand.

transformers 5 has no Flax models: a JAX Llama is now written by hand. The
source is ``transformers.LlamaForCausalLM`` from a small ``LlamaConfig`` (2
decoder layers, width 64, 4 query heads sharing 2 key/value heads, an untied
head), initialised at random: no download; its RMSNorm scales are drawn away
from 1, as a trained checkpoint's are. The two ports live in
``examples/llama_ports.py``, written as each library's users write them:
Equinox ``eqx.nn.Linear(use_bias=False)``, ``eqx.nn.Embedding`` and
``eqx.nn.RMSNorm`` applied token by token with ``jax.vmap``; NNX
``nnx.Linear``, ``nnx.Embed`` and ``nnx.RMSNorm``.

For each library:

1. ``bridge.transfer`` moves the weights from PyTorch into the port (built
   from any weights), pairing the parameterised layers in call order; the
   ported model's plain logits agree with ``model(ids).logits``.
2. ``bridge.compare`` agrees at every paired layer, in activations and in
   the gradients of the next-token loss.
3. Eight porting bugs, each a flag of the port's config, and the layer
   ``report.first_divergence`` names for each (the example fails if it names
   another): interleaved rotary, key/value heads tiled instead of repeated,
   no attention scale, no causal mask, heads split as (head_dim, heads) —
   the first attention's ``o_proj``, the first layer after the attention's
   arithmetic; SiLU on the up projection — the first ``down_proj``; RMSNorm
   epsilon 1e-6 — the first norm; the post-attention norm skipped —
   ``transfer`` refuses the port, naming ``post_attention_layernorm``.
4. ``probe.unwrap()`` takes the port out (a plain ``EqxLlama`` or
   ``NnxLlama``), and ``transfer`` back into a fresh PyTorch Llama gives
   the original logits.

    python -m pip install -e ".[all,examples,torch]"
    python examples/port_llama_equinox_nnx.py

``BRIDGE_EXAMPLES_SMOKE=1`` uses a shorter sequence. It writes no figure.
"""

# The optional packages are imported after `require` has checked them.
# ruff: noqa: E402
from __future__ import annotations

import time

from example_support import SMOKE, require

require("equinox", "flax", "torch", "transformers")

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx
from llama_ports import EqxLlama, LlamaPort, NnxLlama
from transformers import LlamaConfig, LlamaForCausalLM

import bridge

BATCH, SEQ = (2, 8) if SMOKE else (4, 32)
CONFIG = LlamaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
TOLERANCES = {"rtol": 1e-4, "atol": 1e-5}

ATTENTION_OUT = "model.layers.0.self_attn.o_proj"
# bug -> (the port's config changes, the PyTorch layer compare names)
BUGS = {
    "interleaved rotary": ({"interleaved_rotary": True}, ATTENTION_OUT),
    "key/value heads tiled": ({"kv_tiled": True}, ATTENTION_OUT),
    "RMSNorm epsilon 1e-6": ({"rms_norm_eps": 1e-6}, "model.layers.0.input_layernorm"),
    "no attention scale": ({"no_attention_scale": True}, ATTENTION_OUT),
    "SiLU on up": ({"silu_on_up": True}, "model.layers.0.mlp.down_proj"),
    "no causal mask": ({"no_causal_mask": True}, ATTENTION_OUT),
    "heads split (head_dim, heads)": ({"heads_last": True}, ATTENTION_OUT),
}
SKIPPED = "model.layers.0.post_attention_layernorm"


def build(library: str, **changes):
    """A probe of the port, with random weights: transfer replaces them."""
    port = LlamaPort.from_hf(CONFIG, **changes)
    if library == "Equinox":  # one sequence per call: the probe maps the batch
        return bridge.probe(EqxLlama(port, key=jax.random.key(0)), vmap=True)
    return bridge.probe(NnxLlama(port, nnx.Rngs(0)))


def next_token_losses(ids: np.ndarray):
    """`(torch loss, JAX loss)` of the same next-token cross-entropy."""
    targets = ids[:, 1:]

    def torch_loss(outputs):
        logits = outputs.logits[:, :-1]
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            torch.tensor(targets, dtype=torch.long).reshape(-1),
        )

    def jax_loss(logits):
        logits = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.take_along_axis(logits, targets[..., None], axis=-1).mean()

    return torch_loss, jax_loss


def main() -> None:
    start = time.perf_counter()
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG).eval()
    with torch.no_grad():  # RMSNorm scales as a trained checkpoint has them
        for name, tensor in model.named_parameters():
            if "norm" in name:
                tensor.uniform_(0.5, 1.5)
    ids = np.random.default_rng(1).integers(0, CONFIG.vocab_size, (BATCH, SEQ))
    ids = ids.astype(np.int32)
    tokens = torch.tensor(ids)
    with torch.no_grad():
        expected = model(tokens).logits.numpy()
    losses = next_token_losses(ids)
    source = bridge.probe(model)
    print(
        f"Hugging Face LlamaForCausalLM: {CONFIG.num_hidden_layers} layers, width "
        f"{CONFIG.hidden_size}, {CONFIG.num_attention_heads} query heads sharing "
        f"{CONFIG.num_key_value_heads} key/value heads; tokens {BATCH} x {SEQ}"
    )

    for library in ("Equinox", "NNX"):
        ported = bridge.transfer(source, build(library), tokens, args_b=(ids,))
        # The port taken out of its probe, run without bridge.
        (port,) = ported.unwrap()
        logits = np.asarray(jax.vmap(port)(ids) if library == "Equinox" else port(ids))
        print(
            f"\n{library}: {type(port).__name__}, largest difference of the logits "
            f"vs model(ids).logits: {np.max(np.abs(logits - expected)):.1e}"
        )
        np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-5)

        report = bridge.compare(
            source, ported, losses, tokens, args_b=(ids,), **TOLERANCES
        )
        print(f"== PyTorch -> {library}: bridge.compare\n{report}")
        assert report.first_divergence is None

        for label, (changes, site) in BUGS.items():
            buggy = bridge.transfer(
                source, build(library, **changes), tokens, args_b=(ids,)
            )
            report = bridge.compare(
                source, buggy, losses, tokens, args_b=(ids,), **TOLERANCES
            )
            first = report.first_divergence
            named = None if first is None else first.site_a
            assert named == site, (library, label, named)
            print(
                f"  bug {label!r}: first divergence {first.site_a} / {first.site_b}"
                f" (activations {first.activation_rel:.1e}, gradients "
                f"{first.grad_rel:.1e} relative)"
            )
        try:
            bridge.transfer(
                source,
                build(library, skip_post_attention_norm=True),
                tokens,
                args_b=(ids,),
            )
        except ValueError as error:
            assert f"'{SKIPPED}' (rmsnorm)" in str(error), error
            print(
                "  bug 'post-attention norm skipped': transfer refuses, naming "
                + SKIPPED
            )
        else:
            raise AssertionError("a port without its post-attention norm transferred")

        # And back: the port's weights into a fresh PyTorch Llama.
        torch.manual_seed(1)
        back = bridge.transfer(
            ported, bridge.probe(LlamaForCausalLM(CONFIG).eval()), ids, args_b=(tokens,)
        )
        (copy,) = back.unwrap()
        with torch.no_grad():
            returned = copy(tokens).logits.numpy()
        print(
            f"  {library} -> PyTorch: largest difference of the logits "
            f"{np.max(np.abs(returned - expected)):.1e}"
        )
        np.testing.assert_allclose(returned, expected, rtol=1e-5, atol=1e-6)
    print(f"\n{time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
