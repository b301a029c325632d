"""The same architecture agrees between PyTorch and each JAX library after
`bridge.transfer`, in both directions.

The three architectures of `cases/crosslib.py` (an MLP, a CNN with LayerNorm,
a pre-LayerNorm transformer block) are written idiomatically in PyTorch in
`cases/crosslib_torch.py`: NCHW images, `(out, in)` and OIHW weights, a
LayerNorm over channels on a permuted view, `nn.MultiheadAttention` with its
packed `in_proj_weight`. Weights move from PyTorch into each JAX library's
model and back with `bridge.transfer`; then both models give the same loss,
the same activations and activation gradients at every paired site, and the
same parameter gradients, all brought to one layout by hand-written rules
(independent of bridge). The transferred weights equal a port written by
hand, `bridge.compare` finds no divergence, and before the transfer the models
disagreed, so every check here can fail.

PyTorch's attention has no query/key/value sites (its projections are
functional): those layers are compared by their parameter gradients only.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("equinox")
pytest.importorskip("haiku")
torch = pytest.importorskip("torch")

from cases import crosslib, crosslib_torch  # noqa: E402

import bridge  # noqa: E402

#: float32, operations in a different order per framework.
RTOL, ATOL = 1e-4, 1e-5
SOURCE_SEED, DESTINATION_SEED = 0, 7

TO_JAX, TO_TORCH = "torch-to-jax", "jax-to-torch"
TORCH = "torch"

CASES = [
    pytest.param(
        architecture, library, direction, id=f"{architecture}-{library}-{direction}"
    )
    for architecture in crosslib.ARCHITECTURES
    for library in crosslib.LIBRARIES
    for direction in (TO_JAX, TO_TORCH)
]


class Numbers(NamedTuple):
    """One run of a model, every array in the common layout, as numpy."""

    loss: float
    activations: dict[str, np.ndarray]
    activation_grads: dict[str, np.ndarray]
    grads: dict[str, dict[str, np.ndarray]]


def model_inputs(architecture: str, side: str) -> Any:
    """What the model of `side` takes: NCHW torch images, NHWC JAX ones."""
    if side == TORCH:
        return crosslib_torch.inputs(architecture)
    return crosslib.inputs(architecture)


@functools.cache
def probe_of(architecture: str, side: str, origin: int | str) -> Any:
    """A probe of `side`'s model (`"torch"` or a JAX library): with weights
    drawn from a seed when `origin` is one, else carrying the weights of the
    model of `origin` (the other framework), moved by `bridge.transfer`."""
    if isinstance(origin, int):
        if side == TORCH:
            return bridge.probe(crosslib_torch.model(architecture, origin))
        return crosslib.build(architecture, side, origin)
    return bridge.transfer(
        probe_of(architecture, origin, SOURCE_SEED),
        probe_of(architecture, side, DESTINATION_SEED),
        model_inputs(architecture, origin),
        args_b=(model_inputs(architecture, side),),
    )


def roles(architecture: str, library: str, direction: str):
    """`(source, ported destination, destination before)` as `(side, origin)`."""
    if direction == TO_JAX:
        return (TORCH, SOURCE_SEED), (library, TORCH), (library, DESTINATION_SEED)
    return (library, SOURCE_SEED), (TORCH, library), (TORCH, DESTINATION_SEED)


@functools.cache
def _jitted(architecture: str):
    # Probes of one library share a pytree structure: one compilation each.
    loss_fn = crosslib.loss_fn(architecture)
    return jax.jit(lambda probe, x: probe.value_and_grad(loss_fn, x))


def _as_numpy(tree: Any) -> Any:
    return jax.tree.map(
        lambda x: x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x,
        tree,
    )


@functools.cache
def numbers(architecture: str, side: str, origin: int | str) -> Numbers:
    probe = probe_of(architecture, side, origin)
    x = model_inputs(architecture, side)
    if side == TORCH:
        result = probe.value_and_grad(crosslib_torch.loss_fn(architecture), x)
        port = crosslib_torch.PORTS[architecture]
        grads = crosslib_torch.canonical(architecture, result.grads)
    else:
        result = _jitted(architecture)(probe, x)
        port = crosslib.PORTS[architecture][side]
        grads = crosslib.canonical(architecture, side, result.grads)
    activations = port.common_activations(_as_numpy(result.activations))
    activation_grads = port.common_activations(_as_numpy(result.activation_grads))
    return Numbers(
        loss=float(result.loss),
        activations={k: np.asarray(v) for k, v in activations.items()},
        activation_grads={k: np.asarray(v) for k, v in activation_grads.items()},
        grads=grads,
    )


def _paired(architecture: str) -> list[str]:
    """The common names of the sites both frameworks have, in call order."""
    return list(crosslib_torch.PORTS[architecture].sites)


def assert_close(got, expected, message: str) -> None:
    assert np.shape(got) == np.shape(expected), message
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL, err_msg=message)


def assert_same_numbers(got: Numbers, expected: Numbers, what: str) -> None:
    np.testing.assert_allclose(got.loss, expected.loss, rtol=RTOL, err_msg=what)
    for field in ("activations", "activation_grads"):
        got_values, expected_values = getattr(got, field), getattr(expected, field)
        for name in expected_values.keys() & got_values.keys():
            assert_close(
                got_values[name],
                expected_values[name],
                f"{what}: {field} at {name!r}",
            )
    assert_same_weights(got.grads, expected.grads, f"{what}: parameter gradients")


def assert_same_weights(got: dict, expected: dict, what: str, exact=False) -> None:
    assert list(got) == list(expected), what
    for layer, weights in expected.items():
        assert got[layer].keys() == weights.keys(), f"{what}: {layer!r}"
        for name, value in weights.items():
            message = f"{what}: {layer}/{name}"
            if exact:
                assert got[layer][name].shape == value.shape, message
                np.testing.assert_array_equal(got[layer][name], value, message)
            else:
                assert_close(got[layer][name], value, message)


def weights_of(architecture: str, side: str, origin: int | str) -> dict:
    probe = probe_of(architecture, side, origin)
    if side == TORCH:
        return crosslib_torch.canonical(
            architecture, dict(probe.module.named_parameters())
        )
    return crosslib.canonical(architecture, side, crosslib.trainable(probe))


# -- the models themselves ---------------------------------------------------------


@pytest.mark.parametrize("architecture", crosslib.ARCHITECTURES)
def test_every_paired_site_is_a_site(architecture):
    """The PyTorch site table names real sites, in call order, whose values in
    the common layout have the JAX models' shapes; only the query/key/value
    projections of the attention have no PyTorch site."""
    port = crosslib_torch.PORTS[architecture]
    sites = probe_of(architecture, TORCH, SOURCE_SEED).sites(
        model_inputs(architecture, TORCH)
    )
    wanted = list(dict.fromkeys(port.sites.values()))
    assert [path for path in sites if path in wanted] == wanted

    def zeros(struct):
        return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), struct)

    shapes = {
        name: np.shape(port.activation_layout.get(name, lambda v: v)(zeros(sites[p])))
        for name, p in port.sites.items()
    }
    jax_port = crosslib.PORTS[architecture]["linen"]
    jax_sites = probe_of(architecture, "linen", SOURCE_SEED).sites(
        model_inputs(architecture, "linen")
    )
    jax_shapes = {
        name: jax.eval_shape(
            jax_port.activation_layout.get(name, lambda v: v), jax_sites[p]
        ).shape
        for name, p in jax_port.sites.items()
    }
    assert (
        jax_shapes.keys() - shapes.keys() == crosslib_torch.WITHOUT_SITE[architecture]
    )
    assert shapes == {name: jax_shapes[name] for name in shapes}
    # And the parameters: every layer of the JAX models, and nothing else.
    own = weights_of(architecture, TORCH, SOURCE_SEED)
    assert list(own) == list(crosslib.KINDS[architecture])
    module = probe_of(architecture, TORCH, SOURCE_SEED).module
    assert sum(p.numel() for p in module.parameters()) == sum(
        w.size for layer in own.values() for w in layer.values()
    )


@pytest.mark.parametrize("architecture", crosslib.ARCHITECTURES)
def test_the_models_agree_by_a_port_written_by_hand(architecture):
    """Independently of `transfer`: the PyTorch model carrying the Linen
    model's weights, ported by hand, gives the Linen model's numbers. (What
    the tests below find wrong is bridge's, not the models'.)"""
    weights = weights_of(architecture, "linen", SOURCE_SEED)
    module = crosslib_torch.build_from(architecture, weights)
    result = bridge.probe(module).value_and_grad(
        crosslib_torch.loss_fn(architecture), model_inputs(architecture, TORCH)
    )
    port = crosslib_torch.PORTS[architecture]
    got = Numbers(
        loss=float(result.loss),
        activations=port.common_activations(_as_numpy(result.activations)),
        activation_grads=port.common_activations(_as_numpy(result.activation_grads)),
        grads=crosslib_torch.canonical(architecture, result.grads),
    )
    expected = numbers(architecture, "linen", SOURCE_SEED)
    assert_same_numbers(got, expected, f"{architecture}: by hand")
    # The parameter gradients are plain autograd's.
    module.zero_grad()
    outputs = module(model_inputs(architecture, TORCH))
    crosslib_torch.loss_fn(architecture)(outputs).backward()
    plain = crosslib_torch.canonical(
        architecture, {name: p.grad for name, p in module.named_parameters()}
    )
    assert_same_weights(got.grads, plain, "autograd")


# -- transfer: weights --------------------------------------------------------------


@pytest.mark.parametrize(("architecture", "library", "direction"), CASES)
def test_transfer_equals_a_port_written_by_hand(architecture, library, direction):
    """`transfer` builds what a porter would write by hand, in the
    destination's own structure, leaf for leaf; nothing of the destination's
    own initialisation is left, and neither model changed."""
    (src, src_origin), (dst, origin), (_, dst_seed) = roles(
        architecture, library, direction
    )
    weights = weights_of(architecture, src, src_origin)
    ported = probe_of(architecture, dst, origin)
    if dst == TORCH:
        by_hand = crosslib_torch.build_from(architecture, weights).state_dict()
        got = ported.module.state_dict()
        assert list(got) == list(by_hand)
        for key, value in by_hand.items():
            assert got[key].dtype == value.dtype, key
            np.testing.assert_array_equal(got[key].numpy(), value.numpy(), key)
        # The destination's own module is untouched.
        untouched = crosslib_torch.model(architecture, dst_seed).state_dict()
        before = probe_of(architecture, TORCH, dst_seed).module.state_dict()
        for key, value in untouched.items():
            assert torch.equal(before[key], value), key
    else:
        by_hand = crosslib.trainable(crosslib.build_from(architecture, dst, weights))
        got = crosslib.trainable(ported)
        assert jax.tree.structure(got) == jax.tree.structure(by_hand)
        for leaf, reference in zip(
            jax.tree.leaves(got), jax.tree.leaves(by_hand), strict=True
        ):
            assert leaf.dtype == reference.dtype
            np.testing.assert_array_equal(np.asarray(leaf), np.asarray(reference))
    assert_same_weights(
        weights_of(architecture, dst, origin), weights, direction, exact=True
    )
    own = weights_of(architecture, dst, dst_seed)
    for layer in weights:
        assert not np.array_equal(own[layer]["bias"], weights[layer]["bias"]), layer


# -- transfer: numbers --------------------------------------------------------------


@pytest.mark.parametrize(("architecture", "library", "direction"), CASES)
def test_ported_model_agrees_at_every_site(architecture, library, direction):
    """Loss, activations and activation gradients at every paired site, and
    parameter gradients of every layer, equal the source's: PyTorch eagerly,
    JAX under `jax.jit`."""
    source, ported, _ = roles(architecture, library, direction)
    got, expected = numbers(architecture, *ported), numbers(architecture, *source)
    torch_side = got if ported[0] == TORCH else expected
    assert list(torch_side.activations) == _paired(architecture)
    jax_side = expected if ported[0] == TORCH else got
    assert list(jax_side.activations) == list(
        crosslib.PORTS[architecture][library].sites
    )
    assert_same_numbers(got, expected, f"{architecture}: {direction} ({library})")


@pytest.mark.parametrize(("architecture", "library", "direction"), CASES)
def test_the_models_disagreed_before_the_transfer(architecture, library, direction):
    """The destination's own weights gave other numbers at every paired site:
    the agreement above is the transfer's doing."""
    source, _, before = roles(architecture, library, direction)
    got, expected = numbers(architecture, *before), numbers(architecture, *source)
    assert not np.isclose(got.loss, expected.loss, rtol=RTOL)
    for name in _paired(architecture):
        for field in ("activations", "activation_grads"):
            a, b = getattr(got, field)[name], getattr(expected, field)[name]
            assert not np.allclose(a, b, rtol=RTOL, atol=ATOL), (field, name)
    for layer, weights in expected.grads.items():
        for name, value in weights.items():
            if (layer, name) == ("key", "bias"):
                # Zero but for rounding, in both: a key bias adds the same
                # `q . b` to every logit of a query, which softmax ignores.
                assert np.abs(value).max() < 1e-7
                continue
            assert not np.allclose(got.grads[layer][name], value), (layer, name)


