"""The NNX adapter's rules for the call router (`bridge.adapter_api.route`):
how a call reaches its site inside each of NNX's transforms, and NNX's way
out where JAX's (`JAX_RULES`) is not NNX's users'.

JAX's transforms are read off JAX's trace stack by their trace names
(`bridge.adapters.shared.unexpressible.route`); NNX's are known by the
update-context tags they push (`internals.active_transforms`), which say
nothing of where they stand among JAX's traces, so the adapter routes them
on their own (`enclosing`) and asks JAX's traces where they flow
(`bridge.adapters.nnx.transforms`). An `nnx.scan` counts its iterations
while a probe runs, so a call no carrier takes in its body is routed again
with it a loop of known bounds (`SCAN_LOOP`, `scans_as_loops`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from bridge.adapter_api import (
    BRANCH,
    COUNTED_SCAN,
    JAX_RULES,
    LOOP_AMONG,
    TRACED_BOUNDS,
    TRACED_BOUNDS_FIX,
    UNBOUNDED_LOOP,
    Route,
    Rule,
    Transform,
    count_scans_of,
    route,
)

from . import internals


def _not_ridden(transform: str, per: str = "") -> str:
    return (
        f"bridge's variables on the module do not ride through {transform} of "
        f"the model's own code, so no epsilon can enter and no value leave it{per}"
    )


_OVER_STACKED = "write the loop as an nnx.scan over stacked layers"
_REMAT = "rematerialise with nnx.remat, which carries them"
_FIXED_LENGTH = "write the loop as an nnx.scan of fixed length"
_OTHER_OUT = "move the other transform out of the loop, or " + _OVER_STACKED

#: Where a transform differs from `JAX_RULES`: JAX's by its trace's name,
#: NNX's by its own (`transform`). NNX carries bridge's variables (its
#: `nnx.Param`s on the module) through `nnx.scan`, `nnx.vmap` and
#: `nnx.remat` as it carries the module's parameters; while a probe runs the
#: model's own jits run inline (`bridge._session.jit`).
RULES: dict[str, Transform] = {
    "scan": Transform(
        "jax.lax.scan",
        Rule.BLOCKS,
        _not_ridden("a jax.lax.scan", " per iteration"),
        _OVER_STACKED,
    ),
    "checkpoint / remat": Transform(
        "jax.checkpoint", Rule.BLOCKS, _not_ridden("a jax.checkpoint"), _REMAT
    ),
    "checkpoint": Transform(  # jax < 0.5
        "jax.checkpoint", Rule.BLOCKS, _not_ridden("a jax.checkpoint"), _REMAT
    ),
    "fori_loop": dataclasses.replace(JAX_RULES["fori_loop"], fix=_OTHER_OUT),
    "while_body": dataclasses.replace(JAX_RULES["while_body"], fix=_FIXED_LENGTH),
    "while_cond": dataclasses.replace(JAX_RULES["while_cond"], fix=_FIXED_LENGTH),
    "nnx.scan": Transform("nnx.scan", Rule.CARRIES),
    "nnx.vmap": Transform("nnx.vmap", Rule.CARRIES),
    "nnx.remat": Transform("nnx.remat", Rule.CARRIES),
    "nnx.jit": Transform("nnx.jit", Rule.THROUGH),
    "nnx.cond": Transform(
        "nnx.cond",
        Rule.FLOWS,
        BRANCH,
        "compute both branches and pick with jnp.where",
        nests=False,
    ),
    "nnx.switch": Transform(
        "nnx.switch",
        Rule.FLOWS,
        BRANCH,
        "compute every branch and pick with jnp.where",
        nests=False,
    ),
    "nnx.fori_loop": Transform(
        "nnx.fori_loop", Rule.FLOWS, LOOP_AMONG, _OTHER_OUT, nests=False
    ),
    "nnx.fori_loop (traced bounds)": Transform(
        "nnx.fori_loop", Rule.BLOCKS, TRACED_BOUNDS, TRACED_BOUNDS_FIX
    ),
    "nnx.while_loop": Transform(
        "nnx.while_loop", Rule.BLOCKS, UNBOUNDED_LOOP, _FIXED_LENGTH
    ),
    # No update context: NNX's transform runs the module as a pytree.
    "tree mode": Transform(
        "an NNX transform with graph=False or graph_updates=False",
        Rule.BLOCKS,
        "it runs the module as a pytree, which carries none of bridge's "
        "variables on the module",
        "use the transform in graph mode (the default)",
    ),
}

#: An `nnx.scan` as a loop of known bounds: while a probe runs the scan
#: counts its iterations (`count_scans_of`), so a call in its body that no
#: carrier takes (one in a branch or a loop of the model's own there) is one
#: in a loop of known bounds, taking its row of the epsilon by the counter
#: (`scans_as_loops`).
SCAN_LOOP = Transform(
    "nnx.scan",
    Rule.FLOWS,
    LOOP_AMONG,
    "move the other transform out of the nnx.scan, or unroll the loop",
    nests=False,
)
count_scans_of(internals.SCAN_MODULE)

#: JAX's names of the traces NNX's carrying transforms run their bodies in
#: (`unexpressible.within`): an `nnx.scan`'s counts its iterations.
BODIES = {
    "nnx.scan": frozenset({"scan", COUNTED_SCAN}),
    "nnx.vmap": frozenset({"vmap"}),
    "nnx.remat": frozenset({"checkpoint / remat", "checkpoint"}),
}

#: The JAX trace a `fori_loop` of traced bounds runs in (`jax_internals`).
_TRACED_FORI = JAX_RULES["fori_loop (traced bounds)"]


def name(tag: Any) -> str:
    """An NNX transform's name (`nnx.scan`), from its update-context tag."""
    if isinstance(tag, str):
        return f"nnx.{tag.removesuffix('_body')}"
    kind = type(tag).__name__.lower()
    for transform in ("jit", "shard_map", "pmap", "cond", "switch"):
        if transform in kind:
            return f"nnx.{transform}"
    return f"an NNX transform ({type(tag).__name__})"


