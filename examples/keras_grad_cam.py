"""Grad-CAM on a Keras 3 CNN, through bridge, on handwritten digits.

Grad-CAM (Selvaraju et al., 2017) explains a class score by the last
convolution's feature maps ``A_k``, each weighted by the mean gradient of the
score over its positions: ``relu(sum_k mean_ij(d score / d A_k) * A_k)``.
Keras's Grad-CAM example reads that gradient with TensorFlow's
``GradientTape``, and keras-team/keras#20760 asks for a way on the other
backends; with bridge, on the JAX backend, it is one probed pass of the Keras
model, under ``jax.jit``.

A small functional Keras CNN (three ``Conv2D`` layers, the last one named
``last_conv``, max pooling and a ``Dense`` head) is trained with Keras's own
``model.fit`` on the JAX backend, on scikit-learn's bundled digits (8×8
images, no download). Then, for one test digit of each class,
``probe.value_and_grad(score, images, at="last_conv")`` (``score``: the
predicted class's logit, summed over the batch) gives the last convolution's
activations and the score's gradient with respect to them; the 4×4 Grad-CAM
map is upsampled to the 8×8 image. The gradient is checked once against
``jax.grad`` with respect to an offset added after ``last_conv`` in a twin of
the model (``keras.layers.Add`` of an offset input), through Keras's own
``stateless_call``.

With ``--out DIR`` the figure is drawn into ``DIR/keras_grad_cam.png``
(``--out docs`` redraws the committed figure); without it, nothing is written.

    python -m pip install -e ".[all,examples]"
    python examples/keras_grad_cam.py --out docs

``BRIDGE_EXAMPLES_SMOKE=1`` trains for a few steps only.
"""

# The optional packages are imported after `require` has checked them, and
# Keras after its backend is set.
# ruff: noqa: E402
from __future__ import annotations

import os
import time

from example_support import SMOKE, Figure, require

require("keras", "sklearn", "matplotlib")

os.environ["KERAS_BACKEND"] = "jax"  # Keras reads it once, at import

import jax
import jax.numpy as jnp
import keras
import numpy as np

import bridge

FIGURE = Figure("keras_grad_cam.png")
EPOCHS = 1 if SMOKE else 15
BATCH = 64
SHOWN = 3 if SMOKE else 10  # test digits in the figure: one each of 0, 1, …


def digits():
    """Train and test splits of the digits, as (N, 8, 8, 1) images in [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    images = (images / 16.0).reshape(-1, 8, 8, 1).astype(np.float32)
    return train_test_split(images, labels, test_size=0.2, random_state=0)


def cnn():
    """The model and a twin that adds an offset input after ``last_conv``:
    the same layer objects, so the same variables."""
    keras.utils.set_random_seed(0)
    conv1 = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="conv1")
    pool1 = keras.layers.MaxPooling2D(2, name="pool1")
    conv2 = keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="conv2")
    last_conv = keras.layers.Conv2D(
        32, 3, padding="same", activation="relu", name="last_conv"
    )
    pool2 = keras.layers.MaxPooling2D(2, name="pool2")
    flatten = keras.layers.Flatten(name="flatten")
    head = keras.layers.Dense(10, name="logits")

    inputs = keras.Input((8, 8, 1))
    features = last_conv(conv2(pool1(conv1(inputs))))  # (N, 4, 4, 32)
    model = keras.Model(inputs, head(flatten(pool2(features))), name="cnn")

    offset = keras.Input(features.shape[1:])
    shifted = keras.layers.Add(name="offset")([features, offset])
    twin = keras.Model([inputs, offset], head(flatten(pool2(shifted))), name="twin")
    return model, twin


def predicted_logit(logits):
    """The predicted class's logit, summed over the batch (images are
    independent: its gradient is, image by image, that of the image's own
    logit), and the predicted classes."""
    classes = jnp.argmax(logits, axis=-1)
    score = jnp.sum(jnp.take_along_axis(logits, classes[:, None], axis=1))
    return score, classes


@jax.jit
def grad_cam(probe, images):
    """The Grad-CAM map of each image's predicted class, at the image's size."""
    res = probe.value_and_grad(predicted_logit, images, at="last_conv", has_aux=True)
    activations = res.activations["last_conv"]  # (N, 4, 4, channels)
    gradients = res.activation_grads["last_conv"]
    weights = jnp.mean(gradients, axis=(1, 2))  # one per channel: (N, channels)
    cam = jax.nn.relu(jnp.einsum("nijk,nk->nij", activations, weights))
    upsampled = jax.image.resize(cam, (len(images), *images.shape[1:3]), "bilinear")
    return upsampled, cam, res.aux, activations, gradients


def check_against_twin(model, twin, images, predictions, activations, gradients):
    """bridge's activations and gradient at ``last_conv`` against Keras's own
    outputs (``keras.Model(inputs, [last_conv.output, logits])``) and
    ``jax.grad`` of the twin's score with respect to its offset, at zero."""
    inputs = model.inputs[0]
    both = keras.Model(inputs, [model.get_layer("last_conv").output, model.output])
    expected_activations, _ = both(images)
    values = [variable.value for variable in twin.trainable_variables]
    classes = jnp.asarray(predictions)[:, None]  # the classes bridge explained

    def score_of(offset):
        logits, _ = twin.stateless_call(values, [], [images, offset])
        return jnp.sum(jnp.take_along_axis(logits, classes, axis=1))

    zero = jnp.zeros(activations.shape, activations.dtype)
    expected_gradients = np.asarray(jax.jit(jax.grad(score_of))(zero))
    for name, actual, expected in [
        ("activations", activations, expected_activations),
        ("gradient", gradients, expected_gradients),
    ]:
        difference = float(np.abs(np.asarray(actual) - expected).max())
        scale = float(np.abs(expected).max())
        print(
            f"last_conv {name}, bridge vs the Keras twin: max difference "
            f"{difference:.1e} (largest value {scale:.1e})"
        )
        assert difference <= 1e-5 * max(scale, 1.0), name


