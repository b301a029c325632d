"""`bridge.probe` and the adapter registry.

Adapters are found by a predicate on the model. The built-in predicates look
the library up in `sys.modules` instead of importing it: a model of a library
that was never imported cannot be an instance of its classes, so a library
that is not installed costs nothing, and an adapter module is imported only
when a model of its library is probed.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable
from typing import Any

from .._errors import BridgeTypeError
from .._session import inside_functions
from .._session.inside import Inside, check_carried
from .front import ProbeFront
from .protocol import ActivationProbe

#: How to pass each supported library's model: one line each in the error
#: for a model bridge cannot probe.
_SUPPORTED = (
    "Flax Linen: bridge.probe(module, variables) with variables = module.init(key, x)",
    "Flax NNX: bridge.probe(module) with an nnx.Module",
    "Equinox: bridge.probe(module), or bridge.probe(module, state) for a model "
    "with an eqx.nn.State",
    "Haiku: bridge.probe(hk.transform(f), params), or "
    "bridge.probe(hk.transform_with_state(f), params, state)",
    "PyTorch: bridge.probe(module) with a torch.nn.Module",
    "Hugging Face: bridge.probe(model) with a Flax or PyTorch model object",
    "Keras 3 (KERAS_BACKEND=jax): bridge.probe(model) with a built keras.Model",
)


@dataclasses.dataclass(frozen=True)
class _Adapter:
    name: str
    matches: Callable[[Any], bool]
    factory: Callable[..., ActivationProbe] | str

    def create(self, model: Any, variables: tuple, vmap: bool) -> ActivationProbe:
        factory = self.factory
        if isinstance(factory, str):
            module_name, _, attribute = factory.partition(":")
            factory = getattr(importlib.import_module(module_name), attribute)
        return factory(model, *variables, vmap=vmap)


_ADAPTERS: list[_Adapter] = []


def register_adapter(
    matches: type | tuple[type, ...] | Callable[[Any], bool],
    factory: Callable[..., ActivationProbe] | str,
    *,
    name: str | None = None,
    package: str | None = None,
) -> None:
    """Teach `bridge.probe` a new kind of model, without touching `bridge/`.

    Args:
      matches: the model class (or tuple of classes) this adapter handles, or a
        predicate `model -> bool`.
      factory: `factory(model, *variables, vmap=bool) -> ActivationProbe`, or
        `"package.module:attribute"` naming it, imported on first use. Subclass
        `bridge.adapter_api.ProbeBase` to get `sites`, `value_and_grad` and
        `apply` from one method that runs the model under a `Session`.
      name: a label for error messages; defaults to the class or function name.
      package: the top-level package of the library (`"flax"`), whose classes
        are the bases of models, not model code: `bridge.probe(...,
        inside=cls)` rewrites the methods of `cls`'s bases from `cls`'s own
        package, never a library's. Default: none.

    Adapters registered later are tried first, so a registration can override a
    built-in one.
    """
    if isinstance(matches, type | tuple):
        classes = matches
        if isinstance(classes, tuple) and not all(isinstance(c, type) for c in classes):
            raise BridgeTypeError(
                f"`matches` must be a class, a tuple of classes or a predicate; got "
                f"{matches!r}."
            )

        def matches(model: Any, classes=classes) -> bool:
            return isinstance(model, classes)

        label = getattr(classes, "__name__", repr(classes))
    elif callable(matches):
        label = getattr(matches, "__name__", repr(matches))
    else:
        raise BridgeTypeError(
            f"`matches` must be a class, a tuple of classes or a predicate "
            f"`model -> bool`; got {type(matches).__name__}."
        )
    if not (callable(factory) or (isinstance(factory, str) and ":" in factory)):
        raise BridgeTypeError(
            "`factory` must be a callable `(model, *variables, vmap) -> probe` or a "
            f"'module:attribute' string; got {factory!r}."
        )
    if package is not None and not (
        isinstance(package, str) and package.isidentifier()
    ):
        raise BridgeTypeError(
            f"`package` must be a top-level package's name, e.g. 'flax'; got "
            f"{package!r}."
        )
    _ADAPTERS.insert(0, _Adapter(name or label, matches, factory))
    if package is not None:
        inside_functions.add_library_package(package)


def probe(
    model: Any, *variables: Any, vmap: bool = False, inside: Any = None
) -> ActivationProbe:
    """Wrap a model of any supported library as an `ActivationProbe`.

    Args:
      model: a Flax Linen module, an NNX module, an Equinox module, a Haiku
        transformed function, or a `torch.nn.Module`.
      *variables: what the library needs beside the model: Linen `variables`;
        Haiku `params` (and `state`); Equinox `state`, if the model has one.
      vmap: the model handles one example: map it over axis 0 of every
        positional input; activation gradients then have the batch axis first.
      inside: a module class, a plain function, or a list of them: while the
        probe runs, every simple assignment `name = expr` in their code is a
        site, `<module path>/<name>` (in a function, `<calling module
        path>/<function name>/<name>`), as if written `bridge.tap("name",
        expr)` — attention scores and patterns of library-shipped attention
        without editing it. Only a class's methods are rewritten, and only
        floating arrays of rank >= 1 are sites; `bridge.site_sources` says
        which assignment each one is. Works through any adapter. The classes
        and functions are left as they were; without `inside`, nothing is
        rewritten.

    Examples:
      >>> probe = bridge.probe(model, variables)
      >>> res = probe.value_and_grad(lambda y: ((y - t) ** 2).mean(), x)
      >>> res.activation_grads["Dense_0"]
    """
    if not isinstance(vmap, bool):
        raise BridgeTypeError(f"`vmap` must be True or False; got {vmap!r}.")
    rewrites = None if inside is None else Inside(inside)  # errors before any work
    for adapter in _ADAPTERS:
        if adapter.matches(model):
            created = adapter.create(model, variables, vmap)
            if rewrites is None:
                return created
            if not isinstance(created, ProbeFront):
                raise BridgeTypeError(
                    f"`inside` needs a probe built on bridge's ProbeFront (or "
                    "ProbeBase); the "
                    f"adapter for {type(model).__qualname__} made a "
                    f"{type(created).__qualname__}. Mark the values with "
                    "bridge.tap in the model's code instead."
                )
            created._looking_inside(rewrites)
            check_carried(created)  # a rebuilt probe looks inside too
            return created
    # A short first line, what the user probably meant, then one line per
    # library: read at a glance in a traceback.
    lines = [
        f"bridge.probe cannot probe a model of type {type(model).__qualname__}.",
        _misuse_hint(model).strip(),
        "Supported libraries, and how to pass a model of each:",
        *(f"  {line}" for line in _SUPPORTED),
        "A new library can be added with bridge.register_adapter.",
    ]
    raise BridgeTypeError("\n".join(line for line in lines if line))


def _misuse_hint(model: Any) -> str:
    """What the user probably meant, for the common near misses."""
    if isinstance(model, type):
        return (
            f" `model` is the class {model.__qualname__} itself: pass an instance, "
            f"e.g. {model.__qualname__}(...)."
        )
    owner = getattr(model, "__self__", None)
    if owner is not None and any(a.matches(owner) for a in _ADAPTERS):
        return (
            f" `model` is the method {getattr(model, '__name__', '?')} of a "
            f"{type(owner).__qualname__}: pass the model itself, not its method."
        )
    wrapped = _wrapped_model(model)
    if wrapped:
        return wrapped
    if callable(model):
        return (
            " `model` is a plain function: a Haiku function must be transformed "
            "first, bridge.probe(hk.transform(f), params)."
        )
    return ""


def _wrapped_model(model: Any) -> str:
    """For an object that holds a model bridge can probe in one of its
    attributes (a trainer, a hub's wrapper), which attribute to pass."""
    try:
        fields = vars(model)
    except TypeError:  # no `__dict__`
        return ""
    for name, value in fields.items():
        if isinstance(value, type) or not any(a.matches(value) for a in _ADAPTERS):
            continue
        # A private field behind a public property (`_module` -> `module`).
        public = name.lstrip("_")
        shown = public if name != public and hasattr(type(model), public) else name
        variables = ", {'params': model.params}" if "params" in dir(model) else ""
        return (
            f" `model` is a {type(model).__qualname__} that holds the model in "
            f"its attribute {shown!r}: pass that, bridge.probe(model.{shown}"
            f"{variables}) (with the variables its library needs)."
        )
    return ""


def _instance_of(module_name: str, *class_names: str) -> Callable[[Any], bool]:
    def matches(model: Any) -> bool:
        library = sys.modules.get(module_name)
        if library is None:
            return False
        classes = tuple(getattr(library, name) for name in class_names)
        return isinstance(model, classes)

    matches.__name__ = f"{module_name}.{'|'.join(class_names)}"
    return matches


def _keras_3(model: Any) -> bool:
    """A Keras 3 layer or model, on any backend (the adapter names the fix
    for another). Keras 2, where installed as `keras`, has no `keras.Layer`."""
    layer = getattr(sys.modules.get("keras"), "Layer", None)
    return isinstance(layer, type) and isinstance(model, layer)


#: Where Keras 2's classes live: TensorFlow's copy, the `tf_keras` package,
#: and Keras 2's own layout (`keras.engine`, 2.13+'s `keras.src.engine`).
_KERAS_2_MODULES = (
    "tf_keras.",
    "tensorflow.python.keras.",
    "keras.engine.",
    "keras.src.engine.",
)


def _keras_2(model: Any) -> bool:
    """A Keras 2 (`tf.keras`) model, told by its classes' modules."""
    return any(
        (getattr(cls, "__module__", None) or "").startswith(_KERAS_2_MODULES)
        for cls in type(model).__mro__
    )


# Keras 3 and Keras 2 (refused, naming the fix), as the others: a later
# registration is tried first.
register_adapter(
    _instance_of("flax.linen", "Module"),
    "bridge.adapters.linen:probe",
    name="linen",
    package="flax",
)
# A Hugging Face Flax model object: its Linen `module` with its `params`. No
# `package`: `inside=` rewrites a Hugging Face class's same-package bases (one
# attention class subclasses another).
register_adapter(
    _instance_of("transformers.modeling_flax_utils", "FlaxPreTrainedModel"),
    "bridge.adapters.linen.hub:probe",
    name="transformers-flax",
)
register_adapter(
    _instance_of("flax.nnx", "Module"),
    "bridge.adapters.nnx:probe",
    name="nnx",
    package="flax",
)
register_adapter(
    _instance_of("equinox", "Module"),
    "bridge.adapters.equinox:probe",
    name="equinox",
    package="equinox",
)
register_adapter(
    _instance_of("torch.nn", "Module"),
    "bridge.adapters.torch:probe",
    name="torch",
    package="torch",
)
register_adapter(
    _keras_3, "bridge.adapters.keras.probe:probe", name="keras", package="keras"
)
register_adapter(_keras_2, "bridge.adapters.keras.not_keras_3:probe", name="keras 2")
register_adapter(
    _instance_of("haiku", "Transformed", "TransformedWithState"),
    "bridge.adapters.haiku:probe",
    name="haiku",
    package="haiku",
)
