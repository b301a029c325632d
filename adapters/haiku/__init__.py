"""dm-haiku: every module method call reported by `hk.intercept_methods`.

`probe`, `run` (the interceptor), `internals` (version-checked), `guest`,
`porting`: each name as `bridge.adapters` says.
"""

from ..shared import jax_internals

# Before anything of the adapter reads JAX's trace stack.
jax_internals.require("Haiku")

from .probe import HaikuProbe as HaikuProbe  # noqa: E402
from .probe import probe as probe  # noqa: E402
