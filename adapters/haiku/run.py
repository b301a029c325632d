"""One run of a Haiku model: every module method call of its `apply`,
reported to the session by an interceptor (`hk.intercept_methods`), and every
`bridge.tap`, from where it runs.

Each is reported plainly: where it runs (Haiku's lifted transforms, JAX's
branches and loops, the model's own `jax.vmap`s) the core reads from the
computation (`bridge._session.computation`), which gives a site its epsilon,
its patch and its recording, or refuses it with the one sentence of the
primitive no rule crosses. The adapter names the call, as Haiku names its
params.
"""

from __future__ import annotations

import inspect
from typing import Any

import haiku as hk

from bridge.adapter_api import BridgeValueError, Session

from . import internals


class Interceptor:
    """Reports every module method call of one `apply` to the session, and
    every `bridge.tap`.

    Inside `hk.experimental.layer_stack` a module's name is relative to the
    layer (`lin`); the site is named like its params,
    `__layer_stack_no_per_layer/lin`, with the name of the `LiftingModule` the
    stack calls first. Where a call runs (a layer stack's or `hk.scan`'s
    scan, `hk.remat`, `hk.cond`, the model's own `jax.vmap`) the core reads
    from the computation: a site in a layer stack holds every layer.
    """

    def __init__(self, session: Session, apply_frame: Any):
        self.session = session
        self.apply_frame = apply_frame  # where the walks up the stack stop
        self.prefixes: dict[Any, str] = {}  # `_LayerStack.__call__` frame -> name

    def __call__(self, next_fun, call_args, call_kwargs, context):
        if not is_site(context):
            return next_fun(*call_args, **call_kwargs)
        module = context.module
        if self.session.batch_axis is not None:
            _check_batch_norm_mapped(module, self.session.batch_axis)
        stack_call = internals.layer_stack_call(self.apply_frame)
        prefix = self.prefixes.get(stack_call, "")
        if internals.is_lifting(module):
            # Returns the lifted params, not an activation: not a site.
            value = next_fun(*call_args, **call_kwargs)
            caller = internals.layer_stack_caller()
            if caller is not None:
                self.prefixes[caller] = _joined(prefix, module.module_name)
            return value
        method = context.method_name
        call = self.session.enter(
            _joined(prefix, module.module_name),
            None if method == "__call__" else method,
            module,
            call_args,
        )
        return self.session.exit(call, next_fun(*call_args, **call_kwargs))

    def tap(self, name: str, value: Any) -> Any:
        """The session's tap handler: a `bridge.tap` named under the module
        calling it; in a layer stack's body outside any module, like its
        params."""
        enclosing = self.session.enclosing
        if enclosing:
            path = f"{enclosing[-1]}/{name}"
        else:
            stack_call = internals.layer_stack_call(self.apply_frame)
            path = _joined(self.prefixes.get(stack_call, ""), name)
        return self.session.exit(self.session.enter(path, None, None), value)


def _joined(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def is_site(context: hk.MethodContext) -> bool:
    """A module method call a user would name: not `__init__`, private helpers
    (`MultiHeadAttention._linear_projection`) or property reads
    (`Embed.embeddings`, `ExponentialMovingAverage.average`), which Haiku
    intercepts too."""
    method = context.method_name
    if method.startswith("_") and method != "__call__":
        return False
    attribute = inspect.getattr_static(context.orig_class, method, None)
    return not isinstance(attribute, property)


def _check_batch_norm_mapped(module: Any, batch_axis: str) -> None:
    """Under the probe's vmap, an `hk.BatchNorm` without a cross-replica axis
    would normalise each example by its own statistics: not the model's batch
    statistics, and silently so where the parameter shapes happen to fit."""
    if isinstance(module, hk.BatchNorm) and module.cross_replica_axis is None:
        raise BridgeValueError(
            f"{module.module_name} is an hk.BatchNorm, and with vmap=True the "
            "probe calls the model on one example at a time: its statistics "
            "would be each example's own, and params made for a batch do not "
            "fit one example (hk.BatchNorm's scale and offset are (1, C) for a "
            "(N, C) batch). A Haiku model takes the whole batch: probe it with "
            "vmap=False (the default), which runs BatchNorm as written. (A "
            "model written for one example reduces over the probe's axis with "
            f"hk.BatchNorm(..., cross_replica_axis={batch_axis!r}).)"
        )
