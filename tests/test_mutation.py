"""Nothing the user passes is changed: variables, params, state, the model, the
inputs, the `patch` dict and the `at` list — after `sites`, `apply` and
`value_and_grad`, with patches, eagerly and under `jax.jit`.

`test_conformance.py` already checks every case's variables after
`value_and_grad` and `sites`; this adds `apply`, patches, selections, inputs
and the model objects, in every library, and the stateful cases (BatchNorm
statistics, dropout RNG counts of NNX streams).
"""

from __future__ import annotations

import copy
import importlib

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_tree_equal, numpy_snapshot
from reliability import LIBRARIES, Spec, build, loss_fn

for _library in ("flax.linen", "flax.nnx", "equinox", "haiku"):
    pytest.importorskip(_library)


def _model_snapshot(built):
    """Everything observable about the model object itself."""
    model = built.model
    if built.library == "linen":
        # An unbound module: its fields, and no scope attached by a probe.
        return {"fields": repr(model), "scope": repr(model.scope)}
    if built.library == "nnx":
        from cases.nnx import snapshot

        return snapshot(model)
    if built.library == "equinox":
        leaves, treedef = jax.tree.flatten(model)
        return {"leaves": numpy_snapshot(leaves), "treedef": repr(treedef)}
    return {"functions": (id(model.init), id(model.apply))}


def _everything(built, x, patch, at):
    return {
        "model": _model_snapshot(built),
        "variables": numpy_snapshot(built.variables),
        "x": numpy_snapshot(x),
        "patch": (list(patch), numpy_snapshot(patch[built.names[0]])),
        "patch_function": id(patch[built.names[-1]]),
        "at": copy.copy(at),
    }


@pytest.mark.parametrize("library", LIBRARIES)
def test_no_call_changes_what_the_user_passed(library):
    built = build(library, Spec(layers=((3, "tanh"),), repeats=2, index=True))
    x = built.x
    first, last = built.names[0], built.names[-1]
    value = jnp.ones(built.probe.sites(x)[first].shape)
    patch = {first: value, last: lambda v: v * 2.0}
    at = [first, "shared"]
    before = _everything(built, x, patch, at)

    built.probe.sites(x)
    built.probe.apply(x, at=at, patch=patch)
    jax.jit(
        lambda probe, x: probe.value_and_grad(
            loss_fn, x, at=at, patch=patch, with_inputs=True
        )
    )(built.probe, x)

    after = _everything(built, x, patch, at)
    assert after["at"] == before["at"]
    assert after["patch_function"] == before["patch_function"]
    assert_tree_equal(
        {k: v for k, v in after.items() if k not in ("at", "patch_function")},
        {k: v for k, v in before.items() if k not in ("at", "patch_function")},
    )
    assert patch[first] is value


#: Linen's collections are plain dicts of arrays, covered above; its stateful
#: cases are in the slow tier.
STATEFUL = [
    pytest.param("linen", "batchnorm", marks=pytest.mark.slow),
    pytest.param("linen", "dropout", marks=pytest.mark.slow),
    ("nnx", "train_mode"),
    ("equinox", "batchnorm"),
    ("haiku", "batchnorm"),
]


@pytest.mark.parametrize(("library", "name"), STATEFUL)
def test_stateful_models_keep_their_state_and_rng_counts(library, name):
    case = importlib.import_module(f"cases.{library}").CASES[name]()
    sites = case.probe.sites(*case.args, **case.kwargs)
    first = next(iter(sites))
    patch = {first: lambda v: jax.tree.map(lambda leaf: leaf * 0.5, v)}
    at = [first, case.expected_sites[-1]]

    def everything():
        return {
            "user": case.snapshot(),
            "args": numpy_snapshot(case.args),
            "kwargs": numpy_snapshot(_key_data(case.kwargs)),
        }

    def both(probe, args):
        return (
            probe.apply(*args, at=at, patch=patch, **case.kwargs),
            probe.value_and_grad(
                case.loss_fn, *args, at=at, patch=patch, **case.kwargs
            ),
        )

    before = everything()
    # Under `jax.jit` too, an NNX Variable shared with the user and set in
    # place would show: it would hold a leaked tracer afterwards.
    jax.jit(both)(case.probe, case.args)
    assert_tree_equal(everything(), before)
    assert at == [first, case.expected_sites[-1]] and list(patch) == [first]


def _key_data(tree):
    """PRNG keys as their data (numpy cannot copy typed keys); NNX `Rngs` are
    left out here: the case's own snapshot holds their counts."""
    from flax import nnx

    def data(leaf):
        if isinstance(leaf, nnx.Rngs):
            return None
        if isinstance(leaf, jax.Array) and jnp.issubdtype(
            leaf.dtype, jax.dtypes.prng_key
        ):
            return jax.random.key_data(leaf)
        return leaf

    return jax.tree.map(data, tree, is_leaf=lambda leaf: isinstance(leaf, nnx.Rngs))
