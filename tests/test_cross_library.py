"""The same architecture with the same weights agrees in all four libraries.

For each architecture of `cases/crosslib.py` (an MLP, a CNN with LayerNorm, a
transformer block), one library's initialised weights are moved into the
others' models with `bridge.transfer`; then every library gives the same loss,
the same activations and activation gradients at every paired site, and the
same parameter gradients, all brought to one layout by the hand-written rules
of `crosslib` (Equinox convolutions are channel-first, Linen/NNX attention
projections have a head axis, Equinox kernels are `(out, in)`, ...). The
transferred weights themselves are checked against a port written by hand.

The references are the libraries themselves: each model runs its own forward
pass, and `bridge` only reads it. Flax's own Linen-vs-NNX consistency tests
are the model for this file.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, NamedTuple

import jax
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("equinox")
pytest.importorskip("haiku")

from cases import crosslib  # noqa: E402

import bridge  # noqa: E402

#: float32, operations in a different order per library.
RTOL, ATOL = 1e-4, 1e-5
SOURCE_SEED, DESTINATION_SEED = 0, 7

#: The library whose weights each architecture starts from in the default tier.
SOURCES = {"mlp": "haiku", "cnn": "equinox", "transformer": "linen"}


def _ordered_pairs(architecture: str, slow_unless_from: str | None) -> list:
    params = []
    for src, dst in itertools.permutations(crosslib.LIBRARIES, 2):
        slow = slow_unless_from is not None and src != slow_unless_from
        params.append(
            pytest.param(
                architecture,
                src,
                dst,
                id=f"{architecture}-{src}-to-{dst}",
                marks=pytest.mark.slow if slow else (),
            )
        )
    return params


#: Every ordered pair on the MLP; from one source on the others (the rest slow).
PAIRS = [
    *_ordered_pairs("mlp", None),
    *_ordered_pairs("cnn", SOURCES["cnn"]),
    *_ordered_pairs("transformer", SOURCES["transformer"]),
]


class Numbers(NamedTuple):
    """One run of a model, every array in the common layout, as numpy."""

    loss: float
    activations: dict[str, np.ndarray]
    activation_grads: dict[str, np.ndarray]
    grads: dict[str, dict[str, np.ndarray]]


@functools.cache
def source(architecture: str, library: str) -> Any:
    return crosslib.build(architecture, library, SOURCE_SEED)


@functools.cache
def destination(architecture: str, library: str) -> Any:
    """The same architecture freshly initialised with other weights."""
    return crosslib.build(architecture, library, DESTINATION_SEED)


@functools.cache
def ported(architecture: str, src: str, dst: str) -> Any:
    return bridge.transfer(
        source(architecture, src),
        destination(architecture, dst),
        crosslib.inputs(architecture),
    )


@functools.cache
def _jitted(architecture: str):
    # One function per architecture: probes of one library share a pytree
    # structure, so each library's program compiles once.
    loss_fn = crosslib.loss_fn(architecture)
    return jax.jit(lambda probe, x: probe.value_and_grad(loss_fn, x))


@functools.cache
def numbers(architecture: str, library: str, src: str, mode: str) -> Numbers:
    """The run of `library`'s model carrying `src`'s weights."""
    probe = (
        source(architecture, library)
        if src == library
        else ported(architecture, src, library)
    )
    x = crosslib.inputs(architecture)
    if mode == "jit":
        result = _jitted(architecture)(probe, x)
    else:
        result = probe.value_and_grad(crosslib.loss_fn(architecture), x)
    port = crosslib.PORTS[architecture][library]
    as_numpy = functools.partial(jax.tree.map, np.asarray)
    return Numbers(
        loss=float(result.loss),
        activations=as_numpy(port.common_activations(result.activations)),
        activation_grads=as_numpy(port.common_activations(result.activation_grads)),
        grads=crosslib.canonical(architecture, library, result.grads),
    )


def assert_same_numbers(got: Numbers, expected: Numbers, what: str) -> None:
    np.testing.assert_allclose(got.loss, expected.loss, rtol=RTOL, err_msg=what)
    for field in ("activations", "activation_grads"):
        got_values, expected_values = getattr(got, field), getattr(expected, field)
        assert list(got_values) == list(expected_values)
        for site, value in expected_values.items():
            np.testing.assert_allclose(
                got_values[site],
                value,
                rtol=RTOL,
                atol=ATOL,
                err_msg=f"{what}: {field} at {site!r}",
            )
    assert_same_weights(got.grads, expected.grads, f"{what}: parameter gradients")


def assert_same_weights(got: dict, expected: dict, what: str, exact=False) -> None:
    assert got.keys() == expected.keys(), what
    for layer, weights in expected.items():
        assert got[layer].keys() == weights.keys(), f"{what}: {layer!r}"
        for name, value in weights.items():
            message = f"{what}: {layer}/{name}"
            assert got[layer][name].shape == value.shape, message
            if exact:
                np.testing.assert_array_equal(got[layer][name], value, message)
            else:
                np.testing.assert_allclose(
                    got[layer][name], value, rtol=RTOL, atol=ATOL, err_msg=message
                )


def weights_of(architecture: str, library: str, probe: Any) -> dict:
    return crosslib.canonical(architecture, library, crosslib.trainable(probe))


# -- the models themselves -------------------------------------------------------


@pytest.mark.parametrize("architecture", crosslib.ARCHITECTURES)
def test_every_paired_site_is_a_site(architecture):
    """The hand-written site tables name real sites, in call order, and the
    paired values have the same shape in the common layout."""
    x = crosslib.inputs(architecture)
    shapes = {}
    for library, port in crosslib.PORTS[architecture].items():
        sites = source(architecture, library).sites(x)
        order = [path for path in sites if path in port.sites.values()]
        assert order == list(port.sites.values()), library
        shapes[library] = {
            name: jax.eval_shape(
                port.activation_layout.get(name, lambda v: v), sites[path]
            ).shape
            for name, path in port.sites.items()
        }
    assert all(table == shapes["linen"] for table in shapes.values()), shapes


# -- transfer: weights --------------------------------------------------------------


@pytest.mark.parametrize(("architecture", "src", "dst"), PAIRS)
def test_transfer_moves_every_weight(architecture, src, dst):
    """The destination carries the source's weights, layer by layer (read by
    the hand-written layout rules), and nothing of its own initialisation."""
    expected = weights_of(architecture, src, source(architecture, src))
    own = weights_of(architecture, dst, destination(architecture, dst))
    got = weights_of(architecture, dst, ported(architecture, src, dst))
    assert_same_weights(got, expected, f"{src} -> {dst}", exact=True)
    # The test can fail: the destination started from other weights.
    for layer in expected:
        assert not np.array_equal(own[layer]["bias"], expected[layer]["bias"])


@pytest.mark.parametrize(
    ("architecture", "src", "dst"),
    [
        ("cnn", "haiku", "equinox"),
        ("transformer", "equinox", "linen"),
        pytest.param("transformer", "haiku", "nnx", marks=pytest.mark.slow),
        pytest.param("cnn", "linen", "nnx", marks=pytest.mark.slow),
    ],
)
def test_transfer_equals_a_port_written_by_hand(architecture, src, dst):
    """`transfer` builds what a porter would write by hand: the same arrays, in
    the destination's own structure, leaf for leaf."""
    weights = weights_of(architecture, src, source(architecture, src))
    by_hand = crosslib.build_from(architecture, dst, weights)
    got = crosslib.trainable(ported(architecture, src, dst))
    expected = crosslib.trainable(by_hand)
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for leaf, reference in zip(
        jax.tree.leaves(got), jax.tree.leaves(expected), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(reference))


