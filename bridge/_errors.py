"""`BridgeError`: the base of every error bridge raises.

Each concrete error is also the built-in type it has always been
(`ValueError` for a bad value, `TypeError` for a wrong kind of argument, …),
so `except ValueError` keeps working, and `except bridge.BridgeError` tells
bridge's refusals from errors of the model, its library or JAX.

Each is exported as `bridge.<name>` and says so in its `__module__`, so a
traceback names `bridge.BridgeValueError`, the class a user can catch, not
this private module.
"""

from __future__ import annotations


class BridgeError(Exception):
    """An error raised by bridge itself: its message names the argument and
    the fix."""


class BridgeValueError(BridgeError, ValueError):
    """A value bridge cannot use (a selection matching nothing, a misfit patch)."""


class BridgeTypeError(BridgeError, TypeError):
    """An argument of the wrong kind (an unsupported model, a loss that is not
    a function)."""


class BridgeRuntimeError(BridgeError, RuntimeError):
    """A model that cannot be probed as it runs (a site's value escaping its
    transform, a site that autograd skips)."""


class BridgeNotImplementedError(BridgeError, NotImplementedError):
    """A site inside a transform bridge cannot see through, named."""


class BridgeImportError(BridgeError, ImportError):
    """A library version outside the supported range."""


class BridgeAssertionError(BridgeError, AssertionError):
    """A failed check of `bridge.testing`, or a broken invariant of bridge's own."""


class BridgeWarning(UserWarning):
    """Something bridge left out and says so (a site it cannot probe, left out
    of a default selection), where an error would block the rest."""


for _public in (
    BridgeError,
    BridgeValueError,
    BridgeTypeError,
    BridgeRuntimeError,
    BridgeNotImplementedError,
    BridgeImportError,
    BridgeAssertionError,
    BridgeWarning,
):
    _public.__module__ = "bridge"
del _public
