"""Equinox sites inside `lax.scan` over stacked layers and `jax.checkpoint`:
epsilons, patch values and recorders in the tree.

Inside `lax.scan` over stacked layers (`eqx.filter_vmap` builds them, the scan
slices them per step, directly or after `eqx.partition`) and inside
`jax.checkpoint` / `eqx.filter_checkpoint`, no value can be handed out: the
epsilon lives in the tree instead (the design's tree surgery). Discovery finds
these calls and their iterations (a wrapper whose parameters lost a leading
axis of size L was sliced by the scan). For the run, each such wrapper holds,
per call, its `Leaves`, stacked `(L, *shape)` so that the scan slices them
with the parameters: going in, a zero epsilon (its gradient is the stacked
activation gradient) and the patch value, of which each iteration takes its
row (a patch function needs no leaf: it is applied to each iteration's
value); coming out, zero "recorders" of the value and, with
`with_inputs=True`, of the positional inputs. Values leave the scan
backwards: the recorders enter through a `custom_vjp` identity whose backward
pass returns the recorded value and inputs themselves as the recorders'
cotangents, and `run_with_tree_leaves` pulls them out with one `jax.vjp` of the
model (`call_in_transform`). Inputs that are not floating-point travel as
float32 numbers that a cotangent carries exactly (`_as_floats`).

A layer the scan body applies per token with the model's own `jax.vmap`
(`jax.vmap(self.linear)(x)` in a scanned block) sees one token, yet its
site holds every token: its value is handed out of those vmaps to the
body's trace whole, mapped axes first (`transforms.lift`), and there it is
patched, recorded and perturbed with the call's leaves as a call in the body
itself is (`_call_mapped`). The site is `(iterations, *mapped axes, *value)`,
and with `vmap=True` the probe's batch axis after the iterations.

A call inside a transform this cannot express (`lax.cond`, `while_loop`, a
`jax.jit` called in the model's code, a scan or checkpoint inside the
model's own `jax.vmap`, nested scans, a layer closed over by the scan body
rather than scanned over) is listed, and raises an error naming it where it
is selected or patched (`bridge.adapters.equinox.refused`): a site is never
silently missing or summed over iterations, nor does it block the others.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from bridge.adapter_api import (
    BridgeRuntimeError,
    BridgeValueError,
    Session,
    SiteOrigin,
    abstract,
    differentiable_part,
    merge_differentiable,
    positional_arrays,
    without_axis,
    zeros_like_struct,
)

from ..shared import jax_internals as internals
from . import refused
from .transforms import CHECKPOINT, SCAN, describe, lift, transforms


class Leaves(eqx.Module):
    """A call's leaves inside a transform: array leaves of the tree, so a scan
    slices them per iteration as it slices the parameters. The epsilon and the
    patch value go in; the recorders of the value and of the positional
    inputs bring them out, as their cotangents (see `record`). `None` where
    the call has none."""

    epsilon: Any = None
    recorder: Any = None
    inputs: Any = None
    patch: Any = None


def param_shapes(module: Any) -> tuple[tuple[int, ...], ...]:
    """Shapes of a module's arrays, bridge's own leaves left out."""
    arrays = eqx.filter(module, eqx.is_array, is_leaf=lambda x: isinstance(x, Leaves))
    return tuple(tuple(a.shape) for a in jax.tree.leaves(arrays))


# -- inside lax.scan and jax.checkpoint: epsilons, patches, recorders in the tree --


def in_tree(session: Session) -> dict[str, Any]:
    """The selected sites whose epsilons live in the tree."""
    return {
        name: site
        for name, site in session.selected.items()
        if isinstance(site.origin, InTransform)
    }


def patches_in_tree(session: Session) -> dict[str, Any]:
    """The patch values of the sites inside transforms, which ride in the tree
    (sliced per iteration inside a scan). A patch function needs no leaf."""
    return {
        name: session.patches[name]
        for name, site in session.carrier.patched_with_values().items()
        if isinstance(site.origin, InTransform)
    }


def run_with_tree_leaves(
    call_model: Callable[[dict[str, Leaves]], tuple[Any, Any]],
    session: Session,
    vmap: bool,
    model_name: str,
) -> tuple[Any, Any]:
    """Run the model with the `Leaves` of the calls inside transforms
    (`call_model(leaves) -> (outputs, state)`), and record the selected sites
    there, whose values and inputs leave the scan as the recorders' cotangents
    (see `record`)."""
    patches = patches_in_tree(session)
    sites = in_tree(session)
    if not sites:  # nothing to record in there: no backward pass needed
        return call_model({name: Leaves(patch=p) for name, p in patches.items()})
    for site in sites.values():
        if site.origin.blocked:
            raise BridgeValueError(site.origin.blocked)

    def shaped(site: Any) -> Any:
        struct = site.value_struct
        if vmap:  # the probe's own vmap: one example here
            struct = jax.tree.map(lambda s: without_axis(s, site.stacked), struct)
        return zeros_like_struct(struct)

    def shaped_inputs(site: Any) -> Any:
        if not session.with_inputs:
            return None
        # Shaped at discovery, where the probe's vmap had already taken the
        # batch axis away.
        return zeros_like_struct(site.origin.inputs_recorder)

    recorders = {
        name: (shaped(site), shaped_inputs(site)) for name, site in sites.items()
    }

    def forward(recorders: dict) -> tuple[Any, Any]:
        leaves = {name: Leaves(patch=p) for name, p in patches.items()}
        for name, site in sites.items():
            value_recorder, inputs_recorder = recorders[name]
            epsilon = session.epsilons.get(name)
            leaves[name] = Leaves(
                shaped(site) if epsilon is None else epsilon,
                value_recorder,
                inputs_recorder,
                patches.get(name),
            )
        outputs, state = call_model(leaves)
        floats = [
            jnp.sum(leaf)
            for leaf in jax.tree.leaves(differentiable_part(outputs))
            if leaf is not None
        ]
        if not floats:
            raise BridgeValueError(
                "bridge records the sites inside jax.lax.scan or "
                "jax.checkpoint through the backward pass of the model's "
                f"outputs, but {model_name} returned no floating-point array."
            )
        # What the session recorded in here must leave `jax.vjp` as outputs.
        return sum(floats, jnp.zeros(())), (
            outputs,
            state,
            session.carrier.recordings(),
        )

    total, pullback, (outputs, state, recorded) = jax.vjp(
        forward, recorders, has_aux=True
    )
    session.carrier.adopt(recorded)
    (cotangents,) = pullback(jnp.ones_like(total))
    for name, site in sites.items():
        value, inputs = cotangents[name]
        if session.with_inputs:
            inputs = jax.tree.map(_from_floats, site.origin.inputs, inputs)
        session.carrier.carried_out(name, value, inputs)
    return outputs, state


@dataclasses.dataclass(frozen=True)
class InTransform(SiteOrigin):
    """Where a site lives that takes its epsilon and patch value from the tree
    and records through it: `iterations` of the enclosing scan (`None` when
    only a checkpoint encloses it)."""

    iterations: int | None
    transforms: tuple[str, ...]
    #: Why a call there cannot be a site (raised where it is selected).
    blocked: str | None = None
    #: How each positional array input comes back from its float32 transport
    #: (an `_Encoding`, `None` for other arguments), and the abstract zeros of
    #: its recorder, stacked like the site.
    inputs: Any = None
    inputs_recorder: Any = None

    @property
    def described(self) -> str:
        return describe(self.transforms)


#: The innermost scan over stacked layers now running a sliced wrapper:
#: `(the scan body's trace, iterations)`. A call without parameters of its
#: own (a function field, a parameterless module) inside it is sliced too.
_SLICED: contextvars.ContextVar[tuple[Any, int] | None] = contextvars.ContextVar(
    "bridge_equinox_sliced", default=None
)


def iterations(site: Any) -> int | None:
    """L when the wrapper's arrays lost a leading axis of size L (a scan sliced
    them), 0 when they are whole, `None` when it cannot tell (no arrays)."""
    if not site.shapes:
        return None
    module = getattr(site, "module", None)  # a function site has no arrays
    now = () if module is None else param_shapes(module)
    if now == site.shapes:
        return 0
    leading = {shape[:1] for shape in site.shapes}
    if (
        len(now) == len(site.shapes)
        and len(leading) == 1
        and all(n == s[1:] for n, s in zip(now, site.shapes, strict=True))
    ):
        return site.shapes[0][0]
    return None


def call_in_transform(
    context: Any,
    site: Any,
    method: str | None,
    module: Any,
    function: Callable,
    args: tuple,
    kwargs: dict,
) -> Any:
    """A call inside `lax.scan` or `jax.checkpoint`, perhaps inside the
    model's own `jax.vmap`s there: see the module docstring."""
    session = context.session
    enclosing = transforms(context.base_trace)
    # The model's own vmaps inside the scan or checkpoint (a layer applied per
    # token): their value is handed out to the body's trace whole.
    depth = next((i for i, t in enumerate(enclosing) if t != "vmap"), 0)
    outer = enclosing[depth:]
    site_path = site.path if method is None else f"{site.path}.{method}"
    unsupported = [t for t in outer if t not in (SCAN, CHECKPOINT)]
    if unsupported or outer.count(SCAN) > 1:
        # Listed, and refused only where selected or patched (`refused`).
        count = _count(site, depth) if outer.count(SCAN) == 1 else None
        origin = InTransform(None, enclosing, _why(site_path, enclosing, unsupported))
        whole = refused.whole_axes(enclosing, count)
        return refused.unreachable(
            session, site, method, module, function, args, kwargs, origin, whole
        )
    count = None
    if SCAN in outer:
        count = _count(site, depth)
        if not count:
            return refused.unreachable(
                session,
                site,
                method,
                module,
                function,
                args,
                kwargs,
                InTransform(None, enclosing, _not_sliced(site, site_path)),
            )
    if depth:
        return _call_mapped(
            session,
            site,
            method,
            module,
            function,
            args,
            kwargs,
            count,
            depth,
            enclosing,
        )
    # How the inputs are recorded is learnt once, with the site.
    learnt = _inputs_origin(args, count) if session.recorder.learns_sites() else {}
    origin = InTransform(count, enclosing, **learnt)
    call = session.enter(site.path, method, module, args, origin=origin, record=False)
    value = _run_sliced(site, count, 0, site_path, enclosing, function, args, kwargs)
    leaves = site.bridge_leaves.get(call.name)
    # The patch value and the epsilon come from the tree, not from the session.
    value = _exit(session, call, value, None if leaves is None else leaves.patch)
    if count:
        session.recorder.holds_iterations(call.name, value, count)
    if call.name not in session.selected:
        return value
    _check_leaves(call.name, leaves, enclosing)
    inputs = None
    if leaves.inputs is not None:
        inputs = jax.tree.map(_as_floats, positional_arrays(args))
    return _recorded(value, inputs, leaves)


