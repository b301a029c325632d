"""`bridge.transfer` and `bridge.compare` between PyTorch and the JAX libraries.

The references are the libraries themselves: after a transfer, the
destination model's own forward pass (`module(x)` in PyTorch, the JAX
library's `apply`; no bridge code) gives the source model's outputs, in both
directions; and one port is checked against a conversion written out by hand.

The models: `cnn1d`/`cnn2d` (Conv -> BatchNorm with random running statistics
-> relu -> GroupNorm -> mean over space -> Linear -> LayerNorm -> tanh ->
Linear), PyTorch on NCHW inputs, Linen/NNX/Haiku on NHWC, Equinox channel-first
per example (vmap=True, NCHW like PyTorch); `attention` (Embedding -> 2-head
self-attention -> LayerNorm -> mean over tokens -> Linear), the JAX models of
`porting_models`, PyTorch's `nn.MultiheadAttention` batch-first or
sequence-first. Every BatchNorm runs in inference mode, on its statistics.
"""

from __future__ import annotations

import copy
import functools

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from porting_models import LIBRARIES, TOKENS, build, filled, outputs

import bridge
from bridge._porting.transfer import parameterised_layers

EPSILON = 1e-5
SPATIAL = {"cnn1d": 1, "cnn2d": 2}


def _images(spatial: int) -> tuple[np.ndarray, np.ndarray]:
    """The same images as NCHW (PyTorch, Equinox) and NHWC (Linen, NNX, Haiku)."""
    rng = np.random.default_rng(3)
    nchw = rng.standard_normal((2, 3, *(6,) * spatial)).astype(np.float32)
    return nchw, np.ascontiguousarray(np.moveaxis(nchw, 1, -1))


def _inputs(model: str, library: str) -> tuple[np.ndarray, np.ndarray]:
    """`(PyTorch's input, the JAX library's input)`."""
    if model == "attention":
        tokens = np.array(TOKENS)  # writable, for torch.from_numpy
        return tokens, tokens
    nchw, nhwc = _images(SPATIAL[model])
    return nchw, nchw if library == "equinox" else nhwc


# -- PyTorch models ---------------------------------------------------------------


class TorchCNN(torch.nn.Module):
    def __init__(self, spatial=2, layer_norm_epsilon=EPSILON, activation=torch.relu):
        super().__init__()
        conv = (torch.nn.Conv1d, torch.nn.Conv2d)[spatial - 1]
        batch_norm = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d)[spatial - 1]
        self.activation = activation
        self.conv = conv(3, 4, 3, padding=1)
        self.norm = batch_norm(4, eps=EPSILON)
        self.group_norm = torch.nn.GroupNorm(2, 4, eps=EPSILON)
        self.hidden = torch.nn.Linear(4, 8)
        self.layer_norm = torch.nn.LayerNorm(8, eps=layer_norm_epsilon)
        self.out = torch.nn.Linear(8, 5)

    def forward(self, x):
        x = self.group_norm(self.activation(self.norm(self.conv(x))))
        x = x.mean(dim=tuple(range(2, x.ndim)))
        return self.out(torch.tanh(self.layer_norm(self.hidden(x))))


class TorchAttention(torch.nn.Module):
    def __init__(self, batch_first=True):
        super().__init__()
        self.batch_first = batch_first
        self.embed = torch.nn.Embedding(11, 8)
        self.attention = torch.nn.MultiheadAttention(8, 2, batch_first=batch_first)
        self.norm = torch.nn.LayerNorm(8, eps=EPSILON)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, tokens):
        h = self.embed(tokens)
        if not self.batch_first:
            h = h.transpose(0, 1)  # (tokens, batch, features)
        h = self.attention(h, h, h)[0]
        if not self.batch_first:
            h = h.transpose(0, 1)
        return self.out(self.norm(h).mean(dim=1))


