"""Flax Linen: `Module.perturb`, inserted from outside with `nn.intercept_methods`.

`probe` (the adapter), `porting` (its side of `transfer`/`compare`), `guest`
(Linen modules called inside another library's model).
"""

from ..shared import jax_internals

# Before anything of the adapter reads JAX's trace stack.
jax_internals.require("Flax Linen")

from .probe import LinenProbe as LinenProbe  # noqa: E402
from .probe import probe as probe  # noqa: E402
