"""A call's inputs as numbers a floating-point cotangent carries exactly.

A site inside a branch or a loop records its inputs through the backward
pass (`bridge._session.backward.record`), as the cotangent of a zero
recorder; a cotangent is floating-point, so an integer, boolean or random
key input travels as float32 numbers (`as_floats`) and is turned back after
(`from_floats`, by its `Encoding`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Encoding:
    """How an input came to be float32 numbers in `as_floats`, to undo it."""

    dtype: Any
    key_impl: Any = None

    @classmethod
    def of(cls, x: Any) -> Encoding:
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return cls(jax.random.key_data(x).dtype, jax.random.key_impl(x))
        return cls(x.dtype)


def as_floats(x: Any) -> Any:
    """An input as numbers a floating-point cotangent carries exactly: floats
    as they are, integers and booleans as float32 (wider ones as their 16-bit
    words, exact in float32), a typed random key as its integer data."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return x
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype.itemsize > 1:
        x = jax.lax.bitcast_convert_type(x, jnp.uint16)
    return x.astype(jnp.float32)


def from_floats(encoding: Encoding, x: Any) -> Any:
    """The inverse of `as_floats`, on the recorded (stacked) numbers."""
    dtype = jnp.dtype(encoding.dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return x
    if dtype.itemsize > 1:
        x = jax.lax.bitcast_convert_type(x.astype(jnp.uint16), dtype)
    else:
        x = x.astype(dtype)
    if encoding.key_impl is not None:
        x = jax.random.wrap_key_data(x, impl=encoding.key_impl)
    return x
