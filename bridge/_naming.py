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
from collections.abc import Hashable, Iterator
from typing import TYPE_CHECKING, Any

from ._sites import SiteOrigin, site_name

if TYPE_CHECKING:
    from ._session import Session


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


class Naming:
    """The names given so far in one trace, and the calls running now."""

    def __init__(self):
        self._counts: dict[str, int] = {}
        self._enclosing: list[str] = []

    def enter(
        self, path: str, method: str | None, module: Any, origin: SiteOrigin | None
    ) -> Call:
        """Name a call as it starts, and count it."""
        base = path if method is None else f"{path}.{method}"
        index = self._counts.get(base, 0)
        self._counts[base] = index + 1
        self._enclosing.append(path)
        return Call(
            site_name(path, method, index), path, method, index, module, origin, -1
        )

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


class SessionPart:
    """A part of a session that refers back to it (its carrier, taps,
    recorder, body traces), weakly: the session holds its parts, so a strong
    reference back would make a cycle, and a cycle keeps everything the
    session holds — a PyTorch run's recorded tensors and gradient slots, a
    whole training step's memory — alive until the garbage collector runs."""

    def __init__(self, session: Session):
        self._session_ref = weakref.ref(session)

    @property
    def _session(self) -> Session:
        return self._session_ref()


class BodyTraces(SessionPart):
    """Where the traces of lifted bodies began, for a library that traces a
    body more than once (Flax's `nn.scan` traces its body twice, Haiku's
    `layer_stack` once per `init` and `apply` pass). A repeated trace is the
    same code, not new calls: it re-uses the names of the first, so a site
    inside it is one site, never `#1`."""

    def __init__(self, session: Session):
        super().__init__(session)
        self._starts: dict[Hashable, Any] = {}

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
