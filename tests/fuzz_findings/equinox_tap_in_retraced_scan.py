"""bridge bug: in an Equinox model, a `bridge.tap` inside a `lax.scan` whose
body JAX traces twice (its carry starts as a Python `0` that the body turns
into a float: JAX retraces the body with the promoted carry) is listed
twice, a phantom `t#1` beside `t`. The same model whose carry starts as
`0.0` (traced once) lists `t` alone; Linen, NNX and Haiku list the tap once
either way (the fuzzer's `haiku-tap-in-retraced-scan` reproduction).

(Found by tests/test_trace_fuzz.py: `Layer(module=False, tap=True,
wrap="scan")` in Equinox.)
"""

import equinox as eqx
import jax
import jax.numpy as jnp

import bridge


def model_whose_carry_starts_at(start):
    class Net(eqx.Module):
        head: eqx.nn.Linear

        def __call__(self, x):
            def step(carry, _):
                h, total = carry
                h = bridge.tap("t", jnp.tanh(h))
                return (h, total + jnp.mean(h)), None

            (h, total), _ = jax.lax.scan(step, (x, start), None, length=2)
            return self.head(h + total)

    return Net(eqx.nn.Linear(3, 2, key=jax.random.key(0)))


x = jnp.ones((2, 3))
for start in (0.0, 0):
    sites = bridge.probe(model_whose_carry_starts_at(start), vmap=True).sites(x)
    print(
        f"carry starts as {start!r}:",
        {k: v.shape for k, v in sites.items()},
        "<- BUG: phantom t#1" if "t#1" in sites else "",
    )
