"""Per-head attention attribution, gradient x pattern, in JAX and in PyTorch.

TransformerLens users read `hook_pattern` and its gradient; in Hugging Face's
code the pattern is a local variable of the attention function, and
`output_attentions=True` returns a copy that feeds nothing (its gradient is
zero). `bridge.probe(model, params, inside=...)` makes that local a site
without editing the model: here `inside=[FlaxGPT2Attention,
nn.dot_product_attention_weights]` for the Flax model and
`inside=[GPT2Attention, eager_attention_forward]` for its PyTorch original.

1. A 2-layer, 4-head GPT-2 (Hugging Face's Flax class, small config, no
   download) is trained for a few hundred steps on repeated random
   sequences — the task on which attention heads learn to look back one
   period (induction heads).
2. `bridge.transfer` moves the trained weights into the PyTorch
   `GPT2LMHeadModel`.
3. The same call on both, `probe.value_and_grad(metric, ..., at=pattern
   sites)` with the metric the mean logit of the right next token, gives
   each layer's attention pattern and the metric's gradient with respect to
   it; the attribution of head h is `sum(pattern * gradient)` over queries
   and keys (attribution patching's first-order estimate of what removing
   the head's attention would change). The two libraries agree.

``docs/attention_attribution.png`` draws the attribution per layer and head
in JAX and in PyTorch, and the pattern of each layer's most attributed head (in
the full run, layer 0's attends one period back, to the token after the
previous occurrence: the head the task needs).

    python -m pip install -e ".[all,examples,torch]"
    python examples/attention_attribution.py --out docs

Without ``--out DIR`` (or ``BRIDGE_EXAMPLES_OUT=DIR``) it writes nothing.
``BRIDGE_EXAMPLES_SMOKE=1`` trains a few steps.
"""

# The optional packages are imported after `require` has checked them.
# ruff: noqa: E402
from __future__ import annotations

import time
from pathlib import Path

from example_support import SMOKE, Figure, require

require("flax", "optax", "torch", "transformers", "matplotlib")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from transformers import FlaxGPT2LMHeadModel, GPT2Config, GPT2LMHeadModel
from transformers.models.gpt2 import modeling_flax_gpt2, modeling_gpt2

import bridge

FIGURE = Figure("attention_attribution.png")
LAYERS, HEADS, WIDTH, VOCAB = 2, 4, 64, 32
PERIOD = 8  # each sequence is a random period repeated
SEQ = 4 * PERIOD
BATCH = 32
STEPS = 5 if SMOKE else 400
CONFIG = GPT2Config(
    vocab_size=VOCAB,
    n_positions=SEQ,
    n_embd=WIDTH,
    n_layer=LAYERS,
    n_head=HEADS,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    attn_implementation="eager",  # PyTorch's fused kernel has no pattern
)
#: In `dot_product_attention_weights`: the scores, plus the causal bias, then
#: the softmax, the pattern.
FLAX_PATTERN = "transformer/h/{}/attn/dot_product_attention_weights/attn_weights#2"
#: In `eager_attention_forward`: the scores, scaled, masked, plus the mask,
#: then the softmax.
TORCH_PATTERN = "transformer.h.{}.attn/eager_attention_forward/attn_weights#4"


