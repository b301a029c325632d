"""One run of a Keras model, each layer's call reported to the session.

Keras 3 has no interceptor: `Layer.__call__` (dtype conversion, masks, the
name scope, the `training` flag) ends by calling the layer's `call`, read
from the instance. While a probe runs, each layer of the model answers
`call` with a function that reports the call to the session of the thread
running it and calls the layer's own `call`; another thread, or the model
called outside a probe, goes straight to the layer's own. The layers are left
as they were when the run ends. A site's name is the path Keras's name scope
gives the call (the prefix of its variables' paths), relative to the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

from bridge.adapter_api import Session

from . import internals


@dataclasses.dataclass
class _Run:
    session: Session
    #: The model run: its sites are named relative to it.
    model: Any


_runs = threading.local()
_lock = threading.Lock()
#: `id(layer) -> [layer, the layer's own instance attribute 'call' or None,
#: how many runs hold it]`.
_installed: dict[int, list] = {}


def _innermost() -> _Run | None:
    stack = getattr(_runs, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def reporting(model: Any, session: Session) -> Iterator[None]:
    """While the block runs, every call of a layer of `model` in this thread
    is reported to `session`."""
    # `stateless_call` calls the model's `call` itself, not through
    # `Layer.__call__`: the model is no site.
    layers = internals.sublayers(model)
    with _lock:
        for layer in layers:
            _install(layer)
    stack = _runs.__dict__.setdefault("stack", [])
    stack.append(_Run(session, model))
    try:
        yield
    finally:
        stack.pop()
        with _lock:
            for layer in layers:
                _uninstall(layer)


def _install(layer: Any) -> None:
    held = _installed.get(id(layer))
    if held is not None:
        held[2] += 1
        return
    own = layer.__dict__.get("call")
    _installed[id(layer)] = [layer, own, 1]
    original = own if own is not None else type(layer).call.__get__(layer)
    # Past Keras's `__setattr__`, which tracks a layer's state.
    object.__setattr__(layer, "call", _reported(layer, original))


def _uninstall(layer: Any) -> None:
    held = _installed[id(layer)]
    held[2] -= 1
    if held[2]:
        return
    del _installed[id(layer)]
    if held[1] is None:
        object.__delattr__(layer, "call")
    else:
        object.__setattr__(layer, "call", held[1])


def _reported(layer: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        run = _innermost()
        if run is None:
            return original(*args, **kwargs)
        session = run.session
        entered = session.enter(
            relative(internals.current_path(), run.model), None, layer, args
        )
        return session.exit(entered, original(*args, **kwargs))

    call.__wrapped__ = original
    return call


def _own_path(model: Any) -> str:
    return model.path or model.name


def relative(path: str, model: Any) -> str:
    """`path` (a layer's or a variable's) relative to `model`'s: the layers
    built inside the model's name scope have its path as a prefix; those of
    a functional model, built before the model, have none."""
    prefix = f"{_own_path(model)}/"
    return path[len(prefix) :] if path.startswith(prefix) else path
