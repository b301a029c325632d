"""Port a Hugging Face PyTorch ResNet to Flax Linen, and find three porting bugs.

The source is a model nobody on this project wrote:
``transformers.ResNetForImageClassification``, built from a small
``ResNetConfig`` (basic layers, 10 classes, 3x32x32 images) and initialised
at random — no download. A few SGD steps in ``train()`` mode on random images
give its BatchNorm layers running statistics far from their initial 0 and 1,
and its weights stand in for a trained checkpoint; then it is put in
``eval()`` mode, as it would be ported.

The port is written by hand in Flax Linen, channel-last (NHWC), the way a
Flax user writes a ResNet, calling the same layers in the same order as
Hugging Face's ``forward``:

- the embedder: 7x7 convolution, stride 2, padding 3, no bias; BatchNorm;
  ReLU; then a 3x3 max pool, stride 2, padding 1;
- stages of basic layers: 3x3 convolution, BatchNorm, ReLU, 3x3 convolution,
  BatchNorm, and — where the shape changes — a 1x1 convolution with stride 2
  and a BatchNorm on the shortcut, *called after the layer's two
  convolutions*, as Hugging Face does; the sum, then ReLU;
- a global average pool and the linear classifier.

PyTorch's BatchNorm has ``eps=1e-5`` and ``momentum=0.1`` (the weight of the
new batch); Flax's ``momentum`` is the weight of the old average, so 0.9.

1. ``bridge.transfer(torch_probe, linen_probe, x_nchw, args_b=(x_nhwc,))``
   pairs the two models' parameterised layers in call order and moves the
   weights: ``OIHW`` convolution kernels to ``HWIO``, the ``(out, in)``
   classifier weight to ``(in, out)``, BatchNorm ``weight``/``bias`` to
   ``scale``/``bias`` and its running statistics into ``batch_stats``.
2. ``bridge.compare`` runs both, each on its own layout of the same images,
   and prints, layer by layer, the largest difference of the activations and
   of the gradients of the loss with respect to them: the port agrees with
   PyTorch to float32 rounding (about 1e-6 relative at worst, 41 layers).
3. Three deliberate porting bugs, each a one-line slip, and
   ``report.first_divergence`` names the layer where each port parts from
   PyTorch (the example fails if it names another):

   - the stem convolution padded ``"SAME"`` instead of ``((3, 3), (3, 3))``:
     with stride 2 on an even size XLA pads (2, 3), so the output has the
     right shape and the wrong values — the stem convolution itself;
   - the shortcut's BatchNorm with Keras's ``epsilon=1e-3`` instead of
     PyTorch's 1e-5 — the first shortcut BatchNorm;
   - the ReLU after the residual sum forgotten — the first convolution of
     the next layer, the first parameterised layer the unrectified sum
     reaches (in the smoke run's one-layer stages, that of stage 1, whose
     two convolutions run before its shortcut).

``docs/port_from_pytorch.png`` draws, per paired layer in call order, the
largest relative difference of the activations and of their gradients, for
the correct port and each buggy one, with each first divergence marked.

    python -m pip install -e ".[all,examples,torch]"
    python examples/port_from_pytorch.py --out docs

Without ``--out DIR`` (or ``BRIDGE_EXAMPLES_OUT=DIR``) it writes nothing.
``BRIDGE_EXAMPLES_SMOKE=1`` builds a shallower, narrower ResNet and a smaller
batch (the committed picture is that of the full run).
"""

# The optional packages are imported after `require` has checked them.
# ruff: noqa: E402
from __future__ import annotations

import functools
import time
from typing import Any

from example_support import SMOKE, Figure, require

require("flax", "torch", "transformers", "matplotlib")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import torch
from port_plot import plot, show
from transformers import ResNetConfig, ResNetForImageClassification

import bridge

