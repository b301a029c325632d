"""Equinox: tree surgery on a copy of the model, epsilon leaves in the tree.

`probe` (the adapter), `transforms` (sites inside the model's own `jax.vmap`,
`lax.scan` and `jax.checkpoint`), `porting`.
"""

from .probe import EquinoxProbe as EquinoxProbe
from .probe import probe as probe
