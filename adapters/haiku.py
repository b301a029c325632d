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
A plain `hk.transform` model with such a site runs as the
`hk.transform_with_state` of the function it wraps (Haiku keeps it on `apply`).
`hk.fori_loop`, `hk.while_loop`, `hk.vmap`, `hk.cond`, `hk.switch` and a
user's `hk.lift` carry state as one value for every iteration or example:
selecting a site inside them raises, naming the transform.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
from collections.abc import Mapping
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

from bridge._probe import ProbeBase
from bridge._session import Session, positional_arrays
from bridge._sites import (
    Site,
    differentiable_part,
    is_array,
    merge_differentiable,
    zeros_like_struct,
)

#: Prefix of the state entries that hold the probe's epsilons. `#` and `.`
#: cannot occur in a name a Haiku module gives its own state by convention.
EPSILON_PREFIX = "bridge_epsilon."
#: Prefix of the state entries carrying recordings out of lifted transforms.
RECORDING_PREFIX = "bridge_recording."
_RESERVED = (EPSILON_PREFIX, RECORDING_PREFIX)
_STEP = ".step"

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
    if with_state:
        if len(variables) != 2:
            raise TypeError(
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
            raise TypeError(
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
    _porting = "bridge.adapters._porting_haiku"

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
        return (self.params, self.state), (self.transformed, self.takes_rng, self.vmap)

    @classmethod
    def tree_unflatten(cls, static, children):
        transformed, takes_rng, vmap = static
        params, state = children
        return cls(transformed, params, state, takes_rng, vmap)

    def __repr__(self) -> str:
        kind = "transform_with_state" if self.with_state else "transform"
        return f"HaikuProbe({kind}, vmap={self.vmap})"

    def _trainable(self) -> Any:
        return self.params

    def _check_call(self, args: tuple, kwargs: dict) -> None:
        if "rng" in kwargs and not self.takes_rng:
            raise TypeError(
                "`rng` goes to the transformed function's apply, but this one was "
                "made with hk.without_apply_rng and takes no rng. Drop `rng=`, or "
                "transform the model without hk.without_apply_rng."
            )

    def _run(
        self, trainable: Any, args: tuple, kwargs: dict, session: Session
    ) -> tuple[Any, Any]:
        session.tap = _tap_outside_transforms(session.tap)
        if self.with_state:
            return self._apply(trainable, args, kwargs, session, True)
        return session.run_with_fallback(
            lambda state_route: self._apply(
                trainable, args, kwargs, session, state_route
            ),
            _NeedsState,
            lambda origin: origin.lifted,
        )

    def _apply(
        self,
        trainable: Any,
        args: tuple,
        kwargs: dict,
        session: Session,
        state_route: bool,
    ) -> tuple[Any, Any]:
        model_kwargs = {k: v for k, v in kwargs.items() if k != "rng"}
        leading = (kwargs.get("rng"),) if self.takes_rng else ()
        interceptor = _Interceptor(session, state_route)
        if not state_route:  # a plain transform: epsilons from the session
            with hk.intercept_methods(interceptor):
                outputs = self.transformed.apply(
                    trainable, *leading, *args, **model_kwargs
                )
            return outputs, None
        transformed = self.transformed if self.with_state else _with_state(self)
        state = _with_epsilons(self.state or {}, session.selected, session.epsilons)
        with hk.intercept_methods(interceptor):
            outputs, new_state = transformed.apply(
                trainable, state, *leading, *args, **model_kwargs
            )
        interceptor.hand_over(new_state)
        new_state = _without_epsilons(new_state)
        if self.with_state:
            return outputs, new_state
        if new_state:
            raise ValueError(  # what Haiku's own plain apply refuses too
                "The model uses hk.get_state or hk.set_state, so it needs "
                "hk.transform_with_state: pass bridge.probe(transformed, params, "
                "state) with params, state = transformed.init(rng, x)."
            )
        return outputs, None


def _with_state(probe: HaikuProbe) -> hk.TransformedWithState:
    """The plain transform's function under `hk.transform_with_state`, so that
    epsilons and recordings can ride in state through a lifted transform.

    `hk.transform` is `hk.without_state(hk.transform_with_state(f))`; Haiku
    keeps `f` on `apply` as `_original_fn` (marked experimental there).
    """
    apply = probe.transformed.apply
    original = getattr(apply, "_original_fn", None)
    code = getattr(apply, "__code__", None)
    # Haiku's own `apply` only: a wrapper that copied `_original_fn` with
    # `functools.wraps` may compute something else.
    if (
        original is None
        or code is None
        or not code.co_filename.startswith(_HAIKU_SOURCE)
    ):
        raise NotImplementedError(
            "Sites inside hk.experimental.layer_stack, hk.scan or hk.remat of a "
            "plain hk.transform model need the function it wraps, which this "
            "Transformed's apply does not expose (it is not Haiku's own). "
            "Transform the model with hk.transform_with_state and pass "
            "bridge.probe(transformed, params, state)."
        )
    transformed = hk.transform_with_state(original)
    return transformed if probe.takes_rng else hk.without_apply_rng(transformed)


class _NeedsState(Exception):
    """Discovery of a plain transform met a site inside a lifted transform: run
    it again with the epsilons and recordings in state."""


@dataclasses.dataclass(frozen=True)
class _Origin:
    """Where a Haiku site's epsilon and recording live.

    `bundle` is the state bundle, keyed like the module's params as `apply`
    sees them (`__layer_stack_no_per_layer/lin`). `lifted` is true inside
    `layer_stack`, `hk.scan`, `hk.remat` or `hk.jit`, whose values must leave
    through state; `blocked` names a transform whose values cannot leave it
    per call. Inside `hk.scan`, whose state is one carry for every iteration,
    `scan` is `(length, reverse)`: the carry holds the whole stacked epsilon
    and recording, and a step counter picks the iteration's row.
    """

    bundle: str
    lifted: bool = False
    blocked: str | None = None
    scan: tuple[int, bool] | None = None


#: Haiku's own source, to recognise its transforms on the Python call stack.
_HAIKU_SOURCE = os.path.dirname(hk.__file__) + os.sep
_JAX_SOURCE = os.path.dirname(jax.__file__) + os.sep
_LAYER_STACK_CALL = "_LayerStack.__call__"
_LAYER_STACK_BODY = "_LayerStack.__call__.<locals>.layer"
_INNER_APPLY = "transform_with_state.<locals>.apply_fn"
#: `hk.remat` and `hk.jit` thread state in and out of the JAX transform: state
#: set inside comes out, unstacked, as for a call outside.
_THREADS_STATE = "thread_hk_state_in_kwargs"
_TRANSFORM_NAMES = {
    "scan": "hk.scan",
    "fori_loop": "hk.fori_loop",
    "while_loop": "hk.while_loop",
    "vmap": "hk.vmap",
    "stateful_branch": "hk.cond",
    "with_output_structure_hint": "hk.cond",
    "switch": "hk.switch",
    "grad": "hk.grad",
    "value_and_grad": "hk.value_and_grad",
}


@dataclasses.dataclass
class _Enclosing:
    """The Haiku transforms around a call, read from the Python call stack."""

    body: Any = None  # the innermost layer stack body's frame
    stack_call: Any = None  # the `_LayerStack.__call__` frame that runs it
    lifted: bool = False
    blocked: str | None = None
    scan: tuple[int, bool] | None = None


def _qualnames() -> dict[Any, str]:
    """`{code object: qualified name}` for Haiku's transforms: what
    `code.co_qualname` gives from Python 3.11, built here for 3.10."""
    table: dict[Any, str] = {}

    def walk(code: Any, qualname: str) -> None:
        table[code] = qualname
        for const in code.co_consts:
            if inspect.iscode(const):
                walk(const, f"{qualname}.<locals>.{const.co_name}")

    for name in ("stateful", "layer_stack", "transform"):
        module = sys.modules.get(f"haiku._src.{name}")
        for value in vars(module).values() if module else ():
            functions = vars(value).values() if inspect.isclass(value) else [value]
            for function in functions:
                function = inspect.unwrap(function) if callable(function) else None
                if inspect.isfunction(function):
                    walk(function.__code__, function.__qualname__)
    return table


_QUALNAMES = _qualnames()


def _qualname(code: Any) -> str:
    return getattr(code, "co_qualname", None) or _QUALNAMES.get(code, code.co_name)


def _enclosing(stop: Any) -> _Enclosing:
    """Haiku's transforms run the body from their own frames; walk up to the
    probe's `apply` (`stop`, a code object) and name them."""
    found = _Enclosing()
    inner_applies = layer_bodies = scans = 0
    scan_frame = None
    frame = sys._getframe(2)
    while frame is not None and frame.f_code is not stop:
        code = frame.f_code
        if code.co_filename.startswith(_HAIKU_SOURCE):
            qualname = _qualname(code)
            if qualname == _LAYER_STACK_BODY:
                layer_bodies += 1
                found.lifted = True
                if found.body is None:
                    found.body = frame
            elif qualname == _LAYER_STACK_CALL and found.stack_call is None:
                # The stack whose body runs this call, not one being entered.
                if found.body is not None:
                    found.stack_call = frame
            elif qualname == _INNER_APPLY:
                inner_applies += 1
            elif code.co_filename.endswith("stateful.py") and qualname == "scan":
                scan_frame = scan_frame or frame
            elif code.co_filename.endswith("stateful.py") and "<locals>" in qualname:
                outer = qualname.split(".")[0]
                if outer == _THREADS_STATE:
                    found.lifted = True
                elif outer == "scan":
                    scans += 1
                elif found.blocked is None and outer in _TRANSFORM_NAMES:
                    found.blocked = _TRANSFORM_NAMES[outer]
        frame = frame.f_back
    # One `apply_fn` is the probe's own, one more each layer_stack body's; any
    # other is an inner transform the user lifted, whose state is their own.
    if found.blocked is None and inner_applies > 1 + layer_bodies:
        found.blocked = "hk.lift"
    if scans and found.blocked is None:
        if scans > 1 or layer_bodies or scan_frame is None:
            # A per-iteration counter in a carry sliced per layer, or in two
            # nested carries, is not built here.
            found.blocked = "hk.scan"
        else:
            # hk.scan's own arguments, `length` as apply computes it.
            local = scan_frame.f_locals
            found.lifted = True
            found.scan = (int(local["length"]), bool(local["reverse"]))
    return found


class _Interceptor:
    """Reports every module method call of one `apply` to the session.

    Inside `hk.experimental.layer_stack` a module's name is relative to the
    layer (`lin`); the site is named like its params,
    `__layer_stack_no_per_layer/lin`, with the name of the `LiftingModule` the
    stack calls first. A site there holds every layer stacked: its epsilon and
    recording live in state, which the stack slices per layer going in and
    stacks coming out. A repeated trace of a stack's body re-uses the names of
    the first.
    """

    def __init__(self, session: Session, state_route: bool):
        self.session = session
        self.state_route = state_route
        self.prefixes: dict[Any, str] = {}  # `_LayerStack.__call__` frame -> name
        self.checkpoints: dict[Any, Any] = {}
        self.bodies: dict[Any, Any] = {}
        self.deferred: dict[str, tuple[str, str, int]] = {}

    def __call__(self, next_fun, call_args, call_kwargs, context):
        if not _is_site(context):
            return next_fun(*call_args, **call_kwargs)
        module = context.module
        where = _enclosing(_APPLY_CODE)
        prefix = self.prefixes.get(where.stack_call, "")
        if _is_lifting(module):
            # Returns the lifted params, not an activation: not a site.
            value = next_fun(*call_args, **call_kwargs)
            caller = _layer_stack_caller()
            if caller is not None:
                self.prefixes[caller] = _joined(prefix, module.module_name)
                self.checkpoints[caller] = self.session.checkpoint()
            return value
        if where.body is not None:
            first = self.bodies.setdefault(where.stack_call, where.body)
            if first is not where.body:  # the stack's body traced again
                self.session.restore(self.checkpoints[where.stack_call])
                self.bodies[where.stack_call] = where.body
        return self._site(next_fun, call_args, call_kwargs, context, where, prefix)

    def _site(self, next_fun, call_args, call_kwargs, context, where, prefix):
        session, module, method = self.session, context.module, context.method_name
        name = _joined(prefix, module.module_name)
        origin = _Origin(
            _joined(prefix, hk.experimental.current_name()),
            where.lifted and where.blocked is None,
            where.blocked,
            where.scan if where.blocked is None else None,
        )
        if origin.lifted and session.discovering and not self.state_route:
            raise _NeedsState
        inside = origin.lifted or origin.blocked is not None
        call = session.enter(
            name,
            None if method == "__call__" else method,
            module,
            call_args,
            origin=origin,
            record=not inside,
        )
        if inside and not session.discovering:
            _check_reachable(call.name, origin, session)
        value = next_fun(*call_args, **call_kwargs)
        if not self.state_route:
            return session.exit(call, value)  # the session's own epsilon
        entry = _state_entry(method, call.index)
        if origin.scan is not None:
            return self._scanned(call, value, origin, method)

        def perturb(value):
            epsilon = hk.get_state(entry, (), jnp.float32, init=_unreachable(call))
            floats = jax.tree.map(
                lambda v, e: v + e, differentiable_part(value), epsilon
            )
            return merge_differentiable(value, floats)

        value = session.exit(call, value, perturb, record=not inside)
        if origin.lifted and (session.discovering or call.name in session.selected):
            inputs = positional_arrays(call_args) if session.with_inputs else None
            recording = value if session.discovering else differentiable_part(value)
            hk.set_state(_recording_entry(method, call.index), (recording, inputs))
            self.deferred[call.name] = (origin.bundle, method, call.index)
        return value

    def _scanned(self, call: Any, value: Any, origin: _Origin, method: str) -> Any:
        """A call inside `hk.scan`: the carried state holds the site's whole
        stacked epsilon and recording; a carried step counter picks the row."""
        session, (length, reverse) = self.session, origin.scan
        if session.discovering:
            value = session.exit(call, value, record=False)
            stacked = jax.tree.map(
                lambda v: jnp.broadcast_to(v, (length, *jnp.shape(v))),
                jax.tree.map(lambda v: v if is_array(v) else None, value),
            )
            session.restructure(call.name, stacked)
            return value
        if call.name not in session.selected:
            return session.exit(call, value, record=False)
        recording = _recording_entry(method, call.index)
        step = hk.get_state(recording + _STEP)
        row = length - 1 - step if reverse else step

        def perturb(value):
            epsilon = hk.get_state(_state_entry(method, call.index))
            floats = jax.tree.map(
                lambda v, e: v + e[row], differentiable_part(value), epsilon
            )
            return merge_differentiable(value, floats)

        value = session.exit(call, value, perturb, record=False)
        rows, _ = hk.get_state(recording)
        rows = jax.tree.map(
            lambda r, v: r.at[row].set(v), rows, differentiable_part(value)
        )
        hk.set_state(recording, (rows, None))
        hk.set_state(recording + _STEP, step + 1)
        self.deferred[call.name] = (origin.bundle, method, call.index)
        return value

    def hand_over(self, state: Mapping) -> None:
        """Give the session the values recorded inside lifted transforms, as
        they leave them in state (stacked over a layer stack's layers)."""
        for name, (bundle, method, index) in self.deferred.items():
            value, inputs = state[bundle][_recording_entry(method, index)]
            if self.session.discovering:
                self.session.restructure(name, value)
            else:
                self.session.record(name, value, inputs)


def _check_reachable(name: str, origin: _Origin, session: Session) -> None:
    if name not in session.selected and name not in session.patches:
        return
    if origin.blocked is not None:
        raise ValueError(
            f"bridge cannot see through {origin.blocked} around site {name!r}: "
            f"Haiku carries state through {origin.blocked} as one value for "
            "every iteration (or mapped example), so one epsilon would serve "
            "them all and their gradients would be summed. Select sites outside "
            "it with `at=`; a stack of layers written with "
            "hk.experimental.layer_stack is supported."
        )
    if name in session.patches:
        raise NotImplementedError(
            f"Site {name!r} is inside hk.experimental.layer_stack, hk.scan or "
            "hk.remat, where bridge does not patch yet. Patch a site outside it."
        )
    if origin.scan is not None and session.with_inputs:
        raise NotImplementedError(
            f"Site {name!r} is inside hk.scan, where bridge does not record "
            "layer inputs yet: pass with_inputs=False or select sites outside it."
        )


def _tap_outside_transforms(tap: Any) -> Any:
    """The session's `tap`, refusing a tap inside a Haiku transform: its value
    would be recorded from the transform's inner trace and one epsilon would
    serve every layer or iteration."""

    def checked(name: str, value: Any) -> Any:
        where = _enclosing(_APPLY_CODE)
        if where.lifted or where.blocked is not None:
            raise NotImplementedError(
                f"bridge.tap({name!r}) is called inside "
                f"{where.blocked or 'hk.experimental.layer_stack, hk.scan or hk.remat'}"
                ", where bridge does not support taps yet. Wrap the computation "
                "in an hk.Module (its calls are sites there), or tap outside it."
            )
        return tap(name, value)

    return checked


def _layer_stack_caller() -> Any:
    """The `_LayerStack.__call__` frame that called a `LiftingModule`, if a
    layer stack (not a user's `hk.lift`) called it."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(
        (_HAIKU_SOURCE, _JAX_SOURCE)
    ):
        if _qualname(frame.f_code) == _LAYER_STACK_CALL:
            return frame
        frame = frame.f_back
    return None


def _joined(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def _is_lifting(module: Any) -> bool:
    """Haiku's `LiftingModule` (behind `hk.experimental.lift` and `layer_stack`),
    which is not exported."""
    kind = type(module)
    return kind.__name__ == "LiftingModule" and kind.__module__.startswith("haiku")


_APPLY_CODE = HaikuProbe._apply.__code__


def _is_site(context: hk.MethodContext) -> bool:
    """A module method call a user would name: not `__init__`, private helpers
    (`MultiHeadAttention._linear_projection`) or property reads
    (`Embed.embeddings`, `ExponentialMovingAverage.average`), which Haiku
    intercepts too."""
    method = context.method_name
    if method.startswith("_") and method != "__call__":
        return False
    attribute = inspect.getattr_static(context.orig_class, method, None)
    return not isinstance(attribute, property)


def _unreachable(call: Any) -> Any:
    """The `init` of an epsilon's `hk.get_state`: called only where the state
    given to `apply` does not reach, inside a lifted transform."""

    def fail(shape: Any, dtype: Any) -> Any:
        raise NotImplementedError(
            f"The epsilon of site {call.name!r} did not reach it through Haiku "
            "state: it is called inside a transform that does not carry the "
            "state given to `apply`. Select sites outside it with `at=`."
        )

    return fail


def _state_entry(method: str, index: int) -> str:
    return f"{EPSILON_PREFIX}{method}#{index}"


def _recording_entry(method: str, index: int) -> str:
    return f"{RECORDING_PREFIX}{method}#{index}"


def _with_epsilons(
    state: Mapping, selected: Mapping[str, Site], epsilons: Mapping
) -> dict:
    """The user's state plus each epsilon in its module's bundle (new dicts),
    and, for a site inside `hk.scan`, its recording rows and step counter."""
    merged = {bundle: dict(entries) for bundle, entries in state.items()}
    for site in selected.values():
        if site.origin is not None and site.origin.scan is not None:
            entry = _recording_entry(site.method or "__call__", site.index)
            bundle = merged.setdefault(site.origin.bundle, {})
            bundle[entry] = (zeros_like_struct(site.value_struct), None)
            bundle[entry + _STEP] = jnp.zeros((), jnp.int32)
    for name, epsilon in epsilons.items():
        site = selected[name]
        if site.origin is None:  # a `bridge.tap`: its epsilon lives in the session
            continue
        entry = _state_entry(site.method or "__call__", site.index)
        merged.setdefault(site.origin.bundle, {})[entry] = epsilon
    return merged


def _without_epsilons(state: Mapping) -> dict:
    """Apply's new state less the epsilons, and less bundles that held only them."""
    stripped = {}
    for bundle, entries in state.items():
        kept = {k: v for k, v in entries.items() if not k.startswith(_RESERVED)}
        if kept or len(kept) == len(entries):
            stripped[bundle] = kept
    return stripped


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


def _check_mapping(name: str, value: Any, usage: str) -> None:
    if not isinstance(value, Mapping):
        hint = (
            " If you passed the (params, state) pair that "
            "hk.transform_with_state's init returns, unpack it."
            if isinstance(value, tuple)
            else ""
        )
        raise TypeError(
            f"`{name}` must be the dict of dicts that transformed.init returns "
            f"({usage}); got {type(value).__name__}.{hint}"
        )


def _check_reserved(state: Mapping) -> None:
    for bundle, entries in state.items():
        for entry in entries:
            if str(entry).startswith(_RESERVED):
                raise ValueError(
                    f"`state[{bundle!r}]` has an entry {entry!r}: bridge reserves "
                    f"state names starting with {' or '.join(map(repr, _RESERVED))} "
                    "for its own epsilons and recordings. Rename it."
                )
