"""Flax Linen: `Module.perturb`, inserted from outside with `nn.intercept_methods`.

`probe`, `run` (the interceptor), `variables` (bridge's collections),
`transforms` (Flax's lifted transforms), `jax_transforms` (the model's own
JAX transforms), `routes` (what encloses a call, for the core's router),
`guest`, `porting`, `hub` (Hugging Face Flax model objects): each name as
`bridge.adapters` says. It uses no private name of Flax's.
"""

from ..shared import jax_internals

# Before anything of the adapter reads JAX's trace stack.
jax_internals.require("Flax Linen")

from .probe import LinenProbe as LinenProbe  # noqa: E402
from .probe import probe as probe  # noqa: E402