# -- compare --------------------------------------------------------------------


def _torch_or_jax_loss(architecture: str, side: str):
    if side == TORCH:
        return crosslib_torch.loss_fn(architecture)
    return crosslib.loss_fn(architecture)


def _compare(architecture: str, a: tuple, b: tuple) -> bridge.ComparisonReport:
    return bridge.compare(
        probe_of(architecture, *a),
        probe_of(architecture, *b),
        (
            _torch_or_jax_loss(architecture, a[0]),
            _torch_or_jax_loss(architecture, b[0]),
        ),
        model_inputs(architecture, a[0]),
        args_b=(model_inputs(architecture, b[0]),),
        rtol=RTOL,
        atol=ATOL,
    )


def _ports(architecture: str, side: str):
    if side == TORCH:
        return crosslib_torch.PORTS[architecture]
    return crosslib.PORTS[architecture][side]


#: Each library once per architecture in the default tier, both directions
#: per architecture (the JAX side compiles afresh in each `compare`).
_DEFAULT_DIRECTION = {"linen": TO_JAX, "equinox": TO_JAX}


def _compare_case(case):
    architecture, library, direction = case.values
    marks = []
    if direction != _DEFAULT_DIRECTION.get(library, TO_TORCH):
        marks.append(pytest.mark.slow)
    return pytest.param(*case.values, id=case.id, marks=marks)