def _call_mapped(
    session: Session,
    site: Any,
    method: str | None,
    module: Any,
    function: Callable,
    args: tuple,
    kwargs: dict,
    count: int | None,
    depth: int,
    enclosing: tuple[str, ...],
) -> Any:
    """A call `depth` vmaps of the model's own code deep inside a scan or
    checkpoint (`jax.vmap(self.linear)(x)` in a scanned layer): the value is
    handed out of the vmaps to the body's trace whole, mapped axes first
    (`transforms.lift`), and there it is patched, recorded and perturbed with
    the call's leaves from the tree, as a call in the body itself is: one
    iteration's row holds every token."""
    if session.recorder.learns_sites():
        # How the inputs are recorded, learnt once, whole like the value.
        learnt: list = []
        arrays = positional_arrays(args)
        if jax.tree.leaves(arrays):
            lift(arrays, depth, lambda full: learnt.append(full) or full)
        origin = InTransform(
            count, enclosing, **_inputs_origin(learnt[0] if learnt else arrays, count)
        )
    else:
        origin = InTransform(count, enclosing)
    call = session.enter(site.path, method, module, args, origin=origin, record=False)
    site_path = site.path if method is None else f"{site.path}.{method}"
    value = _run_sliced(
        site, count, depth, site_path, enclosing, function, args, kwargs
    )
    if not session.recorder.needs_value(call.name):
        return _exit(session, call, value, None)  # nothing to see: no cost
    leaves = site.bridge_leaves.get(call.name)
    selected = call.name in session.selected
    if selected:
        _check_leaves(call.name, leaves, enclosing)
    inputs = positional_arrays(args) if selected and leaves.inputs is not None else None

    def observe(full: tuple, extra: Any) -> tuple:
        whole, whole_inputs = full
        patch = None if extra is None else extra.patch
        whole = _exit(session, call, whole, patch)
        if count:
            session.recorder.holds_iterations(call.name, whole, count)
        if not selected:
            return whole, whole_inputs
        floats = None
        if whole_inputs is not None:
            floats = jax.tree.map(_as_floats, whole_inputs)
        return _recorded(whole, floats, extra), whole_inputs

    value, _ = lift(
        (value, inputs),
        depth,
        observe,
        extra=leaves if leaves is not None else Leaves(),
    )
    return value


