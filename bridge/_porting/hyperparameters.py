"""Hyperparameters of paired layers, in one canonical form per kind.

`transfer` moves weights only; `compare` lists the hyperparameters that differ
between a pair's modules (`PairComparison.hyperparameters`), since some
differences (LayerNorm epsilons of 1e-6 and 1e-5) do not show in the numbers.
Each porting module reads them off its modules into `Layer.hyperparameters`
with these helpers, in canonical names and conventions: norms' `epsilon`,
`use_scale`, `use_bias` (GroupNorm's `num_groups`); BatchNorm's `momentum` as
the share of the running average kept (PyTorch's `1 - momentum`);
convolutions' `stride`, `dilation`, `groups`, `use_bias`, `padding_mode` and
`padding` as explicit `(before, after)` pairs per axis (PyTorch's and
Equinox's convolutions, which share attribute names, read by
`torch_named_conv_hyperparameters`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class AsGiven:
    """A hyperparameter that cannot be brought to the canonical form: its
    value as the module holds it, and why. Equal only to the same value given
    the same way."""

    value: Any
    why: str

    def __repr__(self) -> str:
        return f"{self.value!r} (as given: {self.why})"


#: Floats agree within this relative difference: a float32 1e-5 and a Python
#: 1e-5 differ by float32's rounding (below 1e-7), a real mismatch by far more.
HYPERPARAMETER_RTOL = 1e-6


def differing_hyperparameters(
    a: Mapping[str, Any], b: Mapping[str, Any]
) -> dict[str, tuple[Any, Any]]:
    """`{name: (a, b)}` of the hyperparameters both sides have and that differ."""
    return {
        name: (a[name], b[name])
        for name in a
        if name in b and not _same(a[name], b[name])
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, AsGiven) or isinstance(b, AsGiven):
        return a == b
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(map(_same, a, b))
    if _is_number(a) and _is_number(b):
        return math.isclose(float(a), float(b), rel_tol=HYPERPARAMETER_RTOL)
    return a == b


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)


def shown(value: Any) -> str:
    if _is_number(value) and not isinstance(value, numbers.Integral):
        return f"{float(value):g}"
    return repr(value)


# -- hyperparameter helpers for the porting modules ------------------------------


def as_float(value: Any) -> float | AsGiven:
    """A float hyperparameter as a Python float (`AsGiven` when it is none)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return AsGiven(value, "not a number")


def per_axis(value: Any, count: int) -> tuple[int, ...]:
    """A stride or dilation (`None`, an int, or one per spatial axis) as one
    int per spatial axis."""
    if value is None:
        return (1,) * count
    if isinstance(value, numbers.Integral):
        return (int(value),) * count
    value = tuple(int(v) for v in value)
    return value * count if len(value) == 1 else value


def conv_padding(
    padding: Any, window: Sequence[int], strides: Sequence[int], dilation: Sequence[int]
) -> tuple[tuple[int, int], ...] | AsGiven:
    """A convolution's padding as explicit `(before, after)` pads per spatial
    axis: `"VALID"`, `"SAME"` (`"same"` in PyTorch) and `"SAME_LOWER"` at
    stride 1, Flax's `"CIRCULAR"`/`"REFLECT"` (the pads of `"SAME"`, see
    `conv_padding_mode`) and `"CAUSAL"`, an int, one int per axis, or pairs.
    `"SAME"` at a larger stride pads by the input's size, which the sites do not
    keep: it is reported `AsGiven`, but for a window of 1, which `"SAME"`
    never pads at any stride (a ResNet's strided 1x1 shortcut)."""
    count = len(window)
    dilated = [(k - 1) * d + 1 for k, d in zip(window, dilation, strict=True)]
    if isinstance(padding, str):
        name = padding.upper()
        if name == "VALID" or (
            name in ("SAME", "SAME_LOWER") and all(k == 1 for k in dilated)
        ):
            return ((0, 0),) * count
        same = name in ("SAME", "SAME_LOWER") and all(s == 1 for s in strides)
        if same or name in ("CIRCULAR", "REFLECT"):
            total = [k - 1 for k in dilated]
            if name == "SAME_LOWER":
                return tuple((t - t // 2, t // 2) for t in total)
            return tuple((t // 2, t - t // 2) for t in total)
        if name == "CAUSAL" and count == 1:
            return ((dilated[0] - 1, 0),)
        if name in ("SAME", "SAME_LOWER"):
            return AsGiven(
                padding,
                f"{name} padding at stride {tuple(strides)} depends on the "
                "input's size",
            )
        return AsGiven(padding, "a padding bridge does not know")
    if isinstance(padding, numbers.Integral):
        return ((int(padding), int(padding)),) * count
    try:
        items = list(padding)
        pairs = [
            (int(p), int(p)) if isinstance(p, numbers.Integral) else tuple(map(int, p))
            for p in items
        ]
    except (TypeError, ValueError):
        return AsGiven(padding, "a padding bridge does not know")
    pairs = pairs * count if len(pairs) == 1 else pairs
    if len(pairs) == count and all(len(p) == 2 for p in pairs):
        return tuple(pairs)
    return AsGiven(padding, "a padding bridge does not know")


def conv_padding_mode(padding: Any) -> str:
    """The values a Flax padding pads with: `"zeros"`, or `"circular"` and
    `"reflect"` (PyTorch's `padding_mode` names) for `"CIRCULAR"`/`"REFLECT"`."""
    if isinstance(padding, str) and padding.upper() in ("CIRCULAR", "REFLECT"):
        return padding.lower()
    return "zeros"


def conv_hyperparameters(
    *,
    window: Sequence[int],
    strides: Any,
    padding: Any,
    dilation: Any,
    groups: int,
    use_bias: bool,
    padding_mode: str = "zeros",
) -> dict[str, Any]:
    """A convolution's hyperparameters in canonical form: `stride`,
    `dilation` (one per spatial axis), `padding` (`conv_padding`),
    `padding_mode` (`"zeros"`, `"reflect"`, `"replicate"`, `"circular"`),
    `groups`, `use_bias`."""
    window = tuple(int(k) for k in window)
    strides = per_axis(strides, len(window))
    dilation = per_axis(dilation, len(window))
    return {
        "stride": strides,
        "padding": conv_padding(padding, window, strides, dilation),
        "padding_mode": str(padding_mode).lower(),
        "dilation": dilation,
        "groups": int(groups),
        "use_bias": bool(use_bias),
    }


def torch_named_conv_hyperparameters(module: Any, use_bias: bool) -> dict[str, Any]:
    """`conv_hyperparameters` of a convolution with PyTorch's attribute names
    (`kernel_size`, `stride`, `padding`, `padding_mode`, `dilation`,
    `groups`), which Equinox's convolutions share."""
    return conv_hyperparameters(
        window=module.kernel_size,
        strides=module.stride,
        padding=module.padding,
        padding_mode=module.padding_mode,
        dilation=module.dilation,
        groups=module.groups,
        use_bias=use_bias,
    )


def norm_hyperparameters(
    epsilon: Any, use_scale: Any = None, use_bias: Any = None, **more: Any
) -> dict[str, Any]:
    """A norm's hyperparameters in canonical form: `epsilon`, `use_scale`,
    `use_bias` (left out when `None`), and `more` as given (`num_groups`;
    `momentum`, the weight of the running average kept at each update)."""
    found: dict[str, Any] = {"epsilon": as_float(epsilon)}
    if use_scale is not None:
        found["use_scale"] = bool(use_scale)
    if use_bias is not None:
        found["use_bias"] = bool(use_bias)
    return found | more
