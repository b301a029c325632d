"""Flax NNX: graph surgery on a copy of the module, made inside the traced call.

`probe`, `surgery` (the copy's reporting classes), `run` (the `Run` of the
copy, which reports each call plainly: where it runs, NNX's lifted
transforms included, the core reads from the computation), `variables`
(the site path each module carries), `internals` (version-checked), `guest`,
`porting`: each name as `bridge.adapters` says.
"""

from ..shared import jax_internals

# Before anything of the adapter reads JAX's trace stack.
jax_internals.require("Flax NNX")

from .probe import NnxProbe as NnxProbe  # noqa: E402
from .probe import probe as probe  # noqa: E402