def _randomised(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights and running statistics (no scale 1, no bias 0), eval mode."""
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if not tensor.is_floating_point():
                continue
            if "var" in name:
                value = rng.uniform(0.5, 1.5, tensor.shape)
            else:
                value = 0.5 * rng.standard_normal(tensor.shape)
            tensor.copy_(torch.from_numpy(value))
    return module.eval()


def torch_model(model: str, seed: int = 0, **options) -> torch.nn.Module:
    if model == "attention":
        return _randomised(TorchAttention(**options), seed)
    return _randomised(TorchCNN(SPATIAL[model], **options), seed)


def torch_output(module: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    """PyTorch's own forward pass."""
    x = torch.tensor(x)
    with torch.no_grad():
        return module(x.long() if not x.is_floating_point() else x).numpy()


# -- JAX models (channel-last, but Equinox) ---------------------------------------


class LinenCNN(nn.Module):
    spatial: int = 2

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(4, (3,) * self.spatial, padding="SAME")(x)
        x = nn.BatchNorm(use_running_average=True, epsilon=EPSILON)(x)
        x = nn.GroupNorm(num_groups=2, epsilon=EPSILON)(nn.relu(x))
        x = nn.Dense(8)(x.mean(axis=tuple(range(1, 1 + self.spatial))))
        return nn.Dense(5)(jnp.tanh(nn.LayerNorm(epsilon=EPSILON)(x)))


class NnxCNN(nnx.Module):
    def __init__(self, spatial: int, rngs: nnx.Rngs):
        self.spatial = spatial
        self.conv = nnx.Conv(3, 4, (3,) * spatial, padding="SAME", rngs=rngs)
        self.norm = nnx.BatchNorm(
            4, use_running_average=True, epsilon=EPSILON, rngs=rngs
        )
        self.group_norm = nnx.GroupNorm(4, num_groups=2, epsilon=EPSILON, rngs=rngs)
        self.hidden = nnx.Linear(4, 8, rngs=rngs)
        self.layer_norm = nnx.LayerNorm(8, epsilon=EPSILON, rngs=rngs)
        self.out = nnx.Linear(8, 5, rngs=rngs)

    def __call__(self, x):
        x = self.group_norm(jax.nn.relu(self.norm(self.conv(x))))
        x = self.hidden(x.mean(axis=tuple(range(1, 1 + self.spatial))))
        return self.out(jnp.tanh(self.layer_norm(x)))


def _haiku_cnn(x, spatial=2, is_training=False):
    x = hk.ConvND(spatial, 4, 3, padding="SAME")(x)
    x = hk.BatchNorm(True, True, 0.9, eps=EPSILON)(x, is_training=is_training)
    x = hk.GroupNorm(2, eps=EPSILON)(jax.nn.relu(x))
    x = hk.Linear(8)(x.mean(axis=tuple(range(1, 1 + spatial))))
    x = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True, eps=EPSILON)(x)
    return hk.Linear(5)(jnp.tanh(x))


class EqxCNN(eqx.Module):
    """One example, channel-first like PyTorch: `(C, *spatial)`."""

    conv: eqx.nn.Conv
    norm: eqx.nn.BatchNorm
    group_norm: eqx.nn.GroupNorm
    hidden: eqx.nn.Linear
    layer_norm: eqx.nn.LayerNorm
    out: eqx.nn.Linear

    def __init__(self, spatial, key):
        keys = jax.random.split(key, 3)
        self.conv = eqx.nn.Conv(spatial, 3, 4, 3, padding=1, key=keys[0])
        self.norm = eqx.nn.BatchNorm(
            4, "batch", eps=EPSILON, inference=True, mode="ema"
        )
        self.group_norm = eqx.nn.GroupNorm(2, 4, eps=EPSILON)
        self.hidden = eqx.nn.Linear(4, 8, key=keys[1])
        self.layer_norm = eqx.nn.LayerNorm(8, eps=EPSILON)
        self.out = eqx.nn.Linear(8, 5, key=keys[2])

    def __call__(self, x, state):
        x, state = self.norm(self.conv(x), state)
        x = self.group_norm(jax.nn.relu(x))
        x = self.hidden(x.mean(axis=tuple(range(1, x.ndim))))
        return self.out(jnp.tanh(self.layer_norm(x))), state


