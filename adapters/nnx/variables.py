"""bridge's variables on an NNX probe's copy, and where a site is.

Each module of the copy carries its site path as a static attribute
(`PATH_ATTRIBUTE`), which survives NNX's split and merge inside transforms,
where the module is a new object. A site inside an NNX transform keeps its
epsilon, patch value and recording in bridge's own `nnx.Param` subclasses on
its module (`BridgeVariable`), which the transform carries exactly as it
carries the module's parameters: placed on the copy before the call and
read back after it (`CopyVariables`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from flax import nnx

from bridge.adapter_api import (
    BridgeValueError,
    Session,
    Site,
    SiteOrigin,
    is_carrier_name,
)

from ..shared import unexpressible
from . import internals

#: The static attribute naming a module of the copy: it survives NNX's
#: split and merge inside transforms, where the module is a new object.
PATH_ATTRIBUTE = "_bridge_path"


class BridgeVariable(nnx.Param):
    """bridge's variables on the private copy. Subclasses of `nnx.Param`, so
    they ride wherever the model's transforms send its parameters (a
    `StateAxes({nnx.Param: 0, ...: None})` too); never in `grads` or `state`."""


class Carried(BridgeVariable):
    """A site's epsilon or patch value, stacked like the site: sliced per
    iteration going in."""


class Recording(BridgeVariable):
    """A site's `(value, inputs)` recorded inside a transform: stacked coming out."""


@dataclasses.dataclass(frozen=True)
class Origin(SiteOrigin):
    """Where an NNX site lives: the module's path, and whether its calls run
    inside an NNX transform of the model's own code (named in `transforms`).

    For a module that `nnx.scan` carries, `scan` is `(length, reverse)`, and
    `value` and `inputs` are the abstract value (floating leaves) and
    positional arguments of one step: its stacked epsilon, recording and step
    counter ride in the carry, shaped before the call.
    """

    path: str
    transforms: tuple[str, ...] = ()
    scan: tuple[int, bool] | None = None
    value: Any = None
    inputs: Any = None


def is_bridge_attribute(name: str) -> bool:
    """Whether an attribute of a module of the copy is bridge's own."""
    return name == PATH_ATTRIBUTE or is_carrier_name(name)


class CopyVariables:
    """bridge's variables on the modules of one run's copy (`modules`, by
    path): placed before the call, read back after it.

    Discovery's second pass (`markers`) places a `(length,)` marker on each
    module of `candidates` (`{(path, step key): scan length}`, see
    `transforms.Lifted`); after the call a marker (or a recording buffer)
    still holding the very array placed was dropped: the transform
    broadcast the module, which raises.
    """

    def __init__(
        self,
        modules: dict[str, nnx.Module],
        candidates: dict[tuple[str, str], int],
        markers: bool,
    ):
        self.modules = modules
        # `(path, key) -> the array placed`: after the call, a variable still
        # holding it was not carried out (the module was broadcast).
        self.placed: dict[tuple[str, str], Any] = {}
        # `(path, step key, transform names)` of the markers to check, in
        # call order (`carried.discover`).
        self.checks: list[tuple[str, str, tuple[str, ...]]] = []
        if markers:
            for (path, key), length in candidates.items():
                marker = jnp.zeros((length,), jnp.int32)
                setattr(modules[path], key, Carried(marker))
                self.placed[path, key] = marker

    def place(self, session: Session) -> None:
        """Put on its module what the carrier's `to_carry_in` gives for each
        selected or patched site inside a transform: its epsilon and patch value,
        stacked like the site, and for a site inside a carrying `nnx.scan` its
        step counter and, if selected, its recording rows."""

        def inside_transform(site: Site) -> bool:
            return isinstance(site.origin, Origin) and bool(site.origin.transforms)

        unexpressible.refuse_patched(session)
        carrier = session.carrier
        for placed in carrier.to_carry_in(inside_transform, inside_transform):
            module = self.modules[placed.site.origin.path]
            if placed.kind == "recording":
                setattr(module, placed.name, Recording(placed.value))
                self.placed[placed.site.origin.path, placed.name] = placed.value
            else:
                setattr(module, placed.name, Carried(placed.value))

    def hand_over(self, session: Session) -> None:
        """Give the session the values recorded inside transforms, as they left."""
        for path, key, names in self.checks:
            if (
                internals.get_value(vars(self.modules[path]).get(key))
                is self.placed[path, key]
            ):
                raise broadcast_error(path, names)
        session.carrier.hand_over(self._recorded)

    def _recorded(self, where: tuple) -> tuple[Any, Any]:
        """A value recorded inside transforms, as it left them on the copy."""
        path, key, names = where
        recording = vars(self.modules[path]).get(key)
        if recording is None:
            raise BridgeValueError(
                f"bridge cannot see through {' inside '.join(reversed(names))} "
                f"around '{path}': its values did not come out with the module's "
                "parameters, so a perturbation there would be silently dropped. "
                "Select sites outside it."
            )
        if internals.get_value(recording) is self.placed.get((path, key)):
            raise broadcast_error(path, names)
        return internals.get_value(recording)


def broadcast_error(path: str, names: tuple[str, ...]) -> ValueError:
    """The error where the innermost of `names` broadcast the module at `path`:
    bridge's variables on it did not come out."""
    return BridgeValueError(
        f"bridge cannot see through this {names[-1]} around '{path}': it "
        "broadcasts the module (in_axes=None for it, or None for its "
        "parameters in nnx.StateAxes), so one epsilon would serve every "
        "iteration (or mapped example) and their gradients would be summed. "
        "Select sites outside it, or map the module over its stacked "
        "parameters (in_axes=0)"
        + (
            ", or carry it (nnx.Carry for it in nnx.StateAxes)."
            if names[-1] == "nnx.scan"
            else "."
        )
    )
