"""A Keras 2 (`tf.keras`, `tf_keras`) model, refused without importing Keras:
where Keras 2 is installed, `import keras` is Keras 2."""

from __future__ import annotations

from typing import Any

from bridge.adapter_api import BridgeTypeError


def probe(model: Any, *variables: Any, vmap: bool = False) -> Any:
    raise BridgeTypeError(
        f"`model` is a Keras 2 (tf.keras) {type(model).__qualname__}, not a Keras 3 "
        "model. bridge probes Keras 3 on the JAX backend: install keras>=3, set "
        "KERAS_BACKEND=jax before `import keras`, and build the model with "
        "`keras` rather than `tf.keras`."
    )
