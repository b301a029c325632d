"""Keras's private API, all of it and only here.

- `current_path()`: the path of the name scope running now, which a layer's
  call opens (`Layer._open_name_scope`) and which prefixes the paths of its
  variables: a site's name;
- `Layer._flatten_layers`: every layer inside a layer, a shared one once.

No public API gives either. At import this module checks that each exists
and raises an error naming the supported versions where one does not: an
unsupported Keras fails at `bridge.probe`, never with a wrong number.
"""

from __future__ import annotations

from typing import Any

import keras

from bridge.adapter_api import unsupported

try:
    from keras.src.backend.common.name_scope import current_path as current_path
except ImportError as error:  # pragma: no cover (every Keras 3 tested has it)
    raise unsupported(
        "keras", "Keras", ["keras.src.backend.common.name_scope.current_path"]
    ) from error
if not hasattr(keras.Layer, "_flatten_layers"):  # pragma: no cover
    raise unsupported("keras", "Keras", ["keras.Layer._flatten_layers"])


def sublayers(layer: Any) -> list[Any]:
    """Every layer inside `layer`, nested ones too, `layer` itself left out:
    Keras's own walk, which lists a shared layer once."""
    return list(layer._flatten_layers(include_self=False, recursive=True))
