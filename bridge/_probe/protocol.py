"""The protocol every adapter implements."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from .result import ForwardResult, ProbeResult


@runtime_checkable
class ActivationProbe(Protocol):
    """A model of some library, ready to hand out activations and their gradients.

    Made by `bridge.probe(model, *variables)`. A probe is a pytree whose leaves
    are the model's variables, so `jax.jit(step)(probe, x)` traces them as
    arguments instead of baking them into the program.

    A site is one call of a submodule (never the root model), named like the
    module's parameters (`Encoder_0/Dense_1`, `blocks/0/linear`, `layers/0`,
    `mlp/~/linear_0`), with `.method` for methods other than `__call__` and
    `#k` for the k-th repeated call. Sites are ordered by call entry.
    """

    def sites(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Every probe-able site of one forward pass on these inputs.

        Costs no FLOPs: the model is evaluated abstractly.

        Args:
          *args: the model's positional inputs.
          **kwargs: the model's keyword inputs (and the library's apply
            keywords, such as Linen `rngs`/`mutable` or Haiku `rng`).

        Returns:
          `{path: jax.ShapeDtypeStruct or pytree of them}` in call order.
          Integer leaves of pytree values, which have no gradient, are `None`.
        """
        ...

    def value_and_grad(
        self,
        loss_fn: Callable[[Any], Any],
        *args: Any,
        at: Any = None,
        has_aux: bool = False,
        patch: Mapping[str, Any] | None = None,
        with_inputs: bool = False,
        **kwargs: Any,
    ) -> ProbeResult:
        """Loss, parameter gradients, activations and activation gradients.

        Args:
          loss_fn: `outputs -> scalar`, or `outputs -> (scalar, aux)` with
            `has_aux=True`. Close over targets.
          *args: the model's positional inputs.
          at: which sites to record: `None` (all), a glob matching paths with or
            without their `#k` suffix, a module class or tuple of classes, a
            predicate `(path, module) -> bool`, or a list of these (union).
            Unselected sites cost nothing.
          has_aux: whether `loss_fn` returns `(loss, aux)`.
          patch: `{path or glob: value or function of the original value}`; the
            patched value flows on and is what is recorded.
          with_inputs: also return each selected call's positional arguments.
          **kwargs: the model's keyword inputs and the library's apply keywords.

        Returns:
          A `bridge.ProbeResult`. Parameter gradients equal those of the
          unprobed model: probing changes no number.

        Raises:
          TypeError, ValueError: for bad input, before any FLOP is spent.
        """
        ...

    def apply(
        self,
        *args: Any,
        at: Any = None,
        patch: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> ForwardResult:
        """One forward pass recording (and optionally patching) activations.

        Args:
          *args, **kwargs: as for `value_and_grad`.
          at: which sites to record, as for `value_and_grad`.
          patch: as for `value_and_grad`.

        Returns:
          A `bridge.ForwardResult(outputs, activations, state, ran)`.
        """
        ...

    def unwrap(self) -> tuple:
        """The model out of the probe: the positional arguments
        `bridge.probe` takes, in the library's own form.

        They carry the probe's weights — after `bridge.transfer`, the ported
        ones — and `bridge.probe(*probe.unwrap())` is the same probe: the same
        sites, the same results. Keyword arguments of `bridge.probe` (`vmap`,
        `inside`) are not part of them.

        Returns:
          Flax Linen `(module, variables)`; Flax NNX `(module,)`, a new module
          (the user's is untouched); Equinox `(model,)` or `(model, state)`;
          Haiku `(transformed, params)` or `(transformed, params, state)`;
          PyTorch `(module,)`, a copy holding the probe's weights. Save them
          with the library's own serialisation.
        """
        ...
