"""Keras's private API, all of it and only here: the name scope a layer's call
runs in, which gives the path Keras names the layer's variables by."""

from __future__ import annotations

from keras.src.backend.common.name_scope import current_path as current_path


def sublayers(layer):
    """Every layer inside `layer`, nested ones too, `layer` itself left out:
    Keras's own walk (`Layer._flatten_layers`), which lists a shared layer
    once."""
    return list(layer._flatten_layers(include_self=False, recursive=True))
