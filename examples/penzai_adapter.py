"""A fifth library through the registry alone: Penzai (`penzai.pz.nn` layers).

This module is written as a third party would write it: it imports only the
public adapter-author module `bridge.adapter_api` (`ProbeBase`, `Session`,
`register_adapter` and, for `bridge.transfer`/`bridge.compare`, the porting
`Layer` record). Importing it registers the adapter:

    >>> import penzai_adapter  # noqa: F401  (registers "penzai")
    >>> probe = bridge.probe(model)          # a pz.nn.Layer with bound parameters
    >>> probe = bridge.probe(unbound, params)  # or pz.unbind_params(model, freeze=True)
    >>> res = probe.value_and_grad(loss_fn, tokens)

The mechanism is Penzai's own tree surgery. A Penzai model is a pytree of
`pz.nn.Layer`s; inside the probe's traced function, a copy of the model is
rebuilt with `pz.select(...).at_children().at_instances_of(pz.nn.Layer)` and
each sublayer replaced by a `_Site` layer that reports its calls to the
probe's `Session` (held by the wrapper, so no private `bridge` name is
needed). The user's model and its `pz.Parameter`s are never changed: the
probe holds the model unbound from frozen copies of its variables.

Sites are named by Penzai's keypaths, `/`-joined: `body/sublayers/2` is
`model.body.sublayers[2]` (what `pz.select(model).at_instances_of(...)`
reports as `.body.sublayers[2]`), ordered by call entry, `#k` for repeated
calls. Values are `pz.nx.NamedArray`s (pytrees: the activation gradient of a
site is a NamedArray with the same named axes).

`res.grads` is what `jax.grad` returns for the frozen parameters,
`pz.unbind_params(model, freeze=True)[1]`: a tuple of `pz.ParameterValue`,
each with the parameter's `label` and its gradient as `.value` (a NamedArray).
That is the structure Penzai's own training loop (`penzai.toolshed.
basic_training`) differentiates and hands to an optimizer. `res.state` holds
the `pz.StateVariableValue`s after the call for a model with state
variables, else `None`.

Not supported: `vmap=True` (Penzai batches through named axes: name a batch
axis instead), and sites inside a `pz.nn.LayerStack` (a scan over stacked
layers: the stack itself is one site, its sublayers are not instrumented).

Run as a script, it probes a small Penzai transformer and prints each block's
activation gradient:

    python -m pip install -e ".[all,examples]"
    python examples/penzai_adapter.py
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

if __name__ == "__main__":  # imported, a missing Penzai is the importer's error
    from example_support import require

    require("penzai")

import jax
import jax.numpy as jnp
from penzai import pz

import bridge
from bridge.adapter_api import Layer as PortingLayer
from bridge.adapter_api import ProbeBase, Session, key_name

# -- the probe ------------------------------------------------------------------


def probe(model: pz.nn.Layer, *variables: Any, vmap: bool = False) -> PenzaiProbe:
    """`bridge.probe` for a Penzai layer: `bridge.probe(model)` with its variables
    bound, or `bridge.probe(unbound, variables)` with the frozen values of
    `pz.unbind_variables(model, freeze=True)` (or of `pz.unbind_params`)."""
    if vmap:
        raise ValueError(
            "vmap=True does not apply to a Penzai model: Penzai layers batch "
            "through named axes. Name a batch axis in the inputs instead, e.g. "
            "pz.nx.wrap(x).tag('batch', 'features')."
        )
    if len(variables) > 1:
        raise TypeError(
            "A Penzai model is probed as bridge.probe(model), or as "
            "bridge.probe(unbound, variables) with the frozen variable values of "
            f"pz.unbind_variables(model, freeze=True); got {len(variables)} "
            "variable arguments."
        )
    if variables:
        values = tuple(variables[0])
        loose = [
            type(v).__name__
            for v in values
            if not isinstance(v, pz.ParameterValue | pz.StateVariableValue)
        ]
        if loose:
            raise TypeError(
                "bridge.probe(unbound, variables) takes frozen variable values "
                "(pz.ParameterValue, pz.StateVariableValue), as "
                "pz.unbind_variables(model, freeze=True) returns them; got "
                f"{', '.join(loose[:3])}."
            )
        unbound = model
    else:
        unbound, values = pz.unbind_variables(model, freeze=True)
    params = tuple(v for v in values if isinstance(v, pz.ParameterValue))
    state = tuple(v for v in values if isinstance(v, pz.StateVariableValue))
    return PenzaiProbe(unbound, params, state)


@jax.tree_util.register_pytree_node_class
class PenzaiProbe(ProbeBase):
    """A Penzai layer, held unbound from frozen copies of its variables.

    A pytree: the parameters, state values and the model's other arrays are
    children, so `jax.jit(step)(probe, x)` bakes none of them in.
    """

    #: `bridge.transfer` and `bridge.compare` import the module named here and
    #: call its `layers(probe, sites)` and `with_weights(probe, updates)`.
    porting_side = __name__

    def __init__(self, unbound: Any, params: tuple, state: tuple):
        self.unbound = unbound
        self.params = params
        self.state = state
        self.vmap = False

    def tree_flatten(self):
        return (self.unbound, self.params, self.state), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)

    def __repr__(self) -> str:
        return f"PenzaiProbe({type(self.unbound).__name__}, {len(self.params)} params)"

    def _trainable(self) -> tuple:
        return self.params

    def _run(
        self, trainable: tuple, args: tuple, kwargs: dict, session: Session
    ) -> tuple[Any, Any]:
        # Fresh mutable copies of the state: the model may update them.
        state = tuple(value.unfreeze_as_copy() for value in self.state)
        model = pz.bind_variables(self.unbound, (*trainable, *state))
        model = _instrument(model, (), session)
        outputs = model(*args, **kwargs)
        return outputs, (tuple(v.freeze() for v in state) if state else None)

    def _check_call(self, args: tuple, kwargs: dict) -> None:
        if len(args) != 1:
            raise TypeError(
                "A Penzai layer takes one positional input and side inputs as "
                f"keywords: probe.value_and_grad(loss_fn, x, **side_inputs); got "
                f"{len(args)} positional inputs."
            )


# -- the surgery ----------------------------------------------------------------


def _instrument(layer: Any, prefix: tuple[str, ...], session: Session) -> Any:
    """A copy of `layer` whose sublayers (at any depth) report their calls.

    Each sublayer is instrumented inside first, then wrapped: a wrapper holds
    an instrumented layer, so a layer's call comes before its sublayers'.
    """
    if isinstance(layer, pz.nn.LayerStack):
        return layer  # a scan over stacked layers: one site, not instrumented

    def wrap(key_path: tuple, sublayer: pz.nn.Layer) -> _Site:
        path = (*prefix, *(key_name(key) for key in key_path))
        return _Site(_instrument(sublayer, path, session), "/".join(path), session)

    return (
        pz.select(layer)
        .at_children()
        .at_instances_of(pz.nn.Layer)
        .apply(wrap, with_keypath=True)
    )


@pz.pytree_dataclass
class _Site(pz.nn.Layer):
    """Stands in for a sublayer: each call is a site of the probe's session."""

    layer: pz.nn.Layer
    path: str = dataclasses.field(metadata={"pytree_node": False})
    session: Any = dataclasses.field(metadata={"pytree_node": False})

    def __call__(self, argument: Any, /, **side_inputs: Any) -> Any:
        call = self.session.enter(self.path, None, self.layer, (argument,))
        return self.session.exit(call, self.layer(argument, **side_inputs))


