"""Flax Linen: `Module.perturb`, inserted from outside with `nn.intercept_methods`.

Every submodule method call passes through an interceptor that reports it to
the probe's session. At a selected call the interceptor calls the module's own
`perturb` on its output, reading the epsilon from a private variable
collection laid out like `params`
(`{scope path...: {"bridge_epsilon:__call__#k": eps}}`, see `carrier_name`).
Each call has its own variable name, so the gradients of a shared module's
calls are never summed, and the collection is passed to `apply` only when
there are epsilons, so unselected sites cost nothing.

Lifted transforms run their body in a scope of their own, and values seen
there are tracers of the transform's inner trace. Recordings leave through a
mutable collection, as Flax's own `sow` does. `nn.remat` and `nn.jit` carry
every collection. `nn.scan` and `nn.vmap` carry only those their
`variable_axes` name — users name `params`, never a perturbation collection, and
an unnamed one is silently dropped — so inside them the epsilons and
recordings ride with the parameters, under reserved names: they are sliced
per iteration going in and stacked coming out exactly as the parameters are.

Modules of other libraries called inside the model — the NNX module an
`nnx.bridge.ToLinen` builds, an `hk.transform`ed function's `apply` — are
sites named under the Linen site that calls them (`bridge.adapters.shared.guests`).
A `ToLinen`'s own epsilon is the session's outside lifted transforms: it
hands every variable of its scope to the NNX module it builds.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax

from bridge.adapter_api import (
    BodyTraces,
    BridgeRuntimeError,
    BridgeTypeError,
    BridgeValueError,
    ProbeBase,
    Session,
    SiteOrigin,
    carrier_name,
    differentiable_part,
    merge_differentiable,
)

from ..shared import guests, jax_internals, lifting, unexpressible
from . import refused
from .guest import body_of, entering_linen_lifted_scope, transform_call
from .variables import (
    EPSILON_COLLECTION,
    RECORDING_COLLECTION,
    names_params,
    place_epsilons,
    recorded,
    with_recordings,
)

#: Keywords of `Module.apply` rather than of the model.
_APPLY_KEYWORDS = ("rngs", "mutable", "capture_intermediates")


@dataclasses.dataclass(frozen=True)
class _Origin(SiteOrigin):
    """Where a Linen site lives: its scope path, and whether its epsilon and
    recording ride with the parameters (inside `nn.scan` or `nn.vmap`).

    `in_session`: the epsilon is the session's own, not a variable. So is an
    `nnx.bridge.ToLinen`'s outside lifted transforms: it hands every variable
    of its scope, bridge's collection too, to the NNX module it builds.

    `tap`: the name of a `bridge.tap` inside a lifted transform, whose
    variables live in the scope of the module that calls it.

    `given`: the call is inside an `apply` the model makes itself, whose
    variables are the model's own arguments (a tied head's kernel, the
    embedding's transpose), not the probe's.

    `blocked`: why bridge cannot express the call, naming the transform that
    holds it (see `bridge.adapters.shared.unexpressible`); listed only.
    """

    scope: tuple[str, ...]
    in_params: bool = False
    in_session: bool = False
    tap: str | None = None
    given: bool = False
    blocked: str | None = None


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


def _check_perturbed(floats: Any, value: Any, name: str) -> None:
    """`Module.perturb` adds an epsilon leaf by leaf since flax 0.10.1; before,
    `value += epsilon` concatenated a tuple-valued call's output with its
    epsilon, and the epsilon's gradient would silently be zero."""
    if jax.tree.structure(floats) != jax.tree.structure(value):
        raise BridgeRuntimeError(
            f"flax.linen.Module.perturb changed the structure of site {name!r}'s "
            "value (a pytree): this flax adds perturbations to pytrees wrongly. "
            "bridge supports flax >= 0.10.1."
        )


class _NeedsParams(Exception):
    """Discovery met a transform that carries only `params`: run it again with
    `params` mutable, so recordings can leave the transform with them."""


