"""Pairing within a parent module's calls where the two libraries' call order
differs.

`bridge._porting.transfer.pair` pairs two equally long lists of layers in call order.
Real ports do not always call the children of one module in the same order:
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