FIGURE = Figure("port_from_pytorch.png")
BATCH = 8 if SMOKE else 64
SIDE = 32  # 3x32x32 images
CLASSES = 10
CONFIG = ResNetConfig(
    num_channels=3,
    embedding_size=8 if SMOKE else 16,
    hidden_sizes=[8, 16] if SMOKE else [16, 32, 64, 128],
    depths=[1, 1] if SMOKE else [2, 2, 2, 2],
    layer_type="basic",
    hidden_act="relu",
    num_labels=CLASSES,
)
WARMUP_STEPS = 3 if SMOKE else 20  # train() steps that move the running statistics
# PyTorch's BatchNorm2d defaults. Flax's momentum is the weight of the old average.
EPSILON = 1e-5
MOMENTUM = 0.9
# compare's defaults (rtol 1e-5, atol 1e-6) suit shallow models: here
# activations reach ~10 and pass through 20 convolutions summed in another
# order, and float32 rounding alone differs by up to ~1e-5 absolute.
TOLERANCES = {"rtol": 1e-5, "atol": 5e-5}


# -- the source: Hugging Face's PyTorch ResNet --------------------------------------


def pytorch_resnet() -> torch.nn.Module:
    """The Hugging Face model, after a few SGD steps in `train()` mode on
    random images (so its BatchNorm running statistics and affine weights are
    no longer 0, 1, 1, 0), in `eval()` mode."""
    torch.manual_seed(0)
    model = ResNetForImageClassification(CONFIG)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    model.train()
    for _ in range(WARMUP_STEPS):
        # Unnormalised pixels in [0, 1]: running means far from 0.
        pixels = torch.rand(BATCH, 3, SIDE, SIDE, generator=generator)
        labels = torch.randint(0, CLASSES, (BATCH,), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(pixels).logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def images() -> tuple[torch.Tensor, torch.Tensor]:
    """`BATCH` random images `(N, 3, 32, 32)` and class labels."""
    generator = torch.Generator().manual_seed(2)
    pixels = torch.rand(BATCH, 3, SIDE, SIDE, generator=generator)
    return pixels, torch.randint(0, CLASSES, (BATCH,), generator=generator)


# -- the port: Flax Linen, channel-last ----------------------------------------------
# Submodules are named as in Hugging Face's model (`stages_1/layers_0/shortcut`
# for `resnet.encoder.stages.1.layers.0.shortcut`), which makes the comparison
# table easy to read; bridge pairs layers by call order, not by name.


def batch_norm(epsilon: float = EPSILON, name: str | None = None) -> nn.BatchNorm:
    return nn.BatchNorm(
        use_running_average=True, momentum=MOMENTUM, epsilon=epsilon, name=name
    )


class ConvLayer(nn.Module):
    """Hugging Face's `ResNetConvLayer`: convolution (padding kernel // 2, no
    bias), BatchNorm, and ReLU unless `relu=False`."""

    features: int
    kernel: int = 3
    stride: int = 1
    relu: bool = True
    padding: Any = None  # None: kernel // 2 on every side, as PyTorch's

    @nn.compact
    def __call__(self, x):
        pad = self.kernel // 2
        padding = ((pad, pad), (pad, pad)) if self.padding is None else self.padding
        x = nn.Conv(
            self.features,
            (self.kernel, self.kernel),
            strides=self.stride,
            padding=padding,
            use_bias=False,
            name="convolution",
        )(x)
        x = batch_norm(name="normalization")(x)
        return nn.relu(x) if self.relu else x


class ShortCut(nn.Module):
    """A 1x1 convolution with stride, and BatchNorm."""

    features: int
    stride: int = 2
    epsilon: float = EPSILON

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(
            self.features,
            (1, 1),
            strides=self.stride,
            padding="VALID",
            use_bias=False,
            name="convolution",
        )(x)
        return batch_norm(self.epsilon, name="normalization")(x)


class BasicLayer(nn.Module):
    features: int
    stride: int = 1
    shortcut_cls: Any = ShortCut

    @nn.compact
    def __call__(self, x):
        residual = x
        # Hugging Face runs the layer's two convolutions first, then the shortcut.
        h = ConvLayer(self.features, stride=self.stride, name="layer_0")(x)
        h = ConvLayer(self.features, relu=False, name="layer_1")(h)
        if x.shape[-1] != self.features or self.stride != 1:
            residual = self.shortcut_cls(
                self.features, stride=self.stride, name="shortcut"
            )(x)
        return self.activation(h + residual)

    def activation(self, x):
        return nn.relu(x)


class ResNet(nn.Module):
    """Hugging Face's `ResNetForImageClassification` (basic layers), NHWC."""

    embedding_size: int
    hidden_sizes: tuple[int, ...]
    depths: tuple[int, ...]
    classes: int
    stem_padding: Any = ((3, 3), (3, 3))
    layer_cls: Any = BasicLayer
    shortcut_cls: Any = ShortCut

    @nn.compact
    def __call__(self, x):
        x = ConvLayer(
            self.embedding_size,
            kernel=7,
            stride=2,
            padding=self.stem_padding,
            name="embedder",
        )(x)
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        for i, (features, depth) in enumerate(
            zip(self.hidden_sizes, self.depths, strict=True)
        ):
            for j in range(depth):
                # Every stage but the first halves the resolution in its first layer.
                stride = 2 if i > 0 and j == 0 else 1
                x = self.layer_cls(
                    features,
                    stride=stride,
                    shortcut_cls=self.shortcut_cls,
                    name=f"stages_{i}_layers_{j}",
                )(x)
        x = jnp.mean(x, axis=(1, 2))  # AdaptiveAvgPool2d((1, 1)), flattened
        return nn.Dense(self.classes, name="classifier")(x)


# -- three porting bugs ----------------------------------------------------------------


class BasicLayerWithoutReLU(BasicLayer):
    """The ReLU after the residual sum is forgotten."""

    def activation(self, x):
        return x


def linen_resnet(**slips) -> ResNet:
    return ResNet(
        CONFIG.embedding_size,
        tuple(CONFIG.hidden_sizes),
        tuple(CONFIG.depths),
        CLASSES,
        **slips,
    )


def placeholders(shapes):
    """Zeros in place of the abstract leaves that `jax.eval_shape` returns."""
    return jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), shapes)


