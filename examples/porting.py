"""Port a Haiku CNN to Flax Linen, Equinox and Flax NNX, and find a porting bug.

The source is a small Haiku convolutional classifier of 8x8 digit images
(scikit-learn's bundled digits): a 3x3 convolution, a LayerNorm over the
channels, ReLU, a second convolution, ReLU, flatten, a dense head. Each port
is written the way its library's users write it — the Equinox one
channel-first and one example at a time, transposing at its entry — and
initialised its own way. Then

1. ``bridge.transfer(haiku_probe, port_probe, x)`` pairs the two models'
   parameterised layers in call order and moves the weights, converting
   layouts (Equinox ``OIHW`` kernels and ``(out, in)`` weights, Haiku
   ``offset`` to Flax ``bias``, ...);
2. ``bridge.compare(haiku_probe, ported, loss_fn, x)`` runs both and prints,
   layer by layer, the largest difference of the activations and of the
   gradients of the loss with respect to them: every port agrees;
3. two deliberate porting bugs — an NNX port that forgets the ReLU after the
   LayerNorm, an Equinox port that pads its first convolution by reflection —
   and ``report.first_divergence`` names the layer where each model parts from
   the source: the first convolution for the padding, the second convolution
   (the first layer after the missing ReLU) for the activation.

Only weights move: hyperparameters are the porter's to match. Flax's
LayerNorm epsilon defaults to 1e-6, Haiku's and Equinox's to 1e-5, so every
port sets it.

    python examples/porting.py

``BRIDGE_EXAMPLES_SMOKE=1`` uses a smaller batch.
"""

from __future__ import annotations

import os
import time

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import bridge

SMOKE = os.environ.get("BRIDGE_EXAMPLES_SMOKE", "") not in ("", "0")
BATCH = 16 if SMOKE else 256
CHANNELS = (8, 16)
CLASSES = 10
SIDE = 8  # the digits are 8x8, one channel
EPSILON = 1e-5  # Haiku's and Equinox's LayerNorm default; Flax's is 1e-6
FLAT = (SIDE - 2) * (SIDE - 2) * CHANNELS[1]  # after a VALID 3x3 convolution


def digits(count: int) -> tuple[jax.Array, jax.Array]:
    """`count` digit images `(N, 8, 8, 1)` scaled to [0, 1], and their labels."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    images = images[:count].reshape(-1, SIDE, SIDE, 1) / 16.0
    return jnp.asarray(images, jnp.float32), jnp.asarray(labels[:count])


def cross_entropy(labels):
    def loss(logits):
        log_probs = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1))

    return loss


# -- the source: Haiku ------------------------------------------------------------


def haiku_cnn(x):
    x = hk.Conv2D(CHANNELS[0], 3, padding="SAME")(x)
    x = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True, eps=EPSILON)(x)
    x = jax.nn.relu(x)
    x = jax.nn.relu(hk.Conv2D(CHANNELS[1], 3, padding="VALID")(x))
    return hk.Linear(CLASSES)(hk.Flatten()(x))


# -- the ports ----------------------------------------------------------------------


class LinenCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(CHANNELS[0], (3, 3), padding="SAME")(x)
        x = nn.relu(nn.LayerNorm(epsilon=EPSILON)(x))
        x = nn.relu(nn.Conv(CHANNELS[1], (3, 3), padding="VALID")(x))
        return nn.Dense(CLASSES)(x.reshape(x.shape[0], -1))


class EquinoxCNN(eqx.Module):
    """Channel-first inside, one image at a time (probed with `vmap=True`)."""

    conv1: eqx.nn.Conv2d
    norm: eqx.nn.LayerNorm
    conv2: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key, padding_mode="ZEROS"):
        keys = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(
            1, CHANNELS[0], 3, padding=1, padding_mode=padding_mode, key=keys[0]
        )
        self.norm = eqx.nn.LayerNorm(CHANNELS[0], eps=EPSILON)
        self.conv2 = eqx.nn.Conv2d(CHANNELS[0], CHANNELS[1], 3, key=keys[1])
        self.head = eqx.nn.Linear(FLAT, CLASSES, key=keys[2])

    def __call__(self, image):  # (H, W, C), as the other libraries take it
        x = self.conv1(jnp.transpose(image, (2, 0, 1)))
        # The LayerNorm normalises the channels of each pixel.
        per_pixel = jax.vmap(jax.vmap(self.norm, in_axes=1, out_axes=1), 2, 2)
        x = jax.nn.relu(per_pixel(x))
        x = jax.nn.relu(self.conv2(x))
        # Back to channel-last before flattening, or the head's inputs are
        # in another order than Haiku's.
        return self.head(jnp.transpose(x, (1, 2, 0)).reshape(-1))


class NnxCNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, CHANNELS[0], (3, 3), rngs=rngs)
        self.norm = nnx.LayerNorm(CHANNELS[0], epsilon=EPSILON, rngs=rngs)
        self.conv2 = nnx.Conv(
            CHANNELS[0], CHANNELS[1], (3, 3), padding="VALID", rngs=rngs
        )
        self.head = nnx.Linear(FLAT, CLASSES, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.norm(self.conv1(x)))
        x = nnx.relu(self.conv2(x))
        return self.head(x.reshape(x.shape[0], -1))


class NnxCNNWithoutReLU(NnxCNN):
    """A porting bug: the ReLU after the LayerNorm is missing."""

    def __call__(self, x):
        x = self.norm(self.conv1(x))
        x = nnx.relu(self.conv2(x))
        return self.head(x.reshape(x.shape[0], -1))


def show(title: str, report) -> None:
    print(f"\n== {title}")
    print(report)
    first = report.first_divergence
    if first is None:
        print("-> the port agrees with the source at every layer")
    else:
        print(f"-> first divergence: Haiku {first.site_a!r} / port {first.site_b!r}")


def main() -> None:
    start = time.perf_counter()
    x, labels = digits(BATCH)
    loss_fn = cross_entropy(labels)

    source_model = hk.transform(haiku_cnn)
    source = bridge.probe(source_model, source_model.init(jax.random.key(0), x))

    ports = {
        "Flax Linen": bridge.probe(
            LinenCNN(), LinenCNN().init(jax.random.key(1), x)
        ),
        "Equinox": bridge.probe(EquinoxCNN(jax.random.key(2)), vmap=True),
        "Flax NNX": bridge.probe(NnxCNN(nnx.Rngs(3))),
    }
    for name, port in ports.items():
        ported = bridge.transfer(source, port, x)
        report = bridge.compare(source, ported, loss_fn, x)
        show(f"Haiku -> {name}", report)
        assert report.first_divergence is None, name

    buggy = {
        # Layer by layer the same weights, but no ReLU between norm and conv2.
        "Flax NNX without the ReLU after the LayerNorm": (
            bridge.probe(NnxCNNWithoutReLU(nnx.Rngs(3))),
            "conv2_d_1",
        ),
        # Reflection instead of zeros at the border of the first convolution.
        "Equinox with reflection padding": (
            bridge.probe(EquinoxCNN(jax.random.key(2), "REFLECT"), vmap=True),
            "conv2_d",
        ),
    }
    for name, (port, expected) in buggy.items():
        report = bridge.compare(source, bridge.transfer(source, port, x), loss_fn, x)
        show(f"Haiku -> {name}", report)
        first = report.first_divergence
        assert first is not None and first.site_a == expected, (name, first)

    print(f"\n{time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
