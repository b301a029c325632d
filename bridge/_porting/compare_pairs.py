"""The pairs `compare` makes beyond `transfer`'s, and how it reports its
tied layers.

`transfer` pairs each module's weights once; `compare` pairs calls, and
needs two things more: a tied layer compared with what stands for it on the
other side (`paired_ties`, described by `tie_notes`), and, once both models
have run, a module called more often on one side paired by the values of
its calls (`matched_by_value`). They are apart from `compare.py` so that the
entry point reads as the steps it takes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .compare_values import broadcast, differences, values_at
from .layer import Layer, described_tie, label

#: The two probes, as `compare`'s arguments, messages and report name them.
NAMES = ("probe_a", "probe_b")


def paired_ties(tied, paired, unpaired) -> tuple[list, list]:
    """`(pairs, unpaired)`: each tied layer paired with what stands for it on
    the other side, compared with it (its weights move with its owner's):
    the other side's tied layer tied to the partner of its owner (PyTorch's
    `lm_head` holding `embed_tokens`' tensor against Flax's `attend` of the
    embedding), or else an extra call of that partner (BART's decoder
    embedding, tied in PyTorch, a second call of the shared embedding in
    Flax), which is then no longer unpaired."""
    partner: tuple[dict, dict] = ({}, {})
    for a, b in paired:
        partner[0].setdefault(a.path, b.path)
        partner[1].setdefault(b.path, a.path)
    found, taken, used = [], set(), set()

    def extra_call(side: int, path: str | None) -> Layer | None:
        for n, (name, layer) in enumerate(unpaired):
            if n not in used and name == NAMES[side] and layer.site:
                if layer.path == path:
                    used.add(n)
                    return layer
        return None

    for a in (layer for layer in tied[0] if layer.site):
        want = partner[0].get(a.tied)
        b = next(
            (
                b
                for b in tied[1]
                if b.site and id(b) not in taken and b.tied == want is not None
            ),
            None,
        )
        b = b if b is not None else extra_call(1, want)
        if b is not None:
            found.append((a, b))
            taken.update((id(a), id(b)))
    for b in (layer for layer in tied[1] if layer.site and id(layer) not in taken):
        a = extra_call(0, partner[1].get(b.tied))
        if a is not None:
            found.append((a, b))
    return found, [pair for n, pair in enumerate(unpaired) if n not in used]


def tie_notes(tied, tie_pairs) -> tuple[str, ...]:
    """Each tied layer described, with what it was compared with."""
    partners = {id(a): (b, "probe_b") for a, b in tie_pairs}
    partners |= {id(b): (a, "probe_a") for a, b in tie_pairs}
    notes = []
    for name, side in zip(NAMES, tied, strict=True):
        for layer in side:
            note = described_tie(layer, name)
            if id(layer) in partners:
                other, other_name = partners[id(layer)]
                note += f"; compared with {label(other)} of {other_name}"
            notes.append(note)
    return tuple(notes)


def matched_by_value(pairs, unpaired, results):
    """Where a module is called more often on one side, the other side's
    call pairs with the call whose activations are nearest its own (for
    equal distances, the first): `(pairs, unpaired)`."""
    pairs, unpaired = list(pairs), list(unpaired)
    for n, (name, extra) in enumerate(unpaired):
        if not extra.site:
            continue
        side = NAMES.index(name)
        for k, pair in enumerate(pairs):
            mine, other = pair[side], pair[1 - side]
            if mine.path != extra.path:
                continue
            theirs = _values(other, results[1 - side])
            if _distance(_values(extra, results[side]), theirs) < _distance(
                _values(mine, results[side]), theirs
            ):
                pairs[k] = (extra, other) if side == 0 else (other, extra)
                unpaired[n] = (name, mine)
            break
    return pairs, unpaired


def _values(layer: Layer, result: Any) -> list[np.ndarray]:
    return values_at(layer, result.activations)


def _distance(values: list, theirs: list) -> float:
    """The largest relative difference of two sites' activations, `inf`
    where they cannot be compared."""
    if len(values) != len(theirs):
        return float("inf")
    values, theirs, _, _ = broadcast(values, theirs, values, theirs)
    if [np.shape(v) for v in values] != [np.shape(v) for v in theirs]:
        return float("inf")
    relative = differences(values, theirs, 0.0, 0.0)[1]
    return float("inf") if np.isnan(relative) else relative
