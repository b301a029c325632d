"""`bridge.compare` a porter can trust: no false alarm from float32 rounding,
a float64 run, dead calls, weights paired as the libraries' converters pair
them, and the outputs compared as logits.

The models: an MLP (Linear 4 -> 16, LayerNorm, tanh, Linear 16 -> 5) in
PyTorch and in each JAX library, optionally calling its LayerNorm once more
and dropping one of the two results (`dead="first"` or `"second"`, the
duplicated line of a port). The references do not use bridge: the models'
own forward passes, a float64 forward pass in NumPy from the PyTorch
weights, weights moved by hand, KL and top-1 written out in NumPy.
"""

from __future__ import annotations

import copy
import warnings

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import bridge

EPSILON = 1e-5
X = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
JAX_LIBRARIES = ("linen", "nnx", "equinox", "haiku")


def loss_fn(outputs):
    return (outputs**2).sum()


# -- the MLP in each library ----------------------------------------------------


class TorchMLP(torch.nn.Module):
    def __init__(self, dead=None, scale=1.0):
        super().__init__()
        self.dead, self.scale = dead, scale
        self.hidden = torch.nn.Linear(4, 16)
        self.norm = torch.nn.LayerNorm(16, eps=EPSILON)
        self.out = torch.nn.Linear(16, 5)

    def forward(self, x):
        x = self.hidden(x)
        if self.dead == "first":
            self.norm(x)
        x = self.norm(x)
        if self.dead == "second":
            self.norm(x)
        return self.scale * self.out(torch.tanh(x))


def _torch_mlp(dead=None, seed=0, scale=1.0):
    torch.manual_seed(seed)
    model = TorchMLP(dead, scale).eval()
    with torch.no_grad():  # no scale 1, no bias 0
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    return model


class LinenMLP(nn.Module):
    dead: str | None = None

    def setup(self):
        self.hidden = nn.Dense(16)
        self.norm = nn.LayerNorm(epsilon=EPSILON)
        self.out = nn.Dense(5)

    def __call__(self, x):
        x = self.hidden(x)
        if self.dead == "first":
            self.norm(x)
        x = self.norm(x)
        if self.dead == "second":
            self.norm(x)
        return self.out(jnp.tanh(x))


class NnxMLP(nnx.Module):
    def __init__(self, dead=None):
        rngs = nnx.Rngs(0)
        self.dead = dead
        self.hidden = nnx.Linear(4, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, epsilon=EPSILON, rngs=rngs)
        self.out = nnx.Linear(16, 5, rngs=rngs)

    def __call__(self, x):
        x = self.hidden(x)
        if self.dead == "first":
            self.norm(x)
        x = self.norm(x)
        if self.dead == "second":
            self.norm(x)
        return self.out(jnp.tanh(x))


class EqxMLP(eqx.Module):
    hidden: eqx.nn.Linear
    norm: eqx.nn.LayerNorm
    out: eqx.nn.Linear
    dead: str | None = eqx.field(static=True, default=None)

    def __init__(self, dead=None):
        keys = jax.random.split(jax.random.key(0))
        self.hidden = eqx.nn.Linear(4, 16, key=keys[0])
        self.norm = eqx.nn.LayerNorm(16, eps=EPSILON)
        self.out = eqx.nn.Linear(16, 5, key=keys[1])
        self.dead = dead

    def __call__(self, x):  # one example
        x = self.hidden(x)
        if self.dead == "first":
            self.norm(x)
        x = self.norm(x)
        if self.dead == "second":
            self.norm(x)
        return self.out(jnp.tanh(x))


def _haiku_mlp(dead):
    def forward(x):
        x = hk.Linear(16, name="hidden")(x)
        norm = hk.LayerNorm(-1, True, True, eps=EPSILON, name="norm")
        if dead == "first":
            norm(x)
        x = norm(x)
        if dead == "second":
            norm(x)
        return hk.Linear(5, name="out")(jnp.tanh(x))

    return hk.without_apply_rng(hk.transform(forward))


