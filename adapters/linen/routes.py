"""How a Linen call (or a `bridge.tap`) inside transforms reaches its site:
the core's router decides (`bridge.adapter_api.route`); this module says
which transforms enclose the call, each with its rule.

JAX's transforms are read off its trace stack
(`bridge.adapters.shared.unexpressible.enclosing`), with Linen's rules over
JAX's (`RULES`: Linen's way out of a transform a value cannot leave). Flax's
lifted transforms run their bodies in traces of JAX's own transforms, which
the adapter does not tell from the model's: a lifted scope is what says a
call is inside one (`run.Interceptor`). Inside the trace the innermost
lifted body runs in (`LiftedTransforms.body_traces`), JAX's transforms are
the model's own and keep their rules; from that trace out, every trace that
neither branches, loops, broadcasts `params` nor is traced through is taken
for the lifted transform's own: it carries bridge's collections (`nn.scan` with
`params` axes, `nn.vmap`, `nn.remat`, `nn.jit`), or blocks where it carries
none of them (`blocking`). A trace of a transform known to broadcast
`params` (`transforms.Broadcasts`) blocks, wherever the call is. Loops and
branches in a lifted transform's body, the call's module lifted or closed
over, are named as the model's code writes them (`nn.cond`, `nn.switch`,
`nn.while_loop`).
"""

from __future__ import annotations

from bridge.adapter_api import (
    BRANCH,
    COUNTED_SCAN,
    JAX_RULES,
    LOOP_AMONG,
    UNBOUNDED_LOOP,
    Route,
    Rule,
    Session,
    ThroughControlFlow,
    Transform,
    count_scans_of,
    route,
)

from ..shared import unexpressible
from .internals import transform_call
from .transforms import LiftedTransforms, carrying_neither
from .variables import Origin

#: Linen's way out of a JAX transform whose values the model's code does not
#: return.
LIFTED_INSTEAD = (
    "move it out of the transform, or use Flax's own lifted transform "
    "(nn.remat, nn.scan with variable_axes={'params': 0}, nn.vmap), which "
    "bridge sees through"
)

#: Where Linen's rules differ from JAX's (`JAX_RULES`), by JAX's name of a
#: trace or Flax's name of a lifted transform (where it does not carry
#: bridge's collections: `blocking`).
RULES: dict[str, Transform] = {
    "scan": Transform("jax.lax.scan", Rule.BLOCKS, fix=LIFTED_INSTEAD),
    "checkpoint / remat": Transform("jax.checkpoint", Rule.BLOCKS, fix=LIFTED_INSTEAD),
    "checkpoint": Transform("jax.checkpoint", Rule.BLOCKS, fix=LIFTED_INSTEAD),
    "while_body": Transform(
        "jax.lax.while_loop",
        Rule.BLOCKS,
        UNBOUNDED_LOOP,
        "write the loop as an nn.scan of fixed length",
    ),
    "nn.scan": Transform(
        "nn.scan",
        Rule.BLOCKS,
        "it broadcasts `params` (variable_broadcast='params', as nn.RNN "
        "does), so one epsilon would serve every iteration and their "
        "gradients would be summed",
        "scan over stacked layers (variable_axes={'params': 0}), or unroll the loop",
    ),
    "nn.vmap": Transform(
        "nn.vmap",
        Rule.BLOCKS,
        "it broadcasts `params` (variable_axes={'params': None}), so one "
        "epsilon would serve every mapped example and their gradients would "
        "be summed",
        "probe the unmapped model with bridge.probe(..., vmap=True)",
    ),
    "nn.while_loop": Transform(
        "nn.while_loop",
        Rule.BLOCKS,
        UNBOUNDED_LOOP,
        "write the loop as an nn.scan of fixed length",
    ),
    "nn.cond": Transform(
        "nn.cond",
        Rule.FLOWS,
        BRANCH,
        "compute both branches and pick with jnp.where",
        nests=False,
    ),
    "nn.switch": Transform(
        "nn.switch",
        Rule.FLOWS,
        BRANCH,
        "compute every branch and pick with jnp.where",
        nests=False,
    ),
}
RULES["while_cond"] = RULES["while_body"]

#: JAX's names of the traces of Flax's lifted loops and branches.
_LIFTED_LOOPS_AND_BRANCHES = {
    "cond": "nn.cond",
    "switch": "nn.switch",
    "while_body": "nn.while_loop",
    "while_cond": "nn.while_loop",
}

#: The rules inside a lifted transform's body: its loops and branches are
#: Flax's own.
_IN_LIFTED_BODY = {
    **RULES,
    **{jax: RULES[flax] for jax, flax in _LIFTED_LOOPS_AND_BRANCHES.items()},
}

#: An `nn.scan` as a loop of known bounds: the scan counts its iterations
#: while a probe runs (`count_scans_of`), so a call in its body takes its
#: row of the epsilon by the counter. So is one that broadcasts `params`
#: (`nn.RNN`'s), which carries none of bridge's state, and one over stacked
#: layers for a call no carrier takes (a branch in its body).
SCAN_LOOP = Transform(
    "nn.scan",
    Rule.FLOWS,
    LOOP_AMONG,
    "move the other transform out of the nn.scan, or unroll the loop",
    nests=False,
)
count_scans_of("flax.core.axes_scan")

