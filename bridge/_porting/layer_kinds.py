"""The porting modules' layer kinds: one table of converters per library.

A library's porting module declares its kinds once, `LayerKinds({nn.Dense:
dense, nn.Conv: conv, ...}, named="nn.")`: each converter reads one call of a
parameterised module (`ParameterisedCall`) into its kind and canonical weights
(`Converted`, see `bridge._porting.transfer`'s table). The table is looked up along the
module's class MRO, so a subclass converts as its nearest listed base, and a
class listed with `None` has no kind whatever its bases. A class may be listed
by its qualified name, `"transformers.pytorch_utils.Conv1D"`: matched by name
along the MRO, it never needs its library imported (an adapter must not import
transformers). A module without a kind, or whose converter returns `None` (a
Linen `Dense` without a kernel), is of kind `weights:<its weights' names>`
(`weight_by_weight`). Building each `Layer`, and listing where each given
weight goes back (`placed`, for `with_weights`), are done here for all
libraries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from .._session.sites import Site
from .hyperparameters import norm_hyperparameters
from .layer import Layer
from .layout import flattened


def _unchanged(value: Any) -> Any:
    return value


@dataclasses.dataclass(frozen=True)
class Weight:
    """One canonical weight: its value (`None` where the module has none),
    where it goes back (library-private), and `back`, its conversion from the
    canonical layout to the library's."""

    value: Any
    where: Any
    back: Callable[[Any], Any] = _unchanged


@dataclasses.dataclass(frozen=True)
class Converted:
    """What a converter reads off one call: the `Layer` fields that depend on
    the module's kind. `to_common` and `select` left `None` are the table's
    and `Layer`'s defaults; `activation` is `Layer.activation`."""

    kind: str
    weights: Mapping[str, Weight]
    hyperparameters: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    to_common: Callable[[Any], Any] | None = None
    select: Callable[[Any], list] | None = None
    activation: Callable[[Any], Any] | None = None


@dataclasses.dataclass(frozen=True)
class ParameterisedCall:
    """One call of a module that owns weights, as a converter reads it.

    Attributes:
      site: the call's site (the root module's has the name and path `""`).
      module: the module called.
      own: the weights it holds itself, by the library's names.
      at: where they go back: a weight `name` to `(*at, name)`.
      statistics: what it keeps besides, by name (Flax's running statistics,
        PyTorch's buffers), going back to `(*statistics_at, name)` (`at` when
        `None`).
      probe: the probe, for what a library's converters read off it.
    """

    site: Site
    module: Any
    own: Mapping[str, Any]
    at: tuple
    statistics: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    statistics_at: tuple | None = None
    probe: Any = None

    def weight(
        self,
        name: str,
        read: Callable[[Any], Any] = _unchanged,
        back: Callable[[Any], Any] = _unchanged,
        *,
        statistic: bool = False,
    ) -> Weight:
        """The weight `name` (of `statistics` with `statistic=True`),
        converted to the canonical layout by `read` and back by `back`."""
        arrays, at = self.own, self.at
        if statistic:
            arrays, at = self.statistics, self.statistics_at or self.at
        value = arrays.get(name)
        return Weight(None if value is None else read(value), (*at, name), back)

    def flat(self, name: str, *, statistic: bool = False) -> Weight:
        """A vector weight (a scale, a bias, a statistic), flattened behind
        the iteration axes of a scanned layer."""
        return self.weight(
            name, lambda value: flattened(value, self.site.stacked), statistic=statistic
        )


Converter = Callable[[ParameterisedCall], Converted | None]


def weights_kind(names: Iterable[str]) -> str:
    """The kind of a module bridge knows no layout of: its weights' names,
    `weights:cls_token,position_embeddings`."""
    return "weights:" + ",".join(sorted(names))


def class_kind(module: Any) -> str:
    """The kind of a library's module whose layout bridge knows but cannot
    convert (a transposed convolution's `(in, out, *window)` kernel)."""
    cls = type(module)  # a reporting subclass keeps the module and name
    return f"module:{cls.__module__}.{cls.__qualname__}"


def weight_by_weight(
    call: ParameterisedCall,
    weights: Mapping[str, Weight] | None = None,
    *,
    same_class: bool = False,
) -> Converted:
    """A layer of a module bridge has no converter for: `weights` (its own
    weights as they are by default), moved unchanged, by name.

    A module of the model's own (a ViT embeddings module's `cls_token`, a
    model's own RMSNorm class) pairs with any module whose weights have the
    same names and shapes: the rule of Hugging Face's own PyTorch-to-Flax
    converter for such weights. A library's module listed as having no kind
    (`same_class=True`) pairs only with a module of its own class: its
    layout is known to differ from the other libraries'.
    """
    if weights is None:
        weights = {name: call.weight(name) for name in call.own}
    kind = class_kind(call.module) if same_class else weights_kind(weights)
    return Converted(kind, weights)