def probe(module: nn.Module, *variables: Any, vmap: bool = False) -> LinenProbe:
    if len(variables) != 1:
        raise BridgeTypeError(
            "A Flax Linen module needs its variables: bridge.probe(module, "
            "variables) with variables = module.init(key, x) (a dict with a "
            f"'params' collection); got {len(variables)} variable arguments."
        )
    (variables,) = variables
    if not isinstance(variables, Mapping):
        raise BridgeTypeError(
            "`variables` must be the dict returned by module.init(key, x), e.g. "
            f"{{'params': ...}}; got {type(variables).__name__}."
        )
    if variables and "params" not in variables:
        raise BridgeValueError(
            "`variables` has no 'params' collection (its keys are "
            f"{sorted(variables)}). Pass what module.init returns, or wrap bare "
            "parameters: bridge.probe(module, {'params': params})."
        )
    for reserved in (EPSILON_COLLECTION, RECORDING_COLLECTION):
        if reserved in variables:
            raise BridgeValueError(
                f"`variables` has a '{reserved}' collection, which bridge reserves "
                "for its own use. Remove it."
            )
    return LinenProbe(module, variables, vmap)


@jax.tree_util.register_pytree_node_class
class LinenProbe(ProbeBase):
    """A Flax Linen module with its variables. See `bridge.ActivationProbe`."""

    #: What `bridge.transfer` and `bridge.compare` know of this library.
    porting_side = "bridge.adapters.linen.porting"

    #: The module (its attributes) is in the treedef, the variables are leaves,
    #: and an origin is a scope path: a discovery is reused by structure.
    reuses_discovery = True

    def __init__(self, module: nn.Module, variables: Mapping, vmap: bool = False):
        self.module = module
        self.variables = variables
        self.vmap = vmap

    def tree_flatten(self):
        return (self.variables,), (self.module, self.vmap, self._inside)

    @classmethod
    def tree_unflatten(cls, static, children):
        return cls(static[0], children[0], static[1])._looking_inside(static[2])

    def __repr__(self) -> str:
        return f"LinenProbe({type(self.module).__name__}, vmap={self.vmap})"

    def _trainable(self) -> Any:
        return self.variables.get("params", {})

    def _check_call(self, args: tuple, kwargs: dict) -> None:
        mutable = kwargs.get("mutable", False)
        if not (
            isinstance(mutable, bool | str)
            or (
                isinstance(mutable, list | tuple)
                and all(isinstance(m, str) for m in mutable)
            )
            or callable(mutable)
        ):
            raise BridgeTypeError(
                "`mutable` goes to Module.apply: a collection name, a list of names "
                f"(e.g. mutable=['batch_stats']), True or False; got {mutable!r}."
            )

    def _run(
        self, trainable: Any, args: tuple, kwargs: dict, session: Session
    ) -> tuple[Any, Any]:
        unexpressible.refuse_patched(session)
        # `{transform: its name}` of the lifted transforms that broadcast
        # `params`, learnt by discovery (`refused.Broadcasts`).
        broadcasting: dict[tuple, str] = {}

        def apply(in_params: bool) -> tuple[Any, Any]:
            while True:
                start = session.checkpoint()
                try:
                    return self._apply(
                        trainable, args, kwargs, session, in_params, broadcasting
                    )
                except refused.Broadcasts as found:
                    if found.key in broadcasting:
                        raise BridgeRuntimeError(
                            f"bridge could not list the calls inside {found.transform} "
                            "as refused sites. This is a bug in bridge: please "
                            "report it."
                        ) from found
                    session.restore(start)
                    broadcasting[found.key] = found.transform

        return session.run_with_fallback(
            apply, _NeedsParams, lambda origin: origin.in_params
        )

    def _apply(
        self,
        trainable: Any,
        args: tuple,
        kwargs: dict,
        session: Session,
        in_params: bool,
        broadcasting: dict[tuple, str],
    ) -> tuple[Any, Any]:
        apply_kwargs = {k: kwargs[k] for k in _APPLY_KEYWORDS if k in kwargs}
        model_kwargs = {k: v for k, v in kwargs.items() if k not in _APPLY_KEYWORDS}
        user_mutable = apply_kwargs.pop("mutable", False)
        epsilons, params = place_epsilons(session, trainable)
        variables = {**self.variables, "params": params}
        if epsilons:
            variables[EPSILON_COLLECTION] = epsilons
        mutable = with_recordings(user_mutable, in_params)
        interceptor = _Interceptor(session, in_params, broadcasting, sys._getframe())
        try:
            with (
                guests.hosting("linen", interceptor.lifted_transform),
                session.taps.tapping(interceptor.tap),
                nn.intercept_methods(interceptor),
            ):
                outputs, state = self.module.apply(
                    variables, *args, mutable=mutable, **apply_kwargs, **model_kwargs
                )
        except ValueError as error:
            transform = refused.broadcasting(error) if in_params else None
            if transform is not None:
                # Discovery lists the calls inside as refused sites; a run
                # records in `params` only the sites discovery did not refuse.
                raise BridgeRuntimeError(
                    f"bridge recorded a site inside {transform}, which broadcasts "
                    "`params`, although discovery listed the calls there as "
                    "refused. This is a bug in bridge: please report it."
                ) from error
            raise
        session.carrier.hand_over(lambda where: recorded(state, where))
        if user_mutable is False:
            return outputs, None
        ours = {EPSILON_COLLECTION, RECORDING_COLLECTION}
        if in_params and not names_params(user_mutable):
            ours.add("params")
        return outputs, {k: v for k, v in state.items() if k not in ours}

    # -- taking the model out (`ActivationProbe.unwrap`) -------------------------

    def unwrap(self) -> tuple:
        """`(module, variables)`, what `bridge.probe` takes: the module, and
        the probe's variables (after `bridge.transfer`, the ported ones) in
        containers of their own, so that changing them changes no probe."""
        return self.module, jax.tree.map(lambda leaf: leaf, self.variables)


