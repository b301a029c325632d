"""Vanishing gradients, made visible: 20-layer MLPs with and without residuals.

Four 20-layer, 64-wide MLPs written with Haiku are trained on scikit-learn's
bundled digits (8×8 images as 64 features, no download) with the same SGD:

- **plain, sigmoid**: the textbook case; each layer multiplies the gradient by
  at most 1/4 times its weights, so the first layers get almost nothing;
- **plain, tanh**: milder, still decaying toward the input;
- **residual, tanh**: ``h + tanh(W h + b)``; the identity path carries the
  gradient back unchanged;
- **residual + LayerNorm, tanh**: ``h + tanh(W LayerNorm(h) + b)``, the pre-norm
  block of modern transformers.

Every layer is a ``Block`` module, so the probe's sites ``block``, ``block_1``,
… hold the hidden state after each layer, and ``res.activation_grads`` holds
the gradient of the loss with respect to it. ``res.norms()`` takes their norms
inside the jitted training step, so one array of 20 numbers per step leaves it
— and the same probed pass gives the parameter gradients for the update. The figure
(``docs/gradient_flow.png``) plots ``‖d loss / d h_ℓ‖`` against depth ℓ at
several points of training.

    python -m pip install -e ".[all,examples]"
    python examples/gradient_flow.py --out docs

Without ``--out DIR`` (or ``BRIDGE_EXAMPLES_OUT=DIR``) it writes nothing.
``BRIDGE_EXAMPLES_SMOKE=1`` trains shallower networks for a few steps only.
"""

# The optional packages are imported after `require` has checked them.
# ruff: noqa: E402
from __future__ import annotations

import time

from example_support import SMOKE, Figure, require

require("haiku", "optax", "sklearn", "tqdm", "matplotlib")

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import bridge

