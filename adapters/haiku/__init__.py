"""dm-haiku: an epsilon read from Haiku state, added by `hk.intercept_methods`.

`probe` (the adapter), `transforms` (Haiku state through `layer_stack`,
`hk.scan`, `hk.remat`), `internals` (Haiku's private API, version-checked),
`porting`, `guest`.
"""

from ..shared import jax_internals

# Before anything of the adapter reads JAX's trace stack.
jax_internals.require("Haiku")

from .probe import HaikuProbe as HaikuProbe  # noqa: E402
from .probe import probe as probe  # noqa: E402
