"""The strict test configuration is really in force, for every test module.

`tests/conftest.py` sets rank promotion to "raise" and pyproject's
`filterwarnings` turns warnings into errors. A test that passes only because
one of these was silently off would hide the bugs they exist to catch.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest


def test_rank_promotion_raises():
    assert jax.config.jax_numpy_rank_promotion == "raise"
    with pytest.raises(ValueError, match="jax_numpy_rank_promotion=.raise."):
        jnp.ones(3) + jnp.ones((2, 3))


@pytest.mark.parametrize("category", [UserWarning, DeprecationWarning, RuntimeWarning])
def test_a_warning_from_our_code_fails_the_test(category):
    with pytest.raises(category, match="must fail"):
        warnings.warn("a warning must fail the test", category, stacklevel=1)


def test_jax_own_warnings_fail_the_test():
    # A real warning from JAX itself, not a DeprecationWarning: not ignored.
    with pytest.raises(UserWarning, match="Explicitly requested dtype"):
        jnp.zeros(2, dtype=jnp.float64)


def test_x64_is_off_so_no_test_leaks_it():
    assert not jax.config.jax_enable_x64
