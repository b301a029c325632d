"""One run of a Linen model: every submodule method call of its `apply`,
reported to the session by an interceptor (`nn.intercept_methods`), from
where it runs.

Each call is named by its module's scope path and reported plainly, as each
`bridge.tap` is: where it runs (Flax's lifted transforms `nn.scan`,
`nn.vmap`, `nn.remat`, `nn.jit`, `nn.cond`, `nn.while_loop`, the model's
own JAX transforms) the core reads from the computation
(`bridge._session.computation`), which gives a site its epsilon, its patch
and its recording, or refuses it with the one sentence of the primitive no
rule crosses. Flax traces an `nn.scan` body twice, the first time in a
partial evaluation whose jaxpr it discards: the core drops what that pass
marks (`bridge._session.liveness`).

An `apply` the model makes itself (a tied LM head's) is a scope root of its
own, whose calls are named under the module that makes it; their variables
are the model's arguments (`Origin.given`). Modules of other libraries called
inside the model — the NNX module an `nnx.bridge.ToLinen` builds, an
`hk.transform`ed function's `apply` — are sites named under the Linen site
that calls them (`bridge.adapters.shared.guests`).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import flax.linen as nn

from bridge.adapter_api import Session, SiteOrigin

from ..shared import guests


def body_of(context: Any) -> Any:
    """The function an intercepted Linen call runs (`context.orig_method`),
    unwrapped from the partial and the bound method Flax makes of it for each
    trace."""
    function = getattr(context, "orig_method", None)
    function = getattr(function, "func", function)
    return getattr(function, "__func__", function)


def runs_lifted_function(context: Any) -> bool:
    """Whether an intercepted Linen call runs a function a lifted transform was
    given rather than a method of the module: `nn.RNN`'s `scan_fn`, the body
    of `nn.scan(f)`, `nn.vmap(f)`, `nn.remat(f)`, `nn.jit(f)` or
    `nn.map_variables(f)`, the branches of `nn.cond` and `nn.switch`, the
    functions of `nn.while_loop`. Flax calls such a function as a method of
    the module it hands it (`nn.intercept_methods` sees
    `OptimizedLSTMCell_0.scan_fn`), but it is the transform's function, not a
    call of the module's: no site, while the calls it makes are. A method of
    the module's class called through a lifted transform (`@nn.remat` on
    `__call__`, `nn.scan(Cell.__call__)`) is a site as ever.

    A method is what the class holds under the call's name, or a function
    one of the class's attributes wraps, through `__wrapped__` (Flax's
    method wrappers and lifted decorators set it): a user's decorator may
    give the function it returns a name of its own (`inner`). Flax calls a
    function of no class as a method only in its lifted transforms (and in
    its check of a `setup`, at path `()`, which is no site)."""
    cls = type(context.module)
    if callable(inspect.getattr_static(cls, context.method_name, None)):
        return False
    function = body_of(context)
    for name in dir(cls):
        attribute = inspect.getattr_static(cls, name, None)
        seen = set()  # a wrapper chain that loops back ends there
        while attribute is not None and id(attribute) not in seen:
            if attribute is function:
                return False
            seen.add(id(attribute))
            attribute = getattr(attribute, "__wrapped__", None)
    return True


def is_no_site(path: tuple[str, ...], context: Any) -> bool:
    """Whether an intercepted call at `path` is no site: the model's root,
    a `setup`, a private method, or a lifted transform's own function
    (`nn.RNN`'s `scan_fn`, an `nn.cond` branch: `runs_lifted_function`),
    whose calls still are."""
    method = context.method_name
    return (
        path == ()
        or method == "setup"
        or (method.startswith("_") and method != "__call__")
        or runs_lifted_function(context)
    )


@dataclasses.dataclass(frozen=True)
class Origin(SiteOrigin):
    """Where a Linen call's weights live, for `bridge.compare` and
    `bridge.transfer` (`bridge.adapters.linen.porting`): its module's scope
    path, and whether it runs inside an `apply` the model makes itself
    (`given`: a tied head's kernel, the embedding's transpose), whose
    variables are the model's own arguments, not the probe's."""

    scope: tuple[str, ...]
    given: bool = False


def _is_nested_apply(module: Any) -> bool:
    """Whether a module's call starts an `apply` (or `bind`) the model makes
    itself, `self.lm_head.apply({"params": ...}, x)` as a tied LM head does:
    a fresh scope root whose module keeps its name. A lifted transform's own
    module (`ScanBlock`) has one too, but its class is made by
    `flax.linen.transforms`."""
    scope = module.scope
    return (
        module.name is not None
        and scope.path == ()
        and getattr(scope, "debug_path", None) == ()
        and type(module).__module__ != nn.transforms.__name__
    )


@dataclasses.dataclass
class Frame:
    """One active method call, as the interceptor sees it: its scope root
    and its module's path in the model."""

    root: Any
    path: tuple[str, ...]


class Interceptor:
    """Reports every submodule call of one `apply` to the session."""

    def __init__(self, session: Session):
        self.session = session
        self.stack: list[Frame] = []
        # The scope roots of `apply`s the model makes itself, by id: the root
        # (kept alive, so that its id is not reused) and the path its module
        # has in the model.
        self.nested: dict[int, tuple[Any, tuple[str, ...]]] = {}

    def __call__(self, next_fun, call_args, call_kwargs, context):
        module = context.module
        parent = self.stack[-1] if self.stack else None
        root = module.scope.root
        if (
            parent is not None
            and root is not parent.root
            and not self._lifted(parent)
            and _is_nested_apply(module)
        ):
            self.nested[id(root)] = (root, (*parent.path, module.name))
        _, prefix = self.nested.get(id(root), (None, ()))
        frame = Frame(root, (*prefix, *module.path))
        self.stack.append(frame)
        try:
            value = self._call(next_fun, call_args, call_kwargs, context, frame)
        finally:
            self.stack.pop()
        return value

    def _call(self, next_fun, call_args, call_kwargs, context, frame):
        module, method = context.module, context.method_name
        if is_no_site(frame.path, context):
            # A root `nnx.bridge.ToLinen`'s NNX submodules are sites.
            return guests.call_module("linen", module, next_fun, call_args, call_kwargs)
        session = self.session
        call = session.enter(
            "/".join(frame.path),
            None if method == "__call__" else method,
            module,
            call_args,
            origin=Origin(frame.path, id(frame.root) in self.nested),
        )
        value = guests.call_module("linen", module, next_fun, call_args, call_kwargs)
        return session.exit(call, value)

    def tap(self, name: str, value: Any) -> Any:
        """`bridge.tap` in the model's code, reported plainly."""
        return self.session.tap_here(name, value)

    def _lifted(self, frame: Frame) -> bool:
        """Whether `frame`'s call runs inside a lifted transform: in a scope
        root other than the model's and its own `apply`s'."""
        return frame.root is not self.stack[0].root and id(frame.root) not in (
            self.nested
        )
