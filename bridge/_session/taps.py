"""Taps: `bridge.tap(name, value)`, a named value inside the model's code.

A tap is a site without a module, named under the call running now. Where
its value is seen in the trace the session runs in, the session takes it
like a module call's (`tap_here`); an adapter whose library runs the tap
inside a transform of its own routes it first (`tapping`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .naming import SessionPart

if TYPE_CHECKING:
    from .session import Session


class Taps(SessionPart):
    """The taps of one session (`session.taps`)."""

    def __init__(self, session: Session):
        super().__init__(session)
        self._handler: Callable[[str, Any], Any] | None = None

    def tap(self, name: str, value: Any) -> Any:
        """A named value inside the model's code (`bridge.tap`): the adapter's
        handler where one is installed (`tapping`), else `tap_here`."""
        if self._handler is not None:
            return self._handler(name, value)
        return self.tap_here(name, value)

    def tap_here(self, name: str, value: Any) -> Any:
        """A site without a module, named under the enclosing call, whose value
        is seen in the trace the session runs in."""
        session = self._session
        path = session.naming.under_enclosing(name)
        return session.exit(session.enter(path, None, None), value)

    @contextlib.contextmanager
    def tapping(self, handler: Callable[[str, Any], Any]) -> Iterator[None]:
        """Within it, `bridge.tap(name, value)` calls `handler(name, value)`:
        an adapter whose taps can run inside its library's transforms hands
        the value out (or refuses it) there, then calls `tap_here`."""
        previous = self._handler
        self._handler = handler
        try:
            yield
        finally:
            self._handler = previous
