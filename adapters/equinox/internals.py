"""The Equinox internals the Equinox adapter relies on: all of them, and only here.

- the modules of Equinox's own classes (`equinox._module`): `eqx.Module` and
  the classes it derives from are no class of a model, and their methods and
  `__init_subclass__` hooks are Equinox's (`is_equinox_base`). Equinox
  exports no list of them.

JAX's private trace stack, which the adapter reads too, is
`bridge.adapters.shared.jax_internals`.
"""

from __future__ import annotations

_BASE_MODULES = frozenset({"builtins", "abc", "typing", "collections.abc"})


def is_equinox_base(klass: type) -> bool:
    """`eqx.Module` and what it derives from: no class of a model."""
    module = klass.__module__
    return module.startswith("equinox._module") or module in _BASE_MODULES
