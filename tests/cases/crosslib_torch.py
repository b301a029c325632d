"""The three architectures of `crosslib`, written idiomatically in PyTorch.

The same MLP, CNN with LayerNorm and pre-LayerNorm transformer block as the
four JAX libraries' (`cases/crosslib.py`), with the same hyperparameters:
LayerNorm epsilon 1e-5, biased attention projections with the usual
`1 / sqrt(head_dim)` scaling, tanh-approximated GELU (`jax.nn.gelu`'s and
`flax`'s default, so `approximate="tanh"` here), ReLU and tanh as there.

PyTorch's own conventions are kept where they differ:

- the CNN takes NCHW images and its convolutions are channel-first; its
  LayerNorm normalises the channels of each pixel, so it runs on a
  channel-last view (`permute` to NHWC and back), and its site is
  channel-last;
- the CNN flattens in channel-last `(H, W, C)` order before its head, as the
  JAX models do, so that the head's `(in, out)` kernel rows mean the same
  features in every library (a PyTorch model flattening NCHW would need its
  head's rows permuted by the porter: no `transfer` can know that);
- `nn.Linear.weight` is `(out, in)`, convolutions OIHW;
- `nn.MultiheadAttention(batch_first=True)` packs the query, key and value
  projections into one `in_proj_weight` `(3 * width, width)` and calls its
  output projection functionally: the module's own output (its first) is the
  output projection's, and the query/key/value projections have no site.

Beside each model, written by hand and independent of `bridge.transfer`, a
`crosslib.Port` (library "torch") names its sites by the common layer names
of `crosslib`, says where each layer's parameters are (a `named_modules()`
path; `(path, i)` for the i-th block of a packed `in_proj`) and how a site's
value reads in the common layout. `canonical` and `build_from` read and write
the common layout of `crosslib` by hand.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import crosslib
from .crosslib import (
    CLASSES,
    CONV,
    CONV_CHANNELS,
    DENSE,
    EPSILON,
    HEADS,
    HEADS_IN,
    HEADS_OUT,
    IMAGE,
    MLP_SIZES,
    MLP_WIDTH,
    NORM,
    WIDTH,
    Port,
)

_FLAT_FEATURES = (IMAGE[0] - 2) * (IMAGE[1] - 2) * CONV_CHANNELS[1]  # VALID 3x3


# -- the models ----------------------------------------------------------------


def torch_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(MLP_SIZES[0], MLP_SIZES[1]),
        nn.Tanh(),
        nn.Linear(MLP_SIZES[1], MLP_SIZES[2]),
        nn.Tanh(),
        nn.Linear(MLP_SIZES[2], MLP_SIZES[3]),
    )


class TorchCNN(nn.Module):
    """NCHW images; channel-first convolutions, a LayerNorm over channels."""

    def __init__(self):
        super().__init__()
        channels = (IMAGE[2], *CONV_CHANNELS)
        self.conv1 = nn.Conv2d(channels[0], channels[1], 3, padding=1)  # SAME
        self.norm = nn.LayerNorm(channels[1], eps=EPSILON)
        self.conv2 = nn.Conv2d(channels[1], channels[2], 3)  # VALID
        self.head = nn.Linear(_FLAT_FEATURES, CLASSES)

    def forward(self, x):  # (N, C, H, W)
        x = self.conv1(x)
        # LayerNorm normalises the last axis: the channels of each pixel.
        x = self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        x = F.relu(x)
        x = F.relu(self.conv2(x))
        # Flattened channel-last, (H, W, C), as the JAX models flatten.
        return self.head(x.permute(0, 2, 3, 1).flatten(1))


class TorchBlock(nn.Module):
    """A pre-LayerNorm transformer block over `(batch, tokens, width)`."""

    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(WIDTH, eps=EPSILON)
        self.attention = nn.MultiheadAttention(
            WIDTH, HEADS, bias=True, batch_first=True
        )
        self.norm2 = nn.LayerNorm(WIDTH, eps=EPSILON)
        self.mlp_in = nn.Linear(WIDTH, MLP_WIDTH)
        self.mlp_out = nn.Linear(MLP_WIDTH, WIDTH)

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        h = F.gelu(self.mlp_in(self.norm2(x)), approximate="tanh")
        return x + self.mlp_out(h)


# -- the ports ---------------------------------------------------------------------


def _nchw_to_nhwc(value):
    return np.transpose(value, (0, 2, 3, 1))


def _first(value):
    """`nn.MultiheadAttention` returns `(output, weights)`; `weights` is `None`
    with `need_weights=False`."""
    return value[0]


_MLP_SITES = {"dense0": "0", "dense1": "2", "dense2": "4"}
_CNN_SITES = {name: name for name in ("conv1", "norm", "conv2", "head")}

PORTS: dict[str, Port] = {
    "mlp": Port("torch", torch_mlp, sites=_MLP_SITES, layers=dict(_MLP_SITES)),
    "cnn": Port(
        "torch",
        TorchCNN,
        sites=_CNN_SITES,
        layers=dict(_CNN_SITES),
        # The norm's site is channel-last already: it runs on a permuted view.
        activation_layout={"conv1": _nchw_to_nhwc, "conv2": _nchw_to_nhwc},
    ),
    "transformer": Port(
        "torch",
        TorchBlock,
        # No query/key/value: `nn.MultiheadAttention` projects functionally.
        # The attention's output is its output projection's.
        sites={
            "norm1": "norm1",
            "attention": "attention",
            "out": "attention",
            "norm2": "norm2",
            "mlp_in": "mlp_in",
            "mlp_out": "mlp_out",
        },
        layers={
            "norm1": "norm1",
            "query": ("attention", 0),
            "key": ("attention", 1),
            "value": ("attention", 2),
            "out": "attention.out_proj",
            "norm2": "norm2",
            "mlp_in": "mlp_in",
            "mlp_out": "mlp_out",
        },
        activation_layout={"attention": _first, "out": _first},
    ),
}

#: The common layers whose activations PyTorch cannot show.
WITHOUT_SITE = {
    "mlp": set(),
    "cnn": set(),
    "transformer": {"query", "key", "value"},
}


def inputs(architecture: str, seed: int = 1) -> torch.Tensor:
    """`crosslib.inputs`, as the PyTorch model takes them (images NCHW)."""
    x = np.asarray(crosslib.inputs(architecture, seed))
    if architecture == "cnn":
        x = x.transpose(0, 3, 1, 2)
    return torch.from_numpy(np.array(x))  # a writable copy


def loss_fn(architecture: str):
    """`crosslib.loss_fn` in torch: the same goal, the same mean square."""
    goal = crosslib._normal(crosslib.OUTPUT_SHAPES[architecture], seed=2)
    goal = torch.from_numpy(np.array(goal))
    return lambda outputs: torch.mean(torch.square(outputs - goal))


def model(architecture: str, seed: int) -> nn.Module:
    """The model in `eval()` mode with weights drawn from `seed` as `crosslib`
    draws them: kernels normal with variance 1 / fan-in, vectors (biases,
    scales) 0.5 + 0.2 normal, so no bias is zero and no scale one (PyTorch's
    own initialisation zeroes the attention biases)."""
    with torch.random.fork_rng():
        module = PORTS[architecture].make()
    generator = np.random.default_rng(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            shape = tuple(parameter.shape)
            if math.prod(shape) == max(shape, default=1):
                values = 0.5 + 0.2 * generator.standard_normal(shape)
            else:  # (out, ...): PyTorch puts the outputs first
                fan_in = math.prod(shape) // shape[0]
                values = generator.standard_normal(shape) / math.sqrt(fan_in)
            parameter.copy_(torch.from_numpy(values))
    return module.eval()


# -- reading and writing the common layout by hand ----------------------------------


def _numpy(tensor) -> np.ndarray:
    return tensor.detach().cpu().numpy()


def canonical(architecture: str, named: dict[str, Any]) -> dict[str, dict]:
    """`{layer: {"kernel"|"bias"|"scale": np.ndarray}}` in `crosslib`'s common
    layout, from `dict(module.named_parameters())` or `ProbeResult.grads`."""
    port = PORTS[architecture]
    kinds = crosslib.KINDS[architecture]
    found = {}
    for name, location in port.layers.items():
        kind = kinds[name]
        if kind == HEADS_IN:  # the i-th block of rows of the packed projection
            path, i = location
            rows = slice(i * WIDTH, (i + 1) * WIDTH)
            weight = _numpy(named[f"{path}.in_proj_weight"])[rows]
            bias = _numpy(named[f"{path}.in_proj_bias"])[rows]
        else:
            weight = _numpy(named[f"{location}.weight"])
            bias = _numpy(named[f"{location}.bias"])
        if kind == NORM:
            found[name] = {"scale": weight, "bias": bias}
        elif kind == CONV:  # OIHW -> HWIO
            found[name] = {"kernel": weight.transpose(2, 3, 1, 0), "bias": bias}
        else:
            assert kind in (DENSE, HEADS_IN, HEADS_OUT), kind
            found[name] = {"kernel": weight.T, "bias": bias}  # (out, in) -> (in, out)
    return found


def build_from(architecture: str, weights: dict[str, dict]) -> nn.Module:
    """The PyTorch model carrying `weights` (as `canonical` gives them): a port
    written by hand, loaded with `load_state_dict(strict=True)`."""
    port = PORTS[architecture]
    kinds = crosslib.KINDS[architecture]
    state: dict[str, np.ndarray] = {}
    packed: dict[str, dict[int, tuple]] = {}
    for name, location in port.layers.items():
        kind, layer = kinds[name], weights[name]
        if kind == NORM:
            weight, bias = layer["scale"], layer["bias"]
        elif kind == CONV:  # HWIO -> OIHW
            weight, bias = layer["kernel"].transpose(3, 2, 0, 1), layer["bias"]
        else:
            weight, bias = layer["kernel"].T, layer["bias"]
        if kind == HEADS_IN:
            path, i = location
            packed.setdefault(path, {})[i] = (weight, bias)
        else:
            state[f"{location}.weight"], state[f"{location}.bias"] = weight, bias
    for path, blocks in packed.items():
        assert sorted(blocks) == [0, 1, 2], blocks
        state[f"{path}.in_proj_weight"] = np.concatenate(
            [blocks[i][0] for i in range(3)]
        )
        state[f"{path}.in_proj_bias"] = np.concatenate([blocks[i][1] for i in range(3)])
    module = model(architecture, seed=0)
    tensors = {key: torch.from_numpy(np.array(value)) for key, value in state.items()}
    module.load_state_dict(tensors, strict=True)
    return module
