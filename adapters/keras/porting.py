"""Keras 3's side of `bridge.transfer` and `bridge.compare`.

A parameterised layer is one holding weights itself (`layer.weights`, less
those of the layers inside it); its weights are read from the probe's values,
keyed by each variable's path (`KerasProbe.trainable`, and `non_trainable`
for BatchNormalization's moving statistics and a frozen layer's weights), by
the variables' own names. Keras is channel-last with
`(in, out)` kernels, the canonical layout already: a `Dense` kernel is
`(in, out)`, a convolution's `(*window, in / groups, out)`. An `EinsumDense`
(the query, key, value and output projections of Keras's and KerasHub's
attention) is a dense layer over the axes its equation contracts: its kernel
is brought to `(in, out)` with the contracted axes in the input's order and
the output axes in the output's, each flattened row-major, as the head axes of
the other libraries' attention kernels are. A layer with an activation of its
own (`Dense(activation="gelu")`, as KerasHub's feed-forward layers are) says
so (`Layer.activation`): `compare` passes the other side's value through it.

KerasHub's `PositionEmbedding` (a learned table, `(sequence, features)`) is an
`embed` layer, listed by name: this module imports no KerasHub. A
`ReversibleEmbedding` called again with `reverse=True` (a language model's
head tied to its token embedding) is `tied` to the embedding. Transposed,
depthwise and separable convolutions keep kernels in layouts of their own and
move only into their own class; a layer of a model's own class moves its
weights by name (`weights:<names>`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import keras
import numpy as np

from bridge.adapter_api import (
    BridgeTypeError,
    Converted,
    Layer,
    LayerKinds,
    ParameterisedCall,
    Site,
    Weight,
    as_float,
    conv_hyperparameters,
    flatten_trailing,
    norm_hyperparameters,
    placed,
)

from . import internals


def _unchanged(value: Any) -> Any:
    return value


@dataclasses.dataclass(frozen=True)
class _Call(ParameterisedCall):
    """A layer's call: `own` holds all its weights by their own names
    (`kernel`, `moving_mean`), trainable or not (a frozen layer's kernel is
    a kernel still), and `keys` where each goes back, `(collection, key of
    the probe's values)`."""

    keys: Mapping[str, tuple[str, str]] = dataclasses.field(default_factory=dict)

    def weight(
        self,
        name: str,
        read: Callable[[Any], Any] = _unchanged,
        back: Callable[[Any], Any] = _unchanged,
        *,
        statistic: bool = False,
    ) -> Weight:
        value = self.own.get(name)
        return Weight(None if value is None else read(value), self.keys.get(name), back)


def _keys(probe: Any) -> dict[int, tuple[str, str]]:
    """`{id(variable): (collection, key)}` of the model's variables, keyed as
    the probe keys their values."""
    trainable_paths, non_trainable_paths = probe._order
    model = probe.model
    keys = {}
    for collection, variables, paths in (
        ("trainable", model.trainable_variables, trainable_paths),
        ("non_trainable", model.non_trainable_variables, non_trainable_paths),
    ):
        for variable, key in zip(variables, paths, strict=True):
            keys[id(variable)] = (collection, key)
    return keys


def _own_weights(layer: Any) -> list:
    """The weights a layer holds itself, not through the layers inside it."""
    inner = {id(weight) for sub in internals.sublayers(layer) for weight in sub.weights}
    return [weight for weight in layer.weights if id(weight) not in inner]


def _calls(probe: Any, sites: list[Site]):
    keys = _keys(probe)
    stores = {"trainable": probe.trainable, "non_trainable": probe.non_trainable}
    owned: dict[int, list] = {}
    # The model is no site, but may hold weights itself (a subclassed model's
    # `add_weight`).
    for site in [Site("", "", None, 0, probe.model, None), *sites]:
        layer = site.module
        if not isinstance(layer, keras.Layer):
            continue
        if id(layer) not in owned:
            owned[id(layer)] = _own_weights(layer)
        own, where = {}, {}
        for variable in owned[id(layer)]:
            found = keys.get(id(variable))
            if found is not None:
                collection, key = found
                own[variable.name] = stores[collection][key]
                where[variable.name] = found
        yield _Call(site, layer, own, (), probe=probe, keys=where)


def layers(probe: Any, sites: list[Site]) -> list[Layer]:
    """Each call of a layer holding weights itself, in call order; an
    embedding called again as a head (`reverse=True`) is tied to itself."""
    found, called = [], set()
    for call in _calls(probe, sites):
        if not KINDS.keeps(call):
            continue
        layer = KINDS.layer(call)
        path = call.site.path
        if layer.kind == "embed" and path in called and _reversed(call):
            layer = dataclasses.replace(layer, tied=path)
        called.add(path)
        found.append(layer)
    return found


def _reversed(call: _Call) -> bool:
    """An embedding's call that gives logits over its vocabulary (a
    `ReversibleEmbedding` called with `reverse=True`): its output's last axis
    is the vocabulary, not the features."""
    struct = call.site.struct
    shape = getattr(struct, "shape", None)
    table = call.own.get("embeddings")
    if not shape or table is None:
        return False
    vocabulary, features = np.shape(table)
    return shape[-1] == vocabulary != features


# -- the converters -------------------------------------------------------------


def _activation(layer: Any) -> tuple[Callable | None, dict]:
    """`(the layer's own activation or None, its hyperparameter)`."""
    activation = getattr(layer, "activation", None)
    if activation is None or activation is keras.activations.linear:
        return None, {}
    name = getattr(activation, "__name__", repr(activation))
    return activation, {"activation": name}


def _only(call: _Call, names: set[str]) -> bool:
    """Whether the layer holds no weights but `names` (a LoRA-enabled or
    quantized Dense holds more, in another layout)."""
    return set(call.own) <= names


def _dense(call: _Call) -> Converted | None:
    if "kernel" not in call.own or not _only(call, {"kernel", "bias"}):
        return None
    activation, named = _activation(call.module)
    return Converted(
        "dense",
        {"kernel": call.weight("kernel"), "bias": call.weight("bias")},
        {"use_bias": "bias" in call.own, **named},
        activation=activation,
    )


def _einsum_dense(call: _Call) -> Converted | None:
    """An `EinsumDense` whose equation contracts the input's last axes with
    the kernel's first and gives the kernel's other axes as the output's
    last (`abc,cde->abde`: `(in, heads, head_dim)`; `abcd,cde->abe`:
    `(heads, head_dim, out)`), and whose bias, if any, spans those output
    axes; any other is moved only into its own class."""
    layer = call.module
    if "kernel" not in call.own or not _only(call, {"kernel", "bias"}):
        return None
    split = _einsum_axes(layer.equation)
    if split is None:
        return None
    contracted, produced, kernel_axes = split
    if "bias" in call.own and (layer.bias_axes or "") != produced:
        return None
    kernel_shape = np.shape(call.own["kernel"])
    order = [kernel_axes.index(axis) for axis in contracted + produced]
    inverse = list(np.argsort(order))
    moved = tuple(kernel_shape[n] for n in order)
    size_in = int(np.prod(moved[: len(contracted)]))

    def read(kernel: Any) -> Any:
        return jnp.reshape(jnp.transpose(kernel, order), (size_in, -1))

    def back(kernel: Any) -> Any:
        return jnp.transpose(jnp.reshape(kernel, moved), inverse)

    activation, named = _activation(layer)
    return Converted(
        "dense",
        {
            "kernel": call.weight("kernel", read, back),
            "bias": call.flat("bias"),
        },
        {"use_bias": "bias" in call.own, **named},
        to_common=flatten_trailing(len(produced)),
        activation=activation,
    )


def _einsum_axes(equation: str) -> tuple[str, str, str] | None:
    """`(contracted, produced, the kernel's axes)` of a dense-like equation
    (see `_einsum_dense`), else `None`."""
    try:
        inputs, output = equation.replace("...", "").split("->")
        given, kernel = inputs.split(",")
    except ValueError:
        return None
    contracted = "".join(c for c in given if c in kernel and c not in output)
    produced = "".join(c for c in output if c in kernel)
    batch = [c for c in given if c not in kernel]
    if (
        not contracted
        or not produced
        or len(set(kernel)) != len(kernel)
        or sorted(kernel) != sorted(contracted + produced)
        or any(axis in given for axis in produced)  # a weight per input row
        or not given.endswith(contracted)
        or not output.endswith(produced)
        or output[: len(output) - len(produced)] != "".join(batch)
    ):
        return None
    return contracted, produced, kernel


def _conv(call: _Call) -> Converted | None:
    """`Conv1D/2D/3D`: the kernel `(*window, in / groups, out)` already."""
    layer = call.module
    if "kernel" not in call.own or not _only(call, {"kernel", "bias"}):
        return None
    window = tuple(layer.kernel_size)
    hyperparameters = conv_hyperparameters(
        window=window,
        strides=layer.strides,
        padding=layer.padding,
        dilation=layer.dilation_rate,
        groups=layer.groups,
        use_bias=layer.use_bias,
    )
    activation, named = _activation(layer)
    return Converted(
        "conv",
        {"kernel": call.weight("kernel"), "bias": call.weight("bias")},
        hyperparameters | named,
        to_common=_channel_last(layer.data_format == "channels_first"),
        activation=activation,
    )


def _channel_last(first: bool) -> Callable[[Any], Any] | None:
    if not first:
        return None
    return lambda value: jnp.moveaxis(value, 1, -1) if jnp.ndim(value) > 2 else value


def _layer_norm(call: _Call) -> Converted | None:
    """A `LayerNormalization`; with `rms_scaling=True` it divides by the
    standard deviation without taking the mean off, no RMSNorm of the other
    libraries (which divide by the root mean square): moved only into its
    own class."""
    layer = call.module
    if getattr(layer, "rms_scaling", False):
        return None
    return Converted(
        "layernorm",
        {"scale": call.flat("gamma"), "bias": call.flat("beta")},
        norm_hyperparameters(layer.epsilon, layer.scale, layer.center),
    )


def _rms_norm(call: _Call) -> Converted:
    layer = call.module
    hyperparameters = norm_hyperparameters(layer.epsilon, use_scale=True)
    return Converted("rmsnorm", {"scale": call.flat("scale")}, hyperparameters)


def _group_norm(call: _Call) -> Converted:
    layer = call.module
    return Converted(
        "groupnorm",
        {"scale": call.flat("gamma"), "bias": call.flat("beta")},
        norm_hyperparameters(
            layer.epsilon, layer.scale, layer.center, num_groups=layer.groups
        ),
        to_common=_channel_last(_channel_axis(layer) == 1),
    )


def _channel_axis(layer: Any) -> int | None:
    axis = layer.axis
    axis = axis[0] if isinstance(axis, list | tuple) and len(axis) == 1 else axis
    return axis if isinstance(axis, int) else None


def _batch_norm(call: _Call) -> Converted:
    """Scale, bias and the moving statistics (non-trainable variables); Keras's
    `momentum` is the weight of the moving average kept, the canonical one."""
    layer = call.module
    return Converted(
        "batchnorm",
        {
            "scale": call.flat("gamma"),
            "bias": call.flat("beta"),
            "mean": call.flat("moving_mean"),
            "var": call.flat("moving_variance"),
        },
        norm_hyperparameters(
            layer.epsilon, layer.scale, layer.center, momentum=as_float(layer.momentum)
        ),
        to_common=_channel_last(_channel_axis(layer) == 1),
    )


def _embedding(call: _Call) -> Converted | None:
    """An `Embedding` (and a `ReversibleEmbedding` whose head is the table
    itself); KerasHub's `PositionEmbedding`."""
    if not _only(call, {"embeddings"}) or "embeddings" not in call.own:
        return None
    return Converted("embed", {"embedding": call.weight("embeddings")})