def jax_mlp(library, dead=None):
    """A probe of the MLP in `library`, with its initial weights."""
    if library == "linen":
        module = LinenMLP(dead)
        return bridge.probe(module, module.init(jax.random.key(1), X))
    if library == "nnx":
        return bridge.probe(NnxMLP(dead))
    if library == "equinox":
        return bridge.probe(EqxMLP(dead), vmap=True)
    transformed = _haiku_mlp(dead)
    return bridge.probe(transformed, transformed.init(jax.random.key(1), X))


def jax_outputs(probe, x):
    """The JAX model's own forward pass (no bridge code), from the probe's
    fields."""
    library = type(probe).__module__.split(".")[2]
    if library == "linen":
        return probe.module.apply(probe.variables, x)
    if library == "nnx":
        return nnx.merge(probe.graphdef, probe.params, probe.rest, copy=True)(x)
    if library == "equinox":
        return jax.vmap(probe.model)(x)
    return probe.transformed.apply(probe.params, x)


def torch_outputs(model, x):
    with torch.no_grad():
        return model(torch.tensor(x)).numpy()


def numpy_forward(model: TorchMLP, x: np.ndarray) -> np.ndarray:
    """The MLP in float64 NumPy from the PyTorch weights."""
    weights = {k: v.detach().double().numpy() for k, v in model.state_dict().items()}
    h = x.astype(np.float64) @ weights["hidden.weight"].T + weights["hidden.bias"]
    mean, var = h.mean(-1, keepdims=True), h.var(-1, keepdims=True)
    h = (h - mean) / np.sqrt(var + EPSILON) * weights["norm.weight"] + weights[
        "norm.bias"
    ]
    return model.scale * (np.tanh(h) @ weights["out.weight"].T + weights["out.bias"])


def _ported(library, dead=None, torch_dead=None):
    """`(PyTorch MLP, the JAX MLP carrying its weights)`."""
    source = _torch_mlp(torch_dead)
    ported = bridge.transfer(bridge.probe(source), jax_mlp(library, dead), X)
    np.testing.assert_allclose(
        jax_outputs(ported, X), torch_outputs(source, X), rtol=1e-5, atol=1e-5
    )
    return source, ported


# -- 1. no false alarm ----------------------------------------------------------


def test_float32_rounding_near_zero_is_no_divergence():
    """PyTorch's hidden weights moved by one float32 unit each (a rounding
    difference, as another summation order gives), on inputs large enough
    that the rounding exceeds `atol` in absolute terms: elementwise, the
    elements near zero fail `|a - b| <= atol + rtol * |b|`; at the scale of
    each tensor, nothing diverges."""
    x = 100.0 * X
    source, ported = _ported("linen")
    rounded = copy.deepcopy(source)
    with torch.no_grad():
        weight = rounded.hidden.weight
        weight.copy_(torch.from_numpy(np.nextafter(weight.numpy(), np.inf)))
    report = bridge.compare(bridge.probe(rounded), ported, loss_fn, x)
    assert report.first_divergence is None, str(report)

    # The reference: the hidden layer's outputs, elementwise, fail the old rule.
    with torch.no_grad():
        a = rounded.hidden(torch.tensor(x)).numpy()
        b = source.hidden(torch.tensor(x)).numpy()
    assert not np.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert np.max(np.abs(a - b)) <= 1e-6 + 1e-5 * np.max(np.abs(b))


@pytest.mark.parametrize("library", JAX_LIBRARIES)
def test_a_planted_bug_of_1e3_relative_in_one_weight_is_named(library):
    """One element of the output layer's weight, times 1 + 1e-3: named at
    the output layer, in its activations; the layers before agree."""
    source, ported = _ported(library)
    buggy = copy.deepcopy(source)
    with torch.no_grad():
        buggy.out.weight[2, 7] *= 1 + 1e-3
    # The reference: the outputs moved by more than the tolerance allows.
    a, b = torch_outputs(buggy, X), torch_outputs(source, X)
    assert np.max(np.abs(a - b)) > 1e-6 + 1e-5 * np.max(np.abs(b))
    report = bridge.compare(bridge.probe(buggy), ported, loss_fn, X)
    first = report.first_divergence
    assert first is not None and first.site_a == "out", str(report)
    assert not first.activations_agree
    assert all(row.activations_agree for row in report.rows[:-1])


