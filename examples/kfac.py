"""K-FAC from layer inputs and output gradients, for any of the four libraries.

K-FAC approximates the Fisher block of a dense layer ``s = a W + b`` by a
Kronecker product of two small matrices:

    A = E[a aᵀ]   (the layer's inputs, with a ones column for the bias)
    G = E[g gᵀ]   (the gradients with respect to the layer's outputs)

Both come out of one probed backward pass: ``with_inputs=True`` gives each
layer's positional arguments (``res.inputs[site][0]`` is ``a``) and
``res.activation_grads[site]`` is ``g``. One function, :func:`kfac_factors`,
computes them for the same 4 -> 16 -> 16 -> 1 tanh MLP written in Flax Linen,
Flax NNX, Equinox and Haiku, all carrying the same weights (made once with
numpy). The script then

1. checks the identity behind K-FAC, kernel gradient = aᵀ g (summed over the
   batch), against every library's own parameter gradients,
2. checks that the four libraries give the same factors,
3. trains the Linen model on a synthetic regression problem with damped
   K-FAC steps, ``(A + γI)⁻¹ ∇W (G + γI)⁻¹`` (the bias is the last row of
   ``W``, its input the ones column), and with plain gradient descent at the
   same learning rate (and at the best of a small sweep), and plots the losses
   (``docs/kfac.png``). A K-FAC step costs one probed backward pass: for a
   scalar output the loss gradient is the residual times the same ``g``.

    python -m pip install -e ".[all,examples]"
    python examples/kfac.py --out docs

Without ``--out DIR`` (or ``BRIDGE_EXAMPLES_OUT=DIR``) it writes nothing.
``BRIDGE_EXAMPLES_SMOKE=1`` runs a few steps only.
"""

# The optional packages are imported after `require` has checked them.
# ruff: noqa: E402
from __future__ import annotations

import functools
import importlib.util
import time
from typing import Any, NamedTuple

from example_support import SMOKE, Figure, require

require("flax", "matplotlib")

import jax
import jax.numpy as jnp
import numpy as np

import bridge

FIGURE = Figure("kfac.png")

SIZES = (4, 16, 16, 1)  # input, hidden, hidden, output
N = 256  # examples in the regression problem
STEPS = 15 if SMOKE else 200
LEARNING_RATE = 0.2  # the same for K-FAC and gradient descent
DAMPING = 3e-2  # γ, added to both factors
GD_SWEEP = (0.05, 0.1, 0.2, 0.5, 1.0)  # to compare against the best plain GD too


# -- the problem and the weights, made once with numpy ------------------------------


