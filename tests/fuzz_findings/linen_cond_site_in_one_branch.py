"""bridge bug: a Linen `nn.cond` (or `nn.switch`) whose branches do not all
call a submodule fails inside bridge.

The model runs unprobed. Probed, Linen's lifted cond raises "cond branch
outputs must have the same pytree structure ... symmetric difference of key
sets: {'bridge_recordings'}": bridge's mutable recording collection is
written only by the branch holding the site.
(tests/test_control_flow.py only covers models with a site in every branch.)
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

import bridge


class Net(nn.Module):
    switch: bool = False

    def setup(self):
        self.dense = nn.Dense(3)

    def __call__(self, x):
        if self.is_initializing():
            self.dense(x)  # parameters made before the branch, as Flax asks

        def taken(mdl, x):
            return mdl.dense(x)

        def other(mdl, x):  # no site here
            return jnp.zeros((*x.shape[:-1], 3))

        if self.switch:
            index = jnp.int32(jnp.sum(x) > 0)
            return nn.switch(index, [taken, other], self, x)
        return nn.cond(jnp.sum(x) > 0, taken, other, self, x)


x = jnp.ones((2, 3))
for switch in (False, True):
    model = Net(switch)
    variables = model.init(jax.random.key(0), x)
    print("unprobed:", model.apply(variables, x).shape)
    probe = bridge.probe(model, variables)
    try:
        res = probe.value_and_grad(lambda y: jnp.sum(y**2), x)
        print("probed:", sorted(res.activations), dict(res.ran))
    except Exception as error:  # noqa: BLE001
        print(
            f"BUG ({'nn.switch' if switch else 'nn.cond'}):",
            type(error).__name__,
            str(error).splitlines()[0],
        )
