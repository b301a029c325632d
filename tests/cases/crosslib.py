"""Three architectures written idiomatically in each of the four libraries.

The same MLP, a small CNN with LayerNorm and a pre-LayerNorm transformer
block, each in Flax Linen, Flax NNX, Equinox and Haiku, with identical
hyperparameters (LayerNorm epsilon 1e-5 everywhere, biased attention
projections, the same activations and attention scaling). Every library's
model takes the same batch: Equinox models handle one example
(`bridge.probe(model, vmap=True)`) and the Equinox CNN is channel-first
inside, transposing at its entry and back before it flattens.

Beside each model, written by hand and independent of `bridge.transfer`, a
`Port` says where each layer's parameters and activations are:

- `sites`: the paired sites, by a common layer name, in call order;
- `layers`: where each layer's parameters live in the library's structure;
- `activation_layout`: the site value in a common layout (channel-last
  convolutions; attention projections flat, `(..., heads * head_dim)`).

`canonical` reads parameters (or their gradients: the same structure) into a
common layout — kernels `(in, out)`, convolutions `HWIO`, flat biases, under
`kernel`/`bias`/`scale` — and `build_from` is the reverse: a hand-written port
of those weights into a library's model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import bridge

LIBRARIES = ("linen", "nnx", "equinox", "haiku")
ARCHITECTURES = ("mlp", "cnn", "transformer")

EPSILON = 1e-5  # every LayerNorm's: Linen and NNX default to 1e-6
BATCH = 4
MLP_SIZES = (6, 16, 16, 3)  # input, hidden, hidden, output
IMAGE = (6, 5, 3)  # (H, W, C), channel-last; not square, so axes cannot be mixed
CONV_CHANNELS = (4, 8)
CLASSES = 3
TOKENS, WIDTH, HEADS, MLP_WIDTH = 5, 16, 2, 32
HEAD_DIM = WIDTH // HEADS
_FLAT_FEATURES = (IMAGE[0] - 2) * (IMAGE[1] - 2) * CONV_CHANNELS[1]  # VALID 3x3

INPUT_SHAPES = {
    "mlp": (BATCH, MLP_SIZES[0]),
    "cnn": (BATCH, *IMAGE),
    "transformer": (BATCH, TOKENS, WIDTH),
}
OUTPUT_SHAPES = {
    "mlp": (BATCH, MLP_SIZES[-1]),
    "cnn": (BATCH, CLASSES),
    "transformer": (BATCH, TOKENS, WIDTH),
}


@dataclasses.dataclass(frozen=True)
class Port:
    """One architecture in one library.

    Attributes:
      make: what builds the model: Linen, the module; NNX, `rngs -> module`;
        Equinox, `key -> module` (of one example); Haiku, the function to
        `hk.transform`.
      sites: common layer name -> site path, in call order.
      layers: common layer name -> where its parameters are: a key path into
        Linen `params` or the NNX `nnx.State`, a Haiku module name, an
        attribute/index path into the Equinox module.
      activation_layout: common name -> `value -> value in the common layout`,
        where the site's layout differs from it.
    """

    library: str
    make: Any
    sites: dict[str, str]
    layers: dict[str, Any]
    activation_layout: dict[str, Callable[[Any], Any]] = dataclasses.field(
        default_factory=dict
    )

    def common_activations(self, values: dict[str, Any]) -> dict[str, Any]:
        """`{common name: value}` in the common layout, from a result's dict."""
        return {
            name: self.activation_layout.get(name, _identity)(values[path])
            for name, path in self.sites.items()
        }


def inputs(architecture: str, seed: int = 1) -> jax.Array:
    return _normal(INPUT_SHAPES[architecture], seed)


def loss_fn(architecture: str) -> Callable[[Any], Any]:
    goal = _normal(OUTPUT_SHAPES[architecture], seed=2)
    return lambda outputs: jnp.mean(jnp.square(outputs - goal))


