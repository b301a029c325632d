"""A Hugging Face Llama decoder written by hand in Equinox and in Flax NNX.

Not an example itself: ``examples/port_llama_equinox_nnx.py``, the tests
(``tests/test_llama_ports.py``) and ``docs/porting.md`` import it. Each port
is the model ``transformers.LlamaForCausalLM`` computes — RMSNorm, rotary
position embeddings rotating the two halves of each head as Hugging Face
does, grouped-query attention (query heads sharing key/value heads), a
causal mask, a SwiGLU MLP, the LM head tied to the embedding or not as the
config says — written the way each library's users write it:

- ``EqxLlama``: ``eqx.Module``s of ``eqx.nn.Embedding``, ``eqx.nn.RMSNorm``
  and ``eqx.nn.Linear(use_bias=False)``, called on one sequence of token ids
  ``(seq,)`` and applied per token with ``jax.vmap`` (probe it with
  ``vmap=True`` for a batch);
- ``NnxLlama``: an ``nnx.Module`` of ``nnx.Embed``, ``nnx.RMSNorm`` and
  ``nnx.Linear(use_bias=False)``, called on a batch ``(batch, seq)``.

Both take a ``LlamaPort``: the hyperparameters of a ``LlamaConfig``
(``LlamaPort.from_hf(config)``), and one flag per classic porting bug, all
off by default, so that one port class serves the correct port and each
buggy one (``LlamaPort.from_hf(config, silu_on_up=True)``).
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

#: The bugs a ``LlamaPort`` can plant, each a flag, with what it does.
BUG_FLAGS = {
    "interleaved_rotary": "rotary embeddings rotate interleaved pairs "
    "(x0, x1), (x2, x3), ... instead of the two halves",
    "kv_tiled": "key/value heads expanded by tiling (k0, k1, k0, k1) instead "
    "of repeating (k0, k0, k1, k1)",
    "no_attention_scale": "attention scores not divided by sqrt(head_dim)",
    "silu_on_up": "SiLU on the up projection instead of the gate",
    "no_causal_mask": "no causal mask",
    "heads_last": "heads split as (seq, head_dim, heads) instead of "
    "(seq, heads, head_dim)",
    "skip_post_attention_norm": "the post-attention RMSNorm not applied",
}


@dataclasses.dataclass(frozen=True)
class LlamaPort:
    """A Llama's hyperparameters, and the porting bugs to plant (none by
    default). Frozen, hence hashable: a static field of an Equinox module."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    # The bugs (BUG_FLAGS); a wrong epsilon is a wrong `rms_norm_eps`.
    interleaved_rotary: bool = False
    kv_tiled: bool = False
    no_attention_scale: bool = False
    silu_on_up: bool = False
    no_causal_mask: bool = False
    heads_last: bool = False
    skip_post_attention_norm: bool = False

    @classmethod
    def from_hf(cls, config, **changes) -> LlamaPort:
        """The hyperparameters of a ``transformers.LlamaConfig``, with
        `changes` (bug flags, or another ``rms_norm_eps``)."""
        fields = {
            field.name: getattr(config, field.name)
            for field in dataclasses.fields(cls)
            if hasattr(config, field.name) and field.name not in BUG_FLAGS
        }
        return cls(**{**fields, **changes})

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


# -- what both ports compute alike: arrays in, arrays out ---------------------------


def split_heads(x: jax.Array, count: int, port: LlamaPort) -> jax.Array:
    """`(..., seq, count * head_dim)` to `(..., seq, count, head_dim)`."""
    if port.heads_last:  # the bug: the head axis taken as the faster one
        x = x.reshape(*x.shape[:-1], port.head_dim, count)
        return jnp.swapaxes(x, -1, -2)
    return x.reshape(*x.shape[:-1], count, port.head_dim)


