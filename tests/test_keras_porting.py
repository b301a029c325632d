"""Keras 3's layer kinds in `bridge.transfer` and `bridge.compare`, against
PyTorch: a small CNN with each kind Keras's porting side converts beyond
KerasHub's GPT-2 (`tests/test_keras_hub.py`): `Conv2D` with its own
activation, `BatchNormalization` with moving statistics, `GroupNormalization`,
`Dense` with and without an activation, `LayerNormalization`,
`RMSNormalization`, `Embedding`.

References are PyTorch's own outputs and weights mapped by hand, no bridge.
"""

from __future__ import annotations

import os

os.environ["KERAS_BACKEND"] = "jax"  # before any import of Keras

import jax
import jax.numpy as jnp
import numpy as np
import pytest

keras = pytest.importorskip("keras")
torch = pytest.importorskip("torch")

import bridge  # noqa: E402

pytestmark = pytest.mark.usefixtures("allow_rank_promotion")

BATCH, SIDE, CHANNELS, FEATURES, CLASSES = 2, 6, 3, 4, 5


def value_of(values, variable):
    """The probe's value of a Keras variable: keyed by the variable's path,
    or by that path relative to the model (a `Sequential` puts its own name in
    front), the longest key that ends it."""
    keys = [k for k in values if variable.path == k or variable.path.endswith(f"/{k}")]
    assert keys, (variable.path, list(values))
    return np.asarray(values[max(keys, key=len)])


def scale_agree(actual, expected, rtol=1e-5, atol=1e-6):
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    difference = np.max(np.abs(actual - expected))
    assert difference <= atol + rtol * np.max(np.abs(expected)), difference


class TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(CHANNELS, FEATURES, 3, padding=1)
        self.batch_norm = torch.nn.BatchNorm2d(FEATURES, eps=1e-5, momentum=0.1)
        self.group_norm = torch.nn.GroupNorm(2, FEATURES, eps=1e-5)
        self.hidden = torch.nn.Linear(FEATURES, 8)
        self.layer_norm = torch.nn.LayerNorm(8, eps=1e-5)
        self.rms_norm = torch.nn.RMSNorm(8, eps=1e-6)
        self.head = torch.nn.Linear(8, CLASSES)

    def forward(self, x):
        x = self.group_norm(self.batch_norm(torch.relu(self.conv(x))))
        x = torch.tanh(self.hidden(x.mean((2, 3))))
        return self.head(self.rms_norm(self.layer_norm(x)))


def keras_net(batch_norm_epsilon=1e-5):
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input((SIDE, SIDE, CHANNELS)),
            layers.Conv2D(FEATURES, 3, padding="same", activation="relu"),
            layers.BatchNormalization(epsilon=batch_norm_epsilon, momentum=0.9),
            layers.GroupNormalization(groups=2, epsilon=1e-5),
            layers.GlobalAveragePooling2D(),
            layers.Dense(8, activation="tanh"),
            layers.LayerNormalization(epsilon=1e-5),
            layers.RMSNormalization(epsilon=1e-6),
            layers.Dense(CLASSES),
        ]
    )


@pytest.fixture(scope="module")
def nets():
    if not hasattr(keras.layers, "RMSNormalization") or not hasattr(
        torch.nn, "RMSNorm"
    ):
        pytest.skip("keras.layers.RMSNormalization or torch.nn.RMSNorm is missing")
    torch.manual_seed(0)
    net = TorchNet().eval()
    with torch.no_grad():  # off the initial ones and zeros
        for parameter in net.parameters():
            parameter.add_(0.2 * torch.randn_like(parameter))
        net.batch_norm.running_mean.copy_(0.3 * torch.randn(FEATURES))
        net.batch_norm.running_var.copy_(0.5 + torch.rand(FEATURES))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, SIDE, SIDE, CHANNELS)).astype(np.float32)
    x_nchw = torch.tensor(np.transpose(x, (0, 3, 1, 2)))
    with jax.numpy_rank_promotion("allow"):  # a module's fixture: no test's
        keras.utils.set_random_seed(0)
        model = keras_net()
        port = bridge.transfer(
            bridge.probe(net), bridge.probe(model), x_nchw, args_b=(x,)
        )
    return net, model, port, x, x_nchw