@functools.cache
def jax_model(library: str, model: str, seed: int = 0):
    """A probe of `model` in `library` with random weights (`filled`)."""
    if model == "attention":
        return build(library, "attention", seed)
    spatial = SPATIAL[model]
    key = jax.random.key(seed)
    x = jnp.asarray(_inputs(model, library)[1])
    if library == "linen":
        module = LinenCNN(spatial)
        return bridge.probe(module, filled(jax.eval_shape(module.init, key, x), seed))
    if library == "nnx":
        abstract = nnx.eval_shape(lambda: NnxCNN(spatial, nnx.Rngs(seed)))
        graphdef, state = nnx.split(abstract)
        return bridge.probe(nnx.merge(graphdef, filled(state, seed)))
    if library == "haiku":
        function = functools.partial(_haiku_cnn, spatial=spatial)
        transformed = hk.without_apply_rng(hk.transform_with_state(function))
        init = functools.partial(transformed.init, is_training=True)  # the EMAs
        params, state = filled(jax.eval_shape(init, key, x), seed)
        return bridge.probe(transformed, params, state)
    make = functools.partial(eqx.nn.make_with_state(EqxCNN), spatial)
    module, state = filled(eqx.filter_eval_shape(make, key), seed)
    rng = np.random.default_rng(seed)
    statistics = (
        jnp.asarray(0.5 * rng.standard_normal(4), jnp.float32),
        jnp.asarray(rng.uniform(0.5, 1.5, 4), jnp.float32),
    )
    state = state.set(module.norm.ema_state_index, statistics)
    return bridge.probe(module, state, vmap=True)


@functools.cache
def _jitted(library: str, model: str):
    del library, model  # cache keys: ported probes share the static structure
    return jax.jit(outputs)


def jax_output(probe, library: str, model: str) -> np.ndarray:
    """The JAX library's own forward pass."""
    return np.asarray(_jitted(library, model)(probe, _inputs(model, library)[1]))


MODELS = [
    ("cnn2d", {}),
    ("cnn1d", {}),
    ("attention", {"batch_first": True}),
    ("attention", {"batch_first": False}),
]


def _model_id(model: str, options: dict) -> str:
    return model if not options else f"{model}-batch_first={options['batch_first']}"


@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize(
    "model, options", MODELS, ids=[_model_id(*case) for case in MODELS]
)
def test_weights_move_both_ways(library, model, options):
    """PyTorch -> JAX, then JAX -> PyTorch: the destination's own forward pass
    gives the source's outputs; before the transfer, it did not."""
    x_torch, x_jax = _inputs(model, library)
    source, destination = torch_model(model, **options), jax_model(library, model, 1)
    expected = torch_output(source, x_torch)
    before = jax_output(destination, library, model)
    ported = bridge.transfer(
        bridge.probe(source), destination, x_torch, args_b=(x_jax,)
    )
    assert type(ported) is type(destination)
    np.testing.assert_allclose(
        jax_output(ported, library, model), expected, rtol=1e-5, atol=2e-6
    )
    assert np.abs(before - expected).max() > 1e-2

    source, destination = jax_model(library, model), torch_model(model, 1, **options)
    if model != "attention":
        destination.norm.num_batches_tracked.fill_(7)
    snapshot = copy.deepcopy(destination.state_dict())
    expected = jax_output(source, library, model)
    before = torch_output(destination, x_torch)
    ported = bridge.transfer(
        source, bridge.probe(destination), x_jax, args_b=(x_torch,)
    )
    assert isinstance(ported, type(bridge.probe(destination)))
    assert ported.module is not destination
    np.testing.assert_allclose(
        torch_output(ported.module, x_torch), expected, rtol=1e-5, atol=2e-6
    )
    assert np.abs(before - expected).max() > 1e-2
    # The user's module is untouched: every parameter and buffer, and its mode.
    for name, value in destination.state_dict().items():
        assert torch.equal(value, snapshot[name]), name
    assert not destination.training
    if model != "attention":  # not a weight: kept as it is
        assert ported.module.norm.num_batches_tracked.item() == 7


