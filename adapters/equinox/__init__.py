"""Equinox: tree surgery on a copy of the model, epsilon leaves in the tree.

`probe` (the adapter), `transforms` (sites inside the model's own `jax.vmap`,
`lax.scan` and `jax.checkpoint`), `porting`.
"""

from ..shared import jax_internals

# Before anything of the adapter reads JAX's trace stack.
jax_internals.require("Equinox")

from .probe import EquinoxProbe as EquinoxProbe  # noqa: E402
from .probe import probe as probe  # noqa: E402
