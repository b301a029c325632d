"""Why a call inside a transform cannot be probed, said once for every library.

A module call inside transforms reaches its site plainly (no transform
between it and the probe's call of the model, or only a `jax.jit`, which
bridge traces through), mapped (the model's own `jax.vmap`s only: its value
is handed out whole), carried (a transform that carries bridge's variables:
a library's lifted scan, vmap or remat), or not at all. In the last case the
site is listed by `sites()` and refused where it is selected or patched, with
one sentence (`refusal`): the transform that blocks, the site, why, and the
way out. Each adapter still decides which case a call is in; the sentence
and the reasons shared by every library are here.

The reasons are properties of the construct, the same in every library (a
branch may not run; a while loop's length is unknown; a loop or a map that
broadcasts the layer gives one epsilon to every iteration); the way out names
the library's own construct, so the adapter supplies it.
"""

from __future__ import annotations

__all__ = [
    "BRANCH",
    "CLOSED_OVER_LOOP",
    "TRACED_BOUNDS",
    "TRACED_BOUNDS_FIX",
    "UNBOUNDED_LOOP",
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


def refusal(
    site: str, transform: str, why: str, fix: str = "move the call out of it"
) -> str:
    """The error of a site bridge lists but cannot probe: the transform that
    holds it, why bridge cannot see through it there, and what to do."""
    return (
        f"bridge cannot see through {transform} around site {site!r}: {why}. "
        f"Select other sites with `at=` (`at=None` leaves it out), or {fix}."
    )