# -- porting: `bridge.transfer` and `bridge.compare` ----------------------------
#
# The parameterised layers are those that own parameters themselves, with
# Penzai's split affine layers taken whole: an `Affine` (a `Linear` and an
# `AddBias`) is one `dense`, as a Linen `Dense` is; a bare `Linear` is a
# `dense` without bias; a `LayerNorm`/`RMSLayerNorm` (a standardisation and a
# scale, and a bias) is one `layernorm`/`rmsnorm`; an `EmbeddingLookup` is an
# `embed`. Kernels are ordered (input axes, output axes) and flattened to the
# canonical `(in, out)`; activations to (other axes..., output axes flattened).


def layers(probe: PenzaiProbe, sites: list) -> list[PortingLayer]:
    # The layers themselves, with the probe's parameters: a site's `module` was
    # seen while tracing, and holds tracers.
    model = pz.bind_variables(probe.unbound, probe.params + probe.state)
    by_path = _layers_by_path(model, ())
    found = []
    for site in sites:
        if site.module is None:
            continue  # a tap
        module = by_path[site.path]
        if any(site.path.startswith(f"{p}/") for p in _whole_paths(sites)):
            continue  # a part of a layer taken whole
        described = f"pz.nn.{type(module).__name__}"
        if isinstance(module, pz.nn.Affine):
            linear, bias = _affine_parts(module)
            found.append(_dense(site, described, linear, bias))
        elif isinstance(module, pz.nn.Linear | pz.nn.LinearInPlace):
            module = _affine_parts(module)[0]
            found.append(_dense(site, described, module, None))
        elif isinstance(module, pz.nn.LayerNorm | pz.nn.RMSLayerNorm):
            found.append(_norm(site, described, module))
        elif isinstance(module, pz.nn.EmbeddingLookup):
            table = module.table.embeddings
            names = _names(table.value)
            vocabulary = module.table.vocabulary_axis
            features = tuple(n for n in names if n != vocabulary)
            found.append(
                PortingLayer(
                    site.name,
                    site.path,
                    "embed",
                    described,
                    {"embedding": _matrix(table.value, (vocabulary,), features)},
                    select=_select(features),
                    locations={"embedding": (table.label, (vocabulary,), features)},
                )
            )
        elif _owns_parameters(module):
            raise ValueError(
                f"bridge cannot port site {site.name!r} ({described}): this "
                "adapter knows Affine, Linear, LayerNorm, RMSLayerNorm and "
                "EmbeddingLookup."
            )
    return found