COMPARE_CASES = [_compare_case(case) for case in CASES]


@pytest.mark.parametrize(("architecture", "library", "direction"), COMPARE_CASES)
def test_compare_finds_no_divergence(architecture, library, direction):
    """`bridge.compare` of the source and the ported destination pairs the
    sites the hand-written tables pair, and every pair agrees."""
    source, ported, _ = roles(architecture, library, direction)
    report = _compare(architecture, source, ported)
    assert report.first_divergence is None, str(report)
    np.testing.assert_allclose(report.loss_a, report.loss_b, rtol=RTOL)
    port_a, port_b = _ports(architecture, source[0]), _ports(architecture, ported[0])
    without = crosslib_torch.WITHOUT_SITE[architecture]
    expected = [
        (port_a.sites[name], port_b.sites[name])
        for name in crosslib.KINDS[architecture]
        if name not in without
    ]
    assert [(row.site_a, row.site_b) for row in report.rows] == expected


@pytest.mark.parametrize(
    ("architecture", "library", "direction"),
    [
        ("mlp", "haiku", TO_JAX),
        ("cnn", "linen", TO_TORCH),
        pytest.param("transformer", "nnx", TO_JAX, marks=pytest.mark.slow),
        pytest.param("cnn", "haiku", TO_JAX, marks=pytest.mark.slow),
    ],
)
def test_compare_finds_the_untransferred_models_apart(architecture, library, direction):
    """Before the transfer, `compare` finds the models apart at their first
    pair: the comparison above can fail."""
    source, _, before = roles(architecture, library, direction)
    report = _compare(architecture, source, before)
    assert report.first_divergence is report.rows[0], str(report)
    assert not report.rows[0].activations_agree
