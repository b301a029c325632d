"""Port a Hugging Face PyTorch Llama to Flax Linen, and find three porting bugs.

The source is ``transformers.LlamaForCausalLM`` from a small ``LlamaConfig``
(2 decoder layers, width 64, 4 query heads sharing 2 key/value heads, a
vocabulary of 256), initialised at random: no download. Its RMSNorm scales
are drawn away from their initial 1, as a trained checkpoint's are.

The port is written by hand in Flax Linen, the way a JAX user writes a Llama,
with its own names (``attention/query``, ``mlp/gate``, ...) and Linen's own
layers: ``nn.Embed``, ``nn.RMSNorm``, ``nn.Dense`` without biases; rotary
position embeddings and grouped-query attention written out.

1. ``bridge.transfer`` pairs the two models' parameterised layers in call
   order — ``LlamaRMSNorm`` is an RMSNorm, ``nn.Linear``'s ``(out, in)``
   weights become ``(in, out)`` kernels — and moves the weights.
2. ``bridge.compare`` runs both on the same token ids and prints, layer by
   layer, the largest difference of the activations and of the gradients of
   the next-token loss with respect to them: the port agrees with PyTorch to
   float32 rounding.
3. Three porting bugs a Llama port is known for, and where
   ``report.first_divergence`` finds each (the example fails if it names
   another layer):

   - rotary embeddings rotating interleaved pairs ``(x0, x1), (x2, x3), ...``
     (Meta's original code and GPT-J) where Hugging Face rotates the two
     halves: queries and keys agree, the first attention's output projection
     does not;
   - SiLU on the up projection instead of the gate: the first
     ``down_proj``;
   - the RMSNorm epsilon of Linen's default (1e-6) where the config says
     1e-5: the first norm, by 2e-2 relative — Llama's embeddings are small
     (initialised at 0.02, mean square 4e-4), so 1e-5 is no rounding there
     — and compare marks the epsilon at every norm.

``docs/port_transformer.png`` draws, per paired layer in call order, the
largest relative difference of the activations and of their gradients, for
the correct port and each buggy one, with each first divergence marked.

    python -m pip install -e ".[all,examples,torch]"
    python examples/port_transformer.py --out docs

Without ``--out DIR`` (or ``BRIDGE_EXAMPLES_OUT=DIR``) it writes nothing.
``BRIDGE_EXAMPLES_SMOKE=1`` uses a shorter sequence.
"""

# The optional packages are imported after `require` has checked them.
# ruff: noqa: E402
from __future__ import annotations

import time

from example_support import SMOKE, Figure, require

require("flax", "torch", "transformers", "matplotlib")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import torch
from port_plot import plot, show
from transformers import LlamaConfig, LlamaForCausalLM

import bridge

FIGURE = Figure("port_transformer.png")
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
)
HEAD_DIM = CONFIG.hidden_size // CONFIG.num_attention_heads
# float32, summed in different orders through 2 layers of attention.
TOLERANCES = {"rtol": 1e-4, "atol": 1e-5}


# -- the port: a Llama written by hand in Flax Linen ---------------------------------


def rotate(x: jax.Array, positions: jax.Array, interleaved: bool) -> jax.Array:
    """Rotary position embedding of `x` `(batch, seq, heads, head_dim)`:
    Hugging Face's halves, or interleaved pairs (the bug)."""
    half = HEAD_DIM // 2
    inverse = 1.0 / CONFIG.rope_theta ** (jnp.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    angles = positions[..., None, None] * inverse  # (batch, seq, 1, half)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if interleaved:
        even, odd = x[..., 0::2], x[..., 1::2]
        pairs = (even * cos - odd * sin, even * sin + odd * cos)
        return jnp.stack(pairs, axis=-1).reshape(x.shape)
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], -1)


