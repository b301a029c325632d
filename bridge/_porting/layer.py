"""`Layer`: one call of a parameterised module, as porting sees it, and how
messages name it.

`transfer`, `compare`, the pairing and every library's porting module work
on `Layer`s, so the record lives apart from all of them: this module imports
none of them, and each imports it. Its weights are in the canonical layout
(the table in `bridge._porting.transfer`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class Layer:
    """One call of a parameterised module, as a library's porting module sees it.

    Attributes:
      site: the site name of the call (`path`, `path#1`, ...).
      path: the module's path.
      kind: `dense`, `conv`, `layernorm`, `rmsnorm`, `groupnorm`, `batchnorm`,
        `embed`, or `weights:<names>` (`bridge._porting.layer_kinds.weights_kind`).
      described: the module's class as its library names it (`nn.Dense`).
      weights: `{name: array or None}` in the canonical layout.
      to_common: maps one activation leaf to the common layout (channel-last,
        head axes flattened).
      select: picks the activation leaves to compare from the site's value
        (an Equinox stateful layer returns `(output, state)`).
      locations: where each canonical weight goes back, and how, for the
        library's `with_weights` (`LayerKinds` writes `{name: (where, back)}`).
      hyperparameters: `{name: value}` of what `transfer` does not move, in
        canonical names and conventions (`epsilon`, `momentum` as the weight
        of the running average kept, a convolution's explicit per-side
        `padding`, ...), for `compare` to list where a pair differs.
      tied: the path of the module whose weights these are, `""` when they
        are the layer's own (a tied LM head holds the embedding's tensor; the
        other library's tied head may own nothing, or be a call of the
        embedding's `attend`): such a layer is not paired by its weights;
        `compare` compares it with the other side's tied layer, if any, and
        reports it.
      optional: weights one library keeps where the other may have none (a
        PyTorch module's buffers, `final_logits_bias`): the layer pairs only
        with a layer of the same kind and shapes (the same names) on the
        other side, and is left out where there is none.
      activation: an element-wise function the layer applies to its output
        after its weights (a Keras `Dense(activation="gelu")`), `None` where
        it applies none: against a layer without one, `compare` passes the
        other side's value through it and this side's gradient back through
        it (`bridge._porting.compare_values`).
      parts: the layers packed into this one, where the other model holds
        their weights as one (Hugging Face GPT-2's `c_attn`, query, key and
        value in one `(in, 3 * out)` kernel, against three projections): the
        canonical weights are the parts' concatenated along the last axis, and
        go back split (`bridge._porting.pairing.packed`). Its `site` and
        `path` are the parts' joined by `+`
        (`self_attention/query+key+value`), `compare` reading its values as
        the parts' concatenated; the `site` is `""` where a part has none.
    """

    site: str
    path: str
    kind: str
    described: str
    weights: dict[str, Any]
    to_common: Callable[[Any], Any] = lambda value: value
    select: Callable[[Any], list] = lambda value: jax.tree.leaves(value)
    locations: Any = None
    hyperparameters: dict[str, Any] = dataclasses.field(default_factory=dict)
    tied: str = ""
    optional: bool = False
    activation: Callable[[Any], Any] | None = None
    parts: tuple[Layer, ...] = ()


def label(layer: Layer) -> str:
    return (
        f"site {layer.site!r}"
        if layer.site
        else repr(layer.path)
        if layer.path
        else "the root module"
    )


def described_tie(layer: Layer, name: str) -> str:
    return f"{label(layer)} ({layer.described}) of {name}, tied to {layer.tied!r}"