# -- 2. float64 -----------------------------------------------------------------


@pytest.mark.parametrize("library", JAX_LIBRARIES)
def test_float64_a_correct_port_agrees_tightly(library):
    source, ported = _ported(library)
    user_params = {k: v.clone() for k, v in source.state_dict().items()}
    report = bridge.compare(bridge.probe(source), ported, loss_fn, X, dtype="float64")
    assert report.dtype == "float64" and report.lower_precision == ()
    assert (report.rtol, report.atol) == (1e-10, 1e-12)
    assert report.first_divergence is None, str(report)
    assert max(row.activation_rel for row in report.rows) < 1e-13
    assert max(row.grad_rel for row in report.rows) < 1e-13
    assert str(report).splitlines()[0].split("; ")[1] == "float64"
    # The reference: both losses are NumPy's float64 loss.
    want = np.sum(numpy_forward(source, X) ** 2)
    np.testing.assert_allclose([report.loss_a, report.loss_b], want, rtol=1e-13)
    # Nothing of the user's changed; x64 is off again.
    assert not jax.config.jax_enable_x64
    for name, tensor in source.state_dict().items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, user_params[name], rtol=0, atol=0)
    assert {leaf.dtype for leaf in jax.tree.leaves(ported)} == {jnp.dtype("float32")}


def test_float64_names_a_planted_bug():
    source, ported = _ported("linen")
    buggy = copy.deepcopy(source)
    with torch.no_grad():
        buggy.norm.weight[3] *= 1 + 1e-6  # below float32's reach at rtol=1e-5
    report = bridge.compare(bridge.probe(buggy), ported, loss_fn, X, dtype="float64")
    assert report.first_divergence.site_a == "norm", str(report)
    assert report.dtype == "float64"


@pytest.mark.parametrize("dtype", [np.float64, jnp.float64, torch.float64, "double"])
def test_float64_by_any_name(dtype):
    source, ported = _ported("linen")
    report = bridge.compare(bridge.probe(source), ported, loss_fn, X, dtype=dtype)
    assert report.dtype == "float64"


def test_float64_leaves_x64_off_when_the_loss_raises():
    def broken(outputs):
        raise RuntimeError("broken loss")

    source, ported = _ported("linen")
    with pytest.raises(RuntimeError, match="broken loss"):
        bridge.compare(bridge.probe(source), ported, broken, X, dtype="float64")
    assert not jax.config.jax_enable_x64


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", 3, "double-ish"])
def test_a_bad_dtype_names_the_argument(dtype):
    source, ported = _ported("linen")
    with pytest.raises(bridge.BridgeError, match=r'`dtype` must be None .* "float64"'):
        bridge.compare(bridge.probe(source), ported, loss_fn, X, dtype=dtype)


def test_float64_runs_a_flax_module_declared_in_float32():
    """A module whose `dtype` field says float32 (as Hugging Face's Flax
    models' do) runs in float64: its copy's field is float64."""
    source = _torch_mlp()

    class Declared(nn.Module):
        dtype: jnp.dtype = jnp.float32

        @nn.compact
        def __call__(self, x):
            x = nn.Dense(16, dtype=self.dtype, name="hidden")(x)
            x = nn.LayerNorm(epsilon=EPSILON, dtype=self.dtype, name="norm")(x)
            return nn.Dense(5, dtype=self.dtype, name="out")(jnp.tanh(x))

    module = Declared()
    probe = bridge.probe(module, module.init(jax.random.key(0), X))
    ported = bridge.transfer(bridge.probe(source), probe, X)
    report = bridge.compare(bridge.probe(source), ported, loss_fn, X, dtype="float64")
    assert report.first_divergence is None, str(report)
    np.testing.assert_allclose(
        report.loss_b, np.sum(numpy_forward(source, X) ** 2), rtol=1e-13
    )
    assert ported.module.dtype == jnp.float32


# -- 3. dead calls --------------------------------------------------------------