KINDS = LayerKinds(
    {
        keras.layers.Dense: _dense,
        keras.layers.EinsumDense: _einsum_dense,
        keras.layers.Conv1D: _conv,
        keras.layers.Conv2D: _conv,
        keras.layers.Conv3D: _conv,
        # Kernels in layouts of their own: moved only into their own class.
        **dict.fromkeys(
            [
                getattr(keras.layers, name)
                for name in (
                    "Conv1DTranspose",
                    "Conv2DTranspose",
                    "Conv3DTranspose",
                    "DepthwiseConv1D",
                    "DepthwiseConv2D",
                    "SeparableConv1D",
                    "SeparableConv2D",
                )
                if hasattr(keras.layers, name)
            ]
        ),
        keras.layers.LayerNormalization: _layer_norm,
        **(
            {keras.layers.RMSNormalization: _rms_norm}
            if hasattr(keras.layers, "RMSNormalization")
            else {}
        ),
        keras.layers.GroupNormalization: _group_norm,
        keras.layers.BatchNormalization: _batch_norm,
        keras.layers.Embedding: _embedding,
        # By name: this adapter imports no KerasHub.
        "keras_hub.src.layers.modeling.position_embedding.PositionEmbedding": (
            _embedding
        ),
    },
    named="keras.layers.",
    home="keras.",
)


