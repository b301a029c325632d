"""`inside=` and a source file edited after import.

`inside=` compiles a function again from its source file as the file is now,
while the function runs the code it was compiled from at import: a notebook
user edits the module's file and probes the model made before. Each model
here is written to a file, imported, then the file is edited; the probe
either refuses, before any work, naming the function and the re-import, or
(an edit that leaves the function's code as it is: lines added above it, a
comment inside it) probes the code as imported, its values and gradients
checked against the model written out by hand, eager and jitted.
"""

from __future__ import annotations

import importlib
import itertools
import re
import sys

import jax
import numpy as np
import pytest

import bridge

flax_linen = pytest.importorskip("flax.linen")
eqx = pytest.importorskip("equinox")

X = np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)
WEIGHTS = np.random.default_rng(1).normal(size=(2, 3)).astype(np.float32)

#: The model of each library: a layer, `tanh`, then `scaled`, a plain
#: function. A method's docstring spans lines, so its constant keeps their
#: indentation (a source dedented before compiling would change it).
SOURCES = {
    "linen": '''\
import flax.linen as nn
import jax.numpy as jnp


def scaled(x):
    """Halve, then shift."""
    y = x * 0.5
    z = y + 1.0
    return z


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        """A Dense, then tanh.

        Its lines keep their indentation in the constant.
        """
        hidden = nn.Dense(3, name="dense")(x)
        squashed = jnp.tanh(hidden)
        return scaled(squashed)
''',
    "equinox": '''\
import equinox as eqx
import jax.numpy as jnp


def scaled(x):
    """Halve, then shift."""
    y = x * 0.5
    z = y + 1.0
    return z


class Block(eqx.Module):
    dense: eqx.nn.Linear

    def __init__(self, key):
        self.dense = eqx.nn.Linear(4, 3, key=key)

    def __call__(self, x):
        """A Linear, then tanh.

        Its lines keep their indentation in the constant.
        """
        hidden = self.dense(x)
        squashed = jnp.tanh(hidden)
        return scaled(squashed)
''',
}
LIBRARIES = list(SOURCES)
_names = itertools.count()


@pytest.fixture
def written(tmp_path, monkeypatch, request):
    """`write(library)`: the library's model written to a new module file and
    imported, as `(module, path)`."""
    monkeypatch.syspath_prepend(str(tmp_path))
    # No bytecode cache: a reload must compile the file as edited.
    monkeypatch.setattr(sys, "dont_write_bytecode", True)

    def write(library):
        name = f"stale_source_{library}_{next(_names)}"
        request.addfinalizer(lambda: sys.modules.pop(name, None))
        path = tmp_path / f"{name}.py"
        path.write_text(SOURCES[library])
        return importlib.import_module(name), path

    return write


def _edit(path, old, new):
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def _probe(library, module, inside):
    """The probe of `module.Block`, and its dense layer's `(kernel, bias)`
    as `x @ kernel + bias` uses them."""
    if library == "linen":
        model = module.Block()
        variables = model.init(jax.random.key(0), X)
        dense = variables["params"]["dense"]
        probe = bridge.probe(model, variables, inside=inside)
        return probe, (dense["kernel"], dense["bias"])
    model = module.Block(jax.random.key(0))
    probe = bridge.probe(model, vmap=True, inside=inside)
    return probe, (model.dense.weight.T, model.dense.bias)


def _loss(outputs):
    return (outputs * WEIGHTS).sum()


def _check_by_hand(result, kernel, bias):
    """The sites against the model written out: `squashed = tanh(x @ kernel
    + bias)`, `y = squashed * 0.5`, outputs `y + 1`; the loss's gradient at
    `squashed` is `0.5 * WEIGHTS`, at `y` `WEIGHTS`."""
    squashed = np.tanh(X @ np.asarray(kernel) + np.asarray(bias))
    expected = {"squashed": squashed, "scaled/y": 0.5 * squashed}
    for name, value in expected.items():
        np.testing.assert_allclose(
            result.activations[name], value, rtol=1e-5, atol=1e-6
        )
    np.testing.assert_allclose(
        result.activation_grads["squashed"], 0.5 * WEIGHTS, rtol=1e-6
    )
    np.testing.assert_allclose(result.activation_grads["scaled/y"], WEIGHTS, rtol=1e-6)
    np.testing.assert_allclose(
        result.loss, (WEIGHTS * (0.5 * squashed + 1.0)).sum(), rtol=1e-5
    )


