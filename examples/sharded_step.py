"""A data-parallel training step with `jax.shard_map`, probing every device's shard.

Each device runs `probe.value_and_grad` on its slice of the batch, with the
loss normalised by the global batch size. The parameters are replicated, so
`shard_map` sums their gradients over devices itself (the transpose of
broadcasting a replicated value); each device keeps the activation gradients
of its own examples, which come back batch-sharded. The numbers equal those of
one device on the whole batch. On a CPU this simulates 8 devices.

    python -m pip install -e ".[all,examples]"
    python examples/sharded_step.py

It draws no figure.
"""

# The optional packages are imported after `require` has checked them, and
# after XLA_FLAGS is set (JAX reads it once, when first imported).
# ruff: noqa: E402
from __future__ import annotations

import os

from example_support import require

require("flax")
# Eight CPU devices, unless XLA_FLAGS already names a count (flags of other
# kinds there are kept).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
    ).strip()

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import bridge


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(1)(nn.LayerNorm()(x))


def main():
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    x = jax.random.normal(jax.random.key(0), (64, 16))
    y = jnp.sin(x.sum(axis=1, keepdims=True))
    model = MLP()
    probe = bridge.probe(model, model.init(jax.random.key(1), x))

    def loss_fn(y):
        return lambda out: jnp.sum((out - y) ** 2) / x.shape[0]

    def local_step(probe, x, y):
        res = probe.value_and_grad(loss_fn(y), x)
        return jax.lax.psum(res.loss, "data"), res.grads, res.activation_grads

    step = jax.jit(
        jax.shard_map(
            local_step,
            mesh=mesh,
            in_specs=(P(), P("data"), P("data")),
            out_specs=(P(), P(), P("data")),
        )
    )
    batch = NamedSharding(mesh, P("data"))
    loss, grads, activation_grads = step(
        probe, jax.device_put(x, batch), jax.device_put(y, batch)
    )

    single = probe.value_and_grad(loss_fn(y), x)
    np.testing.assert_allclose(loss, single.loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(single.grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    for name, grad in activation_grads.items():
        np.testing.assert_allclose(
            grad, single.activation_grads[name], rtol=1e-4, atol=1e-7
        )
    shards = jax.device_count()
    print(f"{shards} devices, loss {float(loss):.4f}")
    for name, grad in activation_grads.items():
        print(f"  {name:<12} {str(grad.shape):<10} sharded as {grad.sharding.spec}")


if __name__ == "__main__":
    main()