def test_torch_to_linen_equals_a_port_written_by_hand():
    source = torch_model("cnn2d")
    x_torch, x_jax = _inputs("cnn2d", "linen")
    ported = bridge.transfer(
        bridge.probe(source), jax_model("linen", "cnn2d", 1), x_torch, args_b=(x_jax,)
    )
    params = ported.variables["params"]
    stats = ported.variables["batch_stats"]["BatchNorm_0"]

    def numpy(tensor):
        return tensor.detach().numpy()

    # OIHW -> HWIO; Linear (out, in) -> (in, out).
    np.testing.assert_array_equal(
        params["Conv_0"]["kernel"],
        np.transpose(numpy(source.conv.weight), (2, 3, 1, 0)),
    )
    np.testing.assert_array_equal(params["Conv_0"]["bias"], numpy(source.conv.bias))
    np.testing.assert_array_equal(
        params["Dense_0"]["kernel"], numpy(source.hidden.weight).T
    )
    np.testing.assert_array_equal(params["Dense_1"]["bias"], numpy(source.out.bias))
    np.testing.assert_array_equal(stats["mean"], numpy(source.norm.running_mean))
    np.testing.assert_array_equal(stats["var"], numpy(source.norm.running_var))
    np.testing.assert_array_equal(
        params["BatchNorm_0"]["scale"], numpy(source.norm.weight)
    )
    np.testing.assert_array_equal(
        params["GroupNorm_0"]["scale"], numpy(source.group_norm.weight)
    )
    np.testing.assert_array_equal(
        params["LayerNorm_0"]["bias"], numpy(source.layer_norm.bias)
    )


def test_attention_projections_equal_a_port_written_by_hand():
    """Packed `in_proj_weight` (3E, E): rows [0, E) query, [E, 2E) key,
    [2E, 3E) value, head h at rows h * 4 : (h + 1) * 4 of each; Linen's kernels
    are (in, heads, head_dim) and the output's (heads, head_dim, out)."""
    source = torch_model("attention", batch_first=False)
    ported = bridge.transfer(
        bridge.probe(source), jax_model("linen", "attention", 1), TOKENS
    )
    attention = ported.variables["params"]["MultiHeadDotProductAttention_0"]
    weight = source.attention.in_proj_weight.detach().numpy()
    bias = source.attention.in_proj_bias.detach().numpy()
    for number, name in enumerate(["query", "key", "value"]):
        rows = weight[number * 8 : (number + 1) * 8]  # (out = heads * 4, in)
        np.testing.assert_array_equal(
            attention[name]["kernel"], rows.T.reshape(8, 2, 4)
        )
        np.testing.assert_array_equal(
            attention[name]["bias"], bias[number * 8 : (number + 1) * 8].reshape(2, 4)
        )
    out = source.attention.out_proj
    np.testing.assert_array_equal(
        attention["out"]["kernel"], out.weight.detach().numpy().T.reshape(2, 4, 8)
    )
    np.testing.assert_array_equal(attention["out"]["bias"], out.bias.detach().numpy())
    np.testing.assert_array_equal(
        ported.variables["params"]["Embed_0"]["embedding"],
        source.embed.weight.detach().numpy(),
    )
    # And back: Linen's key kernel becomes rows [E, 2E) of the packed weight.
    back = bridge.transfer(ported, bridge.probe(torch_model("attention", 1)), TOKENS)
    key = np.asarray(attention["key"]["kernel"]).reshape(8, 8).T
    np.testing.assert_array_equal(
        back.module.attention.in_proj_weight.detach().numpy()[8:16], key
    )


# -- compare ----------------------------------------------------------------------


def torch_loss(outputs):
    return (outputs**2).sum()


def jax_loss(outputs):
    return jnp.sum(outputs**2)


CNN_SITES = {
    "linen": ["Conv_0", "BatchNorm_0", "GroupNorm_0", "Dense_0", "LayerNorm_0"],
    "nnx": ["conv", "norm", "group_norm", "hidden", "layer_norm"],
    "haiku": ["conv_nd", "batch_norm", "group_norm", "linear", "layer_norm"],
    "equinox": ["conv", "norm", "group_norm", "hidden", "layer_norm"],
}
CNN_SITES["linen"].append("Dense_1")
CNN_SITES["nnx"].append("out")
CNN_SITES["haiku"].append("linear_1")
CNN_SITES["equinox"].append("out")