def rotate(x: jax.Array, port: LlamaPort) -> jax.Array:
    """Rotary position embedding of `x` `(..., seq, heads, head_dim)`, at
    positions 0, 1, ...: Hugging Face's halves, or interleaved pairs."""
    dim = port.head_dim
    inverse = 1.0 / port.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    angles = jnp.outer(jnp.arange(x.shape[-3], dtype=jnp.float32), inverse)
    # (..., seq, 1, head_dim / 2): of x's rank, no rank promotion needed.
    angles = angles.reshape((1,) * (x.ndim - 3) + (x.shape[-3], 1, dim // 2))
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if port.interleaved_rotary:  # Meta's original code, GPT-J
        even, odd = x[..., 0::2], x[..., 1::2]
        pairs = (even * cos - odd * sin, even * sin + odd * cos)
        return jnp.stack(pairs, axis=-1).reshape(x.shape)
    first, second = x[..., : dim // 2], x[..., dim // 2 :]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], -1)


def attend(
    query: jax.Array, key: jax.Array, value: jax.Array, port: LlamaPort
) -> jax.Array:
    """Grouped-query causal attention: queries `(..., seq, heads, head_dim)`,
    keys and values `(..., seq, kv_heads, head_dim)`; `(..., seq, hidden)`."""
    share = port.num_attention_heads // port.num_key_value_heads
    if port.kv_tiled:  # the bug: (k0, k1, k0, k1)
        key, value = (
            jnp.tile(t, (1,) * (t.ndim - 2) + (share, 1)) for t in (key, value)
        )
    else:  # Hugging Face's repeat_kv: (k0, k0, k1, k1)
        key, value = (jnp.repeat(t, share, axis=-2) for t in (key, value))
    scores = jnp.einsum("...qhd,...khd->...hqk", query, key)
    if not port.no_attention_scale:
        scores = scores / np.sqrt(port.head_dim).astype(np.float32)
    if not port.no_causal_mask:
        seq = query.shape[-3]
        scores = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    mixed = jnp.einsum("...hqk,...khd->...qhd", weights, value)
    return mixed.reshape(*mixed.shape[:-2], -1)


def swiglu(gate: jax.Array, up: jax.Array, port: LlamaPort) -> jax.Array:
    if port.silu_on_up:  # the bug
        return gate * jax.nn.silu(up)
    return jax.nn.silu(gate) * up


# -- Equinox: one sequence, token by token with jax.vmap ----------------------------


class EqxAttention(eqx.Module):
    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear
    port: LlamaPort = eqx.field(static=True)

    def __init__(self, port: LlamaPort, *, key: jax.Array):
        q, k, v, o = jax.random.split(key, 4)
        width, dim = port.hidden_size, port.head_dim
        kv_width = port.num_key_value_heads * dim
        self.q_proj = eqx.nn.Linear(width, width, use_bias=False, key=q)
        self.k_proj = eqx.nn.Linear(width, kv_width, use_bias=False, key=k)
        self.v_proj = eqx.nn.Linear(width, kv_width, use_bias=False, key=v)
        self.o_proj = eqx.nn.Linear(width, width, use_bias=False, key=o)
        self.port = port

    def __call__(self, x: jax.Array) -> jax.Array:  # (seq, hidden)
        port = self.port
        query = split_heads(jax.vmap(self.q_proj)(x), port.num_attention_heads, port)
        key = split_heads(jax.vmap(self.k_proj)(x), port.num_key_value_heads, port)
        value = split_heads(jax.vmap(self.v_proj)(x), port.num_key_value_heads, port)
        mixed = attend(rotate(query, port), rotate(key, port), value, port)
        return jax.vmap(self.o_proj)(mixed)


class EqxMLP(eqx.Module):
    gate_proj: eqx.nn.Linear
    up_proj: eqx.nn.Linear
    down_proj: eqx.nn.Linear
    port: LlamaPort = eqx.field(static=True)

    def __init__(self, port: LlamaPort, *, key: jax.Array):
        g, u, d = jax.random.split(key, 3)
        width, inner = port.hidden_size, port.intermediate_size
        self.gate_proj = eqx.nn.Linear(width, inner, use_bias=False, key=g)
        self.up_proj = eqx.nn.Linear(width, inner, use_bias=False, key=u)
        self.down_proj = eqx.nn.Linear(inner, width, use_bias=False, key=d)
        self.port = port

    def __call__(self, x: jax.Array) -> jax.Array:  # one token, (hidden,)
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.port))


class EqxDecoderLayer(eqx.Module):
    input_layernorm: eqx.nn.RMSNorm
    self_attn: EqxAttention
    post_attention_layernorm: eqx.nn.RMSNorm
    mlp: EqxMLP
    port: LlamaPort = eqx.field(static=True)

    def __init__(self, port: LlamaPort, *, key: jax.Array):
        attention, mlp = jax.random.split(key)
        eps = port.rms_norm_eps
        self.input_layernorm = eqx.nn.RMSNorm(port.hidden_size, eps, use_bias=False)
        self.self_attn = EqxAttention(port, key=attention)
        self.post_attention_layernorm = eqx.nn.RMSNorm(
            port.hidden_size, eps, use_bias=False
        )
        self.mlp = EqxMLP(port, key=mlp)
        self.port = port

    def __call__(self, x: jax.Array) -> jax.Array:  # (seq, hidden)
        x = x + self.self_attn(jax.vmap(self.input_layernorm)(x))
        normed = x
        if not self.port.skip_post_attention_norm:
            normed = jax.vmap(self.post_attention_layernorm)(x)
        return x + jax.vmap(self.mlp)(normed)


class EqxLlama(eqx.Module):
    """``LlamaForCausalLM`` in Equinox: token ids `(seq,)` to logits
    `(seq, vocab)`."""

    embed_tokens: eqx.nn.Embedding
    layers: list[EqxDecoderLayer]
    norm: eqx.nn.RMSNorm
    lm_head: eqx.nn.Linear | None
    port: LlamaPort = eqx.field(static=True)

    def __init__(self, port: LlamaPort, *, key: jax.Array):
        embed, head, *layers = jax.random.split(key, 2 + port.num_hidden_layers)
        self.embed_tokens = eqx.nn.Embedding(
            port.vocab_size, port.hidden_size, key=embed
        )
        self.layers = [EqxDecoderLayer(port, key=k) for k in layers]
        self.norm = eqx.nn.RMSNorm(port.hidden_size, port.rms_norm_eps, use_bias=False)
        self.lm_head = (
            None
            if port.tie_word_embeddings
            else eqx.nn.Linear(
                port.hidden_size, port.vocab_size, use_bias=False, key=head
            )
        )
        self.port = port

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = jax.vmap(self.embed_tokens)(ids)
        for layer in self.layers:
            x = layer(x)
        x = jax.vmap(self.norm)(x)
        if self.lm_head is None:  # tied: the embedding's matrix, transposed
            return x @ self.embed_tokens.weight.T
        return jax.vmap(self.lm_head)(x)


# -- Flax NNX: a batch at once --------------------------------------------------------


class NnxAttention(nnx.Module):
    def __init__(self, port: LlamaPort, rngs: nnx.Rngs):
        width, kv_width = port.hidden_size, port.num_key_value_heads * port.head_dim
        self.q_proj = nnx.Linear(width, width, use_bias=False, rngs=rngs)
        self.k_proj = nnx.Linear(width, kv_width, use_bias=False, rngs=rngs)
        self.v_proj = nnx.Linear(width, kv_width, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(width, width, use_bias=False, rngs=rngs)
        self.port = port

    def __call__(self, x: jax.Array) -> jax.Array:  # (batch, seq, hidden)
        port = self.port
        query = split_heads(self.q_proj(x), port.num_attention_heads, port)
        key = split_heads(self.k_proj(x), port.num_key_value_heads, port)
        value = split_heads(self.v_proj(x), port.num_key_value_heads, port)
        return self.o_proj(attend(rotate(query, port), rotate(key, port), value, port))


class NnxMLP(nnx.Module):
    def __init__(self, port: LlamaPort, rngs: nnx.Rngs):
        width, inner = port.hidden_size, port.intermediate_size
        self.gate_proj = nnx.Linear(width, inner, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(width, inner, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(inner, width, use_bias=False, rngs=rngs)
        self.port = port

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.port))


class NnxDecoderLayer(nnx.Module):
    def __init__(self, port: LlamaPort, rngs: nnx.Rngs):
        eps = port.rms_norm_eps
        self.input_layernorm = nnx.RMSNorm(port.hidden_size, epsilon=eps, rngs=rngs)
        self.self_attn = NnxAttention(port, rngs)
        self.post_attention_layernorm = nnx.RMSNorm(
            port.hidden_size, epsilon=eps, rngs=rngs
        )
        self.mlp = NnxMLP(port, rngs)
        self.port = port

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x))
        normed = x
        if not self.port.skip_post_attention_norm:
            normed = self.post_attention_layernorm(x)
        return x + self.mlp(normed)


