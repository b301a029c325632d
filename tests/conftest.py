"""A strict test configuration, in the style of Equinox's."""

import functools

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")


@functools.cache
def _build(builder):
    return builder()


@pytest.fixture
def case(request):
    """A conformance case, built once per session: probing never mutates it."""
    return _build(request.param)
