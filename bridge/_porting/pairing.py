"""Pairing two models' parameterised calls, for `transfer` and `compare`.

Layers pair in call order (`pair`; `pair_calls` where one side repeats a
module's call), once the layers not paired by their weights are set aside:
tied heads (`untied`) and optional buffers without a counterpart
(`with_counterparts`), and a packed projection met with the projections it
packs (`packed`). Counts that differ raise, naming the first pair that does
not match.

Within a parent module's calls, the order itself may differ: real ports do
not always call the children of one module in the same order:
PyTorch's BERT embeddings call the token-type table before the position
table, Flax's the other way round. Pairing those by position either raises
(`(2, 32)` vs `(16, 32)`) or, where both tables have one shape, silently
swaps them. So within each *group* — a run of consecutive calls with one
parent path, the same run on both sides — whose kinds follow in the same
order but whose layers evidently do not, layers pair by kind and weight
shapes instead, and where that leaves a tie, by their own names; a tie
neither settles raises. Any other group pairs in order, exactly as before.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._errors import BridgeValueError
from .layer import Layer, label


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


def packed(
    layers_a: Sequence[Layer], layers_b: Sequence[Layer]
) -> tuple[list[Layer], list[Layer]]:
    """Both lists, where a `dense` layer of one side packs the next few
    `dense` layers of the other into its kernel's columns, with those
    layers as one (`Layer.parts`): Hugging Face GPT-2's `c_attn`, query, key
    and value in one `(in, 3 * out)` kernel, against three projections.

    Only where the counts differ. The parts are consecutive calls of one
    parent module's children, without an activation, with the packed layer's
    input size and bias or none alike, and their output sizes sum to the
    packed layer's: its columns are theirs in call order (`compare` finds a
    port that packs them in another order, at the layers after them)."""
    if len(layers_a) == len(layers_b):
        return list(layers_a), list(layers_b)
    found: tuple[list[Layer], list[Layer]] = ([], [])
    sides = (list(layers_a), list(layers_b))
    at = [0, 0]
    while at[0] < len(sides[0]) and at[1] < len(sides[1]):
        for one, other in ((0, 1), (1, 0)):
            merged = _packing(sides[one][at[one]], sides[other], at[other])
            if merged is not None:
                count, layer = merged
                found[one].append(sides[one][at[one]])
                found[other].append(layer)
                at[one] += 1
                at[other] += count
                break
        else:
            for side in (0, 1):
                found[side].append(sides[side][at[side]])
                at[side] += 1
    for side in (0, 1):
        found[side].extend(sides[side][at[side] :])
    return found


def _dense_shape(layer: Layer) -> tuple[int, ...] | None:
    kernel = layer.weights.get("kernel") if layer.kind == "dense" else None
    return None if kernel is None else tuple(np.shape(kernel))


def _packing(whole: Layer, others: Sequence[Layer], start: int):
    """`(count, packed Layer)` of the layers of `others` from `start` that
    `whole` packs (see `packed`), else `None`."""
    shape = _dense_shape(whole)
    if shape is None or whole.activation is not None:
        return None
    parts, total = [], 0
    parent = _split(others[start].path)[0] if start < len(others) else None
    for layer in others[start:]:
        part = _dense_shape(layer)
        if (
            part is None
            or part[:-1] != shape[:-1]
            or layer.activation is not None
            or _split(layer.path)[0] != parent
            or (layer.weights.get("bias") is None)
            != (whole.weights.get("bias") is None)
            or total + part[-1] > shape[-1]
        ):
            return None
        parts.append(layer)
        total += part[-1]
        if total == shape[-1]:
            break
    if len(parts) < 2 or total != shape[-1]:
        return None
    return len(parts), _packed_layer(parts)


def _packed_layer(parts: Sequence[Layer]) -> Layer:
    first = parts[0]
    parent, _ = _split(first.path)
    separator = first.path[len(parent)] if parent else ""
    own = "+".join(_split(layer.path)[1] for layer in parts)
    path = f"{parent}{separator}{own}"
    weights = {
        name: None
        if first.weights.get(name) is None
        else np.concatenate([np.asarray(layer.weights[name]) for layer in parts], -1)
        for name in ("kernel", "bias")
    }
    return Layer(
        path if all(layer.site for layer in parts) else "",
        path,
        "dense",
        f"{first.described} {', '.join(repr(layer.path) for layer in parts)} packed",
        weights,
        hyperparameters=dict(first.hyperparameters),
        parts=tuple(parts),
    )


def unpacked(layer: Layer, weights: dict) -> list[tuple[Layer, dict]]:
    """`[(layer, weights)]` to write back: a packed layer's weights split into
    its parts' columns (`packed`)."""
    if not layer.parts:
        return [(layer, weights)]
    sizes = [np.shape(part.weights["kernel"])[-1] for part in layer.parts]
    bounds = np.cumsum(sizes)[:-1]
    split = {
        name: [None] * len(sizes) if value is None else np.split(value, bounds, -1)
        for name, value in weights.items()
    }
    return [
        (part, {name: values[n] for name, values in split.items()})
        for n, part in enumerate(layer.parts)
    ]


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


