"""bridge bug: a `bridge.tap` inside a branch of Linen's own `nn.cond` (or
`nn.switch`) fails inside bridge with
"ValueError: Perturbation collection bridge_epsilons present, but missing
perturbation variable bridge_epsilon:tap/t#0".

The same tap inside JAX's `lax.cond` in a Linen model is probed
(the fuzzer's non-native cond); with `nn.cond` it is not.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

import bridge


class Net(nn.Module):
    switch: bool = False

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(3, name="dense")(x)

        def taken(mdl, h):
            return bridge.tap("t", jnp.tanh(h))

        def other(mdl, h):
            return -h

        if self.switch:
            return nn.switch(jnp.int32(jnp.sum(h) > 0), [other, taken], self, h)
        return nn.cond(jnp.sum(h) > 0, taken, other, self, h)


x = jnp.ones((2, 3))
for switch in (False, True):
    model = Net(switch)
    variables = model.init(jax.random.key(0), x)
    print("unprobed:", model.apply(variables, x).shape)
    probe = bridge.probe(model, variables)
    try:
        print("listed:", list(probe.sites(x)))
        res = probe.value_and_grad(lambda y: jnp.sum(y**2), x, at="t")
        print("probed:", sorted(res.activations), dict(res.ran))
    except Exception as error:  # noqa: BLE001
        print(
            f"BUG ({'nn.switch' if switch else 'nn.cond'}):",
            type(error).__name__,
            str(error).splitlines()[0],
        )