def sequences(seed: int, batch: int = BATCH) -> np.ndarray:
    period = np.random.default_rng(seed).integers(0, VOCAB, (batch, PERIOD))
    return np.tile(period, (1, SEQ // PERIOD)).astype(np.int32)


def flax_inputs(ids):
    return ids, jnp.ones_like(ids), jnp.broadcast_to(jnp.arange(SEQ), ids.shape)


def next_token_loss(logits, ids, xp):
    """Cross-entropy of the tokens after the first period, which the model
    can predict by looking back; `xp` is `jnp` or `torch`."""
    if xp is torch:
        logits = torch.log_softmax(logits[:, PERIOD - 1 : -1], dim=-1)
        targets = torch.tensor(ids[:, PERIOD:], dtype=torch.long)[..., None]
        return -torch.gather(logits, -1, targets).mean()
    logits = jax.nn.log_softmax(logits[:, PERIOD - 1 : -1])
    return -jnp.take_along_axis(logits, ids[:, PERIOD:, None], axis=-1).mean()


def correct_logit(logits, ids, xp):
    """The mean logit of the right next token after the first period: the
    quantity attributed (a log-probability saturates once trained, and its
    gradients vanish with it)."""
    if xp is torch:
        targets = torch.tensor(ids[:, PERIOD:], dtype=torch.long)[..., None]
        return torch.gather(logits[:, PERIOD - 1 : -1], -1, targets).mean()
    chosen = jnp.take_along_axis(logits[:, PERIOD - 1 : -1], ids[:, PERIOD:, None], -1)
    return chosen.mean()


def train(model) -> dict:
    params = model.params
    optimizer = optax.adam(3e-3)
    state = optimizer.init(params)

    @jax.jit
    def step(params, state, ids):
        def loss(params):
            logits = model.module.apply({"params": params}, *flax_inputs(ids)).logits
            return next_token_loss(logits, ids, jnp)

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = optimizer.update(grads, state)
        return optax.apply_updates(params, updates), state, value

    for n in range(STEPS):
        params, state, value = step(params, state, sequences(n))
        if n % 100 == 0 or n == STEPS - 1:
            print(f"step {n:3d}  loss {float(value):.3f}")
    return params


def attribution(result, site: str) -> np.ndarray:
    """Per head, `sum(pattern * gradient)` over queries and keys, batch mean."""
    product = np.asarray(result.activations[site]) * np.asarray(
        result.activation_grads[site]
    )
    return product.sum(axis=(-1, -2)).mean(axis=0)


def main() -> None:
    start = time.perf_counter()
    with jax.numpy_rank_promotion("allow"):  # transformers' Flax code promotes
        flax_model = FlaxGPT2LMHeadModel(CONFIG, seed=0)
        params = train(flax_model)
        ids = sequences(10_000, batch=8)
        flax_probe = bridge.probe(
            flax_model.module,
            {"params": params},
            inside=[
                modeling_flax_gpt2.FlaxGPT2Attention,
                nn.dot_product_attention_weights,
            ],
        )
        flax_sites = [FLAX_PATTERN.format(layer) for layer in range(LAYERS)]
        flax_result = jax.jit(
            lambda ids: flax_probe.value_and_grad(
                lambda out: correct_logit(out.logits, ids, jnp),
                *flax_inputs(ids),
                at=flax_sites,
            )
        )(ids)

        torch_model = GPT2LMHeadModel(CONFIG).eval()
        torch_probe = bridge.transfer(
            flax_probe,
            bridge.probe(torch_model),
            *flax_inputs(ids),
            args_b=(torch.tensor(ids),),
        )
    torch_probe = bridge.probe(
        torch_probe.module,
        inside=[modeling_gpt2.GPT2Attention, modeling_gpt2.eager_attention_forward],
    )
    torch_sites = [TORCH_PATTERN.format(layer) for layer in range(LAYERS)]
    torch_result = torch_probe.value_and_grad(
        lambda out: correct_logit(out.logits, ids, torch),
        torch.tensor(ids),
        at=torch_sites,
    )
    losses = float(flax_result.loss), float(torch_result.loss)
    print(f"mean correct logit: JAX {losses[0]:.5f}, PyTorch {losses[1]:.5f}")

    jax_scores = np.stack([attribution(flax_result, s) for s in flax_sites])
    torch_scores = np.stack([attribution(torch_result, s) for s in torch_sites])
    print("attribution per layer (rows) and head (columns), JAX:")
    print(np.array2string(jax_scores, precision=4))
    print("PyTorch:")
    print(np.array2string(torch_scores, precision=4))
    difference = np.abs(jax_scores - torch_scores).max()
    print(
        f"largest difference: {difference:.1e} (largest |attribution| "
        f"{np.abs(jax_scores).max():.1e})"
    )
    np.testing.assert_allclose(
        torch_scores, jax_scores, rtol=1e-3, atol=1e-4 * np.abs(jax_scores).max()
    )

    print()
    FIGURE.save(
        lambda path: plot(jax_scores, torch_scores, flax_result, flax_sites, path)
    )
    print(f"{time.perf_counter() - start:.1f}s")


def plot(jax_scores, torch_scores, result, sites, path: Path) -> None:
    """Two rows, 9 inches wide with 11-point text, for the docs page's width:
    the attribution per layer and head in JAX and in PyTorch (top), the
    pattern of each layer's most attributed head (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with plt.rc_context({"font.size": 11}):
        fig = plt.figure(figsize=(9, 7.8), layout="constrained")
        top, bottom = fig.subfigures(2, 1, height_ratios=(1, 1.6))
        axes = top.subplots(1, 2)
        bound = np.abs(jax_scores).max()
        for ax, scores, title in zip(
            axes,
            (jax_scores, torch_scores),
            ("JAX (Flax GPT-2)", "PyTorch (GPT-2)"),
            strict=True,
        ):
            image = ax.imshow(scores, cmap="RdBu_r", vmin=-bound, vmax=bound)
            ax.set_title(title)
            ax.set_xlabel("head")
            ax.set_ylabel("layer")
            ax.set_xticks(range(HEADS))
            ax.set_yticks(range(LAYERS))
            for (i, j), value in np.ndenumerate(scores):
                strong = abs(value) > 0.6 * bound
                ax.text(
                    j,
                    i,
                    f"{value:.4f}",
                    ha="center",
                    va="center",
                    fontsize=10,
                    color="white" if strong else "black",
                )
        top.colorbar(image, ax=axes, shrink=0.9)
        top.suptitle("Attribution per head: sum(pattern × d logit / d pattern)")
        for layer, ax in enumerate(bottom.subplots(1, LAYERS)):
            head = int(np.abs(jax_scores[layer]).argmax())
            ax.imshow(np.asarray(result.activations[sites[layer]])[0, head])
            ax.set_title(f"layer {layer}, head {head}")
            ax.set_xlabel("key position")
            ax.set_ylabel("query position")
        bottom.suptitle("Pattern of each layer's most attributed head (one sequence)")
        fig.suptitle(
            "Attention attribution through bridge.probe(..., inside=...):\n"
            "the same call on a trained GPT-2 in Flax and its PyTorch twin",
            fontsize=12,
        )
        fig.savefig(path, dpi=150)
        plt.close(fig)


if __name__ == "__main__":
    main()
