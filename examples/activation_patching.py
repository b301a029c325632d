"""Activation patching, and attribution patching: its estimate from one gradient.

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
- **Activation patching**: for every site, the clean run's activation is
  patched into the corrupted run, ``probe.apply(x_corrupt, patch={site:
  clean_value})``, and the *recovered fraction* ``(metric_patched −
  metric_corrupt) / (metric_clean − metric_corrupt)`` says how much of the
  answer that site carries: 1 on the path of ``a``, 0 on ``b``'s, a share on
  each of the two parallel paths ``mix`` and ``skip_a``. One forward pass per
  site.
- **Attribution patching**: one ``probe.value_and_grad`` of the metric on the
  corrupted input gives every site's activation and the metric's gradient
  with respect to it; ``sum((clean − corrupt) · d metric / d activation)`` is
  the first-order estimate of what patching that site would change. One
  backward pass for all sites.

The figure (``docs/activation_patching.png``) draws both per site, and a
scatter of the estimate (x) against the patching effect (y), one point per
pair and site. On the line y = x the estimate is exact: the path from the site
to the metric is linear in it, as from ``head`` (the logits themselves). Off
it, the path runs through a nonlinearity, here the ``tanh`` after
``residual``: flipping the answer moves many ``residual`` units from one
saturated end of the ``tanh`` to the other, and the slope at the corrupted
point, all attribution patching sees, misses most of that change. So on
``encode_a``, ``skip_a`` and ``residual`` the estimate recovers about 0.05 of
the logit difference where patching recovers 0.9 to 1, uncorrelated pair by
pair; ``mix`` is in between. ``encode_b``, equal in both runs, is 0 on both
axes. Attribution patching ranks sites for one backward pass; activation
patching, one forward pass per site, checks the ranking where it matters.

    python -m pip install -e ".[all,examples]"
    python examples/activation_patching.py --out docs

Without ``--out DIR`` (or ``BRIDGE_EXAMPLES_OUT=DIR``) it writes nothing.
``BRIDGE_EXAMPLES_SMOKE=1`` trains for a few steps only.
"""

# The optional packages are imported after `require` has checked them.
# ruff: noqa: E402
from __future__ import annotations

import functools
import time

from example_support import SMOKE, Figure, require

require("flax", "optax", "matplotlib")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import bridge

FIGURE = Figure("activation_patching.png")
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


def logit_differences(logits, right, wrong):
    """Per pair, logit[right] − logit[wrong]; the metric is their mean."""
    picked = lambda c: jnp.take_along_axis(logits, c[:, None], axis=1)[:, 0]
    return picked(right) - picked(wrong)


@functools.partial(jax.jit, static_argnames=("sites",))
def patching(probe, clean, corrupt, right, wrong, *, sites):
    """Per pair, the logit difference on the clean and corrupted inputs; and
    per site and pair, what patching the site's clean value into the corrupted
    run changes (activation patching) and its first-order estimate
    (attribution patching)."""
    differences = lambda logits: logit_differences(logits, right, wrong)
    recorded = probe.apply(clean, at=list(sites))  # the clean activations

    # One backward pass: every site's corrupted activation and d metric / d it.
    def metric(logits):
        per_pair = differences(logits)
        return jnp.mean(per_pair), per_pair

    corrupted = probe.value_and_grad(metric, corrupt, at=list(sites), has_aux=True)
    on_corrupt = corrupted.aux
    effects, estimates = [], []
    for site in sites:
        clean_value = recorded.activations[site]
        patched = probe.apply(corrupt, patch={site: clean_value}).outputs
        effects.append(differences(patched) - on_corrupt)
        # The metric is a mean over pairs and no pair affects another, so
        # len(pairs) * the gradient is each pair's own gradient.
        change = (clean_value - corrupted.activations[site]) * len(clean)
        product = change * corrupted.activation_grads[site]
        estimates.append(jnp.sum(product.reshape(len(clean), -1), axis=1))
    on_clean = differences(recorded.outputs)
    return on_clean, on_corrupt, jnp.stack(effects), jnp.stack(estimates)


