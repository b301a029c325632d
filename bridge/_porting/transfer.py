"""Porting a model between libraries: `transfer`, and the canonical layout.

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

The parts live apart, each imported by `transfer` and `compare` alike:
`Layer` (`bridge._porting.layer`), each model's inputs and layers
(`bridge._porting.sides`), the pairing (`bridge._porting.pairing`) and the
layout helpers adapters convert with (`bridge._porting.layout`). This module
moves the weights: `transfer`, and `check_fits` for each pair. It re-exports
the names `bridge.adapter_api` takes from it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import BridgeValueError
from .contract import porting_side
from .layer import Layer as Layer
from .layer import described_tie, label
from .layout import channel_first_kernel_axes as channel_first_kernel_axes
from .layout import dense_kernel as dense_kernel
from .layout import flatten_trailing as flatten_trailing
from .layout import flattened as flattened
from .layout import replace_leaves as replace_leaves
from .pairing import first_calls, packed, pair, unpacked, untied, with_counterparts
from .sides import parameterised_layers as parameterised_layers
from .sides import second_inputs


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
    source = porting_side(src_probe, "src_probe")
    target = porting_side(dst_probe, "dst_probe")
    args_b, kwargs_b = second_inputs(args, kwargs, args_b, kwargs_b)
    _, source_layers = parameterised_layers(
        src_probe, "src_probe", args, kwargs, (target,)
    )
    _, target_layers = parameterised_layers(
        dst_probe, "dst_probe", args_b, kwargs_b, (source,)
    )
    # A tied layer moves nothing of its own: its owner's weights move, and a
    # tied destination shares the tensor written to its owner.
    source_own, source_tied = untied(source_layers)
    target_own, target_tied = untied(target_layers)
    source_own, target_own = with_counterparts(source_own, target_own)
    source_own, target_own = packed(first_calls(source_own), first_calls(target_own))
    names = ("the source (src_probe)", "the destination (dst_probe)")
    pairs = pair(
        source_own,
        target_own,
        names,
        left_out=[
            *(described_tie(la, names[0]) for la in source_tied),
            *(described_tie(la, names[1]) for la in target_tied),
        ],
    )
    updates = []
    for source_layer, target_layer in pairs:
        check_fits(source_layer, target_layer)
        updates += unpacked(target_layer, source_layer.weights)
    return target.with_weights(dst_probe, updates)


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