class Attention(nn.Module):
    interleaved: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        heads, groups = CONFIG.num_attention_heads, CONFIG.num_key_value_heads
        batch, seq, _ = x.shape

        def projection(name: str, count: int) -> jax.Array:
            value = nn.Dense(count * HEAD_DIM, use_bias=False, name=name)(x)
            return value.reshape(batch, seq, count, HEAD_DIM)

        query = rotate(projection("query", heads), positions, self.interleaved)
        key = rotate(projection("key", groups), positions, self.interleaved)
        value = projection("value", groups)
        key = jnp.repeat(key, heads // groups, axis=2)
        value = jnp.repeat(value, heads // groups, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", query, key) / np.sqrt(HEAD_DIM)
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        mixed = jnp.einsum("bhqk,bkhd->bqhd", weights, value)
        return nn.Dense(x.shape[-1], use_bias=False, name="out")(
            mixed.reshape(batch, seq, -1)
        )


class Block(nn.Module):
    interleaved: bool = False
    silu_on_up: bool = False
    epsilon: float = CONFIG.rms_norm_eps

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        normed = nn.RMSNorm(epsilon=self.epsilon, name="attention_norm")(x)
        x = x + Attention(self.interleaved, name="attention")(normed, positions)
        normed = nn.RMSNorm(epsilon=self.epsilon, name="mlp_norm")(x)
        gate = nn.Dense(CONFIG.intermediate_size, use_bias=False, name="gate")(normed)
        up = nn.Dense(CONFIG.intermediate_size, use_bias=False, name="up")(normed)
        hidden = gate * nn.silu(up) if self.silu_on_up else nn.silu(gate) * up
        return x + nn.Dense(x.shape[-1], use_bias=False, name="down")(hidden)


class Llama(nn.Module):
    interleaved: bool = False
    silu_on_up: bool = False
    epsilon: float = CONFIG.rms_norm_eps

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
        x = nn.Embed(CONFIG.vocab_size, CONFIG.hidden_size, name="embed")(ids)
        for n in range(CONFIG.num_hidden_layers):
            block = Block(
                self.interleaved, self.silu_on_up, self.epsilon, name=f"block{n}"
            )
            x = block(x, positions)
        x = nn.RMSNorm(epsilon=self.epsilon, name="norm")(x)
        return nn.Dense(CONFIG.vocab_size, use_bias=False, name="head")(x)


BUGS = {
    "interleaved rotary": (
        {"interleaved": True},
        "model.layers.0.self_attn.o_proj",
    ),
    "SiLU on the up projection": ({"silu_on_up": True}, "model.layers.0.mlp.down_proj"),
    "RMSNorm epsilon 1e-6": ({"epsilon": 1e-6}, "model.layers.0.input_layernorm"),
}


# -- the loss, once per library -------------------------------------------------------


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


def _short(name: str) -> str:
    return name.removeprefix("model.").replace("layers.", "").replace("self_attn.", "")


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
    losses = next_token_losses(ids)
    print(
        f"Hugging Face LlamaForCausalLM: {CONFIG.num_hidden_layers} layers, width "
        f"{CONFIG.hidden_size}, {sum(p.numel() for p in model.parameters())} "
        f"parameters; tokens {BATCH} x {SEQ}"
    )

    source = bridge.probe(model)
    port = Llama()
    # Only the structure is needed: transfer replaces every array.
    variables = jax.eval_shape(port.init, jax.random.key(0), ids)
    variables = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), variables)
    ported = bridge.transfer(
        source, bridge.probe(port, variables), torch.tensor(ids), args_b=(ids,)
    )

    # A check without bridge: the ported logits against model(ids).logits.
    with torch.no_grad():
        expected = model(torch.tensor(ids)).logits.numpy()
    logits = np.asarray(ported.apply(ids).outputs)
    print(
        "largest difference of the logits, Linen port vs model(ids).logits: "
        f"{np.max(np.abs(logits - expected)):.1e}"
    )
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-5)

    report = bridge.compare(
        source, ported, losses, torch.tensor(ids), args_b=(ids,), **TOLERANCES
    )
    show("PyTorch -> Flax Linen", report)
    assert report.first_divergence is None

    reports = {"correct port": report}
    for label, (slips, expected_site) in BUGS.items():
        buggy = bridge.probe(Llama(**slips), ported.variables)
        report = bridge.compare(
            source, buggy, losses, torch.tensor(ids), args_b=(ids,), **TOLERANCES
        )
        show(f"PyTorch -> Flax Linen with the bug: {label}", report)
        first = report.first_divergence
        named = None if first is None else first.site_a
        assert named == expected_site, (label, named)
        if "epsilon" in slips:  # marked at every norm
            marked = [
                row.site_a for row in report.rows if "epsilon" in row.hyperparameters
            ]
            assert len(marked) == 2 * CONFIG.num_hidden_layers + 1, marked
        reports[f"bug: {label}"] = report

    print()
    FIGURE.save(
        lambda path: plot(
            reports,
            path,
            title="Hugging Face Llama (PyTorch) against a hand-written Flax Linen "
            "port: bridge.compare, per paired layer in call order (★ first divergence)",
            xlabel="PyTorch module (model., layers., self_attn. elided)",
            short=_short,
            rtol=TOLERANCES["rtol"],
        )
    )
    print(f"{time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
