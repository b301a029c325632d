"""The checks every multi-device script makes, on 8 simulated CPU devices.

Scripts run as `python tests/multidevice/<lib>_sharded.py`, so this module is
importable beside them.
"""

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

assert jax.device_count() == 8, jax.devices()

#: `jax.make_mesh`'s default axis types (`Explicit` on jax 0.10).
MESH = jax.make_mesh((8,), ("data",))


def _put(probe, x, mesh):
    """The probe replicated, the batch sharded over `mesh`."""
    return (
        jax.device_put(probe, NamedSharding(mesh, P())),
        jax.device_put(x, NamedSharding(mesh, P("data"))),
    )


def stacked_spec(is_stacked: Callable[[str], bool]) -> Callable[[str], P]:
    """A site's batch sharding: a stacked site holds (iterations, batch, ...)."""
    return lambda name: P(None, "data") if is_stacked(name) else P("data")


def assert_close(result, reference, rtol):
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-6),
        result,
        reference,
    )


def check_batch_sharded(step, probe, x, single, spec_of, mesh=MESH):
    """A jitted step on a batch-sharded input gives the single-device numbers,
    with activation gradients sharded over the batch."""
    sharded = step(*_put(probe, x, mesh))
    np.testing.assert_allclose(sharded.loss, single.loss, rtol=1e-6)
    assert_close(
        (sharded.grads, sharded.activations, sharded.activation_grads),
        (single.grads, single.activations, single.activation_grads),
        rtol=1e-5,
    )
    for name, grad in sharded.activation_grads.items():
        expected = NamedSharding(mesh, spec_of(name))
        assert grad.sharding.is_equivalent_to(expected, grad.ndim), (
            name,
            grad.sharding,
        )


def check_shard_map(probe, x, single, spec_of, local_loss, mesh=MESH):
    """Under `shard_map` each device probes its shard, with `local_loss` its
    share of the whole batch's loss. The epsilons must vary across devices like
    the activations they perturb, or their gradients (the activation
    gradients) would be summed over devices."""

    def local_step(probe, x):
        res = probe.value_and_grad(local_loss, x)
        return res.grads, res.activation_grads

    specs = {name: spec_of(name) for name in single.activation_grads}
    local = jax.jit(
        jax.shard_map(
            local_step, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), specs)
        )
    )
    result = local(*_put(probe, x, mesh))
    assert_close(result, (single.grads, single.activation_grads), rtol=1e-4)


def check_explicit_axes(step, probe, x, single):
    """Sharding in types (`Explicit` mesh axes): the single-device numbers.
    Returns the result, for the caller's checks of its shardings."""
    explicit = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(explicit):
        result = step(*_put(probe, x, explicit))
    assert_close(
        (result.loss, result.grads, result.activation_grads),
        (single.loss, single.grads, single.activation_grads),
        rtol=1e-5,
    )
    return result