def _listed(layers: Sequence[Layer]) -> str:
    names = [
        f"{layer.site or layer.path or '(root)'}: {layer.kind}" for layer in layers[:6]
    ]
    return ", ".join(names) + (", ..." if len(layers) > 6 else "")


# -- where the two libraries' call order differs ------------------------------


# Both separators: PyTorch and Equinox paths use ".", the Flax libraries and
# Haiku "/"; the two sides of a port need not share either.
_SEPARATOR = re.compile(r"[./]")


def _split(path: str) -> tuple[str, str]:
    """`(parent path, own name)` of a module path."""
    parts = _SEPARATOR.split(path)
    return path[: max(len(path) - len(parts[-1]) - 1, 0)], parts[-1]


def _signature(layer: Any) -> tuple:
    shapes = tuple(
        (name, None if value is None else tuple(np.shape(value)))
        for name, value in sorted(layer.weights.items())
    )
    return layer.kind, shapes


def _runs(layers: Sequence[Any]) -> list[tuple[int, int]]:
    """`[(start, stop)]` of the runs of consecutive layers sharing a parent."""
    runs, start = [], 0
    for n in range(1, len(layers) + 1):
        if (
            n == len(layers)
            or _split(layers[n].path)[0] != _split(layers[start].path)[0]
        ):
            runs.append((start, n))
            start = n
    return runs


def paired_in_groups(
    layers_a: Sequence[Any], layers_b: Sequence[Any], names: tuple[str, str]
) -> list[tuple[Any, Any]]:
    """Pairs of two equally long lists: in order, except within a group whose
    order differs between the sides (see the module's docstring)."""
    pairs = list(zip(layers_a, layers_b, strict=True))
    # Only a run that is a run on both sides is a group: where the module
    # structure differs (a library without the parent), order is all there is.
    for start, stop in set(_runs(layers_a)) & set(_runs(layers_b)):
        group_a, group_b = layers_a[start:stop], layers_b[start:stop]
        if stop - start > 1 and _reordered(group_a, group_b):
            matched = _matched(group_a, group_b, names)
            if matched is not None:
                pairs[start:stop] = matched
    return pairs


def _reordered(group_a: Sequence[Any], group_b: Sequence[Any]) -> bool:
    """Whether the order evidently differs: the kinds follow in the same
    order, but pairing in order meets shapes that do not fit, or both sides
    name the same children (each once) in another order. Kinds in another
    order are another model (a norm before a dense, not after), for the
    order pairing to refuse as before."""
    if any(a.kind != b.kind for a, b in zip(group_a, group_b, strict=True)):
        return False
    if any(
        _signature(a) != _signature(b) for a, b in zip(group_a, group_b, strict=True)
    ):
        return True
    own_a = [_split(layer.path)[1] for layer in group_a]
    own_b = [_split(layer.path)[1] for layer in group_b]
    unique = len(set(own_a)) == len(own_a)
    return unique and set(own_a) == set(own_b) and own_a != own_b


def _matched(group_a, group_b, names) -> list[tuple[Any, Any]] | None:
    """The group's pairs in side A's order, by kind and shapes and then by
    name; `None` where the two sides' kinds and shapes are not the same
    multiset, for the order pairing to report the first misfit as before."""
    classes: dict[tuple, tuple[list, list]] = {}
    for side, group in enumerate((group_a, group_b)):
        for layer in group:
            classes.setdefault(_signature(layer), ([], []))[side].append(layer)
    if any(len(a) != len(b) for a, b in classes.values()):
        return None
    partner = {}
    for a_side, b_side in classes.values():
        if len(a_side) == 1:
            partner[id(a_side[0])] = b_side[0]
            continue
        by_name = _by_name(a_side, b_side)
        if by_name is None:
            raise _tie(a_side, b_side, names)
        partner.update(by_name)
    return [(a, partner[id(a)]) for a in group_a]


def _by_name(a_side, b_side) -> dict[int, Any] | None:
    """Tied layers paired by their own names (`position_embeddings` on both
    sides), where each name is on both sides once; else `None`."""
    own_a = {_split(layer.path)[1]: layer for layer in a_side}
    own_b = {_split(layer.path)[1]: layer for layer in b_side}
    if len(own_a) != len(a_side) or len(own_b) != len(b_side):
        return None
    if own_a.keys() != own_b.keys():
        return None
    return {id(layer): own_b[name] for name, layer in own_a.items()}


def _tie(a_side, b_side, names) -> BridgeValueError:
    def listed(side):
        return ", ".join(repr(layer.site or layer.path) for layer in side)

    kind, shapes = _signature(a_side[0])
    shown = ", ".join(f"{name} {shape}" for name, shape in shapes)
    return BridgeValueError(
        f"Cannot pair the {kind} layers {listed(a_side)} of {names[0]} with "
        f"{listed(b_side)} of {names[1]}: the two models call their module's "
        f"children in different orders, and these have the same kind and "
        f"shapes ({shown}) and no names the two sides share, so neither call "
        "order nor shape says which is which. Give the two models configs in "
        "which their shapes differ, or pair them by hand (move those weights "
        "yourself after transfer)."
    )
