"""Where an NNX site is: the path each module of the probe's copy carries.

Each module of the copy carries its site path as a static attribute
(`PATH_ATTRIBUTE`), which survives NNX's split and merge inside transforms,
where the module is a new object.
"""

from __future__ import annotations

#: The static attribute naming a module of the copy: it survives NNX's
#: split and merge inside transforms, where the module is a new object.
PATH_ATTRIBUTE = "_bridge_path"


def is_bridge_attribute(name: str) -> bool:
    """Whether an attribute of a module of the copy is bridge's own."""
    return name == PATH_ATTRIBUTE