def plot(images, labels, predictions, maps, path):
    """The digits, and their Grad-CAM maps over them; 8.5 inches wide with
    11-point text, so the docs page (about 690 pixels) shows it at about 0.8
    scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with plt.rc_context({"font.size": 11}):
        fig, axes = plt.subplots(
            2, len(images), figsize=(8.5, 2.4), layout="constrained", squeeze=False
        )
        for col, image in enumerate(images):
            top, bottom = axes[0, col], axes[1, col]
            top.imshow(image, cmap="gray_r", vmin=0, vmax=1)
            top.set_title(f"{labels[col]} → {predictions[col]}")
            # The map, each on its own scale, with the digit's outline over it.
            scale = float(maps[col].max()) or 1.0
            heat = bottom.imshow(maps[col], cmap="inferno", vmin=0, vmax=scale)
            bottom.contour(image, levels=[0.5], colors="cyan", linewidths=1.2)
            for ax in (top, bottom):
                ax.set_xticks([])
                ax.set_yticks([])
        for ax, title in [
            (axes[0, 0], "digit\n(label →\npredicted)"),
            (axes[1, 0], "Grad-CAM\nat last_conv\n(4×4, resized)"),
        ]:
            ax.set_ylabel(title, rotation=0, ha="right", va="center")
        colorbar = fig.colorbar(heat, ax=axes[1, :], pad=0.01, ticks=[0, scale])
        colorbar.ax.set_yticklabels(["0", "max"])
        fig.suptitle(
            "Grad-CAM of the predicted class: Keras 3 CNN on the JAX backend, "
            "scikit-learn digits",
            fontsize=12,
        )
        fig.savefig(path, dpi=150)
        plt.close(fig)


def main():
    start = time.perf_counter()
    train_images, test_images, train_labels, test_labels = digits()
    if SMOKE:
        train_images, train_labels = train_images[:192], train_labels[:192]  # 3 steps
    model, twin = cnn()
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model.fit(train_images, train_labels, batch_size=BATCH, epochs=EPOCHS, verbose=2)
    _, accuracy = model.evaluate(test_images, test_labels, verbose=0)
    print(
        f"trained {EPOCHS} epochs of model.fit on {len(train_images)} digits: "
        f"test accuracy {accuracy:.1%} ({len(test_images)} digits)"
    )

    # One test digit of each of the first classes, in order.
    shown = np.array([np.flatnonzero(test_labels == d)[0] for d in range(SHOWN)])
    images = test_images[shown]
    probe = bridge.probe(model)  # the trained model's variables
    maps, cam, predictions, activations, gradients = jax.tree.map(
        np.asarray, grad_cam(probe, images)
    )
    print(f"Grad-CAM at last_conv: {cam.shape[1:]} per image, upsampled to 8×8")
    check_against_twin(model, twin, images, predictions, activations, gradients)

    FIGURE.save(
        lambda path: plot(images[..., 0], test_labels[shown], predictions, maps, path)
    )
    print(f"({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
