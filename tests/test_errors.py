"""The bad-input catalogue: every misuse fails loudly, names the argument and the
fix, and fails before any work.

"Before any work" is checked with a counter the models themselves hold: each
model built with `watch=True` calls `jax.debug.callback` at the start of its
forward pass, which runs only when a forward pass really executes (abstract
evaluation runs none). Missing variables are tested per library in
`test_<library>.py`; the core's own errors on a toy library in `test_core.py`.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from reliability import EXECUTIONS, LIBRARIES, Spec, build, loss_fn

import bridge

flax_linen = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")
hk = pytest.importorskip("haiku")

SPEC = Spec(layers=((3, "tanh"), (3, "gelu")), repeats=2, index=True, watch=True)

pytestmark = pytest.mark.parametrize("library", LIBRARIES)


@functools.cache
def _built(library):
    return build(library, SPEC)


@pytest.fixture
def built(library):
    _check_the_counter(library)
    return _built(library)


@functools.cache
def _check_the_counter(library):
    """The counter sees a real forward pass: so an empty counter after an error
    means that none ran."""
    EXECUTIONS.clear()
    model = _built(library)
    model.probe.apply(model.x, at=model.names[-1])
    assert EXECUTIONS, "the counter does not see a forward pass"


def _fails_before_any_work(error, match, call):
    EXECUTIONS.clear()
    with pytest.raises(error, match=match) as info:
        call()
    assert EXECUTIONS == [], "a forward pass ran before the error"
    # Every refusal is bridge's own error type, and still the built-in one.
    assert isinstance(info.value, bridge.BridgeError)


# -- the model ---------------------------------------------------------------------


def _near_misses(library):
    """What users pass by mistake, and what the message must say about it."""
    built = _built(library)
    if library == "linen":
        return [
            (flax_linen.Dense, "is the class Dense itself: pass an instance"),
            (built.model.apply, "is the method apply of a .*: pass the model itself"),
        ]
    if library == "nnx":
        return [
            (nnx.Linear, "is the class Linear itself: pass an instance"),
            (nnx.split(built.model)[0], "model of type GraphDef"),
        ]
    if library == "equinox":
        return [(eqx.nn.Linear, "is the class Linear itself: pass an instance")]
    return [
        (lambda x: hk.Linear(2)(x), r"must be transformed first.*hk\.transform\(f\)")
    ]


def test_an_unsupported_model_names_the_four_libraries_and_the_likely_fix(library):
    for model, hint in _near_misses(library):
        with pytest.raises(TypeError, match=hint) as info:
            bridge.probe(model, *_built(library).variables)
        for expected in (
            "Flax Linen: bridge.probe(module, variables)",
            "Flax NNX: bridge.probe(module)",
            "Equinox: bridge.probe(module)",
            "Haiku: bridge.probe(hk.transform(f), params)",
        ):
            assert expected in str(info.value)


# -- `at` ----------------------------------------------------------------------------


def test_at_of_a_wrong_type_says_what_it_takes(built):
    _fails_before_any_work(
        TypeError,
        r"`at` must be None .* a glob string .* or a list of these; got 3 of type int",
        lambda: built.probe.value_and_grad(loss_fn, built.x, at=3),
    )


def test_a_tuple_of_paths_suggests_a_list(built):
    first, last = built.names[0], built.names[-1]
    _fails_before_any_work(
        TypeError,
        re.escape(
            f"A tuple selects module classes; for several paths or globs pass a "
            f"list: at={[first, last]!r}"
        ),
        lambda: built.probe.value_and_grad(loss_fn, built.x, at=(first, last)),
    )


def test_a_selection_matching_nothing_names_the_closest_paths(built):
    typo = built.names[0].replace("layer", "layr")
    _fails_before_any_work(
        ValueError,
        rf"`at='{typo}'` matches no site\. Closest paths: '{built.names[0]}'.*"
        r"probe\.sites",
        lambda: built.probe.value_and_grad(loss_fn, built.x, at=typo),
    )


def test_a_list_element_matching_nothing_is_not_silently_dropped(built):
    _fails_before_any_work(
        ValueError,
        r"`at` element 'hed' matches no site\. Closest paths: 'head'",
        lambda: built.probe.apply(built.x, at=[built.names[0], "hed"]),
    )


#: The class of the layers in `SPEC`'s model, as its library exports it.
_LAYER_CLASS = {
    "linen": "flax.linen.Dense",
    "nnx": "flax.nnx.Linear",
    "equinox": "equinox.nn.Linear",
    "haiku": "haiku.Linear",
}


def test_a_class_name_given_as_a_path_suggests_the_class_itself(built, library):
    public = _LAYER_CLASS[library]
    name = public.rpartition(".")[2]
    _fails_before_any_work(
        ValueError,
        re.escape(
            f"`at={name!r}` matches no site. {name!r} is a module class: to select "
            f"its calls pass the class itself, at={public}, not its name."
        ),
        lambda: built.probe.value_and_grad(loss_fn, built.x, at=name),
    )


def test_module_classes_listed_are_modules_not_functions_or_taps(library):
    """An Equinox MLP's activation sites are functions (`jax.nn.relu` is a
    `custom_jvp`) and a tap has no module: neither is a module class."""
    if library != "equinox":
        pytest.skip("the function sites are Equinox's")
    model = eqx.nn.MLP(3, 2, 4, 2, key=jax.random.key(0))
    probe = bridge.probe(model, vmap=True)
    with pytest.raises(
        ValueError, match=r"Module classes called: Linear\. Call"
    ) as info:
        probe.value_and_grad(jnp.sum, jnp.ones((2, 3)), at="Layer")
    for word in ("custom_jvp", "function", "NoneType"):
        assert word not in str(info.value)


def test_a_numbered_module_name_without_its_number_suggests_the_glob(library):
    if library != "linen":
        pytest.skip("Linen numbers its modules from 0 (Haiku's first has no number)")

    class Chain(flax_linen.Module):
        @flax_linen.compact
        def __call__(self, x):
            return flax_linen.Dense(2)(jnp.tanh(flax_linen.Dense(4)(x)))

    x = jnp.ones((2, 3))
    probe = bridge.probe(Chain(), Chain().init(jax.random.key(0), x))
    with pytest.raises(ValueError, match=r"Closest paths: 'Dense_\*', 'Dense_"):
        probe.value_and_grad(jnp.sum, x, at="Dense")


@pytest.mark.parametrize("at", ["index", ["index", "head"]], ids=["alone", "in-a-list"])
def test_an_integer_site_selected_explicitly_is_refused(built, at):
    _fails_before_any_work(
        ValueError,
        r"'index'`? selects only sites with integer values \('index'\): they have no "
        r"gradient\. Select a site with floating-point values, or leave this one out",
        lambda: built.probe.value_and_grad(loss_fn, built.x, at=at),
    )


# -- the loss ------------------------------------------------------------------------


def test_an_integer_scalar_loss_names_its_dtype(built):
    _fails_before_any_work(
        ValueError,
        r"`loss_fn` returned a scalar of dtype int32, and gradients need a real "
        r"floating-point loss\. Compute it in floating point",
        lambda: built.probe.value_and_grad(
            lambda y: jnp.sum(y > 0).astype(jnp.int32), built.x
        ),
    )


def test_a_non_scalar_loss_is_refused(built):
    _fails_before_any_work(
        ValueError,
        r"`loss_fn` must return a real floating-point scalar.*Reduce it to one "
        r"number, e\.g\. with `\.mean\(\)`",
        lambda: built.probe.value_and_grad(lambda y: y, built.x),
    )


def test_has_aux_true_without_an_aux_is_refused(built):
    _fails_before_any_work(
        ValueError,
        r"has_aux=True, but `loss_fn` did not return a pair `\(loss, aux\)`.*"
        r"pass has_aux=False",
        lambda: built.probe.value_and_grad(loss_fn, built.x, has_aux=True),
    )


def test_an_aux_without_has_aux_is_refused(built):
    _fails_before_any_work(
        ValueError,
        r"`loss_fn` returned a tuple of 2, not a scalar\. If it returns "
        r"`\(loss, aux\)`, pass has_aux=True",
        lambda: built.probe.value_and_grad(lambda y: (loss_fn(y), y), built.x),
    )


# -- inputs and patches --------------------------------------------------------------


def test_vmap_true_refuses_inputs_whose_leading_axes_differ(built):
    mapped = bridge.probe(built.model, *built.variables, vmap=True)
    x = built.x
    # The model cannot run on this pair at all: the error comes before any attempt.
    _fails_before_any_work(
        ValueError,
        r"vmap=True maps every positional input over axis 0, so their leading axes "
        r"must agree; got args\[0\]\[0\]: 2, args\[0\]\[1\]: 1\. Pass inputs that "
        r"are not per-example as keyword arguments",
        lambda: mapped.value_and_grad(loss_fn, (x, x[:1])),
    )


def test_a_patch_value_of_the_wrong_shape_is_refused(built):
    site = built.names[-1]
    _fails_before_any_work(
        ValueError,
        rf"patch for site '{site}' does not fit: the site's value has \(shape, "
        r"dtype\).*give a value of the site's shape and dtype",
        lambda: built.probe.value_and_grad(
            loss_fn, built.x, patch={site: jnp.ones((7,))}
        ),
    )


@pytest.mark.parametrize(
    "function",
    [lambda v: v[..., :1], lambda v: v.astype(jnp.float16)],
    ids=["shape", "dtype"],
)
def test_a_patch_function_that_changes_the_shape_fails_before_any_work(built, function):
    site = built.names[-1]
    message = (
        rf"patch for site '{site}' does not fit: .* the patch function returns .*"
        r"must keep the site's structure, shape and dtype"
    )
    _fails_before_any_work(
        ValueError, message, lambda: built.probe.apply(built.x, patch={site: function})
    )
    _fails_before_any_work(
        ValueError,
        message,
        lambda: jax.jit(
            lambda probe, x: probe.value_and_grad(loss_fn, x, patch={site: function})
        )(built.probe, built.x),
    )