#: Flax's own transforms that block: kept where a lifted scope takes the
#: other traces for its transform's own.
_FLAX_BLOCKING = frozenset(
    RULES[name] for name in ("nn.scan", "nn.vmap", "nn.while_loop")
)


_COUNTED = JAX_RULES[COUNTED_SCAN]


def _broadcasting(name: str, traced: Transform) -> Transform:
    """The lifted transform `name` that broadcasts `params`, whose trace the
    router reads as `traced`: a loop of known bounds where it is an `nn.scan`
    that counts its iterations, else blocking."""
    if name == "nn.scan" and traced is _COUNTED:
        return SCAN_LOOP
    return blocking(name)


def blocking(name: str) -> Transform:
    """Flax's lifted transform `name` where it carries none of bridge's
    collections: broadcasting `params` (`nn.scan`, `nn.vmap`), a loop, or
    carrying neither them nor `params`."""
    return RULES.get(name) or carrying_neither(name)


class Routes:
    """The routes of the calls of one Linen `apply`. `base` and `stop` are
    the trace and the Python frame of the probe's `apply`; `lifted` knows
    the lifted transform entered last and the traces that broadcast
    `params`."""

    def __init__(self, session: Session, lifted: LiftedTransforms, base, stop):
        self.session = session
        self.lifted = lifted
        self.base = base
        self.stop = stop

    def _rules(self, lifted: bool) -> dict[str, Transform]:
        # A module the model closes over, called in a lifted transform's body
        # (`nn.cond(pred, lambda _, x: self.left(x), ...)`), is in Flax's
        # branch too.
        if lifted or transform_call() is not None:
            return _IN_LIFTED_BODY
        return RULES

    def enclosing(
        self, lifted: bool, carries_none: bool, scans_loop: bool = False
    ) -> tuple[Transform, ...]:
        """The transforms around the call running now, innermost first: of
        a module in a `lifted` scope (whose transform carries none of
        bridge's collections where `carries_none`: recording in `params`,
        which it does not carry either), or of one in the model's (module
        docstring). With `scans_loop`, each `nn.scan` that counts its
        iterations is a loop of known bounds, not a carrier."""
        found = unexpressible.enclosing(self.base, self._rules(lifted))
        if lifted and found and found[-1].name == unexpressible.UNKNOWN_TRANSFORM:
            # The stack is not read to `base` (jax < 0.6.2): the lifted
            # transform stands for all of it.
            found = found[-1:]
        traces = tuple(unexpressible.traces(self.base))
        if len(found) == len(traces):  # else one that blocks stands for all
            broadcasting = self.lifted.broadcast_traces
            found = tuple(
                _broadcasting(broadcasting[id(trace)][1], t)
                if id(trace) in broadcasting
                else t
                for trace, t in zip(traces, found, strict=True)
            )
        if not lifted:
            return found
        name = self.lifted.transform
        own = blocking(name) if carries_none else Transform(name, Rule.CARRIES)
        # Inside the innermost lifted body's trace, JAX's own transforms of
        # the model's code keep their rules (a `jax.checkpoint` in an
        # `nn.scan`'s body is no Flax transform).
        bodies = self.lifted.body_traces
        inside = 0
        if len(found) == len(traces):
            inside = next(
                (i for i, trace in enumerate(traces) if id(trace) in bodies), 0
            )
        found = tuple(
            t
            if i < inside
            or (t.rule in (Rule.FLOWS, Rule.THROUGH) and t is not _COUNTED)
            or t in _FLAX_BLOCKING
            or t is SCAN_LOOP
            else SCAN_LOOP
            if scans_loop and t is _COUNTED
            else own
            for i, t in enumerate(found)
        )
        if all(t.rule is Rule.THROUGH for t in found):  # none traced (nn.map_variables)
            found = (*found, own)
        return found

    def route(self, site: str, enclosing: tuple[Transform, ...], lifted: bool) -> Route:
        """The route of a call at `site` inside `enclosing`; inside branches
        and loops of known bounds only, where it runs read off JAX's traces
        (refused where that cannot be read)."""
        found = route(site, enclosing)
        if isinstance(found, ThroughControlFlow):
            return unexpressible.route(site, self.base, self._rules(lifted))
        return found

    def listed(self, run, call_args, module, method, name, origin, refused):
        """A call (or tap) named `name` the router `refused`: listed with its
        whole value, its `origin` blocked with the router's sentence for the
        name the session gives the call, run as it is
        (`bridge.adapters.shared.unexpressible.listed`)."""
        session = self.session
        call = session.enter(
            name, method, module, call_args, origin=origin, record=False
        )
        call.origin = Origin(
            origin.scope, tap=origin.tap, blocked=refused.at(call.name)
        )
        return unexpressible.listed(session, call, run(), self.base, self.stop)