def _normal(shape, seed: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def trainable(probe: Any) -> Any:
    """The probe's trainable parameters, in the structure of `ProbeResult.grads`
    (every adapter keeps them behind `ProbeBase._trainable`)."""
    return probe._trainable()


# -- building, reading and writing the four libraries' parameters ---------------


def build(architecture: str, library: str, seed: int) -> Any:
    """A probe of the model with weights drawn from `seed`, in the structure
    the library's own initialisation gives."""
    port = PORTS[architecture][library]
    shapes = _initial_shapes(architecture, library)
    weights = _draw(shapes, seed, out_axis=0 if library == "equinox" else -1)
    if library == "linen":
        return bridge.probe(port.make, weights)
    if library == "haiku":
        return bridge.probe(hk.transform(port.make), weights)
    if library == "equinox":
        return bridge.probe(weights, vmap=True)
    model = nnx.eval_shape(lambda: port.make(nnx.Rngs(0)))
    nnx.update(model, weights)
    return bridge.probe(model)


def _initial_shapes(architecture: str, library: str) -> Any:
    """The library's initialisation, evaluated abstractly: its structure with
    `jax.ShapeDtypeStruct` leaves (an NNX model: its `nnx.State`)."""
    port = PORTS[architecture][library]
    key, x = jax.random.key(0), inputs(architecture)
    if library == "linen":
        return jax.eval_shape(port.make.init, key, x)
    if library == "haiku":
        return jax.eval_shape(hk.transform(port.make).init, key, x)
    if library == "equinox":
        return eqx.filter_eval_shape(port.make, key)
    model = nnx.eval_shape(lambda: port.make(nnx.Rngs(0)))
    state = nnx.state(model)
    assert not nnx.state(model, nnx.Not(nnx.Param)), "only parameters are drawn"
    return state


def _draw(shapes: Any, seed: int, out_axis: int) -> Any:
    """Weights for the abstract leaves of `shapes`, drawn with numpy: a JAX
    random draw compiles once per shape, which costs seconds eagerly.

    Kernels are normal with variance 1 / fan-in (`out_axis` is where the
    outputs are: Equinox puts them first); vectors (biases, scales) are
    0.5 + 0.2 normal, so no bias is zero and no scale one.
    """
    generator = np.random.default_rng(seed)

    def draw(leaf):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        shape = leaf.shape
        if math.prod(shape) == max(shape, default=1):
            values = 0.5 + 0.2 * generator.standard_normal(shape)
        else:
            fan_in = math.prod(shape) // shape[out_axis]
            values = generator.standard_normal(shape) / math.sqrt(fan_in)
        return jnp.asarray(values, leaf.dtype)

    return jax.tree.map(draw, shapes)


def canonical(architecture: str, library: str, tree: Any) -> dict[str, dict]:
    """`{layer: {"kernel"|"bias"|"scale": np.ndarray}}` in the common layout,
    from parameters or parameter gradients in the library's structure."""
    port = PORTS[architecture][library]
    return {
        name: _TO_COMMON[library](KINDS[architecture][name], _find(tree, location))
        for name, location in port.layers.items()
    }


def build_from(architecture: str, library: str, weights: dict[str, dict]) -> Any:
    """A probe of the library's model carrying `weights` (as `canonical` gives
    them): a port written by hand, layer by layer, into the structure of the
    library's own initialisation."""
    port = PORTS[architecture][library]
    kinds = KINDS[architecture]
    shapes = _initial_shapes(architecture, library)
    if library == "equinox":
        model = shapes
        for name, location in port.layers.items():
            layer = _equinox_from_common(
                kinds[name], weights[name], _find(model, location)
            )
            model = eqx.tree_at(lambda m, at=location: _find(m, at), model, layer)
        _check_complete(model)
        return bridge.probe(model, vmap=True)
    if library == "nnx":
        pure = shapes.to_pure_dict()
    elif library == "linen":
        pure = jax.tree.map(_identity, dict(shapes["params"]))  # a mutable copy
    else:
        pure = jax.tree.map(_identity, dict(shapes))
    convert = _haiku_from_common if library == "haiku" else _flax_from_common
    for name, location in port.layers.items():
        *parents, last = (location,) if library == "haiku" else location
        node = _find(pure, tuple(parents))
        node[last] = convert(weights[name], node[last])
    _check_complete(pure)
    if library == "nnx":
        nnx.replace_by_pure_dict(shapes, pure)
        model = nnx.eval_shape(lambda: port.make(nnx.Rngs(0)))
        nnx.update(model, shapes)
        return bridge.probe(model)
    if library == "linen":
        return bridge.probe(port.make, {**shapes, "params": pure})
    return bridge.probe(hk.transform(port.make), pure)


def _check_complete(tree: Any) -> None:
    left = [leaf for leaf in jax.tree.leaves(tree) if _is_abstract(leaf)]
    assert not left, f"{len(left)} weights were not ported"


def _is_abstract(leaf) -> bool:
    return isinstance(leaf, jax.ShapeDtypeStruct)


def _identity(value):
    return value


def _find(tree: Any, location: Any) -> Any:
    """The node at a key path (a Haiku module name is a one-key path)."""
    for key in (location,) if isinstance(location, str) else location:
        if isinstance(tree, eqx.Module):
            tree = tree[key] if isinstance(key, int) else getattr(tree, key)
        else:
            tree = tree[key]
    return tree


def _array(leaf) -> np.ndarray:
    """An NNX `Variable`'s value, or the array itself, as numpy."""
    return np.asarray(leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf)


# Layer kinds: how the layouts differ.
DENSE, CONV, NORM = "dense", "conv", "norm"
HEADS_IN = "heads_in"  # query/key/value: Linen/NNX kernel (in, heads, head_dim)
HEADS_OUT = "heads_out"  # attention output: Linen/NNX kernel (heads, head_dim, out)


def _flax_to_common(kind: str, node) -> dict[str, np.ndarray]:
    arrays = {key: _array(node[key]) for key in node}
    if kind == HEADS_IN:
        kernel = arrays["kernel"]
        return {
            "kernel": kernel.reshape(kernel.shape[0], -1),
            "bias": arrays["bias"].reshape(-1),
        }
    if kind == HEADS_OUT:
        kernel = arrays["kernel"]
        return {"kernel": kernel.reshape(-1, kernel.shape[-1]), "bias": arrays["bias"]}
    return arrays


def _flax_from_common(weights: dict, like: dict) -> dict:
    # Heads are split off the flat layout by a row-major reshape.
    return {key: jnp.reshape(weights[key], like[key].shape) for key in like}


_HAIKU_NAMES = {"w": "kernel", "b": "bias", "offset": "bias", "scale": "scale"}


def _haiku_to_common(kind: str, node) -> dict[str, np.ndarray]:
    return {_HAIKU_NAMES[key]: np.asarray(value) for key, value in node.items()}


def _haiku_from_common(weights: dict, like: dict) -> dict:
    return {key: jnp.asarray(weights[_HAIKU_NAMES[key]]) for key in like}


def _equinox_to_common(kind: str, layer) -> dict[str, np.ndarray]:
    weight, bias = np.asarray(layer.weight), np.asarray(layer.bias)
    if kind == NORM:
        return {"scale": weight, "bias": bias}
    if kind == CONV:  # OIHW -> HWIO; the bias is (out, 1, 1)
        return {"kernel": weight.transpose(2, 3, 1, 0), "bias": bias.reshape(-1)}
    return {"kernel": weight.T, "bias": bias}  # (out, in) -> (in, out)


def _equinox_from_common(kind: str, weights: dict, layer) -> Any:
    if kind == NORM:
        new = (weights["scale"], weights["bias"])
    elif kind == CONV:
        kernel = weights["kernel"].transpose(3, 2, 0, 1)
        new = (kernel, weights["bias"].reshape(layer.bias.shape))
    else:
        new = (weights["kernel"].T, weights["bias"])
    new = tuple(jnp.asarray(array) for array in new)
    return eqx.tree_at(lambda lay: (lay.weight, lay.bias), layer, new)


_TO_COMMON = {
    "linen": _flax_to_common,
    "nnx": _flax_to_common,
    "haiku": _haiku_to_common,
    "equinox": _equinox_to_common,
}


# -- the MLP: three dense layers, tanh between ----------------------------------


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Dense(MLP_SIZES[1])(x))
        x = nn.tanh(nn.Dense(MLP_SIZES[2])(x))
        return nn.Dense(MLP_SIZES[3])(x)


class NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden1 = nnx.Linear(MLP_SIZES[0], MLP_SIZES[1], rngs=rngs)
        self.hidden2 = nnx.Linear(MLP_SIZES[1], MLP_SIZES[2], rngs=rngs)
        self.readout = nnx.Linear(MLP_SIZES[2], MLP_SIZES[3], rngs=rngs)

    def __call__(self, x):
        x = nnx.tanh(self.hidden1(x))
        x = nnx.tanh(self.hidden2(x))
        return self.readout(x)


def equinox_mlp(key):
    return eqx.nn.MLP(
        MLP_SIZES[0],
        MLP_SIZES[3],
        width_size=MLP_SIZES[1],
        depth=2,
        activation=jax.nn.tanh,
        key=key,
    )


def haiku_mlp(x):
    return hk.nets.MLP(MLP_SIZES[1:], activation=jax.nn.tanh)(x)


_MLP_LAYERS = ("dense0", "dense1", "dense2")


MLP = {
    "linen": Port(
        "linen",
        LinenMLP(),
        sites={name: f"Dense_{i}" for i, name in enumerate(_MLP_LAYERS)},
        layers={name: (f"Dense_{i}",) for i, name in enumerate(_MLP_LAYERS)},
    ),
    "nnx": Port(
        "nnx",
        NnxMLP,
        sites=dict(zip(_MLP_LAYERS, ("hidden1", "hidden2", "readout"), strict=True)),
        layers=dict(
            zip(_MLP_LAYERS, (("hidden1",), ("hidden2",), ("readout",)), strict=True)
        ),
    ),
    "equinox": Port(
        "equinox",
        equinox_mlp,
        sites={name: f"layers/{i}" for i, name in enumerate(_MLP_LAYERS)},
        layers={name: ("layers", i) for i, name in enumerate(_MLP_LAYERS)},
    ),
    "haiku": Port(
        "haiku",
        haiku_mlp,
        sites={name: f"mlp/~/linear_{i}" for i, name in enumerate(_MLP_LAYERS)},
        layers={name: f"mlp/~/linear_{i}" for i, name in enumerate(_MLP_LAYERS)},
    ),
}


