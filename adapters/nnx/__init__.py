"""Flax NNX: graph surgery on a copy of the module, made inside the traced call.

`probe` (the adapter), `transforms` (sites inside NNX's lifted transforms),
`internals` (NNX's private API, version-checked), `porting`, `guest`.
"""

from ..shared import jax_internals

# Before anything of the adapter reads JAX's trace stack.
jax_internals.require("Flax NNX")

from .probe import NnxProbe as NnxProbe  # noqa: E402
from .probe import probe as probe  # noqa: E402
