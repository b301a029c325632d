"""Flax Linen: every submodule call, reached with `nn.intercept_methods`.

`probe`, `run` (the interceptor), `guest`, `porting`, `hub` (Hugging Face
Flax model objects): each name as `bridge.adapters` says. It uses no
private name of Flax's.
"""

from ..shared import jax_internals

# Before anything of the adapter reads JAX's trace stack.
jax_internals.require("Flax Linen")

from .probe import LinenProbe as LinenProbe  # noqa: E402
from .probe import probe as probe  # noqa: E402