def make_data():
    """A fixed synthetic regression problem: no download."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, SIZES[0])).astype(np.float32)
    y = np.sin(2.0 * x[:, 0]) + x[:, 1] * x[:, 2] - 0.5 * x[:, 3]
    return jnp.asarray(x), jnp.asarray(y[:, None].astype(np.float32))


def make_weights():
    """[(kernel (in, out), bias (out,)), ...] for the three dense layers."""
    rng = np.random.default_rng(1)
    return [
        (
            (rng.normal(size=(n_in, n_out)) / np.sqrt(n_in)).astype(np.float32),
            (0.1 * rng.normal(size=n_out)).astype(np.float32),
        )
        for n_in, n_out in zip(SIZES[:-1], SIZES[1:], strict=True)
    ]


def mse(y):
    return lambda out: 0.5 * jnp.mean((out - y) ** 2)


# -- one model, four libraries -------------------------------------------------------


class Model(NamedTuple):
    """A probe of the MLP in one library, and how to read its kernel gradients."""

    probe: Any
    sites: list[str]  # the three dense layers, in call order
    kernel_grad: Any  # (res.grads, layer index) -> gradient, (in, out)
    bias_grad: Any  # (res.grads, layer index) -> gradient, (out,)


def linen_module():
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for width in SIZES[1:-1]:
                x = jnp.tanh(nn.Dense(width)(x))
            return nn.Dense(SIZES[-1])(x)

    return MLP()


def linen_params(weights):
    return {
        f"Dense_{i}": {"kernel": jnp.asarray(w), "bias": jnp.asarray(b)}
        for i, (w, b) in enumerate(weights)
    }


def linen_model(weights):
    return Model(
        bridge.probe(linen_module(), {"params": linen_params(weights)}),
        [f"Dense_{i}" for i in range(len(weights))],
        lambda g, i: g[f"Dense_{i}"]["kernel"],
        lambda g, i: g[f"Dense_{i}"]["bias"],
    )


def nnx_model(weights):
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List(
                [
                    nnx.Linear(n_in, n_out, rngs=rngs)
                    for n_in, n_out in zip(SIZES[:-1], SIZES[1:], strict=True)
                ]
            )

        # Build it abstractly (no random initialisation to run), then load the weights.

        def __call__(self, x):
            for layer in self.layers[:-1]:
                x = jnp.tanh(layer(x))
            return self.layers[-1](x)

    model = nnx.eval_shape(lambda: MLP(nnx.Rngs(0)))
    for layer, (w, b) in zip(model.layers, weights, strict=True):
        layer.kernel = nnx.Param(jnp.asarray(w))
        layer.bias = nnx.Param(jnp.asarray(b))
    return Model(
        bridge.probe(model),
        [f"layers/{i}" for i in range(len(weights))],
        lambda g, i: g["layers"][i]["kernel"][...],
        lambda g, i: g["layers"][i]["bias"][...],
    )


def equinox_model(weights):
    import equinox as eqx

    # Build it abstractly (no random initialisation to run), then load the
    # weights. Equinox stores a Linear weight as (out, in).
    model = eqx.filter_eval_shape(
        lambda: eqx.nn.MLP(
            SIZES[0],
            SIZES[-1],
            SIZES[1],
            depth=len(SIZES) - 2,
            activation=jnp.tanh,
            key=jax.random.key(0),
        )
    )
    model = eqx.tree_at(
        lambda m: (
            [layer.weight for layer in m.layers] + [layer.bias for layer in m.layers]
        ),
        model,
        [jnp.asarray(w.T) for w, _ in weights] + [jnp.asarray(b) for _, b in weights],
    )
    return Model(
        bridge.probe(model, vmap=True),  # the model handles one example
        [f"layers/{i}" for i in range(len(weights))],
        lambda g, i: g.layers[i].weight.T,
        lambda g, i: g.layers[i].bias,
    )


def haiku_model(weights):
    import haiku as hk

    def forward(x):
        return hk.nets.MLP(SIZES[1:], activation=jnp.tanh)(x)

    params = {
        f"mlp/~/linear_{i}": {"w": jnp.asarray(w), "b": jnp.asarray(b)}
        for i, (w, b) in enumerate(weights)
    }
    return Model(
        bridge.probe(hk.without_apply_rng(hk.transform(forward)), params),
        [f"mlp/~/linear_{i}" for i in range(len(weights))],
        lambda g, i: g[f"mlp/~/linear_{i}"]["w"],
        lambda g, i: g[f"mlp/~/linear_{i}"]["b"],
    )


LIBRARIES = {
    "Flax Linen": ("flax", linen_model),
    "Flax NNX": ("flax", nnx_model),
    "Equinox": ("equinox", equinox_model),
    "Haiku": ("haiku", haiku_model),
}


# -- K-FAC ---------------------------------------------------------------------------


def with_ones(a):
    """Append a ones column: the bias becomes one more row of the kernel."""
    return jnp.concatenate([a, jnp.ones((a.shape[0], 1), a.dtype)], axis=1)


class Curvature(NamedTuple):
    """What one probed backward pass of the network's outputs gives."""

    outputs: Any  # the network's outputs, (batch, 1)
    inputs: dict  # {site: ã = [a, 1]}, (batch, in + 1)
    output_grads: dict  # {site: g = d output / d s}, (batch, out)
    factors: dict  # {site: (A, G)}