def _compare(torch_module, library, model, **tolerances):
    x_torch, x_jax = _inputs(model, library)
    torch_probe = bridge.probe(torch_module)
    ported = bridge.transfer(
        torch_probe, jax_model(library, model, 1), x_torch, args_b=(x_jax,)
    )
    return bridge.compare(
        torch_probe,
        ported,
        (torch_loss, jax_loss),
        x_torch,
        args_b=(x_jax,),
        **tolerances,
    )


@pytest.mark.parametrize("library", LIBRARIES)
def test_compare_finds_ported_cnns_agree(library):
    report = _compare(torch_model("cnn2d"), library, "cnn2d", rtol=1e-4, atol=1e-5)
    assert report.first_divergence is None, str(report)
    assert [(row.site_a, row.site_b) for row in report.rows] == list(
        zip(
            ["conv", "norm", "group_norm", "hidden", "layer_norm", "out"],
            CNN_SITES[library],
            strict=True,
        )
    )
    assert [row.kind for row in report.rows] == [
        "conv",
        "batchnorm",
        "groupnorm",
        "dense",
        "layernorm",
        "dense",
    ]
    # PyTorch's NCHW values are compared channel-last.
    assert [row.shape for row in report.rows[:3]] == [(2, 6, 6, 4)] * 3
    np.testing.assert_allclose(report.loss_a, report.loss_b, rtol=1e-5)


@pytest.mark.parametrize(
    "library, batch_first",
    [("linen", False), ("nnx", True), ("haiku", False), ("equinox", True)],
)
def test_compare_finds_ported_attention_agrees(library, batch_first):
    """The attention's output (its first output, batch-first) is compared with
    the JAX output projection's; query, key and value move but are not compared
    (PyTorch computes them inside one fused function)."""
    module = torch_model("attention", batch_first=batch_first)
    report = _compare(module, library, "attention", rtol=1e-4, atol=1e-5)
    assert report.first_divergence is None, str(report)
    assert [row.site_a for row in report.rows] == ["embed", "attention", "norm", "out"]
    assert report.rows[1].site_b.endswith(("out", "linear", "output_proj"))
    assert report.rows[1].shape == (2, 5, 8)


@pytest.mark.parametrize(
    "library, bug",
    [
        ("linen", "epsilon"),
        ("nnx", "relu"),
        ("haiku", "epsilon"),
        ("equinox", "relu"),
    ],
)
def test_compare_names_the_pair_where_a_planted_bug_shows(library, bug):
    """A LayerNorm epsilon of 1 instead of 1e-5 shows at the LayerNorm; a
    missing relu at the GroupNorm after it. Upstream, only gradients differ."""
    if bug == "epsilon":
        module = torch_model("cnn2d", layer_norm_epsilon=1.0)
        at = 4
    else:
        module = torch_model("cnn2d", activation=lambda x: x)
        at = 2
    report = _compare(module, library, "cnn2d", rtol=1e-4, atol=1e-5)
    first = report.first_divergence
    assert first is not None and not first.activations_agree, str(report)
    assert (first.site_a, first.site_b) == (
        ["conv", "norm", "group_norm", "hidden", "layer_norm"][at],
        CNN_SITES[library][at],
    )
    assert all(row.activations_agree for row in report.rows[:at])
    assert not report.rows[at - 1].grads_agree


# -- more layers and layouts ------------------------------------------------------


class TorchCrossAttention(torch.nn.Module):
    """Keys and values of other sizes than the queries: separate
    `q_proj_weight`, `k_proj_weight`, `v_proj_weight`."""

    def __init__(self):
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(
            8, 2, kdim=6, vdim=5, batch_first=True
        )

    def forward(self, query, key, value):
        return self.attention(query, key, value, need_weights=False)[0]


