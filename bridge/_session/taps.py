"""Taps: `bridge.tap(name, value)`, a named value inside the model's code.

A tap is a site without a module, named under the call running now. Where
its value is seen in the trace the session runs in, the session takes it
like a module call's (`Session.tap_here`); an adapter whose library runs the
tap inside a transform of its own routes it first (`Taps.tapping`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


class Taps:
    """The adapter's route for the taps of one session (`session.taps`)."""

    def __init__(self):
        #: `(name, value) -> value`, installed by `tapping`; `None`: none.
        self.route: Callable[[str, Any], Any] | None = None

    @contextlib.contextmanager
    def tapping(self, route: Callable[[str, Any], Any]) -> Iterator[None]:
        """Within it, `bridge.tap(name, value)` calls `route(name, value)`: an
        adapter whose taps can run inside its library's transforms hands the
        value out (or refuses it) there, then calls `session.tap_here`."""
        previous = self.route
        self.route = route
        try:
            yield
        finally:
            self.route = previous
