"""`probe.unwrap()`: the model out of a probe, in its library's own form.

References: each library's own forward pass on the unwrapped arguments
(`module.apply`, `module(x)`, `transformed.apply`, `jax.vmap(model)`; no
bridge code), the PyTorch model's own forward pass after a port, and the
probe the arguments came from.
"""

from __future__ import annotations

import copy

import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from porting_models import IMAGES, LIBRARIES, TOKENS, build

import bridge
from bridge.adapter_api import ProbeBase

torch = pytest.importorskip("torch")

CASES = [
    *((library, "cnn") for library in LIBRARIES),  # with state: batch norm
    ("haiku", "attention"),  # hk.transform: no state
    ("equinox", "attention"),  # no eqx.nn.State
]


def _input(model):
    return IMAGES if model == "cnn" else TOKENS


def _loss(y):
    return jnp.mean(jnp.sin(y))


def _plain_forward(library, args, x):
    """The library's own forward pass on what `unwrap` returned."""
    if library == "linen":
        module, variables = args
        return module.apply(variables, x)
    if library == "nnx":
        (module,) = args
        return module(x)
    if library == "haiku":
        transformed, *variables = args
        out = transformed.apply(*variables, x)
        return out[0] if len(variables) == 2 else out
    if library == "equinox":
        model, *state = args
        if state:
            call = jax.vmap(
                model, in_axes=(0, None), out_axes=(0, None), axis_name="batch"
            )
            return call(x, *state)[0]
        return jax.vmap(model)(x)
    (module,) = args
    with torch.no_grad():
        return module(torch.tensor(np.asarray(x))).numpy()


def _assert_form(library, probe, args):
    """The positional arguments `bridge.probe` takes, in the library's form."""
    if library == "linen":
        module, variables = args
        assert module is probe.module and set(variables) == {"params", "batch_stats"}
    elif library == "nnx":
        (module,) = args
        assert isinstance(module, nnx.Module)
    elif library == "haiku":
        kind = hk.TransformedWithState if probe.state is not None else hk.Transformed
        assert isinstance(args[0], kind)
        assert len(args) == (3 if probe.state is not None else 2)
    else:
        assert isinstance(args[0], eqx.Module)
        assert len(args) == (2 if probe.state is not None else 1)
        if len(args) == 2:
            assert isinstance(args[1], eqx.nn.State)


def _assert_equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.parametrize("library, model", CASES)
def test_a_probe_of_the_unwrapped_model_is_the_same_probe(library, model):
    probe, x = build(library, model), _input(model)
    args = probe.unwrap()
    _assert_form(library, probe, args)
    again = bridge.probe(*args, vmap=probe.vmap)
    assert type(again) is type(probe)
    assert again.sites(x) == probe.sites(x)
    step = jax.jit(lambda p, x: p.value_and_grad(_loss, x, with_inputs=True))
    _assert_equal(step(again, x), step(probe, x))
    # The unwrapped model runs without bridge, with the probe's weights.
    # Eager against the probe's compiled evaluation: float32 rounding apart.
    np.testing.assert_allclose(
        _plain_forward(library, args, x), probe.apply(x).outputs, rtol=1e-5, atol=2e-6
    )


def test_changing_what_unwrap_returned_changes_no_probe_and_no_model():
    x = IMAGES
    # Linen and Haiku: containers of their own.
    for library in ("linen", "haiku"):
        probe = build(library)
        before = probe.apply(x).outputs
        args = probe.unwrap()
        variables = args[1]
        variables.clear()
        assert probe.apply(x).outputs.tolist() == before.tolist()
    # NNX: a new module, its Variables its own; the user's module untouched.
    original = _nnx_mlp()
    kernel = np.asarray(original.linear.kernel[...])
    probe = bridge.probe(original)
    (module,) = probe.unwrap()
    assert module is not original and module.linear is not original.linear
    module.linear.kernel[...] = jnp.zeros_like(module.linear.kernel[...])
    np.testing.assert_array_equal(original.linear.kernel[...], kernel)
    np.testing.assert_allclose(
        probe.apply(x[:, 0, 0]).outputs, original(x[:, 0, 0]), rtol=1e-5, atol=2e-6
    )
    # Equinox: `State.set` on the unwrapped state leaves the probe's valid.
    probe = build("equinox")
    model, state = probe.unwrap()
    index = model.norm.ema_state_index
    state.set(index, jax.tree.map(jnp.zeros_like, state.get(index)))
    probe.apply(x)  # the probe's state is still valid