def _run(probe, jit):
    def run(x):
        return probe.value_and_grad(_loss, x, at=["squashed", "scaled/y"])

    return (jax.jit(run) if jit else run)(X)


def _assert_the_site_lines(probe, path):
    """Each site's line in the file as it is now holds its assignment."""
    lines = path.read_text().splitlines()
    sources = bridge.site_sources(probe, X)
    assert set(sources) == {"hidden", "squashed", "scaled/y", "scaled/z"}
    for source in sources.values():
        assert source.file == str(path)
        assert " ".join(lines[source.line - 1].split()) == source.code


# -- the file as imported, or with only where the code lies changed -----------------


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("library", LIBRARIES)
def test_an_unedited_module_probes(written, library, jit):
    module, path = written(library)
    probe, (kernel, bias) = _probe(library, module, [module.Block, module.scaled])
    _check_by_hand(_run(probe, jit), kernel, bias)
    _assert_the_site_lines(probe, path)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("library", LIBRARIES)
def test_lines_added_above_still_probe_at_the_lines_of_the_file_now(
    written, library, jit
):
    """Lines added above the function and the class move their code, not
    change it: the `def` is found by its qualified name, and the sites'
    lines are those of the file as it is now."""
    module, path = written(library)
    _edit(path, "\n\ndef scaled", "\n\ndef added():\n    return 1\n\n\ndef scaled")
    _edit(path, "import jax.numpy as jnp\n", "import jax.numpy as jnp\n# a note\n")
    probe, (kernel, bias) = _probe(library, module, [module.Block, module.scaled])
    _check_by_hand(_run(probe, jit), kernel, bias)
    _assert_the_site_lines(probe, path)
    assert bridge.site_sources(probe, X)["scaled/y"].line == 12  # 7 at import


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_comment_or_a_blank_line_inside_is_no_edit_of_the_code(written, library):
    module, path = written(library)
    _edit(path, "    z = y + 1.0\n", "    # shifted\n\n    z = y + 1.0\n")
    _edit(path, "        squashed =", "        # squashed\n        squashed =")
    probe, (kernel, bias) = _probe(library, module, [module.Block, module.scaled])
    _check_by_hand(_run(probe, jit=False), kernel, bias)
    _assert_the_site_lines(probe, path)


#: Code whose bytecode and constants depend on where it is compiled: a
#: private name mangled by the class in a function nested in a method (given
#: to `inside=` itself, or among a method's constants), a local class's
#: qualified name (a constant of its body) and its annotations under
#: `from __future__ import annotations`.
COMPILED_IN_PLACE = """\
from __future__ import annotations

import dataclasses

import equinox as eqx
import jax.numpy as jnp


class Block(eqx.Module):
    dense: eqx.nn.Linear
    __scale = 0.5

    def __init__(self, key):
        self.dense = eqx.nn.Linear(4, 3, key=key)

    def __call__(self, x):
        @dataclasses.dataclass
        class Shift:
            by: float = 1.0

        def halve(value):
            return value * self.__scale

        squashed = jnp.tanh(self.dense(x))
        return halve(squashed) + Shift().by

    def halver(self):
        def halve(value):
            halved = value * self.__scale
            return halved

        return halve
"""


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_code_compiled_as_its_module_compiles_it_is_no_edit(tmp_path, monkeypatch, jit):
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"stale_source_in_place_{next(_names)}"
    (tmp_path / f"{name}.py").write_text(COMPILED_IN_PLACE)
    module = importlib.import_module(name)
    try:
        model = module.Block(jax.random.key(0))
        # `Block.halver.<locals>.halve` given alone is compiled in `Block` too.
        inside = [module.Block, model.halver()]
        probe = bridge.probe(model, vmap=True, inside=inside)
        run = lambda x: probe.value_and_grad(_loss, x, at="squashed")  # noqa: E731
        result = (jax.jit(run) if jit else run)(X)
    finally:
        sys.modules.pop(name, None)
    squashed = np.tanh(
        X @ np.asarray(model.dense.weight.T) + np.asarray(model.dense.bias)
    )
    np.testing.assert_allclose(
        result.activations["squashed"], squashed, rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        result.activation_grads["squashed"], 0.5 * WEIGHTS, rtol=1e-6
    )
    np.testing.assert_allclose(
        result.loss, (WEIGHTS * (0.5 * squashed + 1.0)).sum(), rtol=1e-5
    )