BUGS = {
    "stem convolution padded 'SAME' instead of ((3, 3), (3, 3))": (
        "stem padding 'SAME'",
        {"stem_padding": "SAME"},
        "resnet.embedder.embedder.convolution",
    ),
    "shortcut BatchNorm with Keras's epsilon 1e-3 instead of 1e-5": (
        "shortcut BatchNorm epsilon 1e-3",
        {"shortcut_cls": functools.partial(ShortCut, epsilon=1e-3)},
        "resnet.encoder.stages.1.layers.0.shortcut.normalization",
    ),
    # The first ReLU missing is that of stage 0's first layer; the next
    # parameterised layer called is the first convolution of the layer after
    # it (with depth 1, stage 1's first layer, whose shortcut runs last).
    "ReLU after the residual sum forgotten": (
        "no ReLU after the residual sum",
        {"layer_cls": BasicLayerWithoutReLU},
        "resnet.encoder.stages.0.layers.1.layer.0.convolution"
        if CONFIG.depths[0] > 1
        else "resnet.encoder.stages.1.layers.0.layer.0.convolution",
    ),
}


# -- comparing ----------------------------------------------------------------------


def losses(labels: torch.Tensor):
    """The same cross-entropy for both: PyTorch's on Hugging Face's output
    object, JAX's on the Linen logits."""
    labels_jax = jnp.asarray(labels.numpy())

    def torch_loss(outputs):
        return torch.nn.functional.cross_entropy(outputs.logits, labels)

    def jax_loss(logits):
        log_probs = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(log_probs, labels_jax[:, None], axis=1))

    return torch_loss, jax_loss