def plot(sites, effects, estimates, total, path):
    """Top, the recovered fraction per site, patched and estimated; bottom, per
    pair and site, the estimate against the patching effect. 8.5 inches wide
    with 11-point text: the docs page (about 690 pixels) shows it at about 0.8
    scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with plt.rc_context({"font.size": 11}):
        fig, (bars, scatter) = plt.subplots(
            2, 1, figsize=(8.5, 9.6), layout="constrained", height_ratios=(1, 1.6)
        )
        positions = np.arange(len(sites))
        for shift, values, label, color in (
            (-0.2, effects, "activation patching", "C0"),
            (0.2, estimates, "attribution patching (estimate)", "C1"),
        ):
            recovered = values.mean(axis=1) / total
            drawn = bars.bar(
                positions + shift, recovered, 0.4, color=color, label=label
            )
            bars.bar_label(drawn, fmt="%.2f", padding=2, fontsize=10)
        bars.axhline(1.0, color="0.5", lw=0.8, ls="--")
        bars.axhline(0.0, color="0.5", lw=0.8)
        bars.set_xticks(positions, sites)
        bars.set_ylabel("recovered fraction\nof logit difference")
        bars.set_xlabel("site patched with its clean activation")
        bars.set_ylim(-0.1, 1.4)
        bars.legend(loc="upper center", ncols=2)
        bars.set_title(f"Patching clean → corrupted, mean of {effects.shape[1]} pairs")

        for k, site in enumerate(sites):
            scatter.scatter(
                estimates[k], effects[k], s=8, alpha=0.35, color=f"C{k}", lw=0
            )
            scatter.scatter(
                estimates[k].mean(),
                effects[k].mean(),
                s=150 - 14 * k,  # a mean hidden under a later one shows as a ring
                color=f"C{k}",
                edgecolor="black",
                label=f"{site} (mean)",
                zorder=3,
            )
        values = np.concatenate([effects.ravel(), estimates.ravel()])
        low, high = values.min() - 0.5, values.max() + 0.5
        scatter.plot([low, high], [low, high], color="0.4", lw=0.8, ls="--")
        scatter.annotate(
            "y = x: the estimate is exact",
            (low + 0.52 * (high - low),) * 2,
            xytext=(4, -4),
            textcoords="offset points",
            rotation=45,
            rotation_mode="anchor",
            va="top",
            color="0.3",
        )
        scatter.set_xlim(low, high)
        scatter.set_ylim(low, high)
        scatter.set_aspect("equal")
        scatter.axhline(0, color="0.8", lw=0.6)
        scatter.axvline(0, color="0.8", lw=0.6)
        scatter.set_xlabel(
            "attribution patching:\n(clean − corrupt) · d metric / d activation"
        )
        scatter.set_ylabel("activation patching:\nchange of the logit difference")
        scatter.set_title(
            "Per pair and site: the first-order estimate against the truth"
        )
        scatter.legend(loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)
        fig.suptitle(
            "Activation patching and attribution patching,\n"
            "through one bridge.probe (Flax Linen)",
            fontsize=12,
        )
        fig.savefig(path, dpi=150)
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

    sites = tuple(probe.sites(clean))  # every site, in call order
    on_clean, on_corrupt, effects, estimates = map(
        np.asarray,
        patching(
            probe, clean, corrupt, jnp.asarray(right), jnp.asarray(wrong), sites=sites
        ),
    )
    total = on_clean.mean() - on_corrupt.mean()
    print(
        f"logit difference (clean answer − corrupted answer), mean of {PAIRS} "
        f"pairs: clean {on_clean.mean():+.3f}, corrupted {on_corrupt.mean():+.3f}\n"
    )
    print(
        "recovered fraction of the logit difference, by activation patching and\n"
        "its attribution-patching estimate; per pair, how the two agree:\n"
        f"  {'site':<10} {'patched':>8} {'estimated':>10} {'correlation':>12} "
        f"{'mean |error| / mean |effect|':>29}"
    )
    for site, effect, estimate in zip(sites, effects, estimates, strict=True):
        spread = np.abs(effect).mean()
        if spread > 1e-6:
            correlation = f"{np.corrcoef(effect, estimate)[0, 1]:.3f}"
            error = f"{np.abs(estimate - effect).mean() / spread:.3f}"
        else:  # nothing changes: both are 0
            correlation = error = "-"
        print(
            f"  {site:<10} {effect.mean() / total:>8.3f} "
            f"{estimate.mean() / total:>10.3f} {correlation:>12} {error:>29}"
        )
    FIGURE.save(lambda path: plot(sites, effects, estimates, total, path))
    print(f"({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