@pytest.mark.parametrize("dead", ["first", "second"])
@pytest.mark.parametrize("library", JAX_LIBRARIES)
def test_a_dead_call_in_the_jax_model_is_reported_never_paired(library, dead):
    """`self.norm(x); x = self.norm(x)` (or the dropped call second): the
    dead call is found in the loss's jaxpr, the live one pairs with
    PyTorch's only call."""
    source, ported = _ported(library, dead=dead)
    report = bridge.compare(bridge.probe(source), ported, loss_fn, X)
    assert report.first_divergence is None, str(report)
    live, gone = ("norm#1", "norm") if dead == "first" else ("norm", "norm#1")
    assert [(row.site_a, row.site_b) for row in report.rows] == [
        ("hidden", "hidden"),
        ("norm", live),
        ("out", "out"),
    ]
    assert len(report.dead) == 1 and report.dead[0].startswith(f"site {gone!r}")
    assert report.dead[0].endswith("of probe_b") and report.unpaired == ()
    assert f"not paired: site {gone!r}" in str(report)


@pytest.mark.parametrize("dead", ["first", "second"])
@pytest.mark.parametrize("library", ["linen", "nnx", "equinox"])
def test_a_dead_call_in_the_torch_model_is_reported_never_paired(library, dead):
    """The duplicated line in PyTorch's model: autograd's graph has no path
    from the dropped output to the loss."""
    source, ported = _ported(library, torch_dead=dead)
    report = bridge.compare(bridge.probe(source), ported, loss_fn, X)
    assert report.first_divergence is None, str(report)
    live, gone = ("norm#1", "norm") if dead == "first" else ("norm", "norm#1")
    assert [row.site_a for row in report.rows] == ["hidden", live, "out"]
    assert len(report.dead) == 1 and report.dead[0].startswith(f"site {gone!r}")
    assert report.dead[0].endswith("of probe_a")