def test_transfer_from_torch_writes_the_hand_map(nets):
    net, model, port, x, x_nchw = nets
    sd = {name: tensor.detach().numpy() for name, tensor in net.state_dict().items()}
    # {(index of the Keras layer, its variable's name): PyTorch's array}
    by_layer = {
        (0, "kernel"): np.transpose(sd["conv.weight"], (2, 3, 1, 0)),
        (0, "bias"): sd["conv.bias"],
        (1, "gamma"): sd["batch_norm.weight"],
        (1, "beta"): sd["batch_norm.bias"],
        (1, "moving_mean"): sd["batch_norm.running_mean"],
        (1, "moving_variance"): sd["batch_norm.running_var"],
        (2, "gamma"): sd["group_norm.weight"],
        (2, "beta"): sd["group_norm.bias"],
        (4, "kernel"): sd["hidden.weight"].T,
        (4, "bias"): sd["hidden.bias"],
        (5, "gamma"): sd["layer_norm.weight"],
        (5, "beta"): sd["layer_norm.bias"],
        (6, "scale"): sd["rms_norm.weight"],
        (7, "kernel"): sd["head.weight"].T,
        (7, "bias"): sd["head.bias"],
    }
    variables = {
        (n, variable.name): variable
        for n, layer in enumerate(model.layers)
        for variable in layer.weights
    }
    assert set(variables) == set(by_layer)
    values = port.trainable | port.non_trainable
    assert len(values) == len(by_layer)
    for where, value in by_layer.items():
        np.testing.assert_array_equal(value_of(values, variables[where]), value)
    with torch.no_grad():
        expected_outputs = net(x_nchw).numpy()
    scale_agree(port.apply(x).outputs, expected_outputs)


def test_transfer_to_torch_gives_back_the_weights(nets):
    net, _, port, x, x_nchw = nets
    torch.manual_seed(1)
    fresh = TorchNet().eval()
    (moved,) = bridge.transfer(port, bridge.probe(fresh), x, args_b=(x_nchw,)).unwrap()
    for name, tensor in net.state_dict().items():
        if tensor.is_floating_point():
            np.testing.assert_array_equal(
                moved.state_dict()[name].numpy(), tensor.numpy()
            )


def _losses(target):
    return (
        lambda out: torch.mean((out - torch.tensor(target)) ** 2),
        lambda out: jnp.mean((out - target) ** 2),
    )


def test_compare_agrees_and_names_keras_batch_norm_epsilon(nets):
    """Keras's `BatchNormalization` defaults to epsilon 1e-3, PyTorch's to
    1e-5: a port that keeps Keras's default parts at that norm."""
    net, _, port, x, x_nchw = nets
    target = np.random.default_rng(1).standard_normal((BATCH, CLASSES))
    target = target.astype(np.float32)
    report = bridge.compare(
        bridge.probe(net), port, _losses(target), x_nchw, args_b=(x,)
    )
    assert report.first_divergence is None, str(report)
    kinds = [row.kind for row in report.rows]
    assert kinds == [
        "conv", "batchnorm", "groupnorm", "dense", "layernorm", "rmsnorm", "dense"
    ]  # fmt: skip
    assert not any(row.hyperparameters for row in report.rows), str(report)

    with jax.numpy_rank_promotion("allow"):
        keras.utils.set_random_seed(0)
        default_epsilon = keras_net(batch_norm_epsilon=1e-3)
        buggy = bridge.transfer(
            bridge.probe(net), bridge.probe(default_epsilon), x_nchw, args_b=(x,)
        )
    report = bridge.compare(
        bridge.probe(net), buggy, _losses(target), x_nchw, args_b=(x,)
    )
    first = report.first_divergence
    assert first is not None and first.kind == "batchnorm", str(report)
    assert first.hyperparameters["epsilon"] == (1e-5, 1e-3)


def test_an_embedding_and_a_dense_with_its_activation():
    """Keras's `Dense(activation="gelu")` against PyTorch's `Linear` and
    `GELU` modules: compared after the activation, both ways."""
    torch.manual_seed(2)
    net = torch.nn.Sequential(
        torch.nn.Embedding(11, 6),
        torch.nn.Linear(6, 7),
        torch.nn.GELU(),
        torch.nn.Linear(7, 3),
    )
    model = keras.Sequential(
        [
            keras.Input((4,), dtype="int32"),
            keras.layers.Embedding(11, 6),
            keras.layers.Dense(7, activation="gelu"),
            keras.layers.Dense(3),
        ]
    )
    ids = np.array([[1, 2, 3, 10], [0, 5, 5, 9]], np.int32)
    ids_t = torch.tensor(ids, dtype=torch.long)
    target = np.random.default_rng(2).standard_normal((2, 4, 3)).astype(np.float32)
    port = bridge.transfer(bridge.probe(net), bridge.probe(model), ids_t, args_b=(ids,))
    with torch.no_grad():
        scale_agree(port.apply(ids).outputs, net(ids_t).numpy())
    for probe_a, probe_b, inputs, inputs_b, losses in (
        (bridge.probe(net), port, ids_t, ids, _losses(target)),
        (port, bridge.probe(net), ids, ids_t, _losses(target)[::-1]),
    ):
        report = bridge.compare(probe_a, probe_b, losses, inputs, args_b=(inputs_b,))
        assert report.first_divergence is None, str(report)
        assert [row.kind for row in report.rows] == ["embed", "dense", "dense"]