def with_weights(probe: PenzaiProbe, updates: list) -> PenzaiProbe:
    """A new probe whose parameters at the given layers carry new weights."""
    new_values = {}
    for layer, weights in updates:
        for name, (label, rows, columns) in layer.locations.items():
            if weights.get(name) is None:
                continue
            new_values[label] = (weights[name], rows, columns)
    params = []
    for value in probe.params:
        if value.label not in new_values:
            params.append(value)
            continue
        weight, rows, columns = new_values.pop(value.label)
        old = value.value
        shape = [old.named_shape[n] for n in (*rows, *columns)]
        array = jnp.reshape(jnp.asarray(weight, old.dtype), shape)
        new = pz.nx.wrap(array).tag(*rows, *columns).order_like(old)
        params.append(dataclasses.replace(value, value=new))
    if new_values:
        raise AssertionError(f"no parameter labelled {sorted(new_values)}")
    return PenzaiProbe(probe.unbound, tuple(params), probe.state)


def _whole_paths(sites: list) -> list[str]:
    return [
        site.path
        for site in sites
        if isinstance(
            site.module,
            pz.nn.Affine
            | pz.nn.LinearInPlace
            | pz.nn.LayerNorm
            | pz.nn.RMSLayerNorm
            | pz.nn.Linear,
        )
    ]


def _layers_by_path(layer: Any, prefix: tuple[str, ...]) -> dict[str, Any]:
    """Every sublayer by its site path, as `_instrument` names them."""
    found = {}
    if isinstance(layer, pz.nn.LayerStack):
        return found
    selection = pz.select(layer).at_children().at_instances_of(pz.nn.Layer)
    for key_path, sublayer in selection.selected_by_path.items():
        path = (*prefix, *(key_name(key) for key in key_path))
        found["/".join(path)] = sublayer
        found.update(_layers_by_path(sublayer, path))
    return found


def _affine_parts(affine: pz.nn.Affine) -> tuple[Any, Any]:
    linear = next(
        layer for layer in _leaf_layers(affine) if isinstance(layer, pz.nn.Linear)
    )
    bias = next(
        (layer for layer in _leaf_layers(affine) if isinstance(layer, pz.nn.AddBias)),
        None,
    )
    return linear, bias


def _leaf_layers(layer: Any) -> list:
    return list(
        pz.select(layer).at_instances_of(pz.nn.Linear | pz.nn.AddBias).get_sequence()
    )


def _dense(site: Any, described: str, linear: Any, bias: Any) -> PortingLayer:
    weights = linear.weights
    rows = tuple(linear.in_axis_names)
    columns = tuple(linear.out_axis_names)
    canonical = {"kernel": _matrix(weights.value, rows, columns), "bias": None}
    locations = {"kernel": (weights.label, rows, columns)}
    if bias is not None:
        canonical["bias"] = _flat(bias.bias.value)
        locations["bias"] = (bias.bias.label, (), _names(bias.bias.value))
    # A `LinearInPlace` renames its outputs back: the site's output axes are
    # the names the values end with; unprimed they are the same count.
    return PortingLayer(
        site.name,
        site.path,
        "dense",
        described,
        canonical,
        select=_select(_output_names(site, columns)),
        locations=locations,
    )