def transform(tag: Any, jax_enclosing: Iterable[Transform] = ()) -> Transform:
    """The NNX transform of an update-context tag, with its rule; an
    `nnx.fori_loop` whose bounds are traced where `jax_enclosing` (JAX's
    transforms around the call) holds JAX's loop of traced bounds."""
    named = name(tag)
    if named == "nnx.fori_loop" and _TRACED_FORI in jax_enclosing:
        return RULES["nnx.fori_loop (traced bounds)"]
    return RULES.get(named) or Transform(
        named,
        Rule.BLOCKS,
        "bridge carries its variables through nnx.scan, nnx.vmap and nnx.remat only",
        "use one of those transforms",
    )


def enclosing(
    tags: Iterable[Any],
    jax_enclosing: Iterable[Transform] = (),
    tap: str | None = None,
) -> tuple[Transform, ...]:
    """NNX's transforms of `tags` (outermost first), innermost first, as
    `transform` gives them (as `tap_blocked` gives them around a
    `bridge.tap(tap, ...)`): one transform's tags in a row (`nnx.fori_loop`'s
    loop and body) are one."""
    jax_enclosing = tuple(jax_enclosing)
    found = [
        transform(tag, jax_enclosing) if tap is None else tap_blocked(tag, tap)
        for tag in reversed(tuple(tags))
    ]
    return tuple(t for i, t in enumerate(found) if i == 0 or t != found[i - 1])


def for_tap(tap: str) -> dict[str, Transform]:
    """JAX's rules and `RULES` for a `bridge.tap(tap, ...)`: each reason
    says the tap is called there, each way out starts by tapping the value
    outside the transform."""
    return {
        key: dataclasses.replace(
            t,
            why=f"bridge.tap({tap!r}, ...) is called there: {t.why}",
            fix="tap the value outside it, or " + t.fix,
        )
        for key, t in {**JAX_RULES, **RULES}.items()
    }


def tap_blocked(tag: Any, tap: str) -> Transform:
    """An NNX transform around a `bridge.tap(tap, ...)`: where the value is a
    tracer of the transform's trace, bridge does not carry it out yet."""
    return Transform(
        name(tag),
        Rule.BLOCKS,
        f"bridge.tap({tap!r}, ...) is called there, and bridge does not carry "
        "taps out of NNX transforms yet",
        "tap the value outside the transform, or select the call of the module "
        "that computes it",
    )


def scans_as_loops(enclosing: Iterable[Transform]) -> tuple[Transform, ...]:
    """`enclosing` (innermost first) with each `nnx.scan` a loop of known
    bounds (`SCAN_LOOP`): how a call that no carrier takes there is routed
    again."""
    scan = RULES["nnx.scan"]
    return tuple(SCAN_LOOP if t == scan else t for t in enclosing)


def in_tree_mode(site: str) -> Route:
    """The route of a call at `site` where an NNX transform runs the module
    as a pytree (no update context of its own)."""
    return route(site, (RULES["tree mode"],))