def with_weights(probe: Any, updates: list[tuple[Layer, dict]]) -> Any:
    """A new probe of the same model holding the given canonical weights, each
    cast to its variable's dtype; the model's own variables are untouched."""
    stores = {
        "trainable": dict(probe.trainable),
        "non_trainable": dict(probe.non_trainable),
    }
    for _, (collection, key), value in placed(updates):
        old = stores[collection][key]
        new = jnp.asarray(np.asarray(value), jnp.result_type(old))
        stores[collection][key] = jnp.reshape(new, jnp.shape(old))
    new = type(probe)(
        probe.model,
        stores["trainable"],
        stores["non_trainable"],
        probe.vmap,
        probe._order,
    )
    return new._looking_inside(probe._inside)


# -- for compare ----------------------------------------------------------------


def in_float64(probe: Any) -> Any:
    """A probe of a float64 copy of the model (`bridge.compare(...,
    dtype="float64")`): a Keras layer computes in its dtype policy's dtype
    whatever its variables hold, so the model is rebuilt from its config with
    `dtype="float64"` (a `Sequential` or functional model layer by layer,
    with `keras.models.clone_model`; a model of its own class, a KerasHub
    backbone, by `from_config`), and given the probe's values in float64.
    The user's model is untouched. A layer that builds its sublayers in a
    dtype of its own stays in it (`report.lower_precision` names it). Keras's
    type promotion makes 64-bit results 32-bit (`keras.backend.result_type`,
    "aligned with JAX's default"), so the ops that promote compute in float32
    under a float64 policy and give float64 values: `LayerNormalization`
    among them, where a float64 compare parts at float32's rounding."""
    model = probe.model
    try:
        clone = _rebuilt_in_float64(model)
    except Exception as error:  # a model without a config to rebuild from
        raise BridgeTypeError(
            f"compare cannot run the Keras model {model.name!r} in float64: "
            f"rebuilding it from its config with dtype='float64' failed ({error}). "
            'Leave dtype="float64" out, or build the model with '
            'dtype="float64" yourself and probe that.'
        ) from error
    counts = (len(clone.trainable_variables), len(clone.non_trainable_variables))
    if counts != tuple(map(len, probe._order)):
        raise BridgeTypeError(
            f"compare cannot run the Keras model {model.name!r} in float64: "
            f"rebuilt from its config with dtype='float64', it has {counts[0]} "
            f"trainable and {counts[1]} non-trainable variables where the model "
            f"has {len(probe._order[0])} and {len(probe._order[1])}. Leave "
            'dtype="float64" out, or build the model with dtype="float64" '
            "yourself and probe that."
        )

    def cast(value: Any) -> Any:
        if jnp.issubdtype(jnp.result_type(value), jnp.floating):
            return jnp.asarray(value, jnp.float64)
        return value

    new = type(probe)(
        clone,
        {key: cast(value) for key, value in probe.trainable.items()},
        {key: cast(value) for key, value in probe.non_trainable.items()},
        probe.vmap,
        probe._order,
    )
    return new._looking_inside(probe._inside)


def _rebuilt_in_float64(model: Any) -> Any:
    def in_float64(layer: Any) -> Any:
        return type(layer).from_config({**layer.get_config(), "dtype": "float64"})

    if type(model) in (keras.Sequential, keras.Model) or (
        type(model).__name__ == "Functional"
    ):
        return keras.models.clone_model(model, clone_function=in_float64)
    return in_float64(model)
