"""bridge bug: a `bridge.tap` inside the body of NNX's own `nnx.fori_loop`
is listed twice: `probe.sites` gives ['t', 't#1', 'head'], a phantom `t#1`
(the body runs in one loop of static bounds: one site `t`, of shape
(iterations, batch, width)). A module call in the same body is listed once
(tests/test_control_flow.py covers that); JAX's `lax.fori_loop` around the
same tap is fine.
"""

import jax
import jax.numpy as jnp
from flax import nnx

import bridge


class Net(nnx.Module):
    def __init__(self, own_loop):
        self.own_loop = own_loop
        self.head = nnx.Linear(3, 2, rngs=nnx.Rngs(0))

    def __call__(self, x):
        def body(i, h):
            return bridge.tap("t", jnp.tanh(h))

        if self.own_loop:
            _, h = nnx.fori_loop(0, 2, lambda i, c: (c[0], body(i, c[1])), (self, x))
        else:
            h = jax.lax.fori_loop(0, 2, body, x)
        return self.head(h)


x = jnp.ones((2, 3))
for own_loop in (False, True):
    probe = bridge.probe(Net(own_loop))
    sites = probe.sites(x)
    print(
        "nnx.fori_loop" if own_loop else "lax.fori_loop",
        {k: v.shape for k, v in sites.items()},
        "<- BUG: phantom t#1" if "t#1" in sites else "",
    )