# -- the CNN: conv, LayerNorm over channels, conv, dense head -------------------


class LinenCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(CONV_CHANNELS[0], (3, 3), padding="SAME")(x)
        x = nn.relu(nn.LayerNorm(epsilon=EPSILON)(x))
        x = nn.relu(nn.Conv(CONV_CHANNELS[1], (3, 3), padding="VALID")(x))
        return nn.Dense(CLASSES)(x.reshape(x.shape[0], -1))


class NnxCNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        channels = (IMAGE[2], *CONV_CHANNELS)
        self.conv1 = nnx.Conv(channels[0], channels[1], (3, 3), rngs=rngs)
        self.norm = nnx.LayerNorm(channels[1], epsilon=EPSILON, rngs=rngs)
        self.conv2 = nnx.Conv(
            channels[1], channels[2], (3, 3), padding="VALID", rngs=rngs
        )
        self.head = nnx.Linear(_FLAT_FEATURES, CLASSES, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.norm(self.conv1(x)))
        x = nnx.relu(self.conv2(x))
        return self.head(x.reshape(x.shape[0], -1))


class EquinoxCNN(eqx.Module):
    """Channel-first inside, one example at a time."""

    conv1: eqx.nn.Conv2d
    norm: eqx.nn.LayerNorm
    conv2: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 3)
        channels = (IMAGE[2], *CONV_CHANNELS)
        self.conv1 = eqx.nn.Conv2d(channels[0], channels[1], 3, padding=1, key=keys[0])
        self.norm = eqx.nn.LayerNorm(channels[1], eps=EPSILON)
        self.conv2 = eqx.nn.Conv2d(channels[1], channels[2], 3, key=keys[1])
        self.head = eqx.nn.Linear(_FLAT_FEATURES, CLASSES, key=keys[2])

    def __call__(self, image):  # (H, W, C)
        x = self.conv1(jnp.transpose(image, (2, 0, 1)))
        # LayerNorm over the channels of each pixel: map over W, then H.
        per_pixel = jax.vmap(jax.vmap(self.norm, in_axes=1, out_axes=1), 2, 2)
        x = jax.nn.relu(per_pixel(x))
        x = jax.nn.relu(self.conv2(x))
        # Flatten in (H, W, C) order, as the channel-last libraries do.
        return self.head(jnp.transpose(x, (1, 2, 0)).reshape(-1))


