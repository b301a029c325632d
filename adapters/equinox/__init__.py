"""Equinox: tree surgery on a copy of the model, a wrapper around each layer.

`probe`, `surgery` (the wrappers), `run` (a wrapper's call, reported
plainly: where it runs the core reads from the computation), `loops` (where
a call runs inside Equinox's while loops: the core's one fallback),
`internals` (version-checked), `porting`: each name as `bridge.adapters`
says.
"""

from ..shared import jax_internals

# Before anything of the adapter reads JAX's trace stack.
jax_internals.require("Equinox")

from .probe import EquinoxProbe as EquinoxProbe  # noqa: E402
from .probe import probe as probe  # noqa: E402