def _short(name: str) -> str:
    return (
        name.replace("resnet.encoder.", "")
        .replace(".layers.", ".")
        .replace("resnet.embedder.embedder.", "embedder.")
        .replace("convolution", "conv")
        .replace("normalization", "bn")
    )


def main() -> None:
    start = time.perf_counter()
    model = pytorch_resnet()
    x_nchw, labels = images()
    x_nhwc = jnp.asarray(x_nchw.permute(0, 2, 3, 1).numpy())
    loss_fns = losses(labels)
    print(
        f"Hugging Face ResNetForImageClassification: {CONFIG.depths} basic layers, "
        f"widths {CONFIG.embedding_size}, {CONFIG.hidden_sizes}, "
        f"{sum(p.numel() for p in model.parameters())} parameters, eval() mode"
    )
    means = torch.cat([m.running_mean for m in model.modules() if _is_bn(m)])
    variances = torch.cat([m.running_var for m in model.modules() if _is_bn(m)])
    print(
        f"BatchNorm running statistics after {WARMUP_STEPS} train() steps: means in "
        f"[{means.min():.2f}, {means.max():.2f}], variances in "
        f"[{variances.min():.3f}, {variances.max():.2f}]"
    )

    # The port needs only its structure: bridge.transfer replaces every array
    # (`port.init(key, x_nhwc)` would do too, at the cost of compiling it).
    port = linen_resnet()
    variables = placeholders(jax.eval_shape(port.init, jax.random.key(0), x_nhwc))
    source = bridge.probe(model)
    ported = bridge.transfer(
        source, bridge.probe(port, variables), x_nchw, args_b=(x_nhwc,)
    )

    # A check without bridge on the PyTorch side: the ported logits.
    with torch.no_grad():
        expected = model(x_nchw).logits.numpy()
    logits = np.asarray(ported.apply(x_nhwc).outputs)
    print(
        "largest difference of the logits, Linen port vs model(x).logits: "
        f"{np.max(np.abs(logits - expected)):.1e} "
        f"(largest logit {np.max(np.abs(expected)):.2f})"
    )
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-5)

    report = bridge.compare(
        source, ported, loss_fns, x_nchw, args_b=(x_nhwc,), **TOLERANCES
    )
    show("PyTorch -> Flax Linen", report)
    worst_activation = max(report.rows, key=lambda row: row.activation_rel)
    worst_grad = max(report.rows, key=lambda row: row.grad_rel)
    print(
        "largest relative difference: activations "
        f"{worst_activation.activation_rel:.1e} ({worst_activation.site_a}), "
        f"activation gradients {worst_grad.grad_rel:.1e} ({worst_grad.site_a})"
    )
    assert report.first_divergence is None

    reports = {"correct port": report}
    for name, (label, slips, expected_site) in BUGS.items():
        # The slips change no parameter: the same variables fit.
        buggy = bridge.probe(linen_resnet(**slips), variables)
        buggy = bridge.transfer(source, buggy, x_nchw, args_b=(x_nhwc,))
        report = bridge.compare(
            source, buggy, loss_fns, x_nchw, args_b=(x_nhwc,), **TOLERANCES
        )
        show(f"PyTorch -> Flax Linen with the {name}", report)
        first = report.first_divergence
        assert first is not None and first.site_a == expected_site, (name, first)
        reports[f"bug: {label}"] = report

    print()
    FIGURE.save(
        lambda path: plot(
            reports,
            path,
            title="Hugging Face ResNet (PyTorch) against a hand-written Flax Linen "
            "port: bridge.compare, per paired layer in call order (★ first divergence)",
            xlabel="PyTorch module (resnet.encoder. and .layers. elided)",
            short=_short,
            rtol=TOLERANCES["rtol"],
        )
    )
    print(f"{time.perf_counter() - start:.1f}s")


def _is_bn(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.BatchNorm2d)


if __name__ == "__main__":
    main()
