"""`ProbeResult.norms()`: every site reduced to two norms, as one array.

References are computed without bridge: the model's own hand-inserted hooks
(`reliability`) record each site's value and differentiate a zero offset
there with plain JAX, in the same jitted program as the probed step; their
norms are taken in float64 with numpy. Where the values are known in closed
form (a site that returns its input), the reference is that formula.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reliability import LIBRARIES, Spec, build, loss_fn, reference_fn, site_structs

import bridge


def numpy_norm(value) -> float:
    """The L2 norm of a site's floating leaves together, in float64."""
    leaves = [
        np.asarray(leaf, np.float64)
        for leaf in jax.tree.leaves(value)
        if jnp.issubdtype(leaf.dtype, jnp.inexact)
    ]
    return float(np.sqrt(sum(np.sum(np.square(leaf)) for leaf in leaves)))


def numpy_norms(res, name, host=lambda value: value) -> list[float]:
    """A site's row: the norms of its activation and its activation gradient."""
    return [
        numpy_norm(host(res.activations[name])),
        numpy_norm(host(res.activation_grads[name])),
    ]


@pytest.fixture(scope="module", params=LIBRARIES)
def library(request):
    return request.param


@pytest.mark.parametrize(
    "dtype, rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)], ids=["f32", "bf16"]
)
def test_a_jitted_step_returns_one_buffer_of_the_references_norms(library, dtype, rtol):
    # Dense layers, a module called twice, and a pair of heads: a pytree site
    # (`pair`, a tuple) beside its two leaves' own sites.
    built = build(library, Spec(repeats=2, pair=True, dtype=dtype))
    references = reference_fn(built)

    @jax.jit
    def step(probe, params, x, zeros):
        res = probe.value_and_grad(loss_fn, x)
        return res.norms(), probe.apply(x).norms(), references(params, x, zeros)

    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), site_structs(built))
    norms, forward, expected = step(built.probe, built.params, built.x, zeros)

    assert isinstance(norms, bridge.SiteNorms)
    assert norms.names == tuple(built.names)  # call order, through jax.jit
    assert norms.columns == ("activation", "gradient")
    assert norms.values.shape == (len(built.names), 2)
    assert norms.values.dtype == jnp.float32
    wanted = [
        [
            numpy_norm(expected["activations"][name]),
            numpy_norm(expected["activation_grads"][name]),
        ]
        for name in built.names
    ]
    np.testing.assert_allclose(norms.values, wanted, rtol=rtol, atol=1e-6)

    assert forward.names == tuple(built.names)
    assert forward.columns == ("activation",)
    np.testing.assert_allclose(
        forward.values, np.asarray(wanted)[:, :1], rtol=rtol, atol=1e-6
    )


def test_the_norms_are_one_output_buffer(library):
    built = build(library, Spec(repeats=2, pair=True))
    step = jax.jit(lambda probe, x: probe.value_and_grad(loss_fn, x).norms())
    out = step(built.probe, built.x)
    assert len(jax.tree.leaves(out)) == 1
    lowered = step.lower(built.probe, built.x)
    assert len(jax.tree.leaves(lowered.out_info)) == 1
    assert out.names == tuple(built.probe.sites(built.x))


def _identity_net(dtype):
    """A Linen model whose one site returns its input: the site's value is the
    input, and `d loss / d value` is the weights `w` of the loss."""
    import flax.linen as nn

    class Identity(nn.Module):
        def __call__(self, x):
            return x

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Identity(name="same")(x)

    return Net()


@pytest.mark.parametrize(
    "dtype, value",
    # bfloat16: summed in bfloat16 the 16,384 squares would stall at 256 (its
    # spacing there is 2). float16: 300 squared is past float16's 65,504.
    [(jnp.bfloat16, 1.0), (jnp.float16, 300.0)],
    ids=["bf16", "f16"],
)
def test_low_precision_sites_are_upcast_before_squaring(dtype, value):
    pytest.importorskip("flax.linen")
    model = _identity_net(dtype)
    x = jnp.full((64, 256), value, dtype)
    weights = np.linspace(-1.0, 1.0, x.size).reshape(x.shape)
    weights_lp = jnp.asarray(weights, dtype)

    def loss(out):
        return jnp.sum(out.astype(jnp.float32) * weights_lp.astype(jnp.float32))

    probe = bridge.probe(model, {})
    norms = jax.jit(lambda p, x: p.value_and_grad(loss, x).norms())(probe, x)
    expected = [
        value * np.sqrt(x.size),
        np.linalg.norm(np.asarray(weights_lp, np.float64)),
    ]
    assert norms.values.dtype == jnp.float32
    np.testing.assert_allclose(norms["same"], expected, rtol=1e-5)


