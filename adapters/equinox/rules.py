"""The Equinox adapter's rules for the call router (`bridge.adapter_api.route`):
how a module call or a `bridge.tap` reaches its site inside each transform of
the model's own code, and Equinox's way out where JAX's (`JAX_RULES`) is not
Equinox's users'.

Equinox has no transforms of its own: `eqx.filter_vmap`, `eqx.filter_jit` and
`eqx.filter_checkpoint` are JAX's, read off JAX's trace stack by their trace
names (`bridge.adapters.shared.unexpressible.enclosing`). Bridge's leaves are
leaves of the model's tree, so the transforms that carry the tree carry them:
`lax.scan` over stacked layers and `jax.checkpoint` (the tree route,
`bridge.adapters.equinox.transforms`), with a branch inside them and the
model's own vmaps directly around the call. Equinox's while loops with a
bound are one loop of known bounds (the shared reader names them); those it
cannot route, and the solves built on them, are named after themselves
(`bridge.adapters.shared.equinox_loops.blocking`) and block.

The router decides; `Enclosing` only describes what holds the call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from bridge.adapter_api import (
    CLOSED_OVER_LOOP,
    COUNTED_SCAN,
    JAX_RULES,
    Carried,
    Refused,
    Route,
    Rule,
    ThroughControlFlow,
    Transform,
    route,
)

from ..shared import equinox_loops, jax_internals, unexpressible

#: The transforms of the tree route.
SCAN = Transform(
    "jax.lax.scan",
    Rule.CARRIES,
    "bridge carries its leaves through one scan over stacked layers, whose "
    "xs slice them per iteration, not through a scan nested in another",
    "scan over one stack of layers at a time",
    nests=False,
    takes_mapped=True,
)
CHECKPOINT = Transform("jax.checkpoint", Rule.CARRIES, takes_mapped=True)

#: Where a transform differs from `JAX_RULES`, by JAX's name of its trace.
RULES: dict[str, Transform] = {
    "scan": SCAN,
    # A scan of the model's code counts its iterations while a probe runs:
    # the tree route still carries a call whose parameters it slices; one it
    # closes over is a call in a loop of known bounds (`Enclosing.counted`).
    COUNTED_SCAN: SCAN,
    "checkpoint / remat": CHECKPOINT,
    "checkpoint": CHECKPOINT,  # jax < 0.5
    # A branch inside a scan over stacked layers is carried with it, where it
    # ran sliced per iteration (`ProbeResult.ran`).
    "cond": dataclasses.replace(JAX_RULES["cond"], nests=True, takes_mapped=True),
    "switch": dataclasses.replace(JAX_RULES["switch"], nests=True, takes_mapped=True),
    "fori_loop": dataclasses.replace(
        JAX_RULES["fori_loop"],
        why=CLOSED_OVER_LOOP,
        fix="scan over stacked layers (the scan's xs slice them), or unroll the loop",
    ),
    "vmap": dataclasses.replace(
        JAX_RULES["vmap"],
        why="an epsilon in the tree cannot vary along the mapped axis: bridge "
        "hands a value out of the model's own jax.vmap inside a scan or "
        "checkpoint body, not around one",
        fix="move the jax.vmap inside the body, or probe the unmapped model "
        "with bridge.probe(..., vmap=True)",
    ),
}

#: What stands for the transforms where this jax records no jaxpr trace's
#: parent (`unexpressible.UNKNOWN_TRANSFORM`).
UNRECORDED = Transform(
    unexpressible.UNKNOWN_TRANSFORM,
    Rule.BLOCKS,
    "bridge cannot tell which transforms hold the call",
    "upgrade jax: bridge sees through jax.lax.scan and jax.checkpoint from jax 0.6.2",
)


def for_a_tap(rules: Mapping[str, Transform]) -> dict[str, Transform]:
    """`rules` for a `bridge.tap`, which has no leaves in the tree: the
    transforms that carry the tree carry nothing of it, and block."""
    return {
        **rules,
        **{
            name: dataclasses.replace(
                transform,
                rule=Rule.BLOCKS,
                why="a bridge.tap there has no route for its epsilon or its "
                "value, which leave the transform only through the model's tree",
                fix="move the tap out of the transform, or mark the value by "
                "wrapping its computation in an eqx.Module (a module call there "
                "is a site)",
            )
            for name, transform in rules.items()
            if transform.rule is Rule.CARRIES
        },
        # A scan that counts its iterations closes over a tap's epsilon and
        # recorders, as a loop of known bounds does.
        COUNTED_SCAN: JAX_RULES[COUNTED_SCAN],
    }


@dataclasses.dataclass(frozen=True)
class Enclosing:
    """The transforms between a call and the probe's call of the model
    (`base`), innermost first: as the router reads them (`transforms`, by
    `rules`), and by JAX's names (`names`, Equinox's loops and solves that
    block named after themselves), as a site's origin keeps them."""

    base: Any
    transforms: tuple[Transform, ...]
    names: tuple[str, ...]
    rules: Mapping[str, Transform]

    def route(self, site: str) -> Route:
        """The router's route of a call at `site` here; inside branches and
        loops of known bounds only, where it runs is read (or, where it
        cannot be, refused) by the shared reader."""
        found = route(site, self.transforms)
        if isinstance(found, ThroughControlFlow):
            return unexpressible.route(site, self.base, self.rules)
        if isinstance(found, Refused):
            # Where the tree route cannot carry the call (a scan nested in
            # another), the model's own scans, counting their iterations,
            # may still be loops of known bounds around it.
            counted = self.counted()
            if counted.transforms != self.transforms:
                again = counted.route(site)
                if isinstance(again, ThroughControlFlow):
                    return again
        return found

    def counted(self) -> Enclosing:
        """These transforms, a scan of the model's code that counts its
        iterations (`COUNTED_SCAN`) a loop of known bounds: for a call the
        scan closes over rather than slices, which takes its iteration's
        epsilon by the counter."""
        return enclosing(
            self.base, {**self.rules, COUNTED_SCAN: JAX_RULES[COUNTED_SCAN]}
        )

    def replaced(self, instead: Transform) -> Enclosing:
        """These transforms, `instead` of the ones of its name: a refusal the
        adapter makes of a transform the router lets through."""
        return dataclasses.replace(
            self,
            transforms=tuple(
                instead if t.name == instead.name else t for t in self.transforms
            ),
        )


