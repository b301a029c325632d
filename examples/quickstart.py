"""bridge in one screen: one model, four libraries, the same numbers at every site.

The same small classifier — Dense 4→32, ReLU, LayerNorm, Dense 32→32, ReLU,
Dense 32→3 — written the way each library's users write it, in Flax Linen,
Flax NNX, Equinox and Haiku. Each is initialised its own way, then
``bridge.transfer`` copies the Linen model's weights into the other three,
converting layouts. Each library then takes one jitted
``probe.value_and_grad`` on the Iris data set (bundled with scikit-learn: 150
flowers, 4 measurements, 3 species), which returns, without editing any model,
the loss, the parameter gradients, every layer's output and the gradient of
the loss with respect to it — what a PyTorch forward and backward hook would
give you.

The script prints, site by site in call order, each library's name for the
site and the largest difference of its activation and of its activation
gradient from Linen's. With ``--out DIR`` it also draws the gradient norms of
the four side by side into ``DIR/quickstart.png`` (``--out docs`` redraws the
committed figure); without it, it writes nothing.

    python -m pip install -e ".[all,examples]"
    python examples/quickstart.py

``BRIDGE_EXAMPLES_SMOKE=1`` changes nothing here: the script is already fast.
"""

# The optional packages are imported after `require` has checked them.
# ruff: noqa: E402
from __future__ import annotations

import importlib.util
import time

from example_support import Figure, require

require("flax", "sklearn", "matplotlib")

import jax
import jax.numpy as jnp
import numpy as np

import bridge

FIGURE = Figure("quickstart.png")
HIDDEN, CLASSES = 32, 3
# Flax's LayerNorm defaults to epsilon 1e-6, Equinox's and Haiku's to 1e-5: a
# port must match hyperparameters by hand (bridge.transfer moves weights only).
EPSILON = 1e-5


def iris():
    """The Iris measurements, standardised, and the species as integer labels."""
    from sklearn.datasets import load_iris

    x, labels = load_iris(return_X_y=True)
    x = (x - x.mean(0)) / x.std(0)
    return jnp.asarray(x, jnp.float32), jnp.asarray(labels)


def cross_entropy(labels):
    def loss(logits):
        log_probs = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1))

    return loss


# -- one model, four libraries --------------------------------------------------------
# Each function builds its library's model, initialised its own way, and probes it.


def linen_probe(x):
    import flax.linen as nn

    class Classifier(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(HIDDEN)(x))
            x = nn.LayerNorm(epsilon=EPSILON)(x)
            x = nn.relu(nn.Dense(HIDDEN)(x))
            return nn.Dense(CLASSES)(x)

    model = Classifier()
    return bridge.probe(model, jax.jit(model.init)(jax.random.key(0), x))


def nnx_probe(x):
    from flax import nnx

    class Classifier(nnx.Module):
        def __init__(self, features, rngs):
            self.hidden = nnx.Linear(features, HIDDEN, rngs=rngs)
            self.norm = nnx.LayerNorm(HIDDEN, epsilon=EPSILON, rngs=rngs)
            self.mid = nnx.Linear(HIDDEN, HIDDEN, rngs=rngs)
            self.head = nnx.Linear(HIDDEN, CLASSES, rngs=rngs)

        def __call__(self, x):
            x = self.norm(nnx.relu(self.hidden(x)))
            return self.head(nnx.relu(self.mid(x)))

    return bridge.probe(Classifier(x.shape[1], nnx.Rngs(1)))


def equinox_probe(x):
    import equinox as eqx

    class Classifier(eqx.Module):
        hidden: eqx.nn.Linear
        norm: eqx.nn.LayerNorm
        mid: eqx.nn.Linear
        head: eqx.nn.Linear

        def __init__(self, features, key):
            keys = jax.random.split(key, 3)
            self.hidden = eqx.nn.Linear(features, HIDDEN, key=keys[0])
            self.norm = eqx.nn.LayerNorm(HIDDEN, eps=EPSILON)
            self.mid = eqx.nn.Linear(HIDDEN, HIDDEN, key=keys[1])
            self.head = eqx.nn.Linear(HIDDEN, CLASSES, key=keys[2])

        def __call__(self, x):  # one example, as Equinox models are written
            x = self.norm(jax.nn.relu(self.hidden(x)))
            return self.head(jax.nn.relu(self.mid(x)))

    model = eqx.filter_jit(Classifier)(x.shape[1], jax.random.key(1))
    return bridge.probe(model, vmap=True)  # the probe maps it over the batch


def haiku_probe(x):
    import haiku as hk

    def classifier(x):
        x = jax.nn.relu(hk.Linear(HIDDEN)(x))
        x = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True, eps=EPSILON)(x)
        x = jax.nn.relu(hk.Linear(HIDDEN)(x))
        return hk.Linear(CLASSES)(x)

    model = hk.without_apply_rng(hk.transform(classifier))
    return bridge.probe(model, jax.jit(model.init)(jax.random.key(1), x))