# -- an edit of the code: refused, before any work ----------------------------------

#: Edits of the function's code, and what the refusal says of each.
EDITS = {
    "a constant": ("x * 0.5", "x * 0.25", "compiles to other code"),
    "a constant's type": ("x * 0.5", "x * 1", "compiles to other code"),
    "a name": ("y + 1.0", "x + 1.0", "compiles to other code"),
    "a nested function": (
        "    z = y + 1.0\n",
        "    def shift(v):\n        return v + 2.0\n\n    z = shift(y)\n",
        "compiles to other code",
    ),
    "its name": ("def scaled(", "def rescaled(", "the file has no `def` of scaled"),
    "a syntax error": ("y = x * 0.5", "y = x *", "the file does not compile now"),
}


def _refusal(module, function):
    return (
        re.escape(
            f"`inside`: {function} no longer matches its source file "
            f"{module.__file__}: "
        )
        + ".*"
        + re.escape(
            "`inside=` rewrites a function from its source file as it is now, "
            "so the probe would run other code than the model does: the file was "
            f"edited after {module.__name__} was imported (or a tool, such as an "
            "import hook, compiled other code for it). Re-import it: "
            f"importlib.reload({module.__name__}) (or restart the kernel), make "
            "the model again from the reloaded module and pass `inside=` the "
            "reloaded class or function; or undo the edit."
        )
    )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("library", LIBRARIES)
def test_an_edited_function_is_refused_naming_it_and_the_reload(
    written, library, edit, jit
):
    module, path = written(library)
    old, new, why = EDITS[edit]
    _edit(path, old, new)
    code = module.scaled.__code__
    calls = []

    def probed(x):
        probe, _ = _probe(library, module, module.scaled)
        calls.append(x)  # never: the refusal comes first
        return probe.apply(x).outputs

    with pytest.raises(bridge.BridgeError, match=_refusal(module, "scaled")) as error:
        (jax.jit(probed) if jit else probed)(X)
    assert why in str(error.value)
    assert isinstance(error.value, ValueError)
    assert calls == []
    # Left as imported: the model still runs the code it was compiled from.
    assert module.scaled.__code__ is code
    np.testing.assert_allclose(module.scaled(X), X * 0.5 + 1.0, rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("library", LIBRARIES)
def test_an_edited_method_of_a_class_is_refused(written, library, jit):
    """The issue's case: `tanh` edited into another function after import;
    the probe would run the edit while the model runs `tanh`."""
    module, path = written(library)
    _edit(path, "squashed = jnp.tanh(hidden)", "squashed = jnp.sin(hidden) * 100")
    message = _refusal(module, "Block.__call__")

    def probed(x):
        probe, _ = _probe(library, module, module.Block)
        return probe.apply(x).outputs

    with pytest.raises(bridge.BridgeError, match=message) as error:
        (jax.jit(probed) if jit else probed)(X)
    assert "its `def` at line " in str(error.value)
    assert isinstance(error.value, ValueError)


@pytest.mark.parametrize("library", LIBRARIES)
def test_the_reloaded_module_probes_the_edited_code(written, library):
    """The way out the refusal names: reload, make the model again."""
    module, path = written(library)
    _edit(path, "y = x * 0.5", "y = x * 0.25")
    with pytest.raises(bridge.BridgeError, match="no longer matches"):
        _probe(library, module, [module.Block, module.scaled])
    module = importlib.reload(module)
    probe, (kernel, bias) = _probe(library, module, [module.Block, module.scaled])
    result = probe.value_and_grad(_loss, X, at=["squashed", "scaled/y"])
    squashed = np.tanh(X @ np.asarray(kernel) + np.asarray(bias))
    np.testing.assert_allclose(
        result.activations["scaled/y"], 0.25 * squashed, rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        result.activation_grads["squashed"], 0.25 * WEIGHTS, rtol=1e-6
    )