def scanned(carried: Carried) -> bool:
    """Whether the tree route of `carried` runs in a scan over stacked layers."""
    return any(t.name == SCAN.name for t in carried.transforms)


def enclosing(base: Any, rules: Mapping[str, Transform] = RULES) -> Enclosing:
    """The transforms between here and `base`, each with its rule: `rules`
    over JAX's, and what `equinox_loops` names blocking with its reason and
    way out."""
    names = transform_names(base)
    if not names:
        return Enclosing(base, (), (), rules)
    found = unexpressible.enclosing(base, rules)
    if len(found) != len(names) or names[-1] == unexpressible.UNKNOWN_TRANSFORM:
        # The stack is not read to `base`: past a jaxpr trace whose parent is
        # not recorded, what holds the call is unknown; the Equinox loops and
        # solves before it still block.
        unread = names[-1] == unexpressible.UNKNOWN_TRANSFORM
        blocking = tuple(filter(None, map(_blocking, names)))
        return Enclosing(
            base, blocking + ((UNRECORDED,) if unread else found), names, rules
        )
    transforms = tuple(
        _blocking(name) or t for t, name in zip(found, names, strict=True)
    )
    return Enclosing(base, transforms, names, rules)


def _blocking(name: str) -> Transform | None:
    """An Equinox loop or solve `equinox_loops` refuses, as a transform."""
    refused = equinox_loops.refusal(name)
    return None if refused is None else Transform(name, Rule.BLOCKS, *refused)


def transform_names(base: Any) -> tuple[str, ...]:
    """The transforms between here and `base`, innermost first: `vmap` for a
    `jax.vmap`, otherwise JAX's own name (`scan`, `cond`, ...), an Equinox
    loop or solve that blocks named after itself (not after the traces JAX
    opens for it), and `UNKNOWN_TRANSFORM` past a jaxpr trace whose parent
    this jax does not record."""
    trace = jax_internals.current_trace()
    found, traces = [], []
    while trace is not base:
        if trace is None:  # jax < 0.6.2
            found.append(unexpressible.UNKNOWN_TRANSFORM)
            traces.append(None)
            break
        found.append(unexpressible.name(trace))
        traces.append(trace)
        trace = jax_internals.parent(trace)
    if not found:
        return ()
    named = equinox_loops.blocking(traces, found)
    return tuple(
        named.get(id(trace), name) for trace, name in zip(traces, found, strict=True)
    )