# -- transfer: numbers --------------------------------------------------------------


@pytest.mark.parametrize(("architecture", "src", "dst"), PAIRS)
def test_ported_model_agrees_at_every_site(architecture, src, dst):
    """Loss, activations, activation gradients and parameter gradients of the
    destination equal the source's, under `jax.jit`."""
    assert_same_numbers(
        numbers(architecture, dst, src, "jit"),
        numbers(architecture, src, src, "jit"),
        f"{architecture}: {src} -> {dst}",
    )


@pytest.mark.parametrize(
    "architecture",
    [
        "mlp",
        pytest.param("cnn", marks=pytest.mark.slow),
        pytest.param("transformer", marks=pytest.mark.slow),
    ],
)
def test_all_four_agree_eagerly(architecture):
    """Eagerly too: every library's model, with the source's weights, gives the
    source's numbers, and the jitted ones."""
    src = SOURCES[architecture]
    expected = numbers(architecture, src, src, "eager")
    assert_same_numbers(numbers(architecture, src, src, "jit"), expected, src)
    for dst in crosslib.LIBRARIES:
        if dst != src:
            got = numbers(architecture, dst, src, "eager")
            assert_same_numbers(got, expected, f"{architecture}: {src} -> {dst}")


def test_the_common_layout_is_not_trivial():
    """Without the layout rules the numbers would not line up: an Equinox conv
    site is channel-first and a Linen query has a head axis."""
    cnn = numbers("cnn", "equinox", SOURCES["cnn"], "jit")
    x = crosslib.inputs("cnn")
    raw = source("cnn", "equinox").sites(x)["conv1"].shape
    assert raw != cnn.activations["conv1"].shape
    linen = source("transformer", "linen").sites(crosslib.inputs("transformer"))
    assert linen["MultiHeadDotProductAttention_0/query"].shape[-2:] == (
        crosslib.HEADS,
        crosslib.HEAD_DIM,
    )