class LinenCrossAttention(nn.Module):
    @nn.compact
    def __call__(self, query, key, value):
        return nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(
            query, key, value
        )


def test_attention_with_separate_key_and_value_sizes():
    rng = np.random.default_rng(4)
    inputs = tuple(
        rng.standard_normal((2, length, size)).astype(np.float32)
        for length, size in ((5, 8), (7, 6), (7, 5))
    )
    source = _randomised(TorchCrossAttention(), 0)
    module = LinenCrossAttention()
    variables = filled(jax.eval_shape(module.init, jax.random.key(0), *inputs), 1)
    destination = bridge.probe(module, variables)
    ported = bridge.transfer(bridge.probe(source), destination, *inputs)
    with torch.no_grad():
        expected = source(*map(torch.from_numpy, inputs)).numpy()
    apply = jax.jit(module.apply)
    np.testing.assert_allclose(
        apply(ported.variables, *inputs), expected, rtol=1e-5, atol=2e-6
    )
    assert np.abs(apply(variables, *inputs) - expected).max() > 1e-2
    np.testing.assert_array_equal(
        ported.variables["params"]["MultiHeadDotProductAttention_0"]["key"]["kernel"],
        source.attention.k_proj_weight.detach().numpy().T.reshape(6, 2, 4),
    )
    back = bridge.transfer(
        ported, bridge.probe(_randomised(TorchCrossAttention(), 1)), *inputs
    )
    with torch.no_grad():
        again = back.module(*map(torch.from_numpy, inputs)).numpy()
    np.testing.assert_allclose(again, expected, rtol=1e-5, atol=2e-6)


class Scaled(torch.nn.Module):
    """A module of its own, owning a parameter: moved by name, between two
    modules of this class only."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(4))
        self.register_buffer("shift", torch.zeros(4))

    def forward(self, x):
        return x * self.scale + self.shift


class RootOwned(torch.nn.Module):
    """The root owns a parameter too (a site-less layer)."""

    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(4))
        self.linear = torch.nn.Linear(4, 4)
        self.scaled = Scaled()

    def forward(self, x):
        return self.scaled(self.linear(x)) + self.bias


def test_torch_to_torch_moves_custom_modules_and_the_root_parameters():
    x = np.random.default_rng(5).standard_normal((3, 4)).astype(np.float32)
    source, destination = _randomised(RootOwned(), 0), _randomised(RootOwned(), 1)
    ported = bridge.transfer(bridge.probe(source), bridge.probe(destination), x)
    for name, value in source.state_dict().items():
        assert torch.equal(ported.module.state_dict()[name], value), name
    np.testing.assert_array_equal(
        torch_output(ported.module, x), torch_output(source, x)
    )
    _, found = parameterised_layers(bridge.probe(source), "src_probe", (x,), {})
    assert [(layer.site, layer.kind) for layer in found] == [
        ("", "weights:bias"),
        ("linear", "dense"),
        ("scaled", "weights:scale,shift"),
    ]
    assert set(found[2].weights) == {"scale", "shift"}


def test_haiku_channels_first_group_norm():
    """`hk.GroupNorm(data_format="channels_first")`: `(C, 1, 1)` parameters,
    NCHW values like PyTorch's."""
    x = _images(2)[0]
    source = _randomised(
        torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.GroupNorm(2, 4)), 0
    )

    def function(x):
        x = jnp.moveaxis(hk.Conv2D(4, 1)(jnp.moveaxis(x, 1, -1)), -1, 1)
        return hk.GroupNorm(2, eps=EPSILON, data_format="channels_first")(x)

    transformed = hk.without_apply_rng(hk.transform(function))
    params = filled(jax.eval_shape(transformed.init, jax.random.key(0), x), 1)
    assert params["group_norm"]["scale"].shape == (4, 1, 1)
    ported = bridge.transfer(bridge.probe(source), bridge.probe(transformed, params), x)
    np.testing.assert_allclose(
        jax.jit(transformed.apply)(ported.params, x),
        torch_output(source, x),
        rtol=1e-5,
        atol=2e-6,
    )
    report = bridge.compare(
        bridge.probe(source),
        ported,
        (torch_loss, jax_loss),
        x,
        rtol=1e-4,
        atol=1e-5,
    )
    assert report.first_divergence is None, str(report)
    assert report.rows[1].kind == "groupnorm"
    assert report.rows[1].shape == (2, 6, 6, 4)