class NnxLlama(nnx.Module):
    """``LlamaForCausalLM`` in Flax NNX: token ids `(batch, seq)` to logits
    `(batch, seq, vocab)`."""

    def __init__(self, port: LlamaPort, rngs: nnx.Rngs):
        width = port.hidden_size
        self.embed_tokens = nnx.Embed(port.vocab_size, width, rngs=rngs)
        self.layers = nnx.List(
            [NnxDecoderLayer(port, rngs) for _ in range(port.num_hidden_layers)]
        )
        self.norm = nnx.RMSNorm(width, epsilon=port.rms_norm_eps, rngs=rngs)
        self.lm_head = (
            None
            if port.tie_word_embeddings
            else nnx.Linear(width, port.vocab_size, use_bias=False, rngs=rngs)
        )
        self.port = port

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        if self.lm_head is None:  # tied: the embedding, as a head
            return self.embed_tokens.attend(x)
        return self.lm_head(x)


# -- a reference independent of bridge ------------------------------------------------


def hf_state(model) -> dict[str, np.ndarray]:
    """A PyTorch model's ``state_dict`` as float32 NumPy arrays."""
    return {
        name: tensor.detach().cpu().numpy().astype(np.float32)
        for name, tensor in model.state_dict().items()
    }


def load_eqx(model: EqxLlama, state: dict[str, np.ndarray]) -> EqxLlama:
    """`model` holding the weights of a ``LlamaForCausalLM`` ``state_dict``,
    by hand: Equinox's ``Linear`` keeps PyTorch's `(out, in)` layout."""
    names = {
        "embed_tokens.weight": lambda m: m.embed_tokens.weight,
        "norm.weight": lambda m: m.norm.weight,
    }
    for n in range(model.port.num_hidden_layers):
        prefix = f"layers.{n}."
        for path in (
            "input_layernorm",
            "post_attention_layernorm",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ):
            names[f"{prefix}{path}.weight"] = lambda m, n=n, path=path: (
                _attr(m.layers[n], path).weight
            )
    for name, where in names.items():
        model = eqx.tree_at(where, model, jnp.asarray(state[f"model.{name}"]))
    if model.lm_head is not None:
        model = eqx.tree_at(
            lambda m: m.lm_head.weight, model, jnp.asarray(state["lm_head.weight"])
        )
    return model


def load_nnx(model: NnxLlama, state: dict[str, np.ndarray]) -> NnxLlama:
    """`model` holding the weights of a ``LlamaForCausalLM`` ``state_dict``,
    set by hand, in place: NNX kernels are `(in, out)`, norms have a scale."""
    model.embed_tokens.embedding.value = jnp.asarray(state["model.embed_tokens.weight"])
    model.norm.scale.value = jnp.asarray(state["model.norm.weight"])
    for n, layer in enumerate(model.layers):
        prefix = f"model.layers.{n}."
        for path in ("input_layernorm", "post_attention_layernorm"):
            _attr(layer, path).scale.value = jnp.asarray(
                state[f"{prefix}{path}.weight"]
            )
        for path in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ):
            _attr(layer, path).kernel.value = jnp.asarray(
                state[f"{prefix}{path}.weight"].T
            )
    if model.lm_head is not None:
        model.lm_head.kernel.value = jnp.asarray(state["lm_head.weight"].T)
    return model


def _attr(obj, path: str):
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj
