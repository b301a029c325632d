"""How a call inside transforms reaches its site, decided once for every
library.

Between a module call (or a `bridge.tap`) and the probe's own call of the
model stand the transforms of the model's code, JAX's and the library's. Each
has one rule (`Rule`), as JAX's own interpreters keep one rule per primitive:

- `THROUGH`: bridge traces through it (a `jax.jit` inside the model).
- `MAPS`: the model's own `jax.vmap`, whose value bridge hands out whole, its
  mapped axis first.
- `FLOWS`: a branch (`cond`, `switch`) or a loop of known bounds (a
  `fori_loop` of static bounds, Equinox's checkpointed while loop), whose
  value and whether it ran leave through the step's own backward pass.
- `CARRIES`: a library's transform that carries bridge's variables in and
  out (Flax's lifted `nn.scan`, `nnx.vmap`, Haiku's layer stack, Equinox's
  scan over stacked layers, where the epsilons are leaves of the tree).
- `BLOCKS`: none of these: a `while_loop`, whose iterations are known only
  when it runs; a transform that carries none of bridge's state.

`route` reads the enclosing transforms (`Transform`s, innermost first) and
gives the call's one `Route`: `PLAIN` (the probe's own trace), `Mapped`
(inside the model's vmaps only), `ThroughControlFlow` (inside branches and
loops of known bounds only), `Carried` (inside transforms the library carries
through, with the model's vmaps inside the innermost), or `Refused` with the
one sentence a user reads: the transform that blocks, the site, why, and the
way out. The adapter says which rule each of its transforms has and how its
library is left (the way out names the library's own construct); how each
route is then taken (an epsilon on the probe's trace, handed out of a vmap,
closed over by a branch, carried as a variable) is the adapter's and the
session's.

The reasons are properties of the construct, the same in every library (a
branch may not run; a while loop's length is unknown; a loop or a map that
broadcasts the layer gives one epsilon to every iteration).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "BRANCH",
    "CLOSED_OVER_LOOP",
    "CONVERTED",
    "CONVERTED_FIX",
    "JAX_RULES",
    "LOOP_AMONG",
    "PLAIN",
    "TRACED_BOUNDS",
    "TRACED_BOUNDS_FIX",
    "UNBOUNDED_LOOP",
    "UNCARRIED",
    "Carried",
    "Mapped",
    "Refused",
    "Route",
    "Rule",
    "ThroughControlFlow",
    "Transform",
    "refusal",
    "route",
]


#: A call in a `cond` or `switch` branch that another transform encloses (a
#: scanned stack): only where branches and loops of static bounds alone
#: enclose it does its value leave through the backward pass.
BRANCH = (
    "a call in a branch may not run, and bridge brings its value and where "
    "it ran out through the backward pass only where branches and loops of "
    "static bounds alone enclose it"
)

#: A call in a loop of static bounds that another transform encloses.
LOOP_AMONG = (
    "a call in a loop runs once per iteration, and bridge brings its values "
    "out through the backward pass only where branches and loops of static "
    "bounds alone enclose it"
)

#: A call in a `fori_loop` whose bounds are traced: JAX makes it a
#: `while_loop`.
TRACED_BOUNDS = (
    "its bounds are traced, so JAX runs it as a while_loop, which it cannot "
    "reverse-differentiate and whose iterations are known only when the model "
    "runs"
)
TRACED_BOUNDS_FIX = (
    "give it Python int bounds (JAX then makes it a scan, whose iterations "
    "bridge probes one by one)"
)

#: A call in a `while_loop`.
UNBOUNDED_LOOP = (
    "how many iterations run is known only when the model runs, so no "
    "epsilon or recording can be shaped for them"
)

#: A call in a loop that closes over the layer (not a scan over stacked
#: layers): one epsilon would serve every iteration.
CLOSED_OVER_LOOP = (
    "the loop closes over the layer, so one epsilon would serve every "
    "iteration and their gradients would be summed"
)

#: A call inside a function closure-converted (`jax.closure_convert`,
#: `equinox.filter_closure_convert`, as solver libraries convert the function
#: they solve): the conversion traces the function once, and every call of
#: the converted function runs that one trace. A site there would be one
#: trace standing for several calls (`f(f(h))`), whose gradients one epsilon
#: would sum, so it is refused rather than probed.
CONVERTED = (
    "the conversion traces the function once, into a jaxpr that every call of "
    "the converted function runs: a value there belongs to the conversion's "
    "own trace, and one epsilon would serve every call of the converted "
    "function and sum their gradients"
)
CONVERTED_FIX = "call the layer outside the converted function and pass its output in"

#: Why a call inside a transform that carries none of bridge's state cannot
#: be a site, where the adapter has nothing more precise to say.
UNCARRIED = (
    "a value there belongs to the transform's own trace, which hands out only "
    "what the model's code returns from it, so bridge can neither record it "
    "nor give it an epsilon"
)


class Rule(enum.Enum):
    """How bridge reaches a call inside one transform (module docstring)."""

    THROUGH = "traced through"
    MAPS = "maps"
    FLOWS = "flows"
    CARRIES = "carries"
    BLOCKS = "blocks"


@dataclasses.dataclass(frozen=True)
class Transform:
    """One transform around a call.

    Attributes:
      name: as the model's code writes it (`jax.lax.scan`, `nn.scan`), as a
        refusal names it.
      rule: how bridge reaches a call inside it.
      why: where it is what blocks the call, why (for `MAPS`: where another
        transform stands between it and the call; for `FLOWS`: where other
        transforms enclose it too; for `CARRIES`: where another that does
        not nest is among the carriers too).
      fix: the way out, in the library's own terms.
      nests: for `CARRIES`, false where bridge's state rides through it
        only as the one such carrier around the call (Equinox's scan over
        stacked layers: one stack at a time), true where any number nest;
        for `FLOWS`, whether the library carries a call in it as it does in
        its carriers, where other transforms enclose the call (Equinox's
        tree route carries a branch, inside a scan over stacked layers or
        around the model's own vmap).
      takes_mapped: for `CARRIES` (and `FLOWS` where `nests`), whether the
        library's route through it takes a call inside the model's own vmaps
        directly around the call (Equinox's tree route hands the value out
        to the body's trace); where not, the innermost vmap blocks.
    """

    name: str
    rule: Rule
    why: str = UNCARRIED
    fix: str = "move the call out of it"
    nests: bool = True
    takes_mapped: bool = False


#: JAX's transforms (a trace's name, as `bridge.adapters.equinox.loops`
#: reads it) and their rules; an adapter adds its library's and gives its
#: own way out where JAX's is not its users'.
JAX_RULES: Mapping[str, Transform] = {
    "jit": Transform("a jax.jit inside the model", Rule.THROUGH),
    "pjit": Transform("a jax.jit inside the model", Rule.THROUGH),
    "vmap": Transform(
        "jax.vmap",
        Rule.MAPS,
        "bridge hands a value out of the model's own jax.vmap only where "
        "nothing but vmaps stands between the call and the probe's call of "
        "the model",
        "move the jax.vmap out of the other transform, or probe the unmapped "
        "model with bridge.probe(..., vmap=True)",
    ),
    "cond": Transform(
        "jax.lax.cond",
        Rule.FLOWS,
        BRANCH,
        "compute both branches and pick with jnp.where",
        nests=False,
    ),
    "switch": Transform(
        "jax.lax.switch",
        Rule.FLOWS,
        BRANCH,
        "compute every branch and pick with jnp.where",
        nests=False,
    ),
    "fori_loop": Transform(
        "jax.lax.fori_loop",
        Rule.FLOWS,
        LOOP_AMONG,
        "move the other transform out of the loop, or unroll the loop",
        nests=False,
    ),
    "fori_loop (traced bounds)": Transform(
        "jax.lax.fori_loop with traced bounds",
        Rule.BLOCKS,
        TRACED_BOUNDS,
        TRACED_BOUNDS_FIX,
    ),
    "while_body": Transform(
        "jax.lax.while_loop",
        Rule.BLOCKS,
        UNBOUNDED_LOOP,
        "write the loop as a jax.lax.scan of fixed length",
    ),
    "scan": Transform("jax.lax.scan", Rule.BLOCKS),
    "checkpoint / remat": Transform("jax.checkpoint", Rule.BLOCKS),
    "checkpoint": Transform("jax.checkpoint", Rule.BLOCKS),  # jax < 0.5
    "closure_convert": Transform(
        "jax.closure_convert", Rule.BLOCKS, CONVERTED, CONVERTED_FIX
    ),
}
JAX_RULES = {**JAX_RULES, "while_cond": JAX_RULES["while_body"]}


class Route:
    """How a call reaches its site (`route`)."""


@dataclasses.dataclass(frozen=True)
class _Named(Route):
    name: str

    def __repr__(self) -> str:
        return self.name


#: In the probe's own trace, or inside transforms bridge traces through.
PLAIN: Route = _Named("PLAIN")


@dataclasses.dataclass(frozen=True)
class ThroughControlFlow(Route):
    """Inside branches and loops of known bounds only (and what is traced
    through): the session's control-flow route, where the call runs in
    `flow` (a `ControlFlow`, which the adapter reads off JAX's traces;
    `None` from `route`)."""

    flow: Any = None


@dataclasses.dataclass(frozen=True)
class Mapped(Route):
    """Inside `depth` of the model's own vmaps only: the value is handed out
    whole, mapped axes first."""

    depth: int


@dataclasses.dataclass(frozen=True)
class Carried(Route):
    """Inside transforms the library carries bridge's state through
    (`transforms`, innermost first), and `depth` of the model's own vmaps
    inside the innermost of them."""

    transforms: tuple[Transform, ...]
    depth: int = 0


@dataclasses.dataclass(frozen=True)
class Refused(Route):
    """No route: the site is listed, and refused where selected or patched
    with `sentence`, naming `transform`: why it blocks there (`why`, with
    what else encloses the call) and the way out (`fix`). `at` writes the
    same refusal of the call named otherwise (as the session names it: a
    second call of a module, `path#1`)."""

    transform: Transform
    site: str
    why: str
    fix: str

    @property
    def sentence(self) -> str:
        return self.at(self.site)

    def at(self, site: str) -> str:
        """The refusal of the call named `site`."""
        return refusal(site, self.transform.name, self.why, self.fix)


def route(site: str, enclosing: Iterable[Transform]) -> Route:
    """The route of a call at `site` inside `enclosing` (innermost first)."""
    enclosing = tuple(enclosing)
    seen = [t for t in enclosing if t.rule is not Rule.THROUGH]
    rules = {t.rule for t in seen}
    if not seen:
        return PLAIN
    if rules == {Rule.MAPS}:
        return Mapped(len(seen))
    if rules == {Rule.FLOWS}:
        return ThroughControlFlow()
    carriers = [t for t in seen if t.rule is Rule.CARRIES]
    # A branch or a loop among other transforms blocks, unless the library
    # carries it as it does its carriers.
    carried_flows = [t for t in seen if t.rule is Rule.FLOWS and t.nests]
    blocker = next((t for t in seen if t.rule is Rule.BLOCKS), None)
    if blocker is None:
        blocker = next((t for t in seen if t.rule is Rule.FLOWS and not t.nests), None)
    # The model's own vmaps directly around the call are handed out (to the
    # innermost carrier's trace); one further out is not.
    depth = next(i for i, t in enumerate(seen) if t.rule is not Rule.MAPS)
    outer_vmap = next((t for t in seen[depth:] if t.rule is Rule.MAPS), None)
    if blocker is None and outer_vmap is not None:
        # Without a carrier, a branch the library would carry among them is
        # what the vmap around it cannot be seen through.
        blocker = outer_vmap if carriers else carried_flows[0]
    if blocker is None:
        sole = [t for t in carriers if not t.nests]
        blocker = sole[1] if len(sole) > 1 else None
    carried = tuple(carriers or carried_flows)
    if blocker is None and depth and not carried[0].takes_mapped:
        blocker = seen[0]  # the model's vmap the library's route cannot hand out
    if blocker is None:
        return Carried(carried, depth)
    why = blocker.why
    if len(seen) > 1:
        why += f" (it runs inside {describe(enclosing)})"
    return Refused(blocker, site, why, blocker.fix)


def describe(enclosing: Iterable[Transform]) -> str:
    """`a inside b inside c`, innermost first; a transform JAX runs in
    several traces in a row (Equinox's bounded loop) named once."""
    names = [t.name for t in enclosing]
    distinct = [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]]
    return " inside ".join(distinct)


def refusal(
    site: str, transform: str, why: str, fix: str = "move the call out of it"
) -> str:
    """The error of a site bridge lists but cannot probe: the transform that
    holds it, why bridge cannot see through it there, and what to do."""
    return (
        f"bridge cannot see through {transform} around site {site!r}: {why}. "
        f"Select other sites with `at=` (`at=None` leaves it out), or {fix}."
    )