FIGURE = Figure("gradient_flow.png")
DEPTH = 3 if SMOKE else 20
WIDTH, BATCH = 64, 128
STEPS = 3 if SMOKE else 300
LEARNING_RATE = 0.02
SNAPSHOTS = sorted({0, STEPS // 20, STEPS // 4, STEPS - 1})  # steps to draw

VARIANTS = {  # name -> (activation, residual, layer norm)
    "plain, sigmoid": (jax.nn.sigmoid, False, False),
    "plain, tanh": (jnp.tanh, False, False),
    "residual, tanh": (jnp.tanh, True, False),
    "residual + LayerNorm, tanh": (jnp.tanh, True, True),
}


class Block(hk.Module):
    """One layer: ``activation(W h + b)``, optionally pre-normed and residual."""

    def __init__(self, activation, residual, layer_norm, name=None):
        super().__init__(name=name)
        self.activation, self.residual, self.layer_norm = (
            activation,
            residual,
            layer_norm,
        )

    def __call__(self, h):
        z = h
        if self.layer_norm:
            z = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(z)
        z = self.activation(hk.Linear(WIDTH)(z))
        return h + z if self.residual else z


def make_model(activation, residual, layer_norm):
    def forward(x):
        h = hk.Linear(WIDTH, name="embed")(x)
        for _ in range(DEPTH):
            h = Block(activation, residual, layer_norm)(h)
        return hk.Linear(10, name="head")(h)

    return hk.without_apply_rng(hk.transform(forward))


def digits():
    """Standardised train and test splits of the 8×8 digits, as 64 features."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    images = ((images - images.mean(0)) / (images.std(0) + 1e-6)).astype(np.float32)
    return train_test_split(images, labels, test_size=0.2, random_state=0)


def train(model, train_x, train_y, test_x, test_y, desc):
    """SGD with momentum; per step, the loss and ‖d loss / d h_ℓ‖ of every layer."""
    optimizer = optax.sgd(LEARNING_RATE, momentum=0.9)

    @jax.jit
    def step(params, opt_state, x, y):
        probe = bridge.probe(model, params)  # cheap, and traced with the params
        res = probe.value_and_grad(
            lambda logits: optax.softmax_cross_entropy_with_integer_labels(
                logits, y
            ).mean(),
            x,
            at=Block,  # every Block call: the hidden state after each layer
        )
        # Every Block reduced to its norms in the step, one row per layer in
        # call order: one array leaves the step, not one number per layer.
        norms = res.norms().gradient  # ‖d loss / d h_ℓ‖, (DEPTH,)
        updates, opt_state = optimizer.update(res.grads, opt_state)
        return optax.apply_updates(params, updates), opt_state, res.loss, norms

    params = model.init(jax.random.key(0), train_x[:1])
    opt_state = optimizer.init(params)
    rng = np.random.default_rng(0)
    losses, norms = [], []
    for _ in tqdm(range(STEPS), desc=f"{desc:<27}", unit="step"):
        batch = rng.choice(len(train_x), BATCH, replace=False)
        params, opt_state, loss, layer_norms = step(
            params, opt_state, train_x[batch], train_y[batch]
        )
        losses.append(loss)
        norms.append(layer_norms)
    logits = jax.jit(model.apply)(params, test_x)
    accuracy = float(np.mean(np.argmax(logits, -1) == test_y))
    return np.asarray(losses), np.asarray(norms), accuracy


def plot(results, path):
    """One panel per MLP, two by two, 8.5 inches wide with 11-point text: the
    docs page (about 690 pixels) shows it at about 0.8 scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = 2
    rows = -(-len(results) // columns)
    with plt.rc_context({"font.size": 11}):
        fig, axes = plt.subplots(
            rows,
            columns,
            figsize=(8.5, 3.1 * rows + 1.0),
            sharex=True,
            sharey=True,
            layout="constrained",
            squeeze=False,
        )
        colors = plt.cm.viridis(np.linspace(0, 0.9, len(SNAPSHOTS)))
        layers = np.arange(1, DEPTH + 1)
        for ax, (name, (_, norms, accuracy)) in zip(
            axes.flat, results.items(), strict=False
        ):
            for color, step in zip(colors, SNAPSHOTS, strict=True):
                ax.plot(
                    layers, norms[step], "o-", ms=3, color=color, label=f"step {step}"
                )
            ax.set_yscale("log")
            ax.set_title(f"{name}\ntest accuracy {accuracy:.0%}")
            ax.set_xticks(layers[:: max(1, DEPTH // 5)])
            ax.grid(True, which="major", alpha=0.3)
        for ax in axes.flat[len(results) :]:
            ax.set_visible(False)
        for ax in axes[-1]:
            ax.set_xlabel("layer ℓ (input → output)")
        for ax in axes[:, 0]:
            ax.set_ylabel("‖d loss / d h_ℓ‖")
        handles, labels = axes.flat[0].get_legend_handles_labels()
        fig.legend(
            handles,
            labels,
            loc="outside lower center",
            ncols=len(SNAPSHOTS),
            title="training (batch of 128)",
        )
        fig.suptitle(
            f"Gradient flow through {DEPTH}-layer MLPs (Haiku, digits, SGD lr "
            f"{LEARNING_RATE}),\nread from res.activation_grads",
            fontsize=12,
        )
        fig.savefig(path, dpi=150)
        plt.close(fig)


def main():
    start = time.perf_counter()
    train_x, test_x, train_y, test_y = digits()
    results = {}
    for name, variant in VARIANTS.items():
        results[name] = train(
            make_model(*variant), train_x, train_y, test_x, test_y, name
        )

    print(f"\n{DEPTH} layers, {STEPS} steps of {BATCH}:")
    print(
        f"  {'variant':<27} {'final loss':>10} {'test acc.':>9} "
        f"{'‖grad‖ layer 1':>15} {f'layer {DEPTH}':>10}  (at the first step)"
    )
    for name, (losses, norms, accuracy) in results.items():
        print(
            f"  {name:<27} {losses[-1]:>10.4f} {accuracy:>9.1%} "
            f"{norms[0, 0]:>15.1e} {norms[0, -1]:>10.1e}"
        )
    FIGURE.save(lambda path: plot(results, path))
    print(f"({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
