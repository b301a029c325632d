"""dm-haiku: an epsilon read from Haiku state, added by `hk.intercept_methods`.

`probe`, `run` (the interceptor), `variables` (Haiku state as the route of
bridge's values), `transforms` (the rules of Haiku's transforms, by which the
router routes a call; `hk.scan`'s carry), `internals`
(version-checked), `guest`, `porting`: each name as `bridge.adapters` says.
"""

from ..shared import jax_internals

# Before anything of the adapter reads JAX's trace stack.
jax_internals.require("Haiku")

from .probe import HaikuProbe as HaikuProbe  # noqa: E402
from .probe import probe as probe  # noqa: E402
