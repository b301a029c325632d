"""Saliency and gradient × activation of a small Equinox CNN, on handwritten digits.

A two-layer CNN is trained for a few hundred Adam steps on scikit-learn's
bundled digits (1,797 images of 8×8 pixels, no download). Then, for a handful
of test digits, one probed backward pass of the predicted class's logit gives

- **saliency**, ``d logit / d pixel``: the model marks its input with
  ``bridge.tap("pixels", image)``, a no-op outside a probe, so the gradient
  with respect to the input is the activation gradient of that site (checked
  against ``jax.grad`` with respect to the images);
- **gradient × input**, the saliency times the pixel values;
- **gradient × activation** at each convolution's output (before its ReLU),
  summed over channels: how much each position of that layer pushes the logit,
  to first order.

With ``--out DIR`` the grid is drawn into ``DIR/saliency.png`` (``--out docs``
redraws the committed figure); without it, nothing is written.

    python -m pip install -e ".[all,examples]"
    python examples/saliency.py --out docs

``BRIDGE_EXAMPLES_SMOKE=1`` trains for a few steps only.
"""

# The optional packages are imported after `require` has checked them.
# ruff: noqa: E402
from __future__ import annotations

import time

from example_support import SMOKE, Figure, require

require("equinox", "optax", "sklearn", "tqdm", "matplotlib")

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import bridge

FIGURE = Figure("saliency.png")
STEPS = 20 if SMOKE else 400
BATCH = 64
SHOWN = 3 if SMOKE else 8  # test digits in the figure: one each of 0, 1, …
CONVS = ("conv1", "conv2")


class CNN(eqx.Module):
    """Conv 3×3 → ReLU → Conv 3×3 → ReLU → 2×2 average pool → Dense → ReLU → Dense."""

    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    hidden: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 4)
        self.conv1 = eqx.nn.Conv2d(1, 16, 3, padding=1, key=keys[0])
        self.conv2 = eqx.nn.Conv2d(16, 32, 3, padding=1, key=keys[1])
        self.hidden = eqx.nn.Linear(32 * 4 * 4, 64, key=keys[2])
        self.head = eqx.nn.Linear(64, 10, key=keys[3])

    def __call__(self, image):  # one image, channel first: (1, 8, 8)
        image = bridge.tap("pixels", image)  # free outside a probe
        x = jax.nn.relu(self.conv1(image))
        x = jax.nn.relu(self.conv2(x))
        x = x.reshape(32, 4, 2, 4, 2).mean(axis=(2, 4))  # 2×2 average pool
        x = jax.nn.relu(self.hidden(x.ravel()))
        return self.head(x)


def digits():
    """Train and test splits of the digits, as (N, 1, 8, 8) images in [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    images = (images / 16.0).reshape(-1, 1, 8, 8).astype(np.float32)
    return train_test_split(images, labels, test_size=0.2, random_state=0)


def train(model, images, labels):
    optimizer = optax.adam(3e-3)

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        def loss(model):
            logits = jax.vmap(model)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        value, grads = eqx.filter_value_and_grad(loss)(model)
        updates, opt_state = optimizer.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state, value

    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    rng = np.random.default_rng(0)
    progress = tqdm(range(STEPS), desc="training", unit="step")
    for i in progress:
        batch = rng.choice(len(images), BATCH, replace=False)
        model, opt_state, value = step(model, opt_state, images[batch], labels[batch])
        if i % 20 == 0 or i == STEPS - 1:
            progress.set_postfix(loss=f"{float(value):.3f}")
    return model


@eqx.filter_jit
def attributions(model, images, classes):
    """Per image: the saliency and each conv layer's gradient × activation map."""
    probe = bridge.probe(model, vmap=True)
    # Images are independent, so the gradient of the sum of the chosen logits
    # is, image by image, the gradient of that image's own logit.
    res = probe.value_and_grad(
        lambda logits: jnp.sum(jnp.take_along_axis(logits, classes[:, None], 1)),
        images,
        at=["pixels", *CONVS],
    )
    saliency = res.activation_grads["pixels"][:, 0]  # (N, 8, 8)
    per_layer = {
        conv: jnp.sum(res.activations[conv] * res.activation_grads[conv], axis=1)
        for conv in CONVS
    }
    # The independent reference: plain jax.grad with respect to the images.
    reference = jax.grad(
        lambda x: jnp.sum(jnp.take_along_axis(jax.vmap(model)(x), classes[:, None], 1))
    )(images)[:, 0]
    return saliency, per_layer, reference


def plot(images, labels, predictions, saliency, per_layer, path):
    """One column per digit, one row per map; 8.5 inches wide with 11-point
    text, so the docs page (about 690 pixels) shows it at about 0.8 scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {
        "digit\n(label → predicted)": images,
        "saliency:\nd logit / d pixel": saliency,
        "gradient × input": saliency * images,
        **{
            f"{conv} output\n(pre-ReLU):\ngrad × activation": maps
            for conv, maps in per_layer.items()
        },
    }
    with plt.rc_context({"font.size": 11}):
        fig, axes = plt.subplots(
            len(rows),
            len(images),
            figsize=(8.5, 0.9 * len(rows) + 0.9),
            layout="constrained",
        )
        for row, (title, maps) in enumerate(rows.items()):
            for col, (label, prediction) in enumerate(
                zip(labels, predictions, strict=True)
            ):
                ax = axes[row, col]
                if row == 0:
                    ax.imshow(maps[col], cmap="gray_r", vmin=0, vmax=1)
                    ax.set_title(f"{label} → {prediction}")
                else:  # signed, each map on its own symmetric scale
                    scale = float(np.abs(maps[col]).max()) or 1.0
                    ax.imshow(maps[col], cmap="RdBu_r", vmin=-scale, vmax=scale)
                ax.set_xticks([])
                ax.set_yticks([])
                if col == 0:
                    ax.set_ylabel(title, rotation=0, ha="right", va="center")
        fig.suptitle(
            "What raises (red) or lowers (blue) the predicted digit's logit:\n"
            "Equinox CNN, scikit-learn digits",
            fontsize=12,
        )
        fig.savefig(path, dpi=150)
        plt.close(fig)


def main():
    start = time.perf_counter()
    train_images, test_images, train_labels, test_labels = digits()
    model = eqx.filter_jit(CNN)(jax.random.key(0))  # one compilation, not one per op
    model = train(model, train_images, train_labels)

    predictions = np.asarray(
        eqx.filter_jit(lambda m, x: jnp.argmax(jax.vmap(m)(x), -1))(model, test_images)
    )
    accuracy = np.mean(predictions == test_labels)
    print(
        f"trained {STEPS} steps of {BATCH} on {len(train_images)} digits: "
        f"test accuracy {accuracy:.1%} ({len(test_images)} digits)"
    )

    # One example of each of the first digit classes, in order.
    shown = np.array([np.flatnonzero(test_labels == d)[0] for d in range(SHOWN)])
    images = test_images[shown]
    saliency, per_layer, reference = jax.tree.map(
        np.asarray, attributions(model, images, jnp.asarray(predictions[shown]))
    )
    difference = np.abs(saliency - reference).max()
    print(f"saliency from the tapped input vs jax.grad of the images: {difference:.1e}")
    assert difference < 1e-5

    FIGURE.save(
        lambda path: plot(
            images[:, 0],
            test_labels[shown],
            predictions[shown],
            saliency,
            per_layer,
            path,
        )
    )
    print(f"({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
