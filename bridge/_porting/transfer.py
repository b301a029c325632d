"""Porting a model between libraries: pairing layers, and `transfer`.

Both pair the *parameterised modules* of two models — the modules that own
parameters themselves (Dense, Conv, LayerNorm, BatchNorm, Embed, the
projections of an attention layer), not the containers around them — in the
order they are first called on the same inputs. Discovery is the probes' own
abstract evaluation: pairing costs no FLOPs.

Each library's knowledge lives in a porting module of its adapter (named by
the probe class's `porting_side` attribute, imported on first use: the
contract is `bridge._porting.contract`). It lists a
model's parameterised calls as `Layer`s, each with its weights in one
*canonical layout*, and builds a new probe with given canonical weights; the
built-in ones declare a converter per kind of module (`bridge._porting.layer_kinds`).
The canonical layout is channel-last and `(in, out)`:

| kind | canonical weights |
|---|---|
| `dense` | `kernel` `(in, out)` (head axes flattened row-major), `bias` `(out,)` |
| `conv` | `kernel` `(*window, in / groups, out)` (HWIO), `bias` `(out,)` |
| `layernorm`, `rmsnorm` | `scale`, `bias` (flattened) |
| `batchnorm` | `scale`, `bias`, `mean`, `var` (flattened; the running statistics) |
| `groupnorm` | `scale`, `bias` (flattened) |
| `embed` | `embedding` `(vocabulary, features)` |

A scanned layer's weights keep their leading iteration axes (`Site.stacked`).
A weight the module does not have (no bias) is `None`. Anything else (a ViT
embeddings module's own `cls_token` and position table, a model's own RMSNorm
class) is of kind `weights:<names>`: it pairs with a module whose weights have
the same names and shapes, and they move unchanged, by name, as Hugging Face's
converter moves them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import BridgeAssertionError, BridgeTypeError, BridgeValueError
from .contract import PortingSide, porting_side
from .pairing import paired_in_groups


@dataclasses.dataclass(frozen=True)
class Layer:
    """One call of a parameterised module, as a library's porting module sees it.

    Attributes:
      site: the site name of the call (`path`, `path#1`, ...).
      path: the module's path.
      kind: `dense`, `conv`, `layernorm`, `rmsnorm`, `groupnorm`, `batchnorm`,
        `embed`, or `weights:<names>` (`bridge._porting.layer_kinds.weights_kind`).
      described: the module's class as its library names it (`nn.Dense`).
      weights: `{name: array or None}` in the canonical layout.
      to_common: maps one activation leaf to the common layout (channel-last,
        head axes flattened).
      select: picks the activation leaves to compare from the site's value
        (an Equinox stateful layer returns `(output, state)`).
      locations: where each canonical weight goes back, and how, for the
        library's `with_weights` (`LayerKinds` writes `{name: (where, back)}`).
      hyperparameters: `{name: value}` of what `transfer` does not move, in
        canonical names and conventions (`epsilon`, `momentum` as the weight
        of the running average kept, a convolution's explicit per-side
        `padding`, ...), for `compare` to list where a pair differs.
      tied: the path of the module whose weights these are, `""` when they
        are the layer's own (a tied LM head holds the embedding's tensor; the
        other library's tied head may own nothing, or be a call of the
        embedding's `attend`): such a layer is not paired by its weights;
        `compare` compares it with the other side's tied layer, if any, and
        reports it.
      optional: weights one library keeps where the other may have none (a
        PyTorch module's buffers, `final_logits_bias`): the layer pairs only
        with a layer of the same kind and shapes (the same names) on the
        other side, and is left out where there is none.
    """

    site: str
    path: str
    kind: str
    described: str
    weights: dict[str, Any]
    to_common: Callable[[Any], Any] = lambda value: value
    select: Callable[[Any], list] = lambda value: jax.tree.leaves(value)
    locations: Any = None
    hyperparameters: dict[str, Any] = dataclasses.field(default_factory=dict)
    tied: str = ""
    optional: bool = False


def parameterised_layers(
    probe: Any, argument: str, args: tuple, kwargs: dict
) -> tuple[PortingSide, list[Layer]]:
    """`(porting side, [Layer per call of a parameterised module])`, in call
    order, found by abstract evaluation."""
    side = porting_side(probe, argument)
    args, kwargs = inputs_for(probe, args, kwargs)
    discovered = probe.discovered_sites(*args, **kwargs)
    return side, side.layers(probe, discovered)


def untied(layers: Sequence[Layer]) -> tuple[list[Layer], list[Layer]]:
    """`(layers owning their weights, tied layers)`: a tied head is not paired
    (the other library's may be no layer at all), only reported."""
    return [la for la in layers if not la.tied], [la for la in layers if la.tied]


def with_counterparts(
    layers_a: Sequence[Layer], layers_b: Sequence[Layer]
) -> tuple[list[Layer], list[Layer]]:
    """Both lists without the optional layers (a PyTorch buffer) that have no
    layer of the same kind and weight shapes on the other side: a buffer
    the other library holds as a parameter (a logits bias) pairs with it by
    its name; one the other library computes (a table of sinusoids) is left
    out."""

    def signature(layer: Layer) -> tuple:
        shapes = {
            name: None if value is None else tuple(np.shape(value))
            for name, value in layer.weights.items()
        }
        return layer.kind, tuple(sorted(shapes.items()))

    def kept(layers: Sequence[Layer], others: Sequence[Layer]) -> list[Layer]:
        present = {signature(layer) for layer in others}
        return [la for la in layers if not la.optional or signature(la) in present]

    return kept(layers_a, layers_b), kept(layers_b, layers_a)


def described_tie(layer: Layer, name: str) -> str:
    return f"{label(layer)} ({layer.described}) of {name}, tied to {layer.tied!r}"


def first_calls(layers: Sequence[Layer]) -> list[Layer]:
    """Each module once, at its first call: a shared module moves once."""
    seen, first = set(), []
    for layer in layers:
        if layer.path not in seen:
            seen.add(layer.path)
            first.append(layer)
    return first


def pair(
    layers_a: Sequence[Layer],
    layers_b: Sequence[Layer],
    names: tuple[str, str],
    left_out: Sequence[str] = (),
) -> list[tuple[Layer, Layer]]:
    """Pair two lists of layers in order (within a parent module's calls by
    kind, shapes and names where the two orders differ: `bridge._porting.pairing`);
    raise when the counts differ, naming the first pair whose kinds differ or
    else the first layer left over, and the layers `left_out` of the count
    (tied heads; for `compare`, calls that never reach the loss)."""
    if len(layers_a) != len(layers_b):
        mismatch = next(
            (
                f"The first pair that does not match is {label(a)} ({a.kind}) of "
                f"{names[0]} and {label(b)} ({b.kind}) of {names[1]}."
                for a, b in zip(layers_a, layers_b, strict=False)
                if a.kind != b.kind
            ),
            None,
        )
        if mismatch is None:
            more, fewer = (1, 0) if len(layers_a) < len(layers_b) else (0, 1)
            extra = (layers_a, layers_b)[more][len((layers_a, layers_b)[fewer])]
            mismatch = (
                f"The first without a partner is {label(extra)} "
                f"({extra.described}) of {names[more]}."
            )
        raise BridgeValueError(
            f"The models do not have the same number of parameterised modules: "
            f"{names[0]} has {len(layers_a)} ({_listed(layers_a)}), {names[1]} has "
            f"{len(layers_b)} ({_listed(layers_b)}). {mismatch} Check that both "
            "models have the same layers, called in the same order on these inputs."
            + (f" Not counted: {'; '.join(left_out)}." if left_out else "")
        )
    return paired_in_groups(layers_a, layers_b, names)


def pair_calls(
    layers_a: Sequence[Layer],
    layers_b: Sequence[Layer],
    names: tuple[str, str],
    left_out: Sequence[str] = (),
) -> tuple[list[tuple[Layer, Layer]], list[tuple[str, Layer]]]:
    """`(pairs, [(name, layer) of each call left unpaired])`: `pair`, but where
    the counts differ only by repeated calls of a module on one side (a Flax
    module whose `__call__` calls its base class's), those calls are left
    unpaired rather than refused. Equal counts pair in order, as `pair` does."""
    if len(layers_a) != len(layers_b):
        aligned = _aligned(layers_a, layers_b, names)
        if aligned is not None:
            return aligned
    return pair(layers_a, layers_b, names, left_out), []


def _aligned(layers_a, layers_b, names):
    """Pairs in order, skipping a side's repeated call (of a module it called
    already) where the other side's next call is a first one; `None` when a
    first call is left without a partner, for `pair` to explain."""
    seen: tuple[set, set] = (set(), set())
    pairs, unpaired, i, j = [], [], 0, 0
    while i < len(layers_a) or j < len(layers_b):
        a = layers_a[i] if i < len(layers_a) else None
        b = layers_b[j] if j < len(layers_b) else None
        again_a = a is not None and a.path in seen[0]
        again_b = b is not None and b.path in seen[1]
        if a is not None and b is not None and again_a == again_b:
            pairs.append((a, b))
            seen[0].add(a.path), seen[1].add(b.path)
            i, j = i + 1, j + 1
        elif again_a and not again_b:
            unpaired.append((names[0], a))
            i += 1
        elif again_b and not again_a:
            unpaired.append((names[1], b))
            j += 1
        else:  # a first call without a partner
            return None
    return pairs, unpaired


def label(layer: Layer) -> str:
    return (
        f"site {layer.site!r}"
        if layer.site
        else repr(layer.path)
        if layer.path
        else "the root module"
    )


def _listed(layers: Sequence[Layer]) -> str:
    names = [
        f"{layer.site or layer.path or '(root)'}: {layer.kind}" for layer in layers[:6]
    ]
    return ", ".join(names) + (", ..." if len(layers) > 6 else "")


def check_fits(source: Layer, target: Layer) -> None:
    """Raise `ValueError` naming both sites when `source`'s weights cannot
    replace `target`'s."""
    where = (
        f"{label(source)} ({source.described}) of the source and "
        f"{label(target)} ({target.described}) of the destination"
    )
    if source.kind != target.kind:
        raise BridgeValueError(
            f"Cannot pair {where}: their kinds differ ({source.kind} vs "
            f"{target.kind}). transfer pairs parameterised modules in call order: "
            "check that both models call the same layers in the same order."
        )
    for name in dict.fromkeys([*source.weights, *target.weights]):
        have, want = source.weights.get(name), target.weights.get(name)
        if (have is None) != (want is None):
            missing = "the source" if have is None else "the destination"
            raise BridgeValueError(
                f"Cannot pair {where}: {missing} has no {name!r} (a {source.kind} "
                f"with and one without {name}). Build both with the same options "
                "(use_bias, use_scale, create_offset, ...)."
            )
        if have is not None and np.shape(have) != np.shape(want):
            raise BridgeValueError(
                f"Cannot pair {where}: their {source.kind} {name!r} shapes do not "
                f"fit, {tuple(np.shape(have))} vs {tuple(np.shape(want))} in the "
                "canonical layout (kernels (in, out), windows first, channels "
                "last). Check the layers' sizes."
            )


def transfer(
    src_probe: Any,
    dst_probe: Any,
    *args: Any,
    args_b: tuple | None = None,
    kwargs_b: dict | None = None,
    **kwargs: Any,
) -> Any:
    """A probe of `dst_probe`'s model carrying the weights of `src_probe`'s model.

    Both models are called on `*args, **kwargs` (abstractly: no FLOPs). Their
    parameterised modules — those that own weights themselves: Dense/Linear,
    Conv, LayerNorm, RMSNorm, BatchNorm with its running statistics, Embed, the
    projections of an attention layer — are paired in the order of their first
    call, and each pair's weights are converted between the libraries' layouts
    (Equinox `(out, in)` and `OIHW` kernels, attention kernels with and
    without head axes, Haiku's moving averages, ...).

    A tied layer (PyTorch's `lm_head` holding the embedding's tensor) is not
    paired: its owner's weights move, and a tied destination keeps sharing.

    Only weights move: hyperparameters (a LayerNorm's epsilon, a padding
    mode) are the porter's to match, and `bridge.compare` finds where they do
    not. Neither probe nor model is changed; the result is a new probe of the
    destination's library, with its `vmap` flag. An Equinox model that is
    channel-first inside takes the same channel-last inputs as the others and
    transposes at its entry.

    Args:
      src_probe: the probe whose weights are read.
      dst_probe: the probe whose model receives them.
      *args, **kwargs: call arguments both models accept, as for
        `probe.sites` (library keywords such as Haiku `rng` go to both; pass
        keywords only one library accepts through a `functools.partial` of its
        model instead).
      args_b, kwargs_b: the destination's inputs, where they differ from the
        source's (a PyTorch model's NCHW images against a JAX model's NHWC).

    Returns:
      A probe of `dst_probe`'s model with the converted weights.

    Raises:
      ValueError: naming both sites of the first pair that does not fit (kinds
        differ, shapes differ) or when the counts of parameterised modules
        differ.
      TypeError: for a probe of a library bridge cannot port.

    Examples:
      >>> ported = bridge.transfer(bridge.probe(linen_model, variables),
      ...                          bridge.probe(eqx_model), x)
      >>> ported.apply(x).outputs
    """
    porting_side(src_probe, "src_probe")
    porting_side(dst_probe, "dst_probe")
    args_b, kwargs_b = second_inputs(args, kwargs, args_b, kwargs_b)
    _, source_layers = parameterised_layers(src_probe, "src_probe", args, kwargs)
    target, target_layers = parameterised_layers(
        dst_probe, "dst_probe", args_b, kwargs_b
    )
    # A tied layer moves nothing of its own: its owner's weights move, and a
    # tied destination shares the tensor written to its owner.
    source_own, source_tied = untied(source_layers)
    target_own, target_tied = untied(target_layers)
    source_own, target_own = with_counterparts(source_own, target_own)
    names = ("the source (src_probe)", "the destination (dst_probe)")
    pairs = pair(
        first_calls(source_own),
        first_calls(target_own),
        names,
        left_out=[
            *(described_tie(la, names[0]) for la in source_tied),
            *(described_tie(la, names[1]) for la in target_tied),
        ],
    )
    updates = []
    for source_layer, target_layer in pairs:
        check_fits(source_layer, target_layer)
        updates.append((target_layer, source_layer.weights))
    return target.with_weights(dst_probe, updates)


# -- compare --------------------------------------------------------------------


def inputs_for(probe: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The inputs as `probe` takes them: a JAX model gets a PyTorch tensor
    given for both models (a porter's `x`) as a NumPy array."""
    if not getattr(probe, "runs_in_jax", False):
        return args, kwargs
    return jax.tree.map(_host_if_torch, (tuple(args), dict(kwargs)))


def _host_if_torch(leaf: Any) -> Any:
    if type(leaf).__module__.split(".")[0] != "torch" or not hasattr(leaf, "detach"):
        return leaf
    leaf = leaf.detach().cpu()
    if leaf.is_floating_point() and str(leaf.dtype) == "torch.bfloat16":
        return jnp.asarray(leaf.float().numpy(), jnp.bfloat16)
    return leaf.numpy()


def second_inputs(args, kwargs, args_b, kwargs_b) -> tuple[tuple, dict]:
    """The second model's inputs: its own where given, else the first's."""
    if args_b is not None and not isinstance(args_b, tuple | list):
        raise BridgeTypeError(
            "`args_b` must be a tuple of the second model's positional inputs, "
            f"e.g. args_b=(x_nhwc,); got {type(args_b).__name__}."
        )
    if kwargs_b is not None and not isinstance(kwargs_b, Mapping):
        raise BridgeTypeError(
            "`kwargs_b` must be a dict of the second model's keyword inputs; got "
            f"{type(kwargs_b).__name__}."
        )
    if args_b is None and kwargs_b is None:
        return args, kwargs
    return tuple(args if args_b is None else args_b), dict(kwargs_b or {})


def flat_size(shape: Sequence[int]) -> int:
    return math.prod(shape)


def dense_kernel(kernel: Any, inputs: int, stacked: int = 0) -> Any:
    """A kernel `(*stack, *in_axes, *out_axes)` as `(*stack, in, out)`,
    flattened row-major; `stack` are the iteration axes of a scanned layer."""
    shape = np.shape(kernel)
    lead, rest = shape[:stacked], shape[stacked:]
    return jnp.reshape(
        kernel, (*lead, flat_size(rest[:inputs]), flat_size(rest[inputs:]))
    )


def channel_first_kernel_axes(
    spatial: int, stacked: int = 0
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`(to_hwio, to_oihw)`: the axis orders taking a channel-first kernel
    `(*stack, out, in, *window)` (OIHW, PyTorch's and Equinox's) to the
    canonical `(*stack, *window, in, out)`, and back."""
    stack = tuple(range(stacked))
    window = tuple(range(stacked + 2, stacked + spatial + 2))
    to_hwio = (*stack, *window, stacked + 1, stacked)
    back = (stacked + spatial + 1, stacked + spatial)
    to_oihw = (*stack, *back, *range(stacked, stacked + spatial))
    return to_hwio, to_oihw


def flattened(value: Any, stacked: int = 0) -> Any:
    """A vector parameter (a bias, a scale) as `(*stack, size)`."""
    if value is None:
        return None
    return jnp.reshape(value, (*np.shape(value)[:stacked], -1))


def flatten_trailing(count: int) -> Callable[[Any], Any]:
    """Activation layout: the last `count` axes (attention heads) flattened."""
    if count <= 1:
        return lambda value: value
    return lambda value: jnp.reshape(
        value, (*np.shape(value)[:-count], flat_size(np.shape(value)[-count:]))
    )


def replace_leaves(
    tree: Any, updates: dict[tuple[str, ...], Any], named: Callable[[tuple], tuple]
) -> Any:
    """A copy of `tree` whose leaves at the named paths are replaced.

    `named(key_path)` gives a leaf's path as strings. Each replacement is
    cast to the leaf's dtype; its shape is the caller's to have checked.
    """
    used = set()

    def replace(key_path, leaf):
        path = named(key_path)
        if path not in updates:
            return leaf
        used.add(path)
        new = updates[path]
        return jnp.reshape(
            jnp.asarray(new, dtype=jnp.result_type(leaf)), jnp.shape(leaf)
        )

    new_tree = jax.tree_util.tree_map_with_path(replace, tree)
    missing = set(updates) - used
    if missing:
        raise BridgeAssertionError(f"bridge bug: no weight at {sorted(missing)}")
    return new_tree