def test_haiku_channels_first_conv_and_batch_norm_compare_with_torch():
    """`hk.Conv2D(data_format="NCHW")` and a channels-first `hk.BatchNorm` take
    PyTorch's NCHW input as it is; compare brings both to channel-last."""
    x = _images(2)[0]
    source = _randomised(
        torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4)
        ),
        0,
    ).eval()

    def function(x, is_training=False):
        x = hk.Conv2D(4, 3, data_format="NCHW")(x)
        norm = hk.BatchNorm(True, True, 0.9, eps=1e-5, data_format="channels_first")
        return norm(x, is_training=is_training)

    transformed = hk.transform_with_state(function)
    params, state = transformed.init(jax.random.key(0), x, is_training=True)
    ported = bridge.transfer(
        bridge.probe(source), bridge.probe(transformed, params, state), x
    )
    report = bridge.compare(
        bridge.probe(source), ported, (torch_loss, jax_loss), x, rtol=1e-4, atol=1e-5
    )
    assert report.first_divergence is None, str(report)
    assert [row.shape for row in report.rows] == [(2, 6, 6, 4)] * 2


# -- errors -----------------------------------------------------------------------


class LinenNormFirst(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.LayerNorm()(x))


def test_a_kind_mismatch_names_both_sites():
    x = np.ones((2, 4), np.float32)
    source = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    module = LinenNormFirst()
    destination = bridge.probe(module, module.init(jax.random.key(0), x))
    with pytest.raises(
        ValueError,
        match=r"Cannot pair site '0' \(nn.Linear\) of the source and site "
        r"'LayerNorm_0' \(nn.LayerNorm\) of the destination: their kinds differ "
        r"\(dense vs layernorm\)",
    ):
        bridge.transfer(bridge.probe(source), destination, x)
    with pytest.raises(ValueError, match=r"site 'LayerNorm_0' .* site '0'"):
        bridge.transfer(destination, bridge.probe(source), x)


class LinenConvAfterEmbed(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        h = nn.Embed(11, 8)(tokens)
        for _ in range(4):
            h = nn.Conv(8, (1,))(h)
        return nn.Dense(3)(nn.LayerNorm()(h).mean(axis=1))


def test_a_mismatch_at_an_attention_projection_names_it():
    module = LinenConvAfterEmbed()
    destination = bridge.probe(module, module.init(jax.random.key(0), TOKENS))
    with pytest.raises(
        ValueError,
        match=r"Cannot pair 'attention.query' \(nn.MultiheadAttention, its query "
        r"projection\) of the source and site 'Conv_0' \(nn.Conv\) of the "
        r"destination: their kinds differ \(dense vs conv\)",
    ):
        bridge.transfer(bridge.probe(torch_model("attention")), destination, TOKENS)


def test_one_torch_tensor_serves_both_models():
    """A porter's `x` is often a torch tensor: without `args_b`, the JAX model
    gets it as a NumPy array, in transfer and in compare alike."""
    torch.manual_seed(0)
    source = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)
    )

    class Port(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(jnp.tanh(nn.Dense(8)(x)))

    x = torch.randn(3, 4)
    variables = Port().init(jax.random.key(0), jnp.zeros((3, 4)))
    ported = bridge.transfer(bridge.probe(source), bridge.probe(Port(), variables), x)
    report = bridge.compare(
        bridge.probe(source), ported, (lambda y: y.square().sum(), jax_loss), x
    )
    assert report.first_divergence is None, str(report)
    # Linen numbers modules in construction order: the outer Dense is Dense_0.
    assert [row.site_b for row in report.rows] == ["Dense_1", "Dense_0"]
    np.testing.assert_allclose(
        ported.apply(x.numpy()).outputs, source(x).detach().numpy(), atol=1e-6
    )
