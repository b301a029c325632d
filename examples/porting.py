"""Port a Haiku CNN to Flax Linen, Equinox and Flax NNX, and find a porting bug.

The source is a small Haiku convolutional classifier of 8x8 one-channel
images: a 3x3 convolution, a LayerNorm over the channels, ReLU, a second
convolution, ReLU, flatten, a dense head. Its weights stand in for a trained
checkpoint. Each port is written the way its library's users write it — the
Equinox one channel-first and one example at a time, transposing at its
entry — and needs no initialisation of its own: ``jax.eval_shape`` gives its
structure, and ``bridge.transfer`` fills it. Then

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

    python -m pip install -e ".[all,examples]"
    python examples/porting.py

``BRIDGE_EXAMPLES_SMOKE=1`` uses a smaller batch. Each ``compare`` compiles
both models once; nothing else compiles. It draws no figure.
"""

# The optional packages are imported after `require` has checked them.
# ruff: noqa: E402
from __future__ import annotations

import math
import time

from example_support import SMOKE, require

require("flax", "equinox", "haiku")

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import bridge

BATCH = 16 if SMOKE else 256
CHANNELS = (8, 16)
CLASSES = 10
SIDE = 8  # images are 8x8, one channel
EPSILON = 1e-5  # Haiku's and Equinox's LayerNorm default; Flax's is 1e-6
FLAT = (SIDE - 2) * (SIDE - 2) * CHANNELS[1]  # after a VALID 3x3 convolution


def images(count: int) -> tuple[jax.Array, jax.Array]:
    """`count` random images `(N, 8, 8, 1)` and class labels."""
    generator = np.random.default_rng(0)
    pixels = generator.uniform(size=(count, SIDE, SIDE, 1))
    labels = generator.integers(0, CLASSES, size=count)
    return jnp.asarray(pixels, jnp.float32), jnp.asarray(labels)


def checkpoint(shapes):
    """Weights for the abstract leaves of `shapes` (what `jax.eval_shape` of an
    initialisation returns), drawn with numpy: a stand-in for the trained
    checkpoint you would port. Kernels have variance 1 / fan-in."""
    generator = np.random.default_rng(1)

    def draw(leaf):
        fan_in = math.prod(leaf.shape[:-1]) or 1
        scale = 1 / math.sqrt(fan_in) if len(leaf.shape) > 1 else 0.1
        return jnp.asarray(scale * generator.standard_normal(leaf.shape), leaf.dtype)

    return jax.tree.map(draw, shapes)


def placeholders(shapes):
    """Zeros in place of the abstract leaves of `shapes`: a port's own weights
    are all replaced by `bridge.transfer`, so drawing them would be wasted."""
    return jax.tree.map(
        lambda leaf: (
            jnp.zeros(leaf.shape, leaf.dtype)
            if isinstance(leaf, jax.ShapeDtypeStruct)
            else leaf
        ),
        shapes,
    )


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
        # The LayerNorm normalises the channels of each pixel. Mapping over
        # rows outside columns makes its site `(N, H, W, C)`, as in the
        # channel-last libraries (a site inside the model's own vmaps holds
        # the mapped axes first, outermost first).
        per_pixel = jax.vmap(jax.vmap(self.norm, in_axes=1, out_axes=1), 1, 1)
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


def linen_port(x):
    module = LinenCNN()
    shapes = jax.eval_shape(module.init, jax.random.key(0), x)
    return bridge.probe(module, placeholders(shapes))


def equinox_port(**hyperparameters):
    shapes = eqx.filter_eval_shape(EquinoxCNN, jax.random.key(0), **hyperparameters)
    return bridge.probe(placeholders(shapes), vmap=True)


def nnx_port(cls=NnxCNN):
    graphdef, shapes = nnx.split(nnx.eval_shape(lambda: cls(nnx.Rngs(0))))
    return bridge.probe(nnx.merge(graphdef, placeholders(shapes)))


def main() -> None:
    start = time.perf_counter()
    x, labels = images(BATCH)
    loss_fn = cross_entropy(labels)

    source_model = hk.transform(haiku_cnn)
    params = checkpoint(jax.eval_shape(source_model.init, jax.random.key(0), x))
    source = bridge.probe(source_model, params)

    ports = {
        "Flax Linen": linen_port(x),
        "Equinox": equinox_port(),
        "Flax NNX": nnx_port(),
    }
    for name, port in ports.items():
        ported = bridge.transfer(source, port, x)
        report = bridge.compare(source, ported, loss_fn, x)
        show(f"Haiku -> {name}", report)
        assert report.first_divergence is None, name

    buggy = {
        # The same weights, layer by layer, but no ReLU between norm and conv2:
        # the first layer whose activations part is the one after the bug.
        "Flax NNX without the ReLU after the LayerNorm": (
            nnx_port(NnxCNNWithoutReLU),
            "conv2_d_1",
        ),
        # Reflection instead of zeros at the border of the first convolution.
        "Equinox with reflection padding": (
            equinox_port(padding_mode="REFLECT"),
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
    main()