def kfac_factors(probe, x, sites):
    """The K-FAC factors of each dense layer ``site``, for any library's probe.

    ``A = E[ã ãᵀ]`` over the layer inputs ``ã = [a, 1]``; ``G = E[g gᵀ]`` over
    the per-example gradients of the network's output with respect to the
    layer's output. For a Gaussian likelihood with a scalar output this is the
    exact Fisher (= Gauss-Newton) of each example, so no targets are sampled:
    back-propagating ``sum(outputs)`` gives every example's ``d out / d s``.
    """
    res = probe.value_and_grad(
        lambda out: (jnp.sum(out), out), x, at=sites, has_aux=True, with_inputs=True
    )
    inputs = {site: with_ones(res.inputs[site][0]) for site in sites}
    factors = {}
    for site in sites:
        a, g = inputs[site], res.activation_grads[site]
        factors[site] = (a.T @ a / a.shape[0], g.T @ g / g.shape[0])
    return Curvature(res.aux, inputs, res.activation_grads, factors)


def layer_gradients(probe, loss_fn, x, sites):
    """``{site: ãᵀ g}``, the kernel gradient with the bias as its last row,
    from layer inputs and output gradients alone; and the probe's result."""
    res = probe.value_and_grad(loss_fn, x, at=sites, with_inputs=True)
    grads = {
        site: with_ones(res.inputs[site][0]).T @ res.activation_grads[site]
        for site in sites
    }
    return grads, res


def precondition(grad, factors, damping):
    """The damped K-FAC direction ``(A + γI)⁻¹ ∇W (G + γI)⁻¹``."""
    a, g = factors
    a = a + damping * jnp.eye(a.shape[0])
    g = g + damping * jnp.eye(g.shape[0])
    return jnp.linalg.solve(g, jnp.linalg.solve(a, grad).T).T  # G is symmetric


# -- 1 and 2: the identity, and the factors across libraries ---------------------------


def check_libraries(weights, x, y):
    reference = None
    for library, (package, make) in LIBRARIES.items():
        if importlib.util.find_spec(package) is None:
            print(f"{library}: not installed, skipped")
            continue
        model = make(weights)

        @jax.jit  # one compilation instead of one per operation
        def passes(probe, x, y, sites=model.sites):
            grads, res = layer_gradients(probe, mse(y), x, sites)
            return grads, res, kfac_factors(probe, x, sites).factors

        grads, res, factors = jax.tree.map(np.asarray, passes(model.probe, x, y))
        identity = max(
            max(
                np.abs(grads[site][:-1] - model.kernel_grad(res.grads, i)).max(),
                np.abs(grads[site][-1] - model.bias_grad(res.grads, i)).max(),
            )
            for i, site in enumerate(model.sites)
        )
        stacked = [f for site in model.sites for f in factors[site]]
        if reference is None:
            reference, agreement = stacked, 0.0
        else:
            agreement = max(
                np.abs(f - r).max() for f, r in zip(stacked, reference, strict=True)
            )
        shapes = ", ".join(
            f"{site} A{tuple(factors[site][0].shape)} G{tuple(factors[site][1].shape)}"
            for site in model.sites
        )
        print(
            f"  {library:<11} loss {float(res.loss):.6f}  "
            f"max|ãᵀg - grads| {identity:.1e}  "
            f"max|factors - Linen's| {agreement:.1e}\n      {shapes}"
        )
        assert identity < 1e-5, f"{library}: kernel gradient != aᵀ g"
        assert agreement < 1e-4, f"{library}: factors differ from the first library's"


# -- 3: training, K-FAC against gradient descent ---------------------------------------


