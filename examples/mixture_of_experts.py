"""Which expert learns: per-expert activation gradients in a routed model.

A small mixture of experts written with Flax Linen routes each example to one
of four experts (top-1, `nn.switch` on the router's argmax, the expert's output
scaled by its gate) and is trained on scikit-learn's bundled digits (8×8 images
as 64 features, no download) with Adam. The experts run inside the branches of
a `switch`, so the value and gradient of an expert exist only for the examples
routed to it: `res.ran["expert_2"]` says which those are, and
`res.activations` / `res.activation_grads` hold zeros for the others.

The probe reads both inside the jitted training step, which takes its
parameter gradients from the same probed pass. Every few steps the example
prints, per expert, its load (the share of the batch routed to it) and the
mean norm of d loss / d its output over the examples it served: an expert
that the router starves gets no gradient at all, one that serves many gets
most of the signal. Without a load-balancing loss, the router here collapses
onto one expert within a few hundred steps, and the probe shows it.

    python -m pip install -e ".[all,examples]"
    python examples/mixture_of_experts.py

It writes nothing. ``BRIDGE_EXAMPLES_SMOKE=1`` trains for a few steps only.
"""

# The optional packages are imported after `require` has checked them.
# ruff: noqa: E402
from __future__ import annotations

from example_support import SMOKE, require

require("flax", "optax", "sklearn")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import bridge

EXPERTS, WIDTH, BATCH = 4, 64, 128
STEPS = 6 if SMOKE else 300
REPORT_EVERY = 3 if SMOKE else 60


class MixtureOfExperts(nn.Module):
    """One example: encoder, a router choosing one expert (top-1), head."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(WIDTH, name="encoder")(x))
        logits = nn.Dense(EXPERTS, name="router")(h)
        index = jnp.argmax(logits)
        gate = jax.nn.softmax(logits)[index]
        experts = [nn.Dense(WIDTH, name=f"expert_{i}") for i in range(EXPERTS)]
        if self.is_initializing():  # every branch's parameters
            for expert in experts:
                expert(h)
        branches = [
            lambda module, h, expert=expert: nn.relu(expert(h)) for expert in experts
        ]
        y = nn.switch(index, branches, self, h)
        return nn.Dense(10, name="head")(h + gate * y)


def main() -> None:
    digits = load_digits()
    images = (digits.data / 16.0).astype(np.float32)
    labels = digits.target.astype(np.int32)
    model = MixtureOfExperts()
    params = model.init(jax.random.key(0), images[0])["params"]
    optimizer = optax.adam(3e-3)
    opt_state = optimizer.init(params)
    names = [f"expert_{i}" for i in range(EXPERTS)]

    @jax.jit
    def step(params, opt_state, x, y):
        def loss_fn(logits):
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        probe = bridge.probe(model, {"params": params}, vmap=True)
        res = probe.value_and_grad(loss_fn, x, at=names)
        updates, opt_state = optimizer.update(res.grads, opt_state, params)
        served = {name: res.ran[name] for name in names}
        # Per example, the norm of d loss / d the expert's output (zero where
        # it did not run), averaged over the examples it served.
        norms = {
            name: jnp.linalg.norm(res.activation_grads[name], axis=-1).sum()
            / jnp.maximum(served[name].sum(), 1)
            for name in names
        }
        load = {name: served[name].mean() for name in names}
        return optax.apply_updates(params, updates), opt_state, res.loss, load, norms

    rng = np.random.default_rng(0)
    for i in range(1, STEPS + 1):
        batch = rng.choice(len(images), BATCH, replace=False)
        params, opt_state, loss, load, norms = step(
            params, opt_state, images[batch], labels[batch]
        )
        if i % REPORT_EVERY == 0 or i == 1:
            print(f"step {i:4d}  loss {float(loss):.3f}")
            for name in names:
                print(
                    f"    {name}: load {float(load[name]):5.1%}  "
                    f"‖d loss / d output‖ per served example {float(norms[name]):.2e}"
                )
    # The branches' bookkeeping holds: every example ran exactly one expert.
    probe = bridge.probe(model, {"params": params}, vmap=True)
    fwd = probe.apply(images[:BATCH], at=names)
    counts = sum(np.asarray(fwd.ran[name], dtype=int) for name in names)
    assert (counts == 1).all(), counts


if __name__ == "__main__":
    main()
