"""Naming the calls of one trace: `path[.method][#k]`, in call-entry order.

The same code always gives the same names: a call is named by its module's
path, its method and how many calls of the same `path[.method]` came before
it. A library that traces a lifted body more than once (Flax's `nn.scan`
traces it twice, the first time in a partial evaluation it discards) counts
the second trace's calls again, but only the kept trace's markers are in
the computation, and the sites are numbered again from them (`renumbered`,
`renames_of`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .sites import Site, SiteOrigin, site_name


@dataclasses.dataclass
class Call:
    """A submodule call between `Session.enter` and `Session.exit`.

    `slot` is where discovery lists its `Site` (sites are ordered by call
    entry, and a call's value is known only at its exit); `-1` in a run.
    """

    name: str
    path: str
    method: str | None
    index: int
    module: Any
    origin: SiteOrigin | None
    slot: int


#: What a call seen only in a trace JAX discards is named in a run: a name
#: no selection, patch or recording uses.
DISCARDED = "~discarded"


def renames_of(sites: Sequence[Site]) -> Mapping[str, tuple[str, int]] | None:
    """`{name counted while tracing: (public name, public index)}` for a run,
    where discovery found a trace that JAX discards (`Site.traced_as`), else
    `None`: names are then counted as they come."""
    if not any(site.traced_as for site in sites):
        return None
    return {site.traced_as or site.name: (site.name, site.index) for site in sites}


def renumbered(sites: Sequence[Site], kept: Callable[[Site], bool]) -> list[Site]:
    """The sites `kept` keeps, numbered again in call order: the calls of a
    discarded trace (a scan body JAX traced twice) are no calls, so the
    first call kept is `path`, not `path#1`."""
    counts: dict[str, int] = {}
    found = []
    for site in sites:
        if not kept(site):
            continue
        base = site.path if site.method is None else f"{site.path}.{site.method}"
        index = counts.get(base, 0)
        counts[base] = index + 1
        name = site_name(site.path, site.method, index)
        traced_as = site.traced_as or site.name
        found.append(
            dataclasses.replace(
                site,
                name=name,
                index=index,
                traced_as=None if traced_as == name else traced_as,
            )
        )
    return found


class Naming:
    """The names given so far in one trace, and the calls running now.

    `renames` (`renames_of`): the public name of each call as counted while
    tracing, where discovery found a discarded trace; a call it does not
    know was seen only in such a trace and is named out of reach
    (`DISCARDED`)."""

    def __init__(self, renames: Mapping[str, tuple[str, int]] | None = None):
        self._counts: dict[str, int] = {}
        self._enclosing: list[str] = []
        self._renames = renames

    def enter(
        self, path: str, method: str | None, module: Any, origin: SiteOrigin | None
    ) -> Call:
        """Name a call as it starts, and count it."""
        base = path if method is None else f"{path}.{method}"
        index = self._counts.get(base, 0)
        self._counts[base] = index + 1
        self._enclosing.append(path)
        name = site_name(path, method, index)
        if self._renames is not None:
            name, index = self._renames.get(name, (name + DISCARDED, index))
        return Call(name, path, method, index, module, origin, -1)

    def exit(self) -> None:
        """The call entered last has returned."""
        self._enclosing.pop()

    @property
    def enclosing(self) -> tuple[str, ...]:
        """The paths of the calls running now, outermost first."""
        return tuple(self._enclosing)

    def under_enclosing(self, name: str) -> str:
        """The path of `name` inside the call running now (a `bridge.tap`)."""
        return f"{self._enclosing[-1]}/{name}" if self._enclosing else name

    def counts(self) -> dict[str, int]:
        """How many calls of each `path[.method]` were named so far."""
        return dict(self._counts)