class _Frame:
    """One active method call, as the interceptor sees it."""

    def __init__(
        self, module: Any, root: Any, path: tuple[str, ...], bodies: BodyTraces
    ):
        self.module = module
        self.root = root  # the scope root the call runs in
        self.path = path  # the module's path in the model
        self.bodies = bodies  # lifted bodies traced from this call
        self.entered: list[tuple] = []  # the lifted transforms it entered
        # The Python frames of the lifted transforms' calls it made, in order
        # (`transform_call`): the transform a key names is its n-th.
        self.calls: list[Any] = []


class _Interceptor:
    """Reports every submodule call of one `apply` to the session.

    Flax traces some lifted bodies more than once (`nn.scan` twice); a repeated
    trace of the same body re-uses the names of the first, so a scanned site is
    one site, never `#1`.
    """

    def __init__(
        self,
        session: Session,
        in_params: bool,
        broadcasting: dict[tuple, str],
        stop: Any,
    ):
        self.session = session
        self.in_params = in_params
        self.stack: list[_Frame] = []
        self.transform = "a Flax lifted transform"
        # The transforms known to broadcast `params` (`refused.Broadcasts`),
        # and the traces of their bodies now, by id (the trace kept alive).
        self.broadcasting = broadcasting
        self.broadcast_traces: dict[int, tuple[Any, str]] = {}
        # The trace and the frame of the probe's `apply`: the model's own
        # transforms run between here and there.
        self.base = jax_internals.current_trace()
        self.stop = stop
        # The scope roots of `apply`s the model makes itself, by id: the root
        # (kept alive, so that its id is not reused) and the path its module
        # has in the model.
        self.nested: dict[int, tuple[Any, tuple[str, ...]]] = {}
        # The bodies of the model's own `lax.scan`s (outside Flax's lifted
        # transforms), by the scan's Python frame: its body's trace now
        # (`_in_scan_body`).
        self.scan_traces = BodyTraces(session)
        self.scan_bodies: dict[Any, Any] = {}

    def __call__(self, next_fun, call_args, call_kwargs, context):
        module, method = context.module, context.method_name
        parent = self.stack[-1] if self.stack else None
        root = module.scope.root
        if parent is not None and root is not parent.root:
            if not self._lifted(parent) and _is_nested_apply(module):
                self.nested[id(root)] = (root, (*parent.path, module.name))
            elif id(root) not in self.nested:
                self._entering_lifted_scope(parent, module, method, body_of(context))
        _, prefix = self.nested.get(id(root), (None, ()))
        path = (*prefix, *module.path)
        frame = _Frame(module, root, path, BodyTraces(self.session))
        self.stack.append(frame)
        try:
            return self._call(next_fun, call_args, call_kwargs, module, method, frame)
        except ValueError as error:
            # Flax refuses, after tracing a lifted body, a recording in
            # broadcast `params`: the transform this call entered last.
            transform = refused.broadcasting(error) if self.in_params else None
            if transform is None or not frame.entered:
                raise
            raise refused.Broadcasts(frame.entered[-1], transform) from error
        finally:
            self.stack.pop()

    def _call(self, next_fun, call_args, call_kwargs, module, method, frame):
        def run():
            return guests.call_module("linen", module, next_fun, call_args, call_kwargs)

        if (
            frame.path == ()
            or method == "setup"
            or (method.startswith("_") and method != "__call__")
        ):
            return run()  # a root `nnx.bridge.ToLinen`'s NNX submodules are sites
        return self._site(run, call_args, module, method, frame)

    def tap(self, name: str, value: Any) -> Any:
        """`bridge.tap` in the model's code. Inside a lifted transform it is a
        site of the calling module's, carried out and perturbed through its
        scope as the module's own calls are (a value there belongs to the
        transform's trace); elsewhere the session's own."""
        if not self.stack or not self._lifted(self.stack[-1]):
            return self._tap_outside_lifted(name, value)
        frame = self.stack[-1]
        return self._site(lambda: value, (), frame.module, "__call__", frame, name)

    def _in_scan_body(self) -> None:
        """A call outside Flax's lifted transforms, maybe inside a `lax.scan`
        of the model's own code: where JAX traces the scan's body again (its
        carry starts as a Python `0` that the body turns into a float), the
        calls of the discarded trace are forgotten, so a site there is one,
        never a phantom `#1` (a refused site is listed whatever trace JAX
        keeps). The body's trace is the innermost scan's, told by the frame of
        the `lax.scan` running it."""
        scan = jax_internals.scan_call(self.stop)
        if scan is None:
            return
        body = next(
            (
                t
                for t in unexpressible.traces(self.base)
                if unexpressible.name(t) in unexpressible.SCANS
            ),
            None,
        )
        first = self.scan_bodies.setdefault(scan, body)
        if first is body:
            if scan not in set(self.scan_traces):
                self.scan_traces.begin(scan)
        else:  # the same scan's body, traced again
            self.scan_traces.again(scan)
            self.scan_bodies[scan] = body

    def _tap_outside_lifted(self, name: str, value: Any) -> Any:
        """A `bridge.tap` outside Flax's lifted transforms: the session's own
        where the model's trace holds it, handed out of the model's own
        `jax.vmap`s (mapped axes first), else listed and refused."""
        session = self.session
        self._in_scan_body()
        depth = lifting.mapped_depth(self.base)
        if depth == 0:
            return session.tap_here(name, value)
        if depth is not None:
            return lifting.lift(
                value, depth, lambda full: session.tap_here(name, full)
            )
        scope = self.stack[-1].path if self.stack else ()
        path = session.naming.under_enclosing(name)
        return self._unreachable(lambda: value, (), None, None, path, scope)

    def _unreachable(self, run, call_args, module, method, path, scope) -> Any:
        """A call (or a tap) inside a JAX transform of the model's own code
        that gives its value no route out (`jax.checkpoint`, `lax.scan`,
        `lax.cond`): listed with its whole value, run as it is, refused where
        selected or patched, naming the transform (`refused.RAW_REFUSALS`)."""
        session = self.session
        names = [unexpressible.name(t) for t in unexpressible.traces(self.base)]
        transform = refused.raw_transform(names)
        shown = refused.JAX_NAMES.get(transform, transform)
        if transform_call() is not None:
            # A Linen module the model closes over, called in a lifted
            # transform's body (`nn.cond(pred, lambda _, x: self.left(x), ...)`):
            # the transform is the model's `nn.cond`.
            loop = unexpressible.LOOPS_AND_BRANCHES.get(transform)
            shown = refused.LINEN_NAMES.get(loop, shown)
        call = session.enter(
            path, method, module, call_args, origin=_Origin(scope), record=False
        )
        why, fix = refused.RAW_REFUSALS.get(transform, refused.RAW_REFUSAL)
        where = " inside ".join(refused.JAX_NAMES.get(n, n) for n in names)
        call.origin = _Origin(
            scope,
            blocked=unexpressible.reason(
                call.name,
                shown,
                f"{why} (it runs inside {where})",
                fix,
            ),
        )
        return unexpressible.listed(session, call, run(), self.base, self.stop)

    def _mapped(self, run, call_args, module, method, frame, depth: int) -> Any:
        """A call inside `depth` of the model's own `jax.vmap`s (outside
        Flax's lifted transforms): the site holds the mapped value, mapped
        axes first, handed out to the model's trace and back
        (`bridge.adapters.shared.lifting`), where its epsilon is added."""
        session = self.session
        path = frame.path
        given = id(frame.root) in self.nested
        in_session = guests.wraps_guest("linen", module) or given
        entered = []

        def enter(full_args: tuple) -> tuple:
            entered.append(
                session.enter(
                    "/".join(path),
                    None if method == "__call__" else method,
                    module,
                    full_args,
                    origin=_Origin(path, False, in_session, None, given),
                )
            )
            return full_args

        if session.with_inputs:
            lifting.lift(call_args, depth, enter)
        else:
            enter(())
        (call,) = entered
        value = run()
        if not session.recorder.needs_value(call.name):
            return session.exit(call, value)

        def perturb(value):
            unperturbed = differentiable_part(value)
            floats = module.perturb(
                carrier_name("epsilon", method, call.index, None),
                unperturbed,
                collection=EPSILON_COLLECTION,
            )
            _check_perturbed(floats, unperturbed, call.name)
            return merge_differentiable(value, floats)

        return lifting.lift(
            value,
            depth,
            lambda full: session.exit(call, full, None if in_session else perturb),
        )

    def _lifted(self, frame: _Frame) -> bool:
        """Whether `frame`'s call runs inside a lifted transform: in a scope
        root other than the model's and its own `apply`s'."""
        return frame.root is not self.stack[0].root and id(frame.root) not in (
            self.nested
        )

    def lifted_transform(self) -> str | None:
        """The lifted transform the call running now is inside, if any: where a
        module of another library called there cannot be a site."""
        if self.stack and self._lifted(self.stack[-1]):
            return self.transform
        return None

    def _entering_lifted_scope(
        self, parent: _Frame, module: Any, method: str, body: Any
    ) -> None:
        transform = entering_linen_lifted_scope(parent.bodies, module, method, body)
        if transform is not None:
            self.transform = transform
        # Which of `parent`'s lifted transform calls this is: a functional
        # transform's module is of the class of the module it was given
        # (`nn.remat(f)(self, x)` and `nn.vmap(g)(self, x)` both run a clone
        # of `self`), so only the order tells them apart; a repeated trace of
        # one call is the same transform.
        call = transform_call()
        if call is None:
            index = len(parent.entered)
        else:
            index = next((i for i, c in enumerate(parent.calls) if c is call), None)
            if index is None:
                index = len(parent.calls)
                parent.calls.append(call)
        key = (parent.path, type(module).__qualname__, index)
        parent.entered.append(key)
        broadcast = self.broadcasting.get(key)
        if broadcast is not None:
            trace = jax_internals.current_trace()
            self.broadcast_traces[id(trace)] = (trace, broadcast)

    def _blocked(self, frame: _Frame, module: Any, carried: bool) -> str | None:
        """The transform that holds this call where bridge cannot express it
        (innermost first: a loop, a branch, a transform broadcasting
        `params`, one that carries neither bridge's collections nor
        `params`), or `None`. Asked by discovery only: a run never selects
        or patches such a call."""

        def broadcasting(trace: Any) -> str | None:
            found = self.broadcast_traces.get(id(trace))
            return None if found is None else found[1]

        transform = unexpressible.innermost_loop_or_branch(self.base, broadcasting)
        if transform is not None:
            return refused.LINEN_NAMES.get(transform, transform)
        if (
            self._lifted(frame)
            and not carried
            and self.in_params
            and not module.is_mutable_collection("params")
        ):
            return self.transform
        return None

    def _refused(self, run, call_args, module, method, frame, tap, transform):
        """A call bridge cannot express inside `transform`: listed with its
        whole value, run as it is (see `bridge.adapters.shared.unexpressible`)."""
        session = self.session
        path = frame.path
        call = session.enter(
            "/".join(path if tap is None else (*path, tap)),
            None if method == "__call__" else method,
            module if tap is None else None,
            call_args,
            origin=_Origin(path, tap=tap),
            record=False,
        )
        why, fix = refused.REFUSALS.get(
            transform,
            (
                "it carries neither bridge's collections nor `params`, so a "
                "perturbation there would be silently dropped",
                "move the call out of it",
            ),
        )
        call.origin = _Origin(
            path, tap=tap, blocked=unexpressible.reason(call.name, transform, why, fix)
        )
        return unexpressible.listed(session, call, run(), self.base, self.stop)

    def _site(self, run, call_args, module, method, frame, tap=None):
        """The call `run()` of `module`'s `method` as a site; a `bridge.tap`
        named `tap` inside the call of `frame`."""
        session = self.session
        path = frame.path
        lifted = self._lifted(frame)
        carried = not lifted or module.is_mutable_collection(RECORDING_COLLECTION)
        if not lifted:
            self._in_scan_body()
        in_params = not carried and self.in_params
        if session.recorder.learns_sites():
            transform = self._blocked(frame, module, carried)
            if transform is not None:
                return self._refused(
                    run, call_args, module, method, frame, tap, transform
                )
        if not lifted:
            depth = lifting.mapped_depth(self.base)
            if depth is None:
                return self._unreachable(
                    run,
                    call_args,
                    module,
                    None if method == "__call__" else method,
                    "/".join(path),
                    path,
                )
            if depth:
                return self._mapped(run, call_args, module, method, frame, depth)
        if not carried and not (in_params and module.is_mutable_collection("params")):
            if not self.in_params:
                session.recorder.fall_back()  # discovery: again, in `params`
            # A site of this module (or this tap of its) is to leave it: the
            # taps of a functional transform's clone of the model all have
            # scope `()`, so a tap is told by its name.
            if session.carrier.carries_out_any(
                lambda site: (
                    isinstance(site.origin, _Origin)
                    and site.origin.scope == path
                    and site.origin.tap == tap
                )
            ):
                where = "/".join(path if tap is None else (*path, tap))
                raise BridgeValueError(
                    f"bridge cannot see through {self.transform} around "
                    f"'{where}': it carries neither bridge's collections "
                    "nor `params`, so a perturbation there would be silently "
                    "dropped. Select sites outside it."
                )
        # Neither a `ToLinen` nor an `apply` the model makes passes bridge's
        # collection on: their epsilon is the session's.
        given = id(frame.root) in self.nested
        in_session = not in_params and (guests.wraps_guest("linen", module) or given)
        call = session.enter(
            "/".join(path if tap is None else (*path, tap)),
            None if method == "__call__" else method,
            module if tap is None else None,
            call_args,
            origin=_Origin(path, in_params, in_session, tap, given),
            record=not lifted,
        )
        value = run()
        patch = None
        if in_params and call.name in session.carrier.patched_with_values():
            patch = module.scope.get_variable(
                "params", carrier_name("patch", method, call.index, tap)
            )

        def perturb(value):
            unperturbed = differentiable_part(value)
            floats = module.perturb(
                carrier_name("epsilon", method, call.index, tap),
                unperturbed,
                collection="params" if in_params else EPSILON_COLLECTION,
            )
            _check_perturbed(floats, unperturbed, call.name)
            return merge_differentiable(value, floats)

        value = session.exit(
            call,
            value,
            None if in_session else perturb,
            record=not lifted,
            patch=patch,
        )
        carrier = session.carrier
        if lifted and carrier.carries_out(call.name):
            key = carrier_name("recording", method, call.index, tap)
            module.scope.put_variable(
                "params" if in_params else RECORDING_COLLECTION,
                key,
                carrier.to_carry_out(value, call_args),
            )
            carrier.defer(call.name, (in_params, path, key))
        return value
