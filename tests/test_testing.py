"""`bridge.testing`: the assertions fail where they should, naming the site."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from porting_models import IMAGES, TOKENS, build

import bridge
import bridge.testing


def loss_fn(outputs):
    return jnp.sum(outputs**2)


@functools.cache
def _results():
    probe = build("linen")
    run = jax.jit(lambda probe, x: probe.value_and_grad(loss_fn, x))
    return run(probe, IMAGES), run(probe, IMAGES)


def test_assert_results_close_passes_and_names_the_failing_site():
    result, again = _results()
    bridge.testing.assert_results_close(result, again, rtol=0, atol=0)
    changed = dict(again.activation_grads)
    changed["Dense_0"] = changed["Dense_0"].at[1, 3].add(1e-3)
    with pytest.raises(
        AssertionError,
        match=r"activation_grads\['Dense_0'\] differ: largest absolute difference "
        r"0.001.*index \(1, 3\)",
    ):
        bridge.testing.assert_results_close(
            result, again._replace(activation_grads=changed), rtol=1e-5, atol=1e-6
        )
    # Only the named sites are compared.
    bridge.testing.assert_results_close(
        result,
        again._replace(activation_grads=changed),
        rtol=1e-5,
        atol=1e-6,
        sites=["Conv_0", "LayerNorm_0"],
    )
    with pytest.raises(AssertionError, match="the loss differ"):
        bridge.testing.assert_results_close(
            result, again._replace(loss=again.loss + 1), rtol=1e-5, atol=1e-6
        )
    fewer = {k: v for k, v in again.activations.items() if k != "Conv_0"}
    with pytest.raises(AssertionError, match=r"only in result_a \['Conv_0'\]"):
        bridge.testing.assert_results_close(
            result, again._replace(activations=fewer), rtol=1e-5, atol=1e-6
        )


def test_assert_results_close_matches_an_eager_result_with_a_jitted_one():
    """The docstring's own use: a jitted result's sites come back in sorted
    order (JAX sorts a dict's keys), an eager one's in call order; they are
    matched by name, and a real difference is still caught."""
    probe = build("linen")
    eager = probe.value_and_grad(loss_fn, IMAGES)
    jitted, _ = _results()
    assert list(eager.activations) != list(jitted.activations)  # not in one order
    # float32 convolution gradients, summed in another order under jit: a
    # few 1e-5 relative.
    tolerance = {"rtol": 1e-4, "atol": 1e-5}
    bridge.testing.assert_results_close(eager, jitted, **tolerance)
    changed = dict(jitted.activations)
    changed["LayerNorm_0"] = changed["LayerNorm_0"] + 1e-2
    with pytest.raises(AssertionError, match=r"activations\['LayerNorm_0'\] differ"):
        bridge.testing.assert_results_close(
            eager, jitted._replace(activations=changed), **tolerance
        )


@pytest.mark.parametrize(
    "library, model, x, at",
    [("linen", "cnn", IMAGES, None), ("equinox", "attention", TOKENS, "attention/*")],
)
def test_check_activation_grads_passes_on_correct_probes(library, model, x, at):
    """Equinox with vmap=True: the patch sees the whole batch, and the
    attention projections are sites inside the model's own vmap."""
    bridge.testing.check_activation_grads(
        build(library, model), loss_fn, x, at=at, max_sites=2
    )


@jax.tree_util.register_pytree_node_class
class _WrongGradient:
    """A probe whose activation gradient at one site is 1% too large."""

    def __init__(self, probe, site):
        self.probe, self.site = probe, site

    def tree_flatten(self):
        return (self.probe,), self.site

    @classmethod
    def tree_unflatten(cls, site, children):
        return cls(children[0], site)

    def sites(self, *args, **kwargs):
        return self.probe.sites(*args, **kwargs)

    def apply(self, *args, **kwargs):
        return self.probe.apply(*args, **kwargs)

    def value_and_grad(self, *args, **kwargs):
        result = self.probe.value_and_grad(*args, **kwargs)
        grads = dict(result.activation_grads)
        grads[self.site] = grads[self.site] * 1.01
        return result._replace(activation_grads=grads)


def test_check_activation_grads_names_a_wrong_site():
    with pytest.raises(AssertionError, match=r"site 'Dense_0' disagrees with jax.jvp"):
        bridge.testing.check_activation_grads(
            _WrongGradient(build("linen"), "Dense_0"),
            loss_fn,
            IMAGES,
            at=["BatchNorm_0", "Dense_0"],
        )


def test_bridge_testing_imports_only_jax_numpy_and_the_core():
    tree = ast.parse(Path(bridge.testing.__file__).read_text())
    imported = {
        (node.module or "").split(".")[0] if node.level == 0 else "bridge"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
    }
    imported |= {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    assert imported <= {"__future__", "collections", "typing", "jax", "numpy", "bridge"}


@pytest.mark.slow
def test_bridge_testing_imports_with_only_jax():
    blocked = "import sys; sys.modules.update(dict.fromkeys(%r)); import bridge.testing"
    libraries = ["flax", "equinox", "haiku", "torch"]
    subprocess.run([sys.executable, "-c", blocked % libraries], check=True)
    np.testing.assert_equal(bridge.testing.__all__[0], "assert_results_close")
