"""One run of an NNX probe's copy: each call of its modules, reported to the
session from where it runs.

The copy's modules report their calls (`bridge.adapters.nnx.surgery`) to the
`Run` of the probe's call, which names each by its module's path and reports
it plainly, as it does each `bridge.tap`: where it runs (NNX's `nnx.scan`,
`nnx.vmap`, `nnx.remat`, `nnx.cond`, JAX's transforms, the model's own
`jax.vmap`s) the core reads from the computation
(`bridge._session.computation`), which gives a site its epsilon, its patch
and its recording, or refuses it with the one sentence of the primitive no
rule crosses. Inside NNX's transforms a module is a new object NNX merged,
named by the path it carries as a static attribute
(`variables.PATH_ATTRIBUTE`).
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from bridge.adapter_api import BridgeNotImplementedError, Session

from . import internals
from .variables import PATH_ATTRIBUTE


class Run:
    """One run of the probe's copy: its `modules`, by path."""

    def __init__(self, modules: dict[str, nnx.Module]):
        self.ids = {id(module): path for path, module in modules.items()}
        # NNX's transforms running around the probe's call are not the model's.
        self.outer = internals.active_transforms()

    def innermost_transform(self) -> str | None:
        """The name of the innermost NNX transform of the model's code running
        now (`nnx.scan`), for the error about a module that is not the
        model's; `nnx.jit` is traced through."""
        names = [
            internals.transform_name(tag)
            for tag in internals.active_transforms()
            if tag not in self.outer
        ]
        names = [name for name in names if name != "nnx.jit"]
        return names[-1] if names else None

    def report(self, module, method_name, method, args, kwargs, session: Session):
        """A call of a module of the copy (`surgery.Reporter`)."""
        path = self.ids.get(id(module)) or vars(module).get(PATH_ATTRIBUTE)
        if path is None:
            inside = self.innermost_transform() or "a transform"
            raise BridgeNotImplementedError(
                f"A {type(module).__name__} submodule that is not one of the "
                f"model's own is called inside {inside} in the model's own "
                "code: bridge cannot tell which site it is. "
                "Call the model's own submodules there."
            )
        site_method = None if method_name == "__call__" else method_name
        call = session.enter(path, site_method, module, args)
        return session.exit(call, method(module, *args, **kwargs))

    def tap(self, session: Session, name: str, value: Any) -> Any:
        """`bridge.tap` in the model's code, reported plainly."""
        return session.tap_here(name, value)
