"""Naming the calls of one trace: `path[.method][#k]`, in call-entry order.

The same code always gives the same names: a call is named by its module's
path, its method and how many calls of the same `path[.method]` came before
it. A library that traces a lifted body more than once (Flax's `nn.scan`
traces it twice) would count the second trace's calls as new ones;
`BodyTraces` makes a repeated trace re-use the first one's names.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from .sites import Site, SiteOrigin, site_name


class Restorable(Protocol):
    """What `BodyTraces` needs of a session: its naming state, to go back to."""

    def checkpoint(self) -> Any: ...

    def restore(self, checkpoint: Any) -> None: ...


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

    def checkpoint(self) -> tuple[dict[str, int], int]:
        return dict(self._counts), len(self._enclosing)

    def restore(self, checkpoint: tuple[dict[str, int], int]) -> None:
        counts, depth = checkpoint
        self._counts = dict(counts)
        del self._enclosing[depth:]


class BodyTraces:
    """Where the traces of lifted bodies began, for a library that traces a
    body more than once (Flax's `nn.scan` traces its body twice, Haiku's
    `layer_stack` once per `init` and `apply` pass). A repeated trace is the
    same code, not new calls: it re-uses the names of the first, so a site
    inside it is one site, never `#1`.

    An adapter's helper, not a part of the session: it holds the session
    weakly, as an adapter may keep it where the session's own records reach
    it, and a cycle would keep everything the session holds (a PyTorch
    run's recorded tensors, a training step's memory) alive until the
    garbage collector runs."""

    def __init__(self, session: Restorable):
        self._session_ref = weakref.ref(session)
        self._starts: dict[Hashable, Any] = {}

    @property
    def _session(self) -> Restorable:
        return self._session_ref()

    def begin(self, key: Hashable) -> None:
        """A trace of body `key` begins now; a later one begins here again."""
        self._starts[key] = self._session.checkpoint()

    def again(self, key: Hashable) -> None:
        """Body `key` is traced again: forget the calls since its first began."""
        self._session.restore(self._starts[key])

    def begin_or_again(self, key: Hashable) -> None:
        """A call that starts body `key`'s trace: its first, or a repeat."""
        if key in self._starts:
            self.again(key)
        else:
            self.begin(key)

    def clear(self) -> None:
        """A new call of the transform: its body's traces are new calls."""
        self._starts.clear()

    def __iter__(self) -> Iterator[Hashable]:
        """The keys of the bodies whose traces have begun."""
        return iter(list(self._starts))
