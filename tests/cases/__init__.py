"""The conformance suite's models: one module per library, each a dict of cases.

Every adapter joins the suite by adding `cases/<library>.py` with a `CASES`
dict of zero-argument builders returning a `Case`. A case carries the probe and
its inputs plus *independent* references, computed without bridge: the loss
and parameter gradients of the unprobed model, and the loss with a
perturbation added at a site by the test's own hook (for `jax.jvp`).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import pytest
from helpers import add_at_float_leaves, nnx_supported

LIBRARIES = ("linen", "haiku", "equinox", "nnx", "torch", "keras")


@dataclasses.dataclass
class Case:
    """A model under probe with independent references.

    Attributes:
      probe: what `bridge.probe` returned.
      args, kwargs: the call's inputs (`kwargs` may hold apply keywords).
      loss_fn: `outputs -> scalar`.
      expected_sites: every site's name, in call order, written by hand.
      trainable: the trainable parameters, in the structure `ProbeResult.grads`
        must have.
      reference_loss: `(trainable, args) -> loss` of the unprobed model.
      perturbed_loss: `(site, delta) -> loss` with `delta` added to the site's
        value by the test's own hook (`delta` is `None` at integer leaves).
      snapshot: `() -> pytree` of numpy copies of everything the user passed;
        equal before and after probing.
      bias_sites: `{site: grads -> bias gradient}` for layers whose bias
        gradient is the site's gradient summed over the broadcast axes.
      reference_activations: `() -> {site: value}` from the library's own
        recording (`capture_intermediates`, ...), for some sites; or `None`.
      reference_state: `() -> state` of the unprobed model, or `None`.
    """

    probe: Any
    args: tuple
    kwargs: dict
    loss_fn: Callable[[Any], Any]
    expected_sites: list[str]
    trainable: Any
    reference_loss: Callable[[Any, tuple], Any]
    perturbed_loss: Callable[[str, Any], Any]
    snapshot: Callable[[], Any]
    bias_sites: dict[str, Callable[[Any], Any]] = dataclasses.field(
        default_factory=dict
    )
    reference_activations: Callable[[], dict[str, Any]] | None = None
    reference_state: Callable[[], Any] | None = None

    #: How the probe can be called: eagerly, and under `jax.jit` for JAX models.
    modes = ("eager", "jit")

    def reference_value_and_grad(self) -> tuple[Any, Any]:
        return jax.value_and_grad(self.reference_loss)(self.trainable, self.args)

    def directional_derivative(self, site: str, delta: Any) -> Any:
        """d/dt of the loss with `t * delta` added at `site` by the test's own
        hook, at t = 0: `jax.jvp`."""

        def loss_along(t):
            return self.perturbed_loss(site, jax.tree.map(lambda d: t * d, delta))

        return jax.jvp(loss_along, (0.0,), (1.0,))[1]

    def adding(self, delta: Any) -> Callable[[Any], Any]:
        """A patch function adding `delta` (a JAX pytree) to a site's value."""
        return lambda value: add_at_float_leaves(value, delta)

    def to_host(self, tree: Any) -> Any:
        """Results as the tests compare them (JAX arrays as they are)."""
        return tree


def case_params() -> Iterator[Any]:
    """`pytest.param(builder, id="library-name")` for every installed library."""
    for library in LIBRARIES:
        if library == "nnx" and not nnx_supported():
            continue  # flax < 0.12: bridge raises an error (tests/test_core.py)
        try:
            module = importlib.import_module(f"cases.{library}")
        except ModuleNotFoundError as error:
            # The adapter's cases are not written yet, or its library is absent.
            if error.name in (
                f"cases.{library}",
                "flax",
                "haiku",
                "equinox",
                "torch",
                "keras",
            ):
                continue
            raise
        for name, builder in module.CASES.items():
            yield pytest.param(builder, id=f"{library}-{name}")