def _run_sliced(
    site: Any,
    count: int | None,
    depth: int,
    site_path: str,
    enclosing: tuple[str, ...],
    function: Callable,
    args: tuple,
    kwargs: dict,
) -> Any:
    """`function(*args, **kwargs)`; a call without parameters of its own made
    from inside it is sliced by the same scan (see `_SLICED`)."""
    token = (
        _SLICED.set((_body_trace(depth), count)) if count and iterations(site) else None
    )
    try:
        value = function(*args, **kwargs)
    finally:
        if token is not None:
            _SLICED.reset(token)
    if any(isinstance(leaf, eqx.nn.State) for leaf in _leaves_with_state(value)):
        raise BridgeValueError(
            f"site {site_path!r} is a stateful layer inside {describe(enclosing)}: "
            "bridge cannot thread its eqx.nn.State there. Move it out of the "
            "transform."
        )
    return value


def _check_leaves(name: str, leaves: Any, enclosing: tuple[str, ...]) -> None:
    if leaves is None or leaves.recorder is None:
        raise BridgeRuntimeError(
            f"bridge found no epsilon for site {name!r} inside "
            f"{describe(enclosing)}: the model called it differently from the "
            "discovery pass. This is a bug in bridge: please report it."
        )


def _recorded(value: Any, inputs: Any, leaves: Leaves) -> Any:
    """`value` recorded through the tree with its `inputs` (see `record`),
    and its epsilon added. The value recorded is the patched one, before its
    epsilon."""
    floats = record(
        differentiable_part(value), inputs, (leaves.recorder, leaves.inputs)
    )
    floats = jax.tree.map(jnp.add, floats, leaves.epsilon)
    return merge_differentiable(value, floats)