def test_a_live_call_with_a_zero_gradient_is_not_dead():
    """A relu that is off everywhere after the norm: the norm's gradient is
    zero by value, yet its output reaches the loss; it pairs as usual."""
    source = _torch_mlp()

    class Off(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.LayerNorm(epsilon=EPSILON, name="norm")(
                nn.Dense(16, name="hidden")(x)
            )
            return nn.Dense(5, name="out")(jax.nn.relu(x - 100.0))

    class TorchOff(TorchMLP):
        def forward(self, x):
            x = self.norm(self.hidden(x))
            return self.out(torch.relu(x - 100.0))

    torch_off = TorchOff()
    torch_off.load_state_dict(source.state_dict())
    module = Off()
    ported = bridge.transfer(
        bridge.probe(torch_off),
        bridge.probe(module, module.init(jax.random.key(0), X)),
        X,
    )
    report = bridge.compare(bridge.probe(torch_off), ported, loss_fn, X)
    assert report.dead == () and report.first_divergence is None, str(report)
    norm = report.rows[1]
    assert norm.site_a == "norm" and norm.grad_abs == 0.0


def test_an_extra_live_call_pairs_with_the_call_whose_values_match():
    """Linen's model calls its norm on `2 x` first and keeps it (times
    zero: live), then on `x`, which PyTorch's model does: pairing in call
    order would pair the first; the values pair the second."""
    source = _torch_mlp()

    class Extra(nn.Module):
        def setup(self):
            self.hidden = nn.Dense(16)
            self.norm = nn.LayerNorm(epsilon=EPSILON)
            self.out = nn.Dense(5)

        def __call__(self, x):
            x = self.hidden(x)
            doubled = self.norm(2.0 * x + 1.0)
            x = self.norm(x) + 0.0 * doubled
            return self.out(jnp.tanh(x))

    module = Extra()
    ported = bridge.transfer(
        bridge.probe(source), bridge.probe(module, module.init(jax.random.key(0), X)), X
    )
    np.testing.assert_allclose(
        jax_outputs(ported, X), torch_outputs(source, X), rtol=1e-5, atol=1e-5
    )
    report = bridge.compare(bridge.probe(source), ported, loss_fn, X)
    assert report.first_divergence is None, str(report)
    assert report.rows[1].site_b == "norm#1"
    assert report.dead == ()
    assert len(report.unpaired) == 1 and report.unpaired[0].startswith("site 'norm'")


# -- 4. weights paired as the converters pair them ------------------------------


def _normed_conv(style):
    torch.manual_seed(4)
    conv = torch.nn.Conv1d(6, 6, 3, padding=1)
    if style == "parametrization":
        return torch.nn.utils.parametrizations.weight_norm(conv, dim=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated, still used
        return torch.nn.utils.weight_norm(conv, dim=2)


class TorchWeightNormed(torch.nn.Module):
    def __init__(self, style):
        super().__init__()
        self.conv = _normed_conv(style)
        self.norm = torch.nn.LayerNorm(6, eps=EPSILON)

    def forward(self, x):  # (N, C, L)
        return torch.tanh(self.norm(self.conv(x).transpose(1, 2)))


def _normed_kernel(weight_v, weight_g):
    """`weight_v` normed over its first two axes per window position
    (PyTorch's `dim=2`), times `weight_g`: `(out, in, window)`."""
    norm = jnp.sqrt(jnp.sum(weight_v**2, axis=(0, 1), keepdims=True))
    return weight_v / norm * weight_g


def _conv_nlc(x, kernel, bias):
    """A 'SAME' 1-D convolution of channel-last `(N, L, C)` with an `(out,
    in, window)` kernel."""
    out = jax.lax.conv_general_dilated(
        x, kernel, (1,), ((1, 1),), dimension_numbers=("NWC", "OIW", "NWC")
    )
    return out + bias.reshape(1, 1, -1)


class LinenWeightNormConv(nn.Module):
    """As Hugging Face's `FlaxConvWithWeightNorm` (Wav2Vec2): parameters
    `weight_v` `(out, in, window)`, `weight_g` `(1, 1, window)`, `bias`."""

    @nn.compact
    def __call__(self, x):
        weight_v = self.param("weight_v", nn.initializers.normal(), (6, 6, 3))
        weight_g = self.param("weight_g", nn.initializers.ones, (1, 1, 3))
        bias = self.param("bias", nn.initializers.zeros, (6,))
        return _conv_nlc(x, _normed_kernel(weight_v, weight_g), bias)


class LinenWeightNormed(nn.Module):
    @nn.compact
    def __call__(self, x):  # (N, L, C)
        x = LinenWeightNormConv(name="conv")(x)
        return jnp.tanh(nn.LayerNorm(epsilon=EPSILON, name="norm")(x))


class EqxWeightNormConv(eqx.Module):
    weight_v: jax.Array
    weight_g: jax.Array
    bias: jax.Array

    def __call__(self, x):  # one example, (L, C)
        kernel = _normed_kernel(self.weight_v, self.weight_g)
        return _conv_nlc(x[None], kernel, self.bias)[0]


class EqxWeightNormed(eqx.Module):
    conv: EqxWeightNormConv
    norm: eqx.nn.LayerNorm

    def __call__(self, x):
        return jnp.tanh(jax.vmap(self.norm)(self.conv(x)))


class HaikuWeightNormConv(hk.Module):
    def __call__(self, x):
        weight_v = hk.get_parameter("weight_v", (6, 6, 3), init=jnp.ones)
        weight_g = hk.get_parameter("weight_g", (1, 1, 3), init=jnp.ones)
        bias = hk.get_parameter("bias", (6,), init=jnp.zeros)
        return _conv_nlc(x, _normed_kernel(weight_v, weight_g), bias)


def _haiku_weight_normed(x):
    x = HaikuWeightNormConv(name="conv")(x)
    return jnp.tanh(hk.LayerNorm(-1, True, True, eps=EPSILON, name="norm")(x))


SIGNAL = np.random.default_rng(5).normal(size=(2, 6, 7)).astype(np.float32)  # NCL


def _weight_normed_jax(library):
    nlc = SIGNAL.transpose(0, 2, 1)
    if library == "linen":
        module = LinenWeightNormed()
        return bridge.probe(module, module.init(jax.random.key(0), nlc))
    if library == "equinox":
        zeros = jnp.zeros
        model = EqxWeightNormed(
            EqxWeightNormConv(zeros((6, 6, 3)), zeros((1, 1, 3)), zeros(6)),
            eqx.nn.LayerNorm(6, eps=EPSILON),
        )
        return bridge.probe(model, vmap=True)
    transformed = hk.without_apply_rng(hk.transform(_haiku_weight_normed))
    return bridge.probe(transformed, transformed.init(jax.random.key(0), nlc))


def _weight_norm_tensors(model, style):
    """`(weight_g, weight_v, bias)` of PyTorch's conv, read by hand."""
    conv = model.conv
    if style == "parametrization":
        weights = conv.parametrizations.weight
        g, v = weights.original0, weights.original1
    else:
        g, v = conv.weight_g, conv.weight_v
    return [t.detach().numpy() for t in (g, v, conv.bias)]


def _jax_weight_norm_tensors(probe, library):
    if library == "linen":
        conv = probe.variables["params"]["conv"]
    elif library == "haiku":
        conv = probe.params["conv"]
    else:
        conv = vars(probe.model.conv)
    return [np.asarray(conv[name]) for name in ("weight_g", "weight_v", "bias")]


@pytest.mark.parametrize("style", ["parametrization", "weight_g/weight_v"])
@pytest.mark.parametrize("library", ["linen", "equinox", "haiku"])
def test_weight_norm_pairs_with_weight_g_and_weight_v(library, style):
    torch_model = TorchWeightNormed(style).eval()
    with torch.no_grad():  # a gain that is not the norm of `v`
        g = (
            torch_model.conv.parametrizations.weight.original0
            if style == "parametrization"
            else torch_model.conv.weight_g
        )
        g.uniform_(0.5, 1.5)
    nlc = SIGNAL.transpose(0, 2, 1)
    ported = bridge.transfer(
        bridge.probe(torch_model),
        _weight_normed_jax(library),
        torch.tensor(SIGNAL),
        args_b=(nlc,),
    )
    # The reference: the tensors moved by name, unchanged, as HF's converter
    # moves them; and PyTorch's own outputs.
    for got, want in zip(
        _jax_weight_norm_tensors(ported, library),
        _weight_norm_tensors(torch_model, style),
        strict=True,
    ):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(
        jax_outputs(ported, nlc),
        torch_outputs(torch_model, SIGNAL),
        rtol=1e-5,
        atol=1e-5,
    )
    report = bridge.compare(
        bridge.probe(torch_model),
        ported,
        loss_fn,
        torch.tensor(SIGNAL),
        args_b=(nlc,),
    )
    assert report.first_divergence is None, str(report)
    assert report.rows[0].kind == "weights:bias,weight_g,weight_v"
    assert report.rows[0].shape == (2, 7, 6)  # PyTorch's NCL brought channel-last

    # And back, into a fresh PyTorch model.
    fresh = TorchWeightNormed(style).eval()
    back = bridge.transfer(
        ported, bridge.probe(fresh), nlc, args_b=(torch.tensor(SIGNAL),)
    ).module
    for name, tensor in torch_model.state_dict().items():
        np.testing.assert_array_equal(back.state_dict()[name].numpy(), tensor.numpy())


class TorchBiasedHead(torch.nn.Module):
    """A language model's head with a logits bias kept as a buffer, as
    Hugging Face's BART keeps `final_logits_bias`; a table of sinusoids
    kept as a buffer too, which the JAX model computes."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.positions = _Sinusoids()
        self.head = torch.nn.Linear(8, 11, bias=False)
        self.register_buffer("final_logits_bias", torch.zeros(1, 11))

    def forward(self, ids):
        h = self.embed(ids) + self.positions(ids.shape[1])
        return self.head(h) + self.final_logits_bias


class _Sinusoids(torch.nn.Module):
    def __init__(self):
        super().__init__()
        angles = np.arange(16)[:, None] / 10.0 ** (np.arange(8)[None] / 8)
        self.register_buffer("table", torch.tensor(np.sin(angles), dtype=torch.float32))

    def forward(self, length):
        return self.table[:length]


class LinenBiasedHead(nn.Module):
    @nn.compact
    def __call__(self, ids):
        angles = np.arange(16)[:, None] / 10.0 ** (np.arange(8)[None] / 8)
        h = nn.Embed(11, 8, name="embed")(ids) + np.sin(angles)[None, : ids.shape[1]]
        bias = self.param("final_logits_bias", nn.initializers.zeros, (1, 11))
        return nn.Dense(11, use_bias=False, name="head")(h) + bias[None]


IDS = np.random.default_rng(6).integers(0, 11, (2, 5))


def test_a_buffer_pairs_with_a_parameter_of_the_same_name():
    torch.manual_seed(7)
    torch_model = TorchBiasedHead().eval()
    with torch.no_grad():
        torch_model.final_logits_bias.uniform_(-1.0, 1.0)
    module = LinenBiasedHead()
    ported = bridge.transfer(
        bridge.probe(torch_model),
        bridge.probe(module, module.init(jax.random.key(0), IDS)),
        torch.tensor(IDS),
        args_b=(IDS,),
    )
    params = ported.variables["params"]
    np.testing.assert_array_equal(
        params["final_logits_bias"], torch_model.final_logits_bias.numpy()
    )
    np.testing.assert_array_equal(
        params["head"]["kernel"], torch_model.head.weight.detach().numpy().T
    )
    with torch.no_grad():
        want = torch_model(torch.tensor(IDS)).numpy()
    np.testing.assert_allclose(jax_outputs(ported, IDS), want, rtol=1e-5, atol=1e-5)
    report = bridge.compare(
        bridge.probe(torch_model),
        ported,
        loss_fn,
        torch.tensor(IDS),
        args_b=(IDS,),
    )
    assert report.first_divergence is None, str(report)
    # The sinusoids have no counterpart: left out, not refused.
    assert [row.site_a for row in report.rows] == ["embed", "head"]

    # And back: the parameter into the buffer.
    fresh = TorchBiasedHead().eval()
    back = bridge.transfer(
        ported, bridge.probe(fresh), IDS, args_b=(torch.tensor(IDS),)
    )
    np.testing.assert_array_equal(
        back.module.final_logits_bias.numpy(), torch_model.final_logits_bias.numpy()
    )


class TorchTiedHead(torch.nn.Module):
    def __init__(self, extra=False):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.norm = torch.nn.LayerNorm(8, eps=EPSILON)
        self.extra = torch.nn.Linear(8, 8) if extra else None
        self.head = torch.nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.norm(self.embed(ids))
        if self.extra is not None:
            h = self.extra(h)
        return self.head(h)


class LinenTiedHead(nn.Module):
    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(11, 8, name="embed")
        return embed.attend(nn.LayerNorm(epsilon=EPSILON, name="norm")(embed(ids)))


def test_a_tied_head_is_counted_alike_by_transfer_and_compare():
    """PyTorch's head holding the embedding's tensor, Flax's `attend` of
    the embedding: both tied, neither paired by weights, the two heads
    compared with each other; a model that does not pair is refused by
    both with the same count."""
    torch.manual_seed(8)
    torch_model = TorchTiedHead().eval()
    module = LinenTiedHead()
    linen_probe = bridge.probe(module, module.init(jax.random.key(0), IDS))
    ported = bridge.transfer(bridge.probe(torch_model), linen_probe, IDS)
    np.testing.assert_array_equal(
        ported.variables["params"]["embed"]["embedding"],
        torch_model.embed.weight.detach().numpy(),
    )
    with torch.no_grad():
        want = torch_model(torch.tensor(IDS)).numpy()
    np.testing.assert_allclose(jax_outputs(ported, IDS), want, rtol=1e-5, atol=1e-5)
    report = bridge.compare(bridge.probe(torch_model), ported, loss_fn, IDS)
    assert report.first_divergence is None, str(report)
    assert [(row.site_a, row.site_b, row.kind) for row in report.rows] == [
        ("embed", "embed", "embed"),
        ("norm", "norm", "layernorm"),
        ("head", "embed.attend", "tied"),
    ]
    assert [tie.split(" (")[0] for tie in report.tied] == [
        "site 'head'",
        "site 'embed.attend'",
    ]
    back = bridge.transfer(ported, bridge.probe(TorchTiedHead()), IDS).module
    assert back.head.weight is back.embed.weight

    # One more Linear in PyTorch's model: both refuse, counting alike.
    longer = bridge.probe(TorchTiedHead(extra=True))
    counts = r"has 3 \(.*\), .* has 2 \(.*Not counted: site 'head' \(nn.Linear\)"
    with pytest.raises(bridge.BridgeError, match=counts):
        bridge.transfer(longer, linen_probe, IDS)
    with pytest.raises(bridge.BridgeError, match=counts):
        bridge.compare(longer, linen_probe, loss_fn, IDS)


# -- 5. logits ------------------------------------------------------------------


def _kl_and_top1(a, b):
    """By hand: KL(softmax(a) || softmax(b)) per row, averaged; the
    fraction of rows whose argmax agrees."""
    a = a.reshape(-1, a.shape[-1]).astype(np.float64)
    b = b.reshape(-1, b.shape[-1]).astype(np.float64)
    p = np.exp(a) / np.exp(a).sum(-1, keepdims=True)
    q = np.exp(b) / np.exp(b).sum(-1, keepdims=True)
    return np.mean(np.sum(p * np.log(p / q), -1)), np.mean(a.argmax(-1) == b.argmax(-1))


def test_kl_and_top1_of_the_logits_against_numpy():
    """A bug large enough to move the logits (a weight of the output layer
    off by 0.8): KL and top-1 as NumPy computes them from the two models'
    own outputs."""
    x = np.random.default_rng(9).normal(size=(64, 4)).astype(np.float32)
    source, ported = _ported("linen")
    buggy = copy.deepcopy(source)
    with torch.no_grad():
        buggy.out.weight[1] += 0.8
    report = bridge.compare(bridge.probe(buggy), ported, loss_fn, x)
    kl, top1 = _kl_and_top1(torch_outputs(buggy, x), np.asarray(jax_outputs(ported, x)))
    assert 0.0 < top1 < 1.0 and kl > 1e-3  # the bug shows in both
    np.testing.assert_allclose(report.kl_divergence, kl, rtol=1e-4)
    assert report.top1_agreement == top1 and report.logits.positions == 64
    assert (
        f"outputs as logits (64 positions): KL(A || B) {kl:.3g}, top-1 agreement "
        f"{top1:.2%}" in str(report)
    )


def test_which_outputs_are_logits():
    source, ported = _ported("linen")
    torch_probe = bridge.probe(source)
    assert bridge.compare(torch_probe, ported, loss_fn, X, logits=False).logits is None
    # A function picks them: the first two classes only.
    report = bridge.compare(
        torch_probe, ported, loss_fn, X, logits=lambda outputs: outputs[:, :2]
    )
    kl, top1 = _kl_and_top1(
        torch_outputs(source, X)[:, :2], np.asarray(jax_outputs(ported, X))[:, :2]
    )
    np.testing.assert_allclose(report.kl_divergence, kl, atol=1e-9)
    assert report.top1_agreement == top1 == 1.0
    with pytest.raises(bridge.BridgeError, match="`logits` must be None"):
        bridge.compare(torch_probe, ported, loss_fn, X, logits="logits")


def test_one_value_per_position_is_no_logits():
    torch_model = torch.nn.Sequential(torch.nn.Linear(4, 1))
    module = nn.Sequential([nn.Dense(1)])
    ported = bridge.transfer(
        bridge.probe(torch_model),
        bridge.probe(module, module.init(jax.random.key(0), X)),
        X,
    )
    report = bridge.compare(bridge.probe(torch_model), ported, loss_fn, X)
    assert report.logits is None and report.kl_divergence is None
    assert "logits" not in str(report)


def test_a_mapping_with_logits_is_found():
    class Outputs(nn.Module):
        @nn.compact
        def __call__(self, x):
            return {"logits": nn.Dense(5)(x), "hidden": x}

    class TorchOutputs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 5)

        def forward(self, x):
            return {"logits": self.linear(x), "hidden": x}

    torch_model = TorchOutputs()
    module = Outputs()
    ported = bridge.transfer(
        bridge.probe(torch_model),
        bridge.probe(module, module.init(jax.random.key(0), X)),
        X,
    )
    report = bridge.compare(
        bridge.probe(torch_model), ported, lambda o: (o["logits"] ** 2).sum(), X
    )
    assert report.logits.positions == 3 and report.top1_agreement == 1.0