def haiku_cnn(x):
    x = hk.Conv2D(CONV_CHANNELS[0], 3, padding="SAME")(x)
    x = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True, eps=EPSILON)(x)
    x = jax.nn.relu(x)
    x = jax.nn.relu(hk.Conv2D(CONV_CHANNELS[1], 3, padding="VALID")(x))
    return hk.Linear(CLASSES)(hk.Flatten()(x))


def _channel_first_to_last(value):  # (N, C, H, W) -> (N, H, W, C)
    return jnp.transpose(value, (0, 2, 3, 1))


def _per_pixel_to_channel_last(value):
    # The norm's site holds the value mapped by the model's own vmaps, mapped
    # axes first, outermost first: (N, W, H, C).
    return jnp.transpose(value, (0, 2, 1, 3))


_CNN_LAYERS = ("conv1", "norm", "conv2", "head")
_LINEN_CNN = ("Conv_0", "LayerNorm_0", "Conv_1", "Dense_0")
_HAIKU_CNN = ("conv2_d", "layer_norm", "conv2_d_1", "linear")

CNN = {
    "linen": Port(
        "linen",
        LinenCNN(),
        sites=dict(zip(_CNN_LAYERS, _LINEN_CNN, strict=True)),
        layers={
            name: (path,) for name, path in zip(_CNN_LAYERS, _LINEN_CNN, strict=True)
        },
    ),
    "nnx": Port(
        "nnx",
        NnxCNN,
        sites={name: name for name in _CNN_LAYERS},
        layers={name: (name,) for name in _CNN_LAYERS},
    ),
    "equinox": Port(
        "equinox",
        EquinoxCNN,
        sites={name: name for name in _CNN_LAYERS},
        layers={name: (name,) for name in _CNN_LAYERS},
        activation_layout={
            "conv1": _channel_first_to_last,
            "norm": _per_pixel_to_channel_last,
            "conv2": _channel_first_to_last,
        },
    ),
    "haiku": Port(
        "haiku",
        haiku_cnn,
        sites=dict(zip(_CNN_LAYERS, _HAIKU_CNN, strict=True)),
        layers=dict(zip(_CNN_LAYERS, _HAIKU_CNN, strict=True)),
    ),
}


# -- the transformer block: pre-LayerNorm attention and MLP, residuals ----------


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(epsilon=EPSILON)(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS)(h)
        h = nn.LayerNorm(epsilon=EPSILON)(x)
        # Built outer first: the second layer called is `Dense_0`.
        return x + nn.Dense(WIDTH)(nn.gelu(nn.Dense(MLP_WIDTH)(h)))


class NnxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(WIDTH, epsilon=EPSILON, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(HEADS, WIDTH, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(WIDTH, epsilon=EPSILON, rngs=rngs)
        self.mlp_in = nnx.Linear(WIDTH, MLP_WIDTH, rngs=rngs)
        self.mlp_out = nnx.Linear(MLP_WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp_out(nnx.gelu(self.mlp_in(self.norm2(x))))


class EquinoxBlock(eqx.Module):
    """One sequence `(tokens, width)` at a time."""

    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp_in: eqx.nn.Linear
    mlp_out: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(WIDTH, eps=EPSILON)
        self.attention = eqx.nn.MultiheadAttention(
            HEADS,
            WIDTH,
            use_query_bias=True,
            use_key_bias=True,
            use_value_bias=True,
            use_output_bias=True,
            key=keys[0],
        )
        self.norm2 = eqx.nn.LayerNorm(WIDTH, eps=EPSILON)
        self.mlp_in = eqx.nn.Linear(WIDTH, MLP_WIDTH, key=keys[1])
        self.mlp_out = eqx.nn.Linear(MLP_WIDTH, WIDTH, key=keys[2])

    def __call__(self, x):
        h = jax.vmap(self.norm1)(x)
        x = x + self.attention(h, h, h)
        h = jax.nn.gelu(jax.vmap(self.mlp_in)(jax.vmap(self.norm2)(x)))
        return x + jax.vmap(self.mlp_out)(h)


class HaikuBlock(hk.Module):
    def __call__(self, x):
        h = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True, eps=EPSILON)(x)
        attention = hk.MultiHeadAttention(
            num_heads=HEADS,
            key_size=HEAD_DIM,
            w_init=hk.initializers.VarianceScaling(1.0),
        )
        x = x + attention(h, h, h)
        h = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True, eps=EPSILON)(x)
        # Built outer first: the first layer called is `linear_1`.
        return x + hk.Linear(WIDTH)(jax.nn.gelu(hk.Linear(MLP_WIDTH)(h)))


def haiku_block(x):
    return HaikuBlock()(x)


_PROJECTIONS = ("query", "key", "value")


def _heads_flat(value):  # (N, T, heads, head_dim) -> (N, T, heads * head_dim)
    return value.reshape(*value.shape[:-2], -1)


_LINEN_ATTENTION = "MultiHeadDotProductAttention_0"
_HAIKU_ATTENTION = "haiku_block/multi_head_attention"
_LINEN_BLOCK = {
    "norm1": "LayerNorm_0",
    **{name: f"{_LINEN_ATTENTION}/{name}" for name in (*_PROJECTIONS, "out")},
    "norm2": "LayerNorm_1",
    "mlp_in": "Dense_1",
    "mlp_out": "Dense_0",
}
_NNX_BLOCK = {
    "norm1": "norm1",
    **{name: f"attention/{name}" for name in (*_PROJECTIONS, "out")},
    "norm2": "norm2",
    "mlp_in": "mlp_in",
    "mlp_out": "mlp_out",
}
_EQUINOX_BLOCK = {
    "norm1": "norm1",
    **{name: f"attention/{name}_proj" for name in _PROJECTIONS},
    "out": "attention/output_proj",
    "norm2": "norm2",
    "mlp_in": "mlp_in",
    "mlp_out": "mlp_out",
}
_HAIKU_BLOCK = {
    "norm1": "haiku_block/layer_norm",
    **{name: f"{_HAIKU_ATTENTION}/{name}" for name in _PROJECTIONS},
    "out": f"{_HAIKU_ATTENTION}/linear",
    "norm2": "haiku_block/layer_norm_1",
    "mlp_in": "haiku_block/linear_1",
    "mlp_out": "haiku_block/linear",
}


def _with_attention(sites: dict[str, str], attention: str) -> dict[str, str]:
    """The block's sites in call order: the attention module before its
    projections."""
    return {"norm1": sites["norm1"], "attention": attention} | sites


TRANSFORMER = {
    "linen": Port(
        "linen",
        LinenBlock(),
        sites=_with_attention(_LINEN_BLOCK, _LINEN_ATTENTION),
        layers={name: tuple(path.split("/")) for name, path in _LINEN_BLOCK.items()},
        activation_layout={name: _heads_flat for name in _PROJECTIONS},
    ),
    "nnx": Port(
        "nnx",
        NnxBlock,
        sites=_with_attention(_NNX_BLOCK, "attention"),
        layers={name: tuple(path.split("/")) for name, path in _NNX_BLOCK.items()},
        activation_layout={name: _heads_flat for name in _PROJECTIONS},
    ),
    "equinox": Port(
        "equinox",
        EquinoxBlock,
        sites=_with_attention(_EQUINOX_BLOCK, "attention"),
        layers={name: tuple(path.split("/")) for name, path in _EQUINOX_BLOCK.items()},
    ),
    "haiku": Port(
        "haiku",
        haiku_block,
        sites=_with_attention(_HAIKU_BLOCK, _HAIKU_ATTENTION),
        layers=_HAIKU_BLOCK,
    ),
}

KINDS: dict[str, dict[str, str]] = {
    "mlp": dict.fromkeys(_MLP_LAYERS, DENSE),
    "cnn": {"conv1": CONV, "norm": NORM, "conv2": CONV, "head": DENSE},
    "transformer": {
        "norm1": NORM,
        **dict.fromkeys(_PROJECTIONS, HEADS_IN),
        "out": HEADS_OUT,
        "norm2": NORM,
        "mlp_in": DENSE,
        "mlp_out": DENSE,
    },
}

PORTS: dict[str, dict[str, Port]] = {
    "mlp": MLP,
    "cnn": CNN,
    "transformer": TRANSFORMER,
}