def _body_trace(depth: int) -> Any:
    """The trace `depth` vmaps out from here: the scan or checkpoint body."""
    trace = internals.current_trace()
    for _ in range(depth):
        trace = internals.parent(trace)
    return trace


def _count(site: Any, depth: int = 0) -> int | None:
    """The iterations of the scan slicing this call (see `_SLICED`), `depth`
    vmaps of the model's own code inside the scan body."""
    count = iterations(site)
    sliced = _SLICED.get()
    if not count and sliced and sliced[0] is _body_trace(depth):
        count = sliced[1]
    return count


def _not_sliced(site: Any, site_path: str) -> str:
    """Why a call in every iteration of a scan that does not slice it cannot
    be a site."""
    function = getattr(site, "module", None) is None
    return (
        f"bridge cannot see through this jax.lax.scan: site {site_path!r} is "
        "called in every iteration, but the scan does not slice its "
        "parameters (a layer closed over by the scan body, as in an RNN), "
        "so one epsilon would sum the gradients of all iterations. Select "
        "sites outside the scan with `at=`, scan over stacked layers "
        "(eqx.filter_vmap to build them, the scan's xs to slice them), or "
        "unroll the loop."
        + (
            " (eqx.nn.MLP(scan=True) applies its activation so: use scan=False.)"
            if function
            else ""
        )
    )


def _why(site_path: str, enclosing: tuple[str, ...], unsupported: list) -> str:
    """Why a call inside `enclosing` cannot be a site."""
    where = describe(enclosing)
    if not unsupported:
        return (
            f"bridge cannot see through nested jax.lax.scan: site {site_path!r} "
            f"is called inside {where}. Scan over one stack of layers at a time, "
            "or select other sites with `at=`."
        )
    detail = (
        "a jax.lax.scan or jax.checkpoint inside a jax.vmap of the model's own "
        "code (an epsilon in the tree cannot vary along the mapped axis; "
        "bridge sees the model's own jax.vmap inside the scan body, not around "
        "the scan)"
        if "vmap" in unsupported
        else describe((unsupported[0],))
    )
    return (
        f"bridge cannot see through {detail}: site {site_path!r} is called "
        f"inside {where}. bridge sees through jax.lax.scan over stacked layers "
        "and jax.checkpoint; select other sites with `at=`, move the call out "
        "of the transform, or unroll it."
    )