def _nnx_mlp():
    class Mlp(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(3, 4, rngs=rngs)

        def __call__(self, x):
            return jnp.tanh(self.linear(x))

    return Mlp(nnx.Rngs(0))


# -- PyTorch ----------------------------------------------------------------------


class _TorchCNN(torch.nn.Module):
    """`porting_models`' cnn in PyTorch: channel-last in, flattened as the
    JAX models flatten."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(4, eps=1e-5)
        self.hidden = torch.nn.Linear(144, 16)
        self.layer_norm = torch.nn.LayerNorm(16, eps=1e-5)
        self.out = torch.nn.Linear(16, 5)

    def forward(self, x):
        x = torch.relu(self.norm(self.conv(x.permute(0, 3, 1, 2))))
        x = self.hidden(x.permute(0, 2, 3, 1).reshape(x.shape[0], -1))
        return self.out(torch.tanh(self.layer_norm(x)))


def _torch_cnn(seed=0):
    torch.manual_seed(seed)
    module = _TorchCNN()
    with torch.no_grad():
        module.norm.running_mean.uniform_(-0.5, 0.5)
        module.norm.running_var.uniform_(0.5, 1.5)
        module.norm.weight.uniform_(0.5, 1.5)
    return module.eval()


def test_a_pytorch_probe_unwraps_to_a_copy_of_its_module():
    module, x = _torch_cnn(), torch.tensor(np.asarray(IMAGES))
    module(x).sum().backward()  # the user's `.grad`: not carried over
    snapshot = copy.deepcopy(module.state_dict())
    probe = bridge.probe(module)
    (copied,) = probe.unwrap()
    assert type(copied) is _TorchCNN and copied is not module
    assert not copied.training
    assert all(p.grad is None for p in copied.parameters())
    again = bridge.probe(copied)
    assert again.sites(x) == probe.sites(x)
    a = probe.value_and_grad(lambda y: y.sin().mean(), x, with_inputs=True)
    b = again.value_and_grad(lambda y: y.sin().mean(), x, with_inputs=True)
    for field in ("loss", "grads", "activations", "activation_grads", "inputs"):
        torch.testing.assert_close(getattr(b, field), getattr(a, field), rtol=0, atol=0)
    with torch.no_grad():
        copied.out.weight.zero_()
    for name, value in module.state_dict().items():
        assert torch.equal(value, snapshot[name]), name
    assert torch.equal(probe.apply(x).outputs, module(x).detach())


@pytest.mark.parametrize("library", LIBRARIES)
def test_the_unwrapped_port_carries_the_ported_weights(library):
    """PyTorch -> JAX: the unwrapped model's own forward pass gives the
    PyTorch model's outputs; JAX -> PyTorch: the unwrapped module's gives the
    JAX model's. The models given are left as they were."""
    x = np.asarray(IMAGES)
    source, destination = _torch_cnn(), build(library, "cnn", 1)
    destination_args = jax.tree.map(np.asarray, destination.unwrap()[1:])
    expected = _plain_forward("torch", (source,), x)
    ported = bridge.transfer(
        bridge.probe(source), destination, torch.tensor(x), args_b=(x,)
    )
    args = ported.unwrap()
    np.testing.assert_allclose(
        _plain_forward(library, args, x), expected, rtol=1e-5, atol=2e-6
    )
    assert (
        np.abs(_plain_forward(library, destination.unwrap(), x) - expected).max() > 1e-2
    )
    _assert_equal(jax.tree.map(np.asarray, destination.unwrap()[1:]), destination_args)
    again = bridge.probe(*args, vmap=ported.vmap)
    _assert_equal(again.apply(x).outputs, ported.apply(x).outputs)

    target = _torch_cnn(seed=1)
    snapshot = copy.deepcopy(target.state_dict())
    ported = bridge.transfer(
        destination, bridge.probe(target), x, args_b=(torch.tensor(x),)
    )
    (module,) = ported.unwrap()
    assert module is not target and module is not ported.module
    np.testing.assert_allclose(
        _plain_forward("torch", (module,), x),
        _plain_forward(library, destination.unwrap(), x),
        rtol=1e-5,
        atol=2e-6,
    )
    for name, value in target.state_dict().items():
        assert torch.equal(value, snapshot[name]), name


# -- the protocol and adapters without it ------------------------------------------


def test_unwrap_is_part_of_the_protocol():
    assert "unwrap" in dir(bridge.ActivationProbe)
    assert isinstance(build("linen"), bridge.ActivationProbe)


def test_an_adapter_without_unwrap_says_so():
    class Bare(ProbeBase):
        pass

    with pytest.raises(
        NotImplementedError, match=r"Bare does not implement unwrap"
    ) as info:
        Bare().unwrap()
    assert isinstance(info.value, bridge.BridgeError)
