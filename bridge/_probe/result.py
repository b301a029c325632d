"""What a probe returns."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from .norms import FORWARD_COLUMNS, GRADIENT_COLUMNS, SiteNorms, site_norms

if TYPE_CHECKING:
    from .._session.sites import Site


class ProbeResult(NamedTuple):
    """The result of `ActivationProbe.value_and_grad` (a NamedTuple: a pytree).

    Attributes:
      loss: the scalar loss.
      aux: the auxiliary output of `loss_fn` with `has_aux=True`, else `None`.
      grads: d loss / d trainable parameters, in the library's own structure
        (Linen like `variables["params"]`, Haiku like `params`, Equinox as
        `eqx.filter_grad` returns, NNX an `nnx.State` of `nnx.Param`, PyTorch
        keyed like `dict(module.named_parameters())`).
      activations: `{path: value}` at each selected site, in call order.
      activation_grads: `{path: d loss / d value}`, same keys, shapes and dtypes.
      state: updated non-trainable state (Linen mutable collections, Haiku
        state, Equinox `State`, NNX non-`Param` variables, PyTorch buffers), or
        `None` where the model has none.
      inputs: with `with_inputs=True`, `{path: positional arguments}` of each
        selected call; else `None`.
      ran: `{path: bool array}` for each selected site inside a `cond`, a
        `switch` or a while loop, and no other: where the site's call ran,
        shaped like its value's leading stacked and mapped axes (`()` for one
        call, `(iterations,)` in a scan, the batch axis where `vmap=True`
        puts it). Where it did not run, its activation and gradient are zeros.
    """

    loss: Any
    aux: Any
    grads: Any
    activations: dict[str, Any]
    activation_grads: dict[str, Any]
    state: Any
    inputs: dict[str, tuple] | None
    ran: dict[str, Any]

    def norms(self) -> SiteNorms:
        """Every site reduced to two float32 norms, as one `(sites, 2)` array.

        Column 0 is the L2 norm of the site's activation, column 1 that of its
        activation gradient, each over all of the site's elements (every
        floating leaf of a pytree site together; bfloat16 upcast before
        squaring, and no overflow where the norm is a float32 number). Rows
        follow `activations`: call order, their names in `.names`, static.
        Taken inside a jitted step, the norms leave it as one buffer instead
        of one per site, and XLA frees each activation and gradient once it
        is reduced: what a gradient-flow monitor keeps, at plain's cost.

        Example:
          >>> @jax.jit
          ... def step(probe, x):
          ...     res = probe.value_and_grad(loss_fn, x)
          ...     return res.grads, res.norms()
          >>> grads, norms = step(probe, x)
          >>> dict(zip(norms.names, norms.gradient.tolist()))
        """
        names = list(self.activations)
        return site_norms(
            (self.activations, self.activation_grads), names, GRADIENT_COLUMNS
        )


class ForwardResult(NamedTuple):
    """The result of `ActivationProbe.apply`: a forward pass, no gradients.

    Attributes:
      outputs: the model's return value.
      activations: `{path: value}` at each selected site, in call order.
      state: updated non-trainable state, as in `ProbeResult.state`.
      ran: where each selected site inside a branch or a while loop ran, as
        in `ProbeResult.ran`.
    """

    outputs: Any
    activations: dict[str, Any]
    state: Any
    ran: dict[str, Any]

    def norms(self) -> SiteNorms:
        """Every site's activation reduced to its float32 L2 norm, as one
        `(sites, 1)` array (`ProbeResult.norms` without the gradient column)."""
        return site_norms((self.activations,), list(self.activations), FORWARD_COLUMNS)


def in_order(values: dict[str, Any], chosen: Sequence[Site]) -> dict[str, Any]:
    """Dicts come back from traced functions with sorted keys: restore call order."""
    return {site.name: values[site.name] for site in chosen if site.name in values}