@functools.cache
def training_step(kfac):
    """One jitted full-batch step of the Linen MLP, shared by every learning rate."""
    module, sites = linen_module(), [f"Dense_{i}" for i in range(len(SIZES) - 1)]

    @jax.jit
    def step(params, x, y, learning_rate):
        probe = bridge.probe(module, {"params": params})  # cheap, and traced
        if not kfac:
            res = probe.value_and_grad(mse(y), x, at=sites)
            return jax.tree.map(
                lambda p, g: p - learning_rate * g, params, res.grads
            ), res.loss
        # One pass gives the gradient too: with a scalar output,
        # d loss / d s_n = (f_n - y_n) / N · d f_n / d s_n.
        curvature = kfac_factors(probe, x, sites)
        residual = (curvature.outputs - y) / x.shape[0]
        for s in sites:
            grad = curvature.inputs[s].T @ (residual * curvature.output_grads[s])
            update = precondition(grad, curvature.factors[s], DAMPING)
            params = {
                **params,
                s: {
                    "kernel": params[s]["kernel"] - learning_rate * update[:-1],
                    "bias": params[s]["bias"] - learning_rate * update[-1],
                },
            }
        return params, mse(y)(curvature.outputs)

    def loss(params, x, y):
        return mse(y)(bridge.probe(module, {"params": params}).apply(x).outputs)

    return step, jax.jit(loss)


def train(weights, x, y, learning_rate, kfac):
    """The losses before each of ``STEPS`` full-batch steps, and after the last."""
    step, loss = training_step(kfac)
    params, losses = linen_params(weights), []
    for _ in range(STEPS):
        params, value = step(params, x, y, learning_rate)
        losses.append(float(value))
    losses.append(float(loss(params, x, y)))
    return np.array(losses)


def plot(curves, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), layout="constrained")
    for label, losses, style in curves:
        ax.plot(np.arange(len(losses)), losses, style, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("full-batch step")
    ax.set_ylabel("training loss  ½·mean (f(x) − y)²")
    ax.set_title("K-FAC vs gradient descent, 4→16→16→1 tanh MLP (Flax Linen)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    start = time.perf_counter()
    x, y = make_data()
    weights = make_weights()

    print("1-2. kernel gradient = ãᵀ g, and the K-FAC factors, in each library:")
    check_libraries(weights, x, y)
    print(f"  ({time.perf_counter() - start:.1f} s)")

    print(f"\n3. {STEPS} full-batch steps, learning rate {LEARNING_RATE}:")
    kfac = train(weights, x, y, LEARNING_RATE, kfac=True)
    gd = train(weights, x, y, LEARNING_RATE, kfac=False)
    sweep = {lr: train(weights, x, y, lr, kfac=False) for lr in GD_SWEEP}
    best_lr = min(
        sweep, key=lambda lr: sweep[lr][-1] if np.isfinite(sweep[lr][-1]) else np.inf
    )
    print(f"  {'step':>5} {'K-FAC':>10} {'GD':>10} {f'best GD, lr {best_lr}':>16}")
    for i in sorted({0, 1, 2, 5, 10, STEPS // 4, STEPS // 2, STEPS}):
        print(f"  {i:>5} {kfac[i]:>10.5f} {gd[i]:>10.5f} {sweep[best_lr][i]:>16.5f}")
    print(
        f"  final loss: K-FAC {kfac[-1]:.5f}, gradient descent {gd[-1]:.5f} "
        f"(best GD of lr {GD_SWEEP}: {sweep[best_lr][-1]:.5f} at lr {best_lr})"
    )

    curves = [
        (f"K-FAC, lr {LEARNING_RATE}, damping {DAMPING}", kfac, "C0-"),
        (
            f"gradient descent, lr {LEARNING_RATE}"
            + (" (best of sweep)" if best_lr == LEARNING_RATE else ""),
            gd,
            "C1-",
        ),
    ]
    if best_lr != LEARNING_RATE:
        curves.append((f"gradient descent, lr {best_lr} (best)", sweep[best_lr], "C1:"))
    print()
    FIGURE.save(lambda path: plot(curves, path))
    print(f"({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
