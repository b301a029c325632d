"""Equinox: tree surgery on a copy of the model, epsilon leaves in the tree.

`probe`, `surgery` (the wrappers), `run` (a wrapper's call), `variables`
(the leaves in the tree), `transforms` (`lax.scan` over stacked layers,
`jax.checkpoint`), `jax_transforms` (the model's own `jax.vmap`, and the
calls with no route), `internals`, `porting`, and `rules` (the call
router's rules for Equinox, which decide each call's route): each name as
`bridge.adapters` says.
"""

from ..shared import jax_internals

# Before anything of the adapter reads JAX's trace stack.
jax_internals.require("Equinox")

from .probe import EquinoxProbe as EquinoxProbe  # noqa: E402
from .probe import probe as probe  # noqa: E402