def test_site_norms_read_by_name_column_and_on_the_host():
    pytest.importorskip("flax.linen")
    built = build("linen", Spec(repeats=1))
    res = jax.jit(lambda p, x: p.value_and_grad(loss_fn, x))(built.probe, built.x)
    norms = res.norms()  # eagerly, of a result that left jax.jit
    # The rows follow `res.activations`, whose keys left `jax.jit` sorted.
    names = tuple(res.activations)
    assert norms.names == names == tuple(sorted(built.names))
    wanted = {
        name: [
            numpy_norm(res.activations[name]),
            numpy_norm(res.activation_grads[name]),
        ]
        for name in names
    }
    for name in names:
        np.testing.assert_allclose(norms[name], wanted[name], rtol=1e-5)
    np.testing.assert_allclose(
        norms.activation, [wanted[n][0] for n in names], rtol=1e-5
    )
    np.testing.assert_allclose(norms.gradient, [wanted[n][1] for n in names], rtol=1e-5)
    as_dict = norms.as_dict()
    assert list(as_dict) == list(names)
    for name in names:
        assert set(as_dict[name]) == {"activation", "gradient"}
        assert all(isinstance(v, float) for v in as_dict[name].values())
        np.testing.assert_allclose(
            [as_dict[name]["activation"], as_dict[name]["gradient"]],
            wanted[name],
            rtol=1e-5,
        )
    assert list(norms) == list(names) and len(norms) == len(names)

    with pytest.raises(ValueError, match="No site 'nowhere' among these norms"):
        norms["nowhere"]  # noqa: B018
    forward = built.probe.apply(built.x).norms()
    with pytest.raises(ValueError, match="a forward pass has no gradients"):
        forward.gradient  # noqa: B018
    with pytest.raises(TypeError, match=r"as_dict\(\) reads the norms on the host"):
        jax.jit(lambda p, x: p.value_and_grad(loss_fn, x).norms().as_dict())(
            built.probe, built.x
        )


def test_norms_under_vmap_keep_their_names():
    pytest.importorskip("flax.linen")
    built = build("linen", Spec(repeats=1))
    xs = jnp.stack([built.x, 2 * built.x, -built.x])
    step = jax.jit(
        jax.vmap(lambda p, x: p.value_and_grad(loss_fn, x).norms(), in_axes=(None, 0))
    )
    norms = step(built.probe, xs)
    assert norms.names == tuple(built.names)
    assert norms.values.shape == (3, len(built.names), 2)
    one = jax.jit(lambda p, x: p.value_and_grad(loss_fn, x).norms())
    for i, x in enumerate(xs):
        np.testing.assert_allclose(
            norms.values[i], one(built.probe, x).values, rtol=1e-5, atol=1e-7
        )
    for row, name in enumerate(built.names):  # a site's rows, mapped axis first
        np.testing.assert_array_equal(norms[name], norms.values[:, row])
    np.testing.assert_array_equal(norms.gradient, norms.values[..., 1])
    with pytest.raises(ValueError, match="index the mapped axis first"):
        norms.as_dict()


def test_a_result_with_no_sites_has_no_rows():
    empty = bridge.ProbeResult(jnp.zeros(()), None, {}, {}, {}, None, None, {})
    norms = empty.norms()
    assert norms.names == () and norms.values.shape == (0, 2)
    assert jax.jit(lambda r: r.norms())(empty).values.shape == (0, 2)


@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="torch is not installed"
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_pytorch_result_gives_one_torch_tensor(dtype):
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = torch.nn.LSTM(5, 7, batch_first=True)  # a pytree site
            self.head = torch.nn.Linear(7, 3)

        def forward(self, x):
            out, _ = self.lstm(x)
            return self.head(torch.tanh(out))

    torch.manual_seed(0)
    torch_dtype = getattr(torch, dtype)
    model = Net().to(torch_dtype)
    x = torch.randn(4, 6, 5, dtype=torch_dtype)
    probe = bridge.probe(model)
    res = probe.value_and_grad(lambda out: out.float().square().mean(), x)
    norms = res.norms()
    assert isinstance(norms.values, torch.Tensor)
    assert norms.values.dtype == torch.float32
    assert norms.names == tuple(res.activations) == tuple(probe.sites(x))

    def host(value):
        return jax.tree.map(lambda t: t.float().numpy(), value)

    wanted = [
        [
            numpy_norm(host(res.activations[n])),
            numpy_norm(host(res.activation_grads[n])),
        ]
        for n in norms.names
    ]
    np.testing.assert_allclose(norms.values.numpy(), wanted, rtol=1e-5, atol=1e-7)
    forward = probe.apply(x).norms()
    assert isinstance(forward.values, torch.Tensor)
    np.testing.assert_allclose(
        forward.values.numpy(), np.asarray(wanted)[:, :1], rtol=1e-5, atol=1e-7
    )
    assert set(norms.as_dict()) == set(norms.names)