def test_compare_in_float64_rebuilds_the_keras_model():
    """`dtype="float64"`: a Keras layer computes in its dtype policy's dtype,
    so the model is rebuilt in float64; float32 rounding goes, and the port
    agrees at float64's tolerances."""
    torch.manual_seed(3)
    net = torch.nn.Sequential(
        torch.nn.Linear(6, 7), torch.nn.GELU(), torch.nn.Linear(7, 3)
    )
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(7, activation="gelu"),
            keras.layers.Dense(3),
        ]
    )
    x = np.random.default_rng(3).standard_normal((2, 6)).astype(np.float32)
    x_t = torch.tensor(x)
    port = bridge.transfer(bridge.probe(net), bridge.probe(model), x_t, args_b=(x,))
    losses = (lambda out: torch.mean(out**2), lambda out: jnp.mean(out**2))
    report = bridge.compare(
        bridge.probe(net), port, losses, x_t, args_b=(x,), dtype="float64"
    )
    assert report.dtype == "float64" and not report.lower_precision
    assert report.first_divergence is None, str(report)
    assert all(row.activation_rel < 1e-12 for row in report.rows), str(report)
    assert model.dtype_policy.name == "float32"  # the user's model as it was


def test_a_frozen_layer_moves_its_weights_too(nets):
    """A layer with `trainable=False` holds its kernel among the
    non-trainable variables: it is the same layer, and moves the same way."""
    net, ported_model, port, x, x_nchw = nets
    with jax.numpy_rank_promotion("allow"):
        keras.utils.set_random_seed(0)
        model = keras_net()
        model.layers[0].trainable = False  # the convolution
        model.layers[4].trainable = False  # the hidden Dense
        frozen = bridge.transfer(
            bridge.probe(net), bridge.probe(model), x_nchw, args_b=(x,)
        )
    for n in (0, 4):
        for variable in model.layers[n].weights:
            value_of(frozen.non_trainable, variable)  # held there
    # Layer by layer, the same values as the port of the trainable model.
    values = frozen.trainable | frozen.non_trainable
    ported = port.trainable | port.non_trainable
    for layer, ported_layer in zip(model.layers, ported_model.layers, strict=True):
        for variable, twin in zip(layer.weights, ported_layer.weights, strict=True):
            np.testing.assert_array_equal(
                value_of(values, variable), value_of(ported, twin)
            )


@pytest.mark.parametrize(
    ("equation", "expected"),
    [
        ("ab,bc->ac", ("b", "c", "bc")),  # a Dense
        ("abc,cde->abde", ("c", "de", "cde")),  # attention's query projection
        ("abcd,cde->abe", ("cd", "e", "cde")),  # attention's output projection
        ("...b,bc->...c", ("b", "c", "bc")),
        ("abc,bcd->abd", None),  # a weight per position: no dense layer
        ("abc,cd->adb", None),  # the output axes not last
        ("abc,dc->abd", ("c", "d", "dc")),  # a kernel stored (out, in)
    ],
)
def test_which_einsum_dense_layers_are_dense(equation, expected):
    from bridge.adapters.keras.porting import _einsum_axes

    assert _einsum_axes(equation) == expected


def test_an_einsum_dense_with_its_kernel_stored_out_by_in():
    """`EinsumDense("ab,cb->ac")` holds its kernel `(out, in)`, as PyTorch's
    `nn.Linear` holds its weight: moved across unchanged, both ways."""
    torch.manual_seed(4)
    net = torch.nn.Linear(6, 3)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.EinsumDense("ab,cb->ac", output_shape=3, bias_axes="c"),
        ]
    )
    x = np.random.default_rng(4).standard_normal((2, 6)).astype(np.float32)
    x_t = torch.tensor(x)
    port = bridge.transfer(bridge.probe(net), bridge.probe(model), x_t, args_b=(x,))
    layer = model.layers[0]
    np.testing.assert_array_equal(
        value_of(port.trainable, layer.kernel), net.weight.detach().numpy()
    )
    np.testing.assert_array_equal(
        value_of(port.trainable, layer.bias), net.bias.detach().numpy()
    )
    with torch.no_grad():
        scale_agree(port.apply(x).outputs, net(x_t).numpy())
    (back,) = bridge.transfer(
        port, bridge.probe(torch.nn.Linear(6, 3)), x, args_b=(x_t,)
    ).unwrap()
    np.testing.assert_array_equal(
        back.weight.detach().numpy(), net.weight.detach().numpy()
    )