def _norm(site: Any, described: str, norm: Any) -> PortingLayer:
    kind = "rmsnorm" if isinstance(norm, pz.nn.RMSLayerNorm) else "layernorm"
    canonical, locations = {"scale": None, "bias": None}, {}
    scale = next(
        (layer for layer in norm.sublayers if isinstance(layer, pz.nn.Linear)), None
    )
    bias = next(
        (layer for layer in norm.sublayers if isinstance(layer, pz.nn.AddBias)), None
    )
    features: tuple[str, ...] = ()
    if scale is not None:
        # A scale is a diagonal `Linear` over the normalised axes.
        canonical["scale"] = _flat(scale.weights.value)
        features = _names(scale.weights.value)
        locations["scale"] = (scale.weights.label, (), features)
    if bias is not None:
        canonical["bias"] = _flat(bias.bias.value)
        features = _names(bias.bias.value)
        locations["bias"] = (bias.bias.label, (), features)
    return PortingLayer(
        site.name,
        site.path,
        kind,
        described,
        canonical,
        select=_select(features),
        locations=locations,
    )


def _output_names(site: Any, columns: tuple[str, ...]) -> tuple[str, ...]:
    named = tuple(site.value_struct.named_shape)
    # A `LinearInPlace` renames `features_out` back to `features`.
    return tuple(
        name if name in named or not name.endswith("_out") else name[:-4]
        for name in columns
    )


def _names(named: Any) -> tuple[str, ...]:
    return tuple(named.named_shape)


def _matrix(named: Any, rows: tuple[str, ...], columns: tuple[str, ...]) -> Any:
    array = named.order_as(*rows, *columns).unwrap(*rows, *columns)
    size = lambda names: math.prod(named.named_shape[n] for n in names)  # noqa: E731
    return jnp.reshape(array, (size(rows), size(columns)))


def _flat(named: Any) -> Any:
    names = _names(named)
    return jnp.reshape(named.unwrap(*names), (-1,))


def _select(features: tuple[str, ...]):
    """The site's value as one array: its other named axes first, in their
    order (`batch`, `seq`), then the feature axes flattened."""

    def select(value: Any) -> list:
        if not isinstance(value, pz.nx.NamedArray | pz.nx.NamedArrayView):
            return jax.tree.leaves(value)
        others = tuple(n for n in value.named_shape if n not in features)
        array = value.order_as(*others, *features).unwrap(*others, *features)
        lead = array.shape[: len(others)]
        return [jnp.reshape(array, (*lead, -1))]

    return select


def _owns_parameters(module: Any) -> bool:
    def is_own(x: Any) -> bool:
        return isinstance(x, pz.nn.Layer) and x is not module

    children = jax.tree_util.tree_leaves(
        module, is_leaf=lambda x: is_own(x) or isinstance(x, pz.AbstractVariable)
    )
    return any(isinstance(c, pz.AbstractVariable) for c in children)


bridge.register_adapter(pz.nn.Layer, probe, name="penzai")


# -- run as a script: a small Penzai transformer, probed ---------------------------


def main() -> None:
    from penzai.models.transformer.variants import llamalike_common

    config = llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=2,
        query_head_multiplier=1,
        embedding_dim=16,
        projection_dim=8,
        mlp_hidden_dim=32,
        num_decoder_blocks=2,
        vocab_size=32,
        mlp_variant="swiglu",
        tie_embedder_and_logits=True,
    )
    model = llamalike_common.build_llamalike_transformer(
        config, init_base_rng=jax.random.key(0)
    )
    ids = jax.random.randint(jax.random.key(1), (2, 9), 0, config.vocab_size)
    tokens = pz.nx.wrap(ids[:, :-1]).tag("batch", "seq")

    def loss(logits):  # next-token cross-entropy
        values = logits.unwrap("batch", "seq", "vocabulary")
        log_probs = jax.nn.log_softmax(values, axis=-1)
        return -jnp.mean(jnp.take_along_axis(log_probs, ids[:, 1:, None], -1))

    probe = bridge.probe(model)  # this module registered the adapter
    blocks = [name for name in probe.sites(tokens) if name.count("/") == 2]
    res = jax.jit(lambda p, t: p.value_and_grad(loss, t, at=blocks))(probe, tokens)
    print(f"a Penzai llamalike transformer; next-token loss {float(res.loss):.4f}")
    print(
        f"  {'site (Penzai keypath)':<21} {'named axes of the value':<42} "
        "‖d loss / d value‖"
    )
    for name, grad in res.activation_grads.items():
        axes = dict(grad.named_shape)
        norm = float(jnp.linalg.norm(_flat(grad)))
        print(f"  {name:<21} {str(axes):<42} {norm:.3e}")


if __name__ == "__main__":
    main()
