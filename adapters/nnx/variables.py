"""bridge's variables on an NNX probe's copy, and where a site is.

Each module of the copy carries its site path as a static attribute
(`PATH_ATTRIBUTE`), which survives NNX's split and merge inside transforms,
where the module is a new object. A site inside an NNX transform keeps its
epsilon, patch value and recording in bridge's own `nnx.Param` subclasses on
its module (`BridgeVariable`), which the transform carries exactly as it
carries the module's parameters.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from bridge.adapter_api import SiteOrigin, is_carrier_name

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
