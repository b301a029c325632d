"""Hugging Face Flax model objects (`FlaxPreTrainedModel`): their Linen
`module`, probed with their `params`.

The object is a wrapper: its `__call__` fills in defaults (the attention
mask, position ids) and calls `module.apply({"params": params}, ...)`. The
probe is that of the module, so the model's inputs are the module's own
positional arguments (for GPT-2: `input_ids, attention_mask, position_ids`).
"""

from __future__ import annotations

from typing import Any

from bridge.adapter_api import BridgeValueError

from .probe import LinenProbe
from .probe import probe as linen_probe


def probe(model: Any, *variables: Any, vmap: bool = False) -> LinenProbe:
    """`bridge.probe(model.module, {"params": model.params})`, or with the
    variables given (say, fine-tuned parameters)."""
    if not variables:
        try:
            params = model.params
        except ValueError as error:  # made with `_do_init=False`: no params
            raise BridgeValueError(
                f"This {type(model).__name__} holds no parameters (it was made "
                "with _do_init=False): pass them, bridge.probe(model, {'params': "
                "params}) with params = model.init_weights(key, input_shape)."
            ) from error
        variables = ({"params": params},)
    return linen_probe(model.module, *variables, vmap=vmap)
