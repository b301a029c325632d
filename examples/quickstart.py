"""bridge in one screen: probe a small model, print one row per site.

Each row is one call of a submodule: its path, the shape of its value, the norm
of the activation and the norm of the loss's gradient with respect to it —
what a PyTorch backward hook would give you, without editing the model.

    python examples/quickstart.py
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp

import bridge

BATCH, FEATURES, CLASSES = 16, 8, 3


def data():
    """A fixed synthetic classification batch: no download."""
    x = jax.random.normal(jax.random.key(0), (BATCH, FEATURES))
    labels = jax.random.randint(jax.random.key(1), (BATCH,), 0, CLASSES)
    return x, labels


def cross_entropy(labels):
    def loss(logits):
        log_probs = jax.nn.log_softmax(logits)
        picked = jnp.take_along_axis(log_probs, labels[:, None], axis=1)
        return -jnp.mean(picked)

    return loss


def rows(res):
    return [
        (path, tuple(jnp.shape(grad)), jnp.linalg.norm(act), jnp.linalg.norm(grad))
        for (path, act), grad in zip(
            res.activations.items(), res.activation_grads.values(), strict=True
        )
    ]


def linen_rows():
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(32)(x))
            x = nn.LayerNorm()(x)
            x = nn.relu(nn.Dense(32)(x))
            return nn.Dense(CLASSES)(x)

    x, labels = data()
    model = MLP()
    variables = model.init(jax.random.key(2), x)
    probe = bridge.probe(model, variables)
    res = probe.value_and_grad(cross_entropy(labels), x)
    return res.loss, rows(res)


def nnx_rows():
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(FEATURES, 32, rngs=rngs)
            self.norm = nnx.LayerNorm(32, rngs=rngs)
            self.blocks = nnx.List([nnx.Linear(32, 32, rngs=rngs)])
            self.head = nnx.Linear(32, CLASSES, rngs=rngs)

        def __call__(self, x):
            x = self.norm(nnx.relu(self.hidden(x)))
            for block in self.blocks:
                x = nnx.relu(block(x))
            return self.head(x)

    x, labels = data()
    probe = bridge.probe(MLP(nnx.Rngs(2)))  # the module carries its own variables
    res = probe.value_and_grad(cross_entropy(labels), x)
    return res.loss, rows(res)


def equinox_rows():
    import equinox as eqx

    # An Equinox model handles one example; the probe maps it over the batch.
    model = eqx.nn.MLP(FEATURES, CLASSES, 32, depth=2, key=jax.random.key(2))
    x, labels = data()
    probe = bridge.probe(model, vmap=True)
    res = probe.value_and_grad(cross_entropy(labels), x)
    return res.loss, rows(res)


def haiku_rows():
    import haiku as hk

    def forward(x):
        x = hk.nets.MLP([32, 32], activate_final=True)(x)
        x = hk.BatchNorm(True, True, decay_rate=0.9)(x, is_training=True)
        return hk.Linear(CLASSES)(x)

    model = hk.without_apply_rng(hk.transform_with_state(forward))
    x, labels = data()
    params, state = model.init(jax.random.key(2), x)
    probe = bridge.probe(model, params, state)
    res = probe.value_and_grad(cross_entropy(labels), x)
    return res.loss, rows(res)


LIBRARIES = {
    "Flax Linen": ("flax", linen_rows),
    "Flax NNX": ("flax", nnx_rows),
    "Equinox": ("equinox", equinox_rows),
    "Haiku": ("haiku", haiku_rows),
}


def main():
    for library, (package, make_rows) in LIBRARIES.items():
        if importlib.util.find_spec(package) is None:
            print(f"{library}: not installed, skipped")
            continue
        loss, table = make_rows()
        print(f"\n{library} — loss {float(loss):.4f}")
        print(
            f"  {'site':<28} {'shape':<14} {'|activation|':>13} {'|d loss/d act|':>15}"
        )
        for path, shape, act_norm, grad_norm in table:
            print(f"  {path:<28} {str(shape):<14} {act_norm:>13.4f} {grad_norm:>15.6f}")


if __name__ == "__main__":
    main()
