"""Run in a subprocess with 8 simulated CPU devices (see tests/test_sharding.py).

The model scans a stack of layers with `hk.experimental.layer_stack` and
rematerialises its head: their sites ride in Haiku state, sharded like the
activations they perturb.
"""

import haiku as hk
import jax
import jax.numpy as jnp
from checks import check_batch_sharded, check_shard_map, stacked_spec

import bridge


def block(x):
    return jax.nn.relu(hk.Linear(32)(x))


def model(x):
    x = hk.Linear(32)(x)
    x = hk.experimental.layer_stack(2)(block)(x)
    return hk.remat(hk.Linear(4))(x)


def loss(y):
    return jnp.mean(jnp.square(y - 1.0))


x = jax.random.normal(jax.random.key(0), (32, 16))
transformed = hk.without_apply_rng(hk.transform(model))
params = transformed.init(jax.random.key(1), x)
probe = bridge.probe(transformed, params)
assert probe.sites(x)["__layer_stack_no_per_layer/linear"].shape == (2, 32, 32)
step = jax.jit(lambda probe, x: probe.value_and_grad(loss, x))
single = step(probe, x)

# A stacked site's batch axis is its second: (layers, batch, features).
spec_of = stacked_spec(lambda name: name.startswith("__layer_stack"))
check_batch_sharded(step, probe, x, single, spec_of)
check_shard_map(probe, x, single, spec_of, lambda y: jnp.sum(jnp.square(y - 1.0)) / 128)
print("ok")