def weight_rmsnorm(
    call: ParameterisedCall,
    epsilon: Any,
    read: Callable[[Any], Any],
    offset: float = 0.0,
) -> Converted:
    """An RMSNorm of a model's own that keeps its scale as `weight`, less
    `offset` (Gemma's scale is `1 + weight`); `read` flattens a weight in
    the library's layout. The offset is added and taken off in float64,
    where both are exact for float32 weights: a port moves them unchanged."""
    scale = call.weight(
        "weight",
        lambda weight: np.asarray(read(weight), np.float64) + offset,
        lambda scale: np.asarray(scale, np.float64) - offset,
    )
    return Converted(
        "rmsnorm", {"scale": scale}, norm_hyperparameters(epsilon, use_scale=True)
    )


class LayerKinds:
    """A library's converters, `{module class: converter or None}`.

    Args:
      converters: the table, looked up along a module's class MRO; a key may
        be a class's `"module.QualifiedName"` instead of the class.
      named: the prefix of a module's class in messages (`"nn."`).
      home: the library's package (`"flax."`): a class from elsewhere (a
        model's own) is named in full in messages.
      to_common: `to_common(call)`, the activation layout of a layer whose
        converter sets none (identity by default).
      kept_without_weights: classes that are layers even when they own no
        weights (a BatchNorm without scale and bias has running statistics).
    """

    def __init__(
        self,
        converters: Mapping[type | str, Converter | None],
        *,
        named: str,
        home: str,
        to_common: Callable[[ParameterisedCall], Callable[[Any], Any]] | None = None,
        kept_without_weights: tuple[type, ...] = (),
    ):
        self.converters = dict(converters)
        self.named = named
        self.home = home
        self.to_common = to_common
        self.kept_without_weights = kept_without_weights

    def _listed(self, module: Any) -> tuple[bool, bool, Converter | None]:
        """`(listed, listed by name, converter)` of the nearest listed class."""
        for cls in type(module).__mro__:
            if cls in self.converters:
                return True, False, self.converters[cls]
            name = f"{cls.__module__}.{cls.__qualname__}"
            if name in self.converters:
                return True, True, self.converters[name]
        return False, False, None

    def converter(self, module: Any) -> Converter | None:
        return self._listed(module)[2]

    def described(self, module: Any) -> str:
        """`nn.Dense` for the library's own class, the qualified name of any
        other (a model's own, or another library's listed by name)."""
        cls = type(module)
        _, by_name, _ = self._listed(module)
        if cls.__module__.startswith(self.home) and not by_name:
            return f"{self.named}{cls.__name__}"
        return f"{cls.__module__}.{cls.__qualname__}"

    def keeps(self, call: ParameterisedCall) -> bool:
        """Whether the call is of a parameterised module."""
        return bool(call.own) or isinstance(call.module, self.kept_without_weights)

    def layers(self, calls: Iterable[ParameterisedCall]) -> list[Layer]:
        """A `Layer` of each call of a parameterised module, in order. An
        embedding called again through another method than `__call__` (Flax's
        `attend`: an LM head tied to the embedding) is `tied` to itself, as
        PyTorch's head holding the embedding's tensor is."""
        found, called = [], set()
        for call in calls:
            if not self.keeps(call):
                continue
            layer = self.layer(call)
            method = call.site.method
            if layer.kind == "embed" and method not in (None, "__call__"):
                if call.site.path in called:
                    layer = dataclasses.replace(layer, tied=call.site.path)
            called.add(call.site.path)
            found.append(layer)
        return found

    def layer(self, call: ParameterisedCall) -> Layer:
        listed, _, converter = self._listed(call.module)
        converted = converter(call) if converter is not None else None
        if converted is None:  # a library's class listed without a kind
            converted = weight_by_weight(call, same_class=listed)
        to_common = converted.to_common
        if to_common is None and self.to_common is not None:
            to_common = self.to_common(call)
        layouts = {"to_common": to_common, "select": converted.select}
        return Layer(
            call.site.name,
            call.site.path,
            converted.kind,
            self.described(call.module),
            {name: weight.value for name, weight in converted.weights.items()},
            locations={
                name: (weight.where, weight.back)
                for name, weight in converted.weights.items()
            },
            hyperparameters=dict(converted.hyperparameters),
            activation=converted.activation,
            **{name: value for name, value in layouts.items() if value is not None},
        )


def placed(
    updates: Iterable[tuple[Layer, Mapping]],
) -> Iterator[tuple[Layer, Any, Any]]:
    """`(layer, where, value)` of each weight given to `with_weights` for a
    layer that `LayerKinds` built, converted back to the library's layout."""
    for layer, weights in updates:
        for name, (where, back) in layer.locations.items():
            if weights.get(name) is not None:
                yield layer, where, back(weights[name])
