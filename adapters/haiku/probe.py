"""dm-haiku: an epsilon read from Haiku state, added by `hk.intercept_methods`.

Every module method call passes through an interceptor, installed around
`apply` from outside, that reports it to the probe's session. At a selected
call of an `hk.transform_with_state` model the interceptor adds
`hk.get_state(...)` to the call's output: the epsilons travel in the state
passed to `apply`, in the module's own state bundle (keyed like its params),
so Haiku threads them wherever it threads state, and the gradient with respect
to those state entries is the activation gradient. They are stripped from the
state `apply` returns.

Haiku refuses state inside a plain `hk.transform` (`NonEmptyStateError`), so
there the epsilon comes from the probe's session instead: the same interceptor
adds it from a closure. Both give the same numbers; the state route is kept
where Haiku allows it because it is Haiku's own way to feed a value into a
module call.

Haiku's transforms run a module's call inside a JAX transform, where a value
seen by the interceptor is a tracer of the inner trace; they are recognised
on the Python call stack. Inside `hk.experimental.layer_stack`, `hk.remat`
(and `hk.jit`) and `hk.scan`, epsilons ride in with state and recordings leave
with `hk.set_state`, so a site there is a real site: a layer stack slices
state per layer going in and stacks it coming out (its sites hold every layer,
`(layers, *value shape)`); `hk.remat` threads it through; `hk.scan` carries it,
so the carry holds the whole stacked epsilon and recording and a step counter
picks the iteration's row (sites hold every iteration, in the order of `xs`).
A patch value there is given in the site's stacked shape and rides in state
beside the epsilon, so each layer or iteration takes its row; a patch
function is applied per layer or iteration; `with_inputs=True` records each
one's positional inputs, stacked like the values. A plain `hk.transform`
model with such a site runs as the `hk.transform_with_state` of the function
it wraps (Haiku keeps it on `apply`). `hk.fori_loop`, `hk.while_loop`,
`hk.vmap`, `hk.cond`, `hk.switch` and a user's `hk.lift` carry state as one
value for every iteration or example: selecting or patching a site inside
them raises, naming the transform.

The state route is `bridge.adapters.haiku.transforms`; reading the enclosing
transforms off the call stack, the one use of Haiku's internals, is
`bridge.adapters.haiku.internals`.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Mapping
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

from bridge.adapter_api import (
    BodyTraces,
    BridgeTypeError,
    BridgeValueError,
    ProbeBase,
    Session,
    Site,
    add_epsilon,
    carrier_name,
    is_array,
    is_carrier_name,
)

from ..shared import guests as _guests
from ..shared import jax_internals, unexpressible
from . import internals, jax_transforms
from . import transforms as haiku_state

_PLAIN_USAGE = (
    "bridge.probe(transformed, params) with params = transformed.init(rng, x)"
)
_STATE_USAGE = (
    "bridge.probe(transformed, params, state) with params, state = "
    "transformed.init(rng, x)"
)


def probe(
    transformed: hk.Transformed | hk.TransformedWithState,
    *variables: Any,
    vmap: bool = False,
) -> HaikuProbe:
    with_state = isinstance(transformed, hk.TransformedWithState)
    if len(variables) == 1 and _is_params_and_state(variables[0]):
        raise BridgeTypeError(
            "bridge.probe got the (params, state) pair that "
            "hk.transform_with_state's init returns as one argument: unpack it, "
            f"{_STATE_USAGE}: bridge.probe(transformed, *variables)."
        )
    if with_state:
        if len(variables) != 2:
            raise BridgeTypeError(
                "An hk.transform_with_state model needs its params and its state: "
                f"{_STATE_USAGE}; got {len(variables)} variable arguments."
            )
        params, state = variables
        _check_mapping("state", state, _STATE_USAGE)
        _check_reserved(state)
    else:
        if len(variables) != 1:
            hint = (
                " An hk.transform model has no state: if it uses hk.get_state or "
                "hk.set_state, transform it with hk.transform_with_state and pass "
                "bridge.probe(transformed, params, state)."
                if len(variables) > 1
                else ""
            )
            raise BridgeTypeError(
                f"An hk.transform model needs its params: {_PLAIN_USAGE}; got "
                f"{len(variables)} variable arguments.{hint}"
            )
        (params,) = variables
        state = None
    _check_mapping("params", params, _STATE_USAGE if with_state else _PLAIN_USAGE)
    return HaikuProbe(transformed, params, state, _takes_rng(transformed), vmap)


@jax.tree_util.register_pytree_node_class
class HaikuProbe(ProbeBase):
    """A Haiku transformed function with its params (and state).

    See `bridge.ActivationProbe`. `rng=` given to `value_and_grad`, `apply` or
    `sites` goes to the transformed function's `apply`.
    """

    #: What `bridge.transfer` and `bridge.compare` know of this library.
    porting_side = "bridge.adapters.haiku.porting"

    #: The transformed functions are in the treedef, params and state are
    #: leaves, and an origin is a state bundle's name and flags: a discovery
    #: is reused by structure.
    reuses_discovery = True

    def __init__(
        self,
        transformed: hk.Transformed | hk.TransformedWithState,
        params: Mapping,
        state: Mapping | None,
        takes_rng: bool,
        vmap: bool = False,
    ):
        self.transformed = transformed
        self.params = params
        self.state = state
        self.takes_rng = takes_rng
        self.vmap = vmap

    @property
    def with_state(self) -> bool:
        return self.state is not None

    def tree_flatten(self):
        static = (self.transformed, self.takes_rng, self.vmap, self._inside)
        return (self.params, self.state), static

    @classmethod
    def tree_unflatten(cls, static, children):
        transformed, takes_rng, vmap, inside = static
        params, state = children
        probe = cls(transformed, params, state, takes_rng, vmap)
        return probe._looking_inside(inside)

    def __repr__(self) -> str:
        kind = "transform_with_state" if self.with_state else "transform"
        return f"HaikuProbe({kind}, vmap={self.vmap})"

    def _trainable(self) -> Any:
        return self.params

    def _check_call(self, args: tuple, kwargs: dict) -> None:
        if "rng" in kwargs and not self.takes_rng:
            raise BridgeTypeError(
                "`rng` goes to the transformed function's apply, but this one was "
                "made with hk.without_apply_rng and takes no rng. Drop `rng=`, or "
                "transform the model without hk.without_apply_rng."
            )

    @_guests.hosted("haiku")
    def _run(
        self, trainable: Any, args: tuple, kwargs: dict, session: Session
    ) -> tuple[Any, Any]:
        unexpressible.refuse_patched(session)
        placed = haiku_state.placed(session)
        if self.with_state:
            return self._apply(trainable, args, kwargs, session, True, placed)
        return session.run_with_fallback(
            lambda state_route: self._apply(
                trainable, args, kwargs, session, state_route, placed
            ),
            haiku_state.NeedsState,
            lambda origin: origin.lifted,
        )

    def _apply(
        self,
        trainable: Any,
        args: tuple,
        kwargs: dict,
        session: Session,
        state_route: bool,
        placed: Mapping[str, Site],
    ) -> tuple[Any, Any]:
        model_kwargs = {k: v for k, v in kwargs.items() if k != "rng"}
        leading = (kwargs.get("rng"),) if self.takes_rng else ()
        # Haiku's transforms around a call are read off the stack up to this
        # frame: what runs the probe (a user's jit, a scan of it) is not the
        # model's.
        here = sys._getframe()
        interceptor = _Interceptor(session, state_route, placed, here)
        tapping = session.taps.tapping(
            haiku_state.tap_handler(session, here, interceptor.base, interceptor.tap)
        )
        if not state_route:  # a plain transform: epsilons from the session
            with tapping, hk.intercept_methods(interceptor):
                outputs = self.transformed.apply(
                    trainable, *leading, *args, **model_kwargs
                )
            return outputs, None
        transformed = (
            self.transformed
            if self.with_state
            else haiku_state.with_state(self.transformed, self.takes_rng)
        )
        state = haiku_state.with_epsilons(self.state or {}, session, placed)
        with tapping, hk.intercept_methods(interceptor):
            outputs, new_state = transformed.apply(
                trainable, state, *leading, *args, **model_kwargs
            )
        # The values recorded inside lifted transforms, as they leave them in
        # state (stacked over a layer stack's layers).
        session.carrier.hand_over(lambda where: new_state[where[0]][where[1]])
        new_state = haiku_state.without_epsilons(new_state)
        if self.with_state:
            return outputs, new_state
        if new_state:
            raise BridgeValueError(  # what Haiku's own plain apply refuses too
                "The model uses hk.get_state or hk.set_state, so it needs "
                "hk.transform_with_state: pass bridge.probe(transformed, params, "
                "state) with params, state = transformed.init(rng, x)."
            )
        return outputs, None

    # -- taking the model out (`ActivationProbe.unwrap`) -------------------------

    def unwrap(self) -> tuple:
        """`(transformed, params)`, or `(transformed, params, state)` for
        `hk.transform_with_state`, what `bridge.probe` takes: the probe's
        params and state (after `bridge.transfer`, the ported ones) in
        containers of their own, so that changing them changes no probe."""
        params, state = jax.tree.map(lambda leaf: leaf, (self.params, self.state))
        if self.with_state:
            return self.transformed, params, state
        return self.transformed, params


class _Interceptor:
    """Reports every module method call of one `apply` to the session.

    Inside `hk.experimental.layer_stack` a module's name is relative to the
    layer (`lin`); the site is named like its params,
    `__layer_stack_no_per_layer/lin`, with the name of the `LiftingModule` the
    stack calls first. A site there holds every layer stacked: its epsilon and
    recording live in state, which the stack slices per layer going in and
    stacks coming out; so does a patch value for it (`placed`). A repeated
    trace of a stack's body re-uses the names of the first.
    """

    def __init__(
        self,
        session: Session,
        state_route: bool,
        placed: Mapping[str, Site],
        apply_frame: Any,
    ):
        self.session = session
        self.apply_frame = apply_frame  # where the walks up the stack stop
        self.base = jax_internals.current_trace()  # the trace of that apply
        self.state_route = state_route
        self.placed = placed  # sites whose patch value rides in state
        self.prefixes: dict[Any, str] = {}  # `_LayerStack.__call__` frame -> name
        self.traces = BodyTraces(session)  # of each stack's body, by stack call
        self.bodies: dict[Any, Any] = {}  # each stack's body frame traced last
        # Each `lax.scan` frame of the model's own code -> its body's trace.
        self.scan_bodies: dict[Any, Any] = {}

    def __call__(self, next_fun, call_args, call_kwargs, context):
        if not is_site(context):
            return next_fun(*call_args, **call_kwargs)
        module = context.module
        if self.session.batch_axis is not None:
            _check_batch_norm_mapped(module, self.session.batch_axis)
        where = internals.enclosing(self.apply_frame)
        prefix = self.prefixes.get(where.stack_call, "")
        if internals.is_lifting(module):
            # Returns the lifted params, not an activation: not a site.
            value = next_fun(*call_args, **call_kwargs)
            caller = internals.layer_stack_caller()
            if caller is not None:
                self.prefixes[caller] = _joined(prefix, module.module_name)
                self.traces.begin(caller)
            return value
        if where.body is not None:
            first = self.bodies.setdefault(where.stack_call, where.body)
            if first is not where.body:  # the stack's body traced again
                self.traces.again(where.stack_call)
                self.bodies[where.stack_call] = where.body
        return self._site(
            lambda: next_fun(*call_args, **call_kwargs),
            call_args,
            module,
            context.method_name,
            where,
            _joined(prefix, module.module_name),
        )

    def tap(self, name: str, value: Any, where: Any) -> Any:
        """`bridge.tap` inside a layer stack, `hk.scan` or `hk.remat`: a site
        named under the module calling it, whose state bundle holds its
        values (see `carrier_name`'s `tap`)."""
        enclosing = self.session.enclosing
        if enclosing:
            path = f"{enclosing[-1]}/{name}"
        else:  # in the stack's body, outside any module: named like its params
            path = _joined(self.prefixes.get(where.stack_call, ""), name)
        return self._site(lambda: value, (), None, "__call__", where, path, name)

    def _site(self, run, call_args, module, method, where, name, tap=None):
        """The call `run()` of `module`'s `method`, named `name`, as a site;
        a `bridge.tap` named `tap` inside the module running now."""
        session = self.session
        prefix = self.prefixes.get(where.stack_call, "")
        bundle = _joined(prefix, hk.experimental.current_name())
        if where.blocked is None and not where.lifted:
            # JAX's own transforms in the model's code (Haiku's name none).
            depth, blocker = jax_transforms.around(self.base)
            if blocker is not None:
                where = dataclasses.replace(where, blocked=blocker)
                self._scan_body_traced()
            elif depth:
                origin = haiku_state.Origin(bundle, tap=tap)
                return self._mapped(run, call_args, module, method, name, origin, depth)
        if where.blocked is not None:
            # Listed, and refused where selected or patched.
            origin = haiku_state.Origin(bundle, tap=tap)
            call = session.enter(
                name,
                None if method == "__call__" else method,
                module,
                call_args,
                origin=origin,
                record=False,
            )
            call.origin = haiku_state.refused(origin, call.name, where.blocked)
            return unexpressible.listed(
                session, call, run(), self.base, self.apply_frame
            )
        origin = haiku_state.Origin(bundle, where.lifted, scan=where.scan, tap=tap)
        if origin.lifted and not self.state_route:
            session.recorder.fall_back()  # discovery: again, through state
        inside = origin.lifted
        call = session.enter(
            name,
            None if method == "__call__" else method,
            module,
            call_args,
            origin=origin,
            record=not inside,
        )
        value = run()
        if not self.state_route:
            return session.exit(call, value)  # the session's own epsilon
        entry = carrier_name("epsilon", method, call.index, tap)
        recording_entry = carrier_name("recording", method, call.index, tap)
        patched = call.name in self.placed
        if origin.scan is not None:
            value = haiku_state.scanned(
                session, call, value, call_args, origin, method, patched
            )
            if call.name in session.selected:  # its recording rows are carried
                session.carrier.defer(call.name, (origin.bundle, recording_entry))
            return value

        def perturb(value):
            epsilon = hk.get_state(
                entry, (), jnp.float32, init=haiku_state.unreachable(call)
            )
            return add_epsilon(value, epsilon)

        patch = haiku_state.patch_from_state(call, method) if patched else None
        value = session.exit(call, value, perturb, record=not inside, patch=patch)
        carrier = session.carrier
        if origin.lifted and carrier.carries_out(call.name):
            hk.set_state(recording_entry, carrier.to_carry_out(value, call_args))
            carrier.defer(call.name, (origin.bundle, recording_entry))
        return value

    def _scan_body_traced(self) -> None:
        """A call inside a `lax.scan` of the model's own code: where JAX traces
        the scan's body again (its carry starts as a Python `0` that the body
        turns into a float), the calls of the discarded trace are forgotten,
        so the site is one, never a phantom `#1`. The body's trace is the
        innermost scan's, told by the frame of the `lax.scan` running it."""
        scan = jax_internals.scan_call(self.apply_frame)
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
            if scan not in set(self.traces):
                self.traces.begin(scan)
        else:  # the same scan's body, traced again
            self.traces.again(scan)
            self.scan_bodies[scan] = body

    def _mapped(self, run, call_args, module, method, name, origin, depth):
        """The call `run()` inside `depth` of the model's own `jax.vmap`s: a
        site at the probe's trace, its value (and inputs) handed out whole,
        mapped axes first (`jax_transforms.lift`); the session adds its
        epsilon and patch there."""
        session = self.session
        entered = []

        def enter(full_args: tuple) -> tuple:
            entered.append(
                session.enter(
                    name,
                    None if method == "__call__" else method,
                    module,
                    full_args,
                    origin=origin,
                )
            )
            return full_args

        if session.with_inputs and any(map(is_array, jax.tree.leaves(call_args))):
            # Inputs are recorded at the probe's trace too, mapped axes first.
            jax_transforms.lift(call_args, depth, enter)
        else:
            enter(())
        (call,) = entered
        value = run()
        if not session.recorder.needs_value(call.name):
            return session.exit(call, value)  # bookkeeping only
        return jax_transforms.lift(value, depth, lambda full: session.exit(call, full))


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


def _takes_rng(transformed: hk.Transformed | hk.TransformedWithState) -> bool:
    """Whether `apply` takes an rng (`hk.without_apply_rng` removes it).

    Haiku gives every apply it builds a signature; its rng parameter is named
    `rng`, after `params` (and `state`).
    """
    position = 2 if isinstance(transformed, hk.TransformedWithState) else 1
    try:
        parameters = list(inspect.signature(transformed.apply).parameters.values())
    except (TypeError, ValueError):
        return True  # not inspectable: assume Haiku's default signature
    return len(parameters) > position and parameters[position].name == "rng"


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


def _is_params_and_state(value: Any) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(part, Mapping) for part in value)
    )


def _check_mapping(name: str, value: Any, usage: str) -> None:
    if not isinstance(value, Mapping):
        hint = (
            " If you passed the (params, state) pair that "
            "hk.transform_with_state's init returns, unpack it."
            if isinstance(value, tuple)
            else ""
        )
        raise BridgeTypeError(
            f"`{name}` must be the dict of dicts that transformed.init returns "
            f"({usage}); got {type(value).__name__}.{hint}"
        )


def _check_reserved(state: Mapping) -> None:
    for bundle, entries in state.items():
        for entry in entries:
            if is_carrier_name(entry):
                raise BridgeValueError(
                    f"`state[{bundle!r}]` has an entry {entry!r}: bridge reserves "
                    "state names of the form 'bridge_<kind>:<method>#<index>' "
                    "for its own epsilons and recordings. Rename it."
                )
