"""The one fallback's router: whether a call inside Equinox's while loops,
or a solve built on them, has a way to its site, or the sentence refusing it.

Every other call is reported plainly and read from the computation JAX
builds (`bridge._session.computation`). Inside Equinox's checkpointed or
bounded while loop (a `custom_vjp`, whose backward pass calls the body again
where the computation does not show it) the Equinox adapter reads the
transforms around a call off JAX's trace stack (`Transform`s, innermost
first, each with one `Rule`, as JAX's own interpreters keep one rule per
primitive):

- `THROUGH`: traced through (a `jax.jit` inside the model).
- `MAPS`: the model's own `jax.vmap`.
- `FLOWS`: a branch (`cond`, `switch`) or a loop of known bounds (a
  `fori_loop` of static bounds, Equinox's loops with `max_steps`), whose
  value and whether it ran leave through the step's own backward pass
  (`Session.call_in_control_flow`) where they alone enclose the call.
- `BLOCKS`: none of these: a `while_loop`, whose iterations are known only
  when it runs; a closure conversion; an optimistix solve.

`blocked` gives the call's `Refused`, with the one sentence a user reads
(the transform that blocks, the site, why, and the way out), or `None`
where the call has a way. The reasons are properties of the construct, the
same in every library (a branch may not run; a while loop's length is
unknown).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping

__all__ = [
    "BRANCH",
    "CONVERTED",
    "CONVERTED_FIX",
    "JAX_RULES",
    "LOOP_AMONG",
    "TRACED_BOUNDS",
    "TRACED_BOUNDS_FIX",
    "UNBOUNDED_LOOP",
    "UNCARRIED",
    "Refused",
    "Rule",
    "Transform",
    "blocked",
    "refusal",
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
    BLOCKS = "blocks"


@dataclasses.dataclass(frozen=True)
class Transform:
    """One transform around a call.

    Attributes:
      name: as the model's code writes it (`jax.lax.scan`,
        `equinox.internal.while_loop`), as a refusal names it.
      rule: how bridge reaches a call inside it.
      why: where it is what blocks the call, why (for `MAPS` and `FLOWS`:
        where other transforms enclose the call too).
      fix: the way out, in the library's own terms.
    """

    name: str
    rule: Rule
    why: str = UNCARRIED
    fix: str = "move the call out of it"


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
    ),
    "switch": Transform(
        "jax.lax.switch",
        Rule.FLOWS,
        BRANCH,
        "compute every branch and pick with jnp.where",
    ),
    "fori_loop": Transform(
        "jax.lax.fori_loop",
        Rule.FLOWS,
        LOOP_AMONG,
        "move the other transform out of the loop, or unroll the loop",
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


@dataclasses.dataclass(frozen=True)
class Refused:
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


def blocked(site: str, enclosing: Iterable[Transform]) -> Refused | None:
    """The refusal of a call at `site` inside `enclosing` (innermost first),
    or `None` where it has a way: in the probe's own trace or inside
    transforms traced through, inside the model's own vmaps only (read from
    the computation), or inside branches and loops of known bounds only (the
    control-flow route). A transform that blocks blocks first; then a branch
    or loop among other transforms."""
    enclosing = tuple(enclosing)
    seen = [t for t in enclosing if t.rule is not Rule.THROUGH]
    rules = {t.rule for t in seen}
    if rules <= {Rule.MAPS} or rules == {Rule.FLOWS}:
        return None
    blocker = next((t for t in seen if t.rule is Rule.BLOCKS), None)
    if blocker is None:
        blocker = next(t for t in seen if t.rule is Rule.FLOWS)
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
