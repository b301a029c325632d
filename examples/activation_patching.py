"""Activation patching: which site carries the information that changes the answer?

The standard interpretability experiment, on a small Flax Linen model trained
for a few hundred steps on a synthetic task:

- The input is two vectors, ``a`` and ``b``. The label has two bits,
  ``[a·u > 0]`` and ``[b·v > 0]``: four classes. The model encodes ``a`` and
  ``b`` separately, mixes them, and also carries ``a`` forward on a skip path:

      encode_a ─┬──────── skip_a ───┐
                └─ mix ─┐           + ─ residual (a bridge.tap) ─ head ─ logits
      encode_b ─────────┘ ──────────┘

- A *clean* input and a *corrupted* one differ only in ``a``, reflected across
  the plane ``a·u = 0``: the first bit, and so the answer, flips.
- The metric is the logit difference ``logit[clean answer] − logit[corrupted
  answer]``, averaged over pairs.
- For every site, the clean run's activation is patched into the corrupted
  run, ``probe.apply(x_corrupt, patch={site: clean_value})``, and the
  *recovered fraction* ``(metric_patched − metric_corrupt) /
  (metric_clean − metric_corrupt)`` says how much of the answer that site
  carries: 1 on the path of ``a``, 0 on ``b``'s, a share on each of the two
  parallel paths ``mix`` and ``skip_a``.

    python examples/activation_patching.py

``BRIDGE_EXAMPLES_SMOKE=1`` trains for a few steps only;
``BRIDGE_EXAMPLES_OUT`` names the directory for the PNG (default: the
repository's ``docs/``).
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import bridge

SMOKE = os.environ.get("BRIDGE_EXAMPLES_SMOKE", "") not in ("", "0")
OUT = Path(
    os.environ.get(
        "BRIDGE_EXAMPLES_OUT", Path(__file__).resolve().parent.parent / "docs"
    )
)

DIM, HIDDEN, CLASSES = 6, 32, 4
TRAIN, PAIRS = 1024, 256  # training examples; clean/corrupted test pairs
STEPS = 40 if SMOKE else 400
SMOOTHING = 0.1


class TwoPaths(nn.Module):
    """``a`` reaches the head twice (through ``mix`` and ``skip_a``), ``b`` once."""

    @nn.compact
    def __call__(self, x):
        a, b = x[:, :DIM], x[:, DIM:]
        h_a = jnp.tanh(nn.Dense(HIDDEN, name="encode_a")(a))
        h_b = jnp.tanh(nn.Dense(HIDDEN, name="encode_b")(b))
        mixed = jnp.tanh(nn.Dense(HIDDEN, name="mix")(jnp.concatenate([h_a, h_b], -1)))
        skip = nn.Dense(HIDDEN, name="skip_a")(h_a)
        residual = bridge.tap("residual", mixed + skip)  # a site that is no module
        return nn.Dense(CLASSES, name="head")(jnp.tanh(residual))


# -- the task -----------------------------------------------------------------------


def directions():
    rng = np.random.default_rng(0)
    u, v = rng.normal(size=(2, DIM))
    return u / np.linalg.norm(u), v / np.linalg.norm(v)


def labels(x):
    u, v = directions()
    bit_a = x[:, :DIM] @ u > 0
    bit_b = x[:, DIM:] @ v > 0
    return 2 * bit_a.astype(np.int32) + bit_b.astype(np.int32)


def make_pairs(rng, n):
    """Clean inputs, and the same inputs with ``a`` reflected across ``a·u = 0``."""
    u, _ = directions()
    clean = rng.normal(size=(n, 2 * DIM))
    corrupt = clean.copy()
    corrupt[:, :DIM] -= 2 * (clean[:, :DIM] @ u)[:, None] * u
    return clean.astype(np.float32), corrupt.astype(np.float32)


def train(model):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(TRAIN, 2 * DIM)).astype(np.float32)
    # Label smoothing keeps the logits moderate, closer to the linear regime
    # that attribution patching assumes.
    one_hot = np.eye(CLASSES, dtype=np.float32)[labels(x)]
    targets = one_hot * (1 - SMOOTHING) + SMOOTHING / CLASSES
    params = jax.jit(model.init)(jax.random.key(0), x)["params"]
    optimizer = optax.adam(1e-2)

    @jax.jit
    def step(params, opt_state):
        def loss(params):
            logits = model.apply({"params": params}, x)
            return optax.softmax_cross_entropy(logits, targets).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state = jax.jit(optimizer.init)(params)
    for _ in range(STEPS):
        params, opt_state, value = step(params, opt_state)
    return {"params": params}, float(value)


# -- patching -----------------------------------------------------------------------


def logit_difference(right, wrong):
    """The metric: mean over pairs of logit[right] − logit[wrong]."""

    def metric(logits):
        picked = lambda c: jnp.take_along_axis(logits, c[:, None], axis=1)[:, 0]
        return jnp.mean(picked(right) - picked(wrong))

    return metric


@functools.partial(jax.jit, static_argnames=("metric", "sites"))
def patching(probe, clean, corrupt, *, metric, sites):
    """The metric on the clean and corrupted inputs, and with each site patched."""
    recorded = probe.apply(clean, at=list(sites))  # the clean activations
    on_corrupt = metric(probe.apply(corrupt).outputs)
    patched = [
        metric(probe.apply(corrupt, patch={site: recorded.activations[site]}).outputs)
        for site in sites
    ]
    return metric(recorded.outputs), on_corrupt, jnp.stack(patched)


def plot(table, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sites, recovered = list(table), list(table.values())
    fig, ax = plt.subplots(figsize=(6.4, 3.6), layout="constrained")
    bars = ax.bar(sites, recovered, color="C0")
    ax.bar_label(bars, fmt="%.2f", padding=2)
    ax.axhline(1.0, color="0.5", lw=0.8, ls="--")
    ax.axhline(0.0, color="0.5", lw=0.8)
    ax.set_ylim(min(0.0, *recovered) - 0.05, max(1.0, *recovered) + 0.15)
    ax.set_ylabel("recovered fraction of\nlogit difference")
    ax.set_xlabel("site patched with its clean activation")
    ax.set_title(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    start = time.perf_counter()
    model = TwoPaths()
    variables, loss = train(model)
    probe = bridge.probe(model, variables)

    clean, corrupt = make_pairs(np.random.default_rng(2), PAIRS)
    right, wrong = labels(clean), labels(corrupt)
    outputs = probe.apply(np.concatenate([clean, corrupt])).outputs
    accuracy = np.mean(np.argmax(outputs, -1) == np.concatenate([right, wrong]))
    print(f"trained {STEPS} steps: loss {loss:.3f}, test accuracy {accuracy:.1%}")

    metric = logit_difference(jnp.asarray(right), jnp.asarray(wrong))
    sites = tuple(probe.sites(clean))  # every site, in call order
    m_clean, m_corrupt, patched = map(
        np.asarray, patching(probe, clean, corrupt, metric=metric, sites=sites)
    )
    recovered = (patched - m_corrupt) / (m_clean - m_corrupt)
    table = dict(zip(sites, recovered.tolist(), strict=True))
    print(
        f"logit difference (clean answer − corrupted answer), mean of {PAIRS} "
        f"pairs: clean {m_clean:+.3f}, corrupted {m_corrupt:+.3f}\n"
    )
    print(f"  {'site':<10} {'recovered fraction':>18}")
    for site, recovered in table.items():
        print(f"  {site:<10} {recovered:>18.3f}")

    path = OUT / "activation_patching.png"
    plot(table, path, f"Patching clean → corrupted, {PAIRS} pairs (Flax Linen)")
    print(f"\nwrote {path}  ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