LIBRARIES = {
    "Flax NNX": ("flax", nnx_probe),
    "Equinox": ("equinox", equinox_probe),
    "Haiku": ("haiku", haiku_probe),
}


@jax.jit  # the probe is a pytree: its weights are arguments, not constants
def probed_step(probe, x, labels):
    res = probe.value_and_grad(cross_entropy(labels), x)
    return res.loss, res.activations, res.activation_grads


# -- the comparison -------------------------------------------------------------------


def largest_difference(a, b):
    return float(np.max(np.abs(a - b)))


def plot(norms, site_names, gradient_differences, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    libraries = list(norms)
    fig, ax = plt.subplots(figsize=(7.2, 3.6), layout="constrained")
    width = 0.8 / len(libraries)
    positions = np.arange(len(site_names["Flax Linen"]))
    for k, library in enumerate(libraries):
        ax.bar(
            positions + (k - (len(libraries) - 1) / 2) * width,
            norms[library],
            width,
            label=library,
            color=f"C{k}",
        )
    for position, height, difference in zip(
        positions,
        np.max(list(norms.values()), axis=0),
        gradient_differences,
        strict=True,
    ):
        ax.annotate(
            f"largest Δ {difference:.0e}",
            (position, height),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            fontsize=8,
        )
    ax.set_xticks(
        positions,
        ["\n".join(names) for names in zip(*site_names.values(), strict=True)],
        fontsize=8,
    )
    ax.set_xlabel("site, in call order — its name in " + ", ".join(site_names))
    ax.set_ylabel("‖d loss / d activation‖")
    ax.set_title("One model, four libraries, one probe call each (Iris, 150 flowers)")
    ax.set_ylim(0, 1.15 * max(max(n) for n in norms.values()))
    ax.legend(fontsize=8, ncols=4, loc="upper right")
    ax.grid(True, axis="y", alpha=0.3)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main():
    start = time.perf_counter()
    x, labels = iris()
    reference = linen_probe(x)
    probes = {"Flax Linen": reference}
    for library, (package, make_probe) in LIBRARIES.items():
        if importlib.util.find_spec(package) is None:
            print(f"{library}: not installed, skipped")
            continue
        # Pairs the four parameterised layers in call order and converts each
        # one's weights to this library's layout (Equinox's Linear is (out, in)).
        probes[library] = bridge.transfer(reference, make_probe(x), x)

    losses, activations, gradients, site_names = {}, {}, {}, {}
    for library, probe in probes.items():
        site_names[library] = list(probe.sites(x))  # call order (jit sorts keys)
        loss, acts, grads = jax.tree.map(np.asarray, probed_step(probe, x, labels))
        losses[library] = float(loss)
        activations[library] = [acts[site] for site in site_names[library]]
        gradients[library] = [grads[site] for site in site_names[library]]

    print(f"Iris, {x.shape[0]} flowers; cross-entropy loss of the same weights:")
    print("  " + "   ".join(f"{lib} {loss:.6f}" for lib, loss in losses.items()))
    print(
        "\nPer site, in call order: each library's name, ‖d loss/d activation‖ in "
        "Linen,\nand the largest |difference| from Linen of the activation / of "
        "its gradient."
    )
    others = [library for library in probes if library != "Flax Linen"]
    print(
        f"  {'Flax Linen':<12} {'‖grad‖':>7}"
        + "".join(f"  {library:<22}" for library in others).rstrip()
    )
    worst, gradient_differences = 0.0, []
    for i, linen_site in enumerate(site_names["Flax Linen"]):
        norm = float(np.linalg.norm(gradients["Flax Linen"][i]))
        row = f"  {linen_site:<12} {norm:>7.4f}"
        gradient_differences.append(0.0)
        for library in others:
            act, grad = (
                largest_difference(values[library][i], values["Flax Linen"][i])
                for values in (activations, gradients)
            )
            worst = max(worst, act, grad)
            gradient_differences[-1] = max(gradient_differences[-1], grad)
            row += f"  {site_names[library][i]:<10} {act:.0e}/{grad:.0e}"
        print(row)
    print(
        f"\nlargest difference anywhere: {worst:.1e}: float32 rounding, whose last "
        "digits\nvary with the CPU and the XLA version (the check is < 1e-4)"
    )
    assert worst < 1e-4, "the libraries disagree"
    norms = {
        library: [float(np.linalg.norm(g)) for g in grads]
        for library, grads in gradients.items()
    }
    FIGURE.save(lambda path: plot(norms, site_names, gradient_differences, path))
    print(f"({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
