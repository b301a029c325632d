"""An adapter whose library lacks the internals it relies on fails at
`bridge.probe` with an error naming the supported versions, never later with
a wrong number. Each internal is monkeypatched away and the adapter imported
afresh."""

from __future__ import annotations

import importlib
import pathlib
import re
import sys

import numpy as np
import pytest
from helpers import nnx_supported

import bridge
from bridge._versions import ADAPTER_MINIMUM, MINIMUM, NEWEST_TESTED


def _fresh_adapter(monkeypatch, *modules: str) -> None:
    """Forget the adapter modules, so the next probe imports them again (the
    originals come back after the test). `from . import x` takes the package's
    attribute first: that goes too."""

    for name in modules:
        monkeypatch.delitem(sys.modules, name, raising=False)
        parent, _, child = name.rpartition(".")
        if parent in sys.modules:
            monkeypatch.delattr(sys.modules[parent], child, raising=False)


def _supported(distribution: str, adapter: str) -> str:
    oldest = ADAPTER_MINIMUM.get((adapter, distribution), MINIMUM[distribution])
    return re.escape(
        f"bridge supports {distribution} {oldest} to "
        f"{NEWEST_TESTED[distribution]} for {adapter} models"
    )


def test_equinox_adapter_needs_the_jax_trace_stack(monkeypatch):
    eqx = pytest.importorskip("equinox")
    import jax
    from jax._src import core

    model = eqx.nn.Linear(2, 2, key=jax.random.key(0))
    _fresh_adapter(
        monkeypatch,
        "bridge.adapters.equinox",
        "bridge.adapters.equinox.probe",
        "bridge.adapters.equinox.run",
        "bridge.adapters.shared.jax_internals",
    )
    monkeypatch.delattr(core, "trace_ctx")
    with pytest.raises(ImportError, match=_supported("jax", "Equinox")) as error:
        bridge.probe(model)
    assert "jax._src.core.trace_ctx.trace" in str(error.value)


def test_haiku_adapter_needs_its_lifting_module(monkeypatch):
    pytest.importorskip("haiku")
    import haiku as hk

    lift = importlib.import_module("haiku._src.lift")
    transformed = hk.transform(lambda x: hk.Linear(2)(x))
    _fresh_adapter(
        monkeypatch,
        "bridge.adapters.haiku",
        "bridge.adapters.haiku.probe",
        "bridge.adapters.haiku.run",
        "bridge.adapters.haiku.internals",
    )
    monkeypatch.delattr(lift, "LiftingModule")
    with pytest.raises(ImportError, match=_supported("dm-haiku", "Haiku")) as error:
        bridge.probe(transformed, {})
    assert "haiku._src.lift.LiftingModule" in str(error.value)


@pytest.mark.skipif(not nnx_supported(), reason="NNX needs flax 0.12 (test_core)")
def test_nnx_adapter_needs_the_transform_stack(monkeypatch):
    from flax import nnx

    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    _fresh_adapter(
        monkeypatch,
        "bridge.adapters.nnx",
        "bridge.adapters.nnx.probe",
        "bridge.adapters.nnx.run",
        "bridge.adapters.nnx.surgery",
        "bridge.adapters.nnx.internals",
    )
    monkeypatch.delattr(nnx.graphlib, "GRAPH_CONTEXT")
    with pytest.raises(ImportError, match=_supported("flax", "Flax NNX")) as error:
        bridge.probe(model)
    assert "GRAPH_CONTEXT.update_context_stacks" in str(error.value)


def test_torch_adapter_needs_fake_tensors(monkeypatch):
    torch = pytest.importorskip("torch")
    fake_tensor = importlib.import_module("torch._subclasses.fake_tensor")

    model = torch.nn.Linear(2, 2)
    _fresh_adapter(
        monkeypatch,
        "bridge.adapters.torch",
        "bridge.adapters.torch.probe",
        "bridge.adapters.torch.internals",
    )
    monkeypatch.delattr(fake_tensor, "FakeTensorMode")
    with pytest.raises(ImportError, match=_supported("torch", "PyTorch")) as error:
        bridge.probe(model)
    assert "FakeTensorMode" in str(error.value)


def test_the_minimum_versions_are_pyprojects_lower_bounds():
    """`bridge._versions.MINIMUM` (named in errors) and pyproject's bounds are
    one list."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11

    project = tomllib.loads(
        (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text()
    )["project"]
    requirements = project["dependencies"] + [
        requirement
        for extra in ("flax", "equinox", "haiku", "torch", "keras")
        for requirement in project["optional-dependencies"][extra]
    ]
    bounds = dict(
        re.fullmatch(r"([\w-]+)>=([\w.]+)", requirement).groups()
        for requirement in requirements
        if ">=" in requirement
    )
    assert {name: bounds[name] for name in MINIMUM} == MINIMUM


def test_a_guest_library_of_an_unsupported_release_leaves_the_host_probed(
    monkeypatch,
):
    """Haiku imported, at a release its adapter refuses: a Linen model (which
    could host Haiku calls) is still probed, with its own sites and plain
    gradients; only Haiku's guest interceptor is left out."""
    pytest.importorskip("haiku")
    nn = pytest.importorskip("flax.linen")
    import jax
    import jax.numpy as jnp

    from bridge.adapters.shared import guests

    lift = importlib.import_module("haiku._src.lift")
    _fresh_adapter(
        monkeypatch,
        "bridge.adapters.haiku",
        "bridge.adapters.haiku.guest",
        "bridge.adapters.haiku.probe",
        "bridge.adapters.haiku.run",
        "bridge.adapters.haiku.internals",
    )
    monkeypatch.delattr(lift, "LiftingModule")
    guests._load.cache_clear()
    monkeypatch.setattr(guests, "_load", guests._load.__wrapped__)

    model = nn.Sequential([nn.Dense(3), nn.tanh, nn.Dense(2)])
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    variables = model.init(jax.random.key(0), x)
    res = bridge.probe(model, variables).value_and_grad(lambda y: (y**2).sum(), x)
    assert list(res.activations) == ["layers_0", "layers_2"]
    plain = jax.grad(lambda p: (model.apply({"params": p}, x) ** 2).sum())(
        variables["params"]
    )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), res.grads, plain
    )
    # The guard is real: with the adapter's import failing, loading it raises.
    with pytest.raises(ImportError, match="dm-haiku"):
        guests._load("bridge.adapters.haiku.guest:intercepting")