def _exit(session: Session, call: Any, value: Any, patch: Any) -> Any:
    """`session.exit` for a call whose epsilon the caller adds, patched with
    `patch`, the patch value's leaf in the tree: one iteration's row of a
    stacked patch inside a scan. Without it, the session's own patch applies
    (a patch function, to this iteration's value)."""
    patched = session.exit(call, value, perturb=lambda v: v, record=False, patch=patch)
    return through_patch(session, call.name, value, patched)


def through_patch(session: Session, name: str, original: Any, patched: Any) -> Any:
    """`patched`, the value of patched site `name`, through which the backward
    pass still reaches `original` (with zero cotangents). Values recorded
    inside a scan or checkpoint leave through the backward pass of the
    model's outputs (`run_with_tree_leaves`): a patch downstream of them
    would cut that pass, and their activations would come out as zeros."""
    if name not in session.patches or not in_tree(session):
        return patched

    def keep(before: Any, after: Any) -> Any:
        if not (eqx.is_inexact_array(before) and eqx.is_inexact_array(after)):
            return after
        if before.shape != after.shape or before.dtype != after.dtype:
            return after
        return jax.lax.select(jnp.zeros(after.shape, bool), before, after)

    return jax.tree.map(keep, original, patched, is_leaf=lambda x: x is None)


def _inputs_origin(args: tuple, iterations: int | None) -> dict[str, Any]:
    """Discovery: how a call's positional inputs are recorded inside a
    transform (see `InTransform.inputs`)."""
    inputs = positional_arrays(args)
    transported = jax.tree.map(_as_floats, inputs)
    if iterations:
        # Broadcast, not zeros, as for the value (`holds_iterations` in
        # `call_in_transform`): inputs varying across devices stay varying.
        transported = jax.tree.map(
            lambda a: jnp.broadcast_to(a, (iterations, *a.shape)), transported
        )
    return {
        "inputs": jax.tree.map(_Encoding.of, inputs),
        "inputs_recorder": abstract(transported),
    }


@dataclasses.dataclass(frozen=True)
class _Encoding:
    """How an input came to be float32 numbers in `_as_floats`, to undo it."""

    dtype: Any
    key_impl: Any = None

    @classmethod
    def of(cls, x: Any) -> _Encoding:
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return cls(jax.random.key_data(x).dtype, jax.random.key_impl(x))
        return cls(x.dtype)


def _as_floats(x: Any) -> Any:
    """An input as numbers a floating-point cotangent carries exactly: floats
    as they are, integers and booleans as float32 (wider ones as their 16-bit
    words, exact in float32), a typed random key as its integer data."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return x
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype.itemsize > 1:
        x = jax.lax.bitcast_convert_type(x, jnp.uint16)
    return x.astype(jnp.float32)


def _from_floats(encoding: _Encoding, x: Any) -> Any:
    """The inverse of `_as_floats`, on the recorded (stacked) numbers."""
    dtype = jnp.dtype(encoding.dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return x
    if dtype.itemsize > 1:
        x = jax.lax.bitcast_convert_type(x.astype(jnp.uint16), dtype)
    else:
        x = x.astype(dtype)
    if encoding.key_impl is not None:
        x = jax.random.wrap_key_data(x, impl=encoding.key_impl)
    return x


def _leaves_with_state(value: Any) -> list:
    return jax.tree.leaves(value, is_leaf=lambda x: isinstance(x, eqx.nn.State))


@jax.custom_vjp
def record(value: Any, inputs: Any, recorders: Any) -> Any:
    """`value`; the cotangent of `recorders` is `(value, inputs)` themselves,
    so they leave a scan as the gradient of the stacked recorder leaves."""
    del inputs, recorders
    return value


def _record_forward(value: Any, inputs: Any, recorders: Any) -> tuple[Any, Any]:
    del recorders
    return value, (value, inputs)


def _record_backward(recorded: Any, cotangent: Any) -> tuple[Any, Any, Any]:
    _, inputs = recorded
    return cotangent, jax.tree.map(jnp.zeros_like, inputs), recorded


record.defvjp(_record_forward, _record_backward)
