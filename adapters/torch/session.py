"""Catching the gradient at a PyTorch call: `TorchSession` hands the model a
view of each selected value, whose gradient `torch.autograd.grad` returns,
or passes it through `_Catch`, an identity whose backward keeps its gradient
(see `bridge.adapters.torch`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import torch

from bridge.adapter_api import BridgeRuntimeError, Call, Request, Session

from . import internals
from .arrays import TORCH_ARRAYS, inexact, jax_tree, tree_map


def _versions(tree: Any) -> list:
    """The version counter of each tensor leaf (`None` where a tensor keeps
    none: an inference-mode tensor, which is copied at once)."""
    found = []
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, torch.Tensor):
            found.append(internals.version(leaf))
    return found


def _copy(leaf: Any) -> Any:
    return leaf.clone() if isinstance(leaf, torch.Tensor) else leaf


class _Slot:
    """Where the gradient of one floating leaf of a site arrives: set by
    `_Catch`'s backward, or, for a site caught by a view, from
    `torch.autograd.grad`'s result for `view`."""

    __slots__ = ("size", "stride", "dtype", "device", "view", "grad")

    def __init__(self, value: torch.Tensor, view: torch.Tensor | None = None):
        # The value's layout, not the value: a slot must not keep every
        # site's value alive until the step ends. (A meta tensor of its
        # shape would serve too, at ten times the cost of these reads.)
        self.size, self.stride = value.shape, value.stride()
        self.dtype, self.device = value.dtype, value.device
        self.view = view
        self.grad: torch.Tensor | None = None

    def result(self) -> torch.Tensor:
        """The gradient; zeros where the loss does not depend on the value."""
        if self.grad is None:
            return torch.empty_strided(
                self.size, self.stride, dtype=self.dtype, device=self.device
            ).zero_()
        return self.grad


class _Catch(torch.autograd.Function):
    """The identity, catching the gradient of its output: the epsilon trick
    without the epsilon (no zeros, no add, no copy).

    The output is a new tensor sharing the value's memory, as an identity
    module's output would, so only the code after the site consumes it; its
    gradient is exactly what a zero epsilon added there would get. An
    in-place change of the output later (`nn.ReLU(inplace=True)`,
    `x += residual`) is a new node after this one: the gradient caught is that
    of the value before the change. `anchor`, a zero leaf that requires grad,
    makes the output require grad where the value does not yet (a site before
    any trainable parameter), so the backward pass reaches every site.
    """

    @staticmethod
    def forward(ctx, value, anchor, slot):
        ctx.slot = slot
        return value.detach()

    @staticmethod
    def backward(ctx, grad):
        ctx.slot.grad = grad
        return (grad if ctx.needs_input_grad[0] else None), None, None


class TorchSession(Session):
    """A session over torch tensors whose gradients are caught at the call.

    Each floating leaf of a selected site's value goes on as a view or
    through `_Catch` (`perturb`); `slots` keeps, per site, the pytree of
    `_Slot`s (`None` at integer leaves). `inputs_to_differentiate()` are
    what to differentiate besides the parameters.
    """

    def __init__(
        self,
        selected=None,
        epsilons=None,
        patches=None,
        with_inputs=False,
        device=None,
        copied=frozenset(),
    ):
        super().__init__(
            Request(
                selected,
                epsilons or {},
                patches or {},
                with_inputs=with_inputs,
                arrays=TORCH_ARRAYS,
            )
        )
        self.slots: dict[str, Any] = {}
        self.anchor = torch.zeros((), device=device, requires_grad=True)
        # The slots of the sites caught by a view (see `perturb`), whose
        # gradients `torch.autograd.grad` returns: `receive` files them.
        self.views: list[_Slot] = []
        # Recordings are aliases of the values the model goes on with: each
        # site's version counters at its call, to tell whether the model
        # changed the value in place afterwards; the sites in `copied` (known
        # to be changed so) are recorded as copies.
        self._copied = copied
        self._versions: dict[str, list] = {}

    def exit(self, call: Call, value: Any, perturb=None, record=True) -> Any:
        # Module calls and `bridge.tap` alike: the gradient is caught here.
        value = super().exit(call, value, perturb or self.perturb(call.name), record)
        recorded = self.recorder.activations.get(call.name)
        if recorded is not None and call.name not in self._versions:
            versions = _versions(recorded)
            if call.name in self._copied or None in versions:
                self.recorder.activations[call.name] = tree_map(_copy, recorded)
            self._versions[call.name] = versions
        return value

    def stale(self) -> set[str]:
        """The sites whose recorded value the model changed in place after
        the call (their version counters moved): recorded aliases now hold
        the changed values."""
        activations = self.recorder.activations
        return {
            name
            for name, versions in self._versions.items()
            if name not in self._copied and _versions(activations[name]) != versions
        }

    def inputs_to_differentiate(self) -> list[torch.Tensor]:
        """Besides the parameters: the anchor, through which `_Catch` is
        reached, and the views whose gradients are the sites'."""
        return [self.anchor, *(slot.view for slot in self.views)]

    def receive(self, grads: list[torch.Tensor | None]) -> None:
        """Files `torch.autograd.grad`'s results for
        `inputs_to_differentiate()`."""
        for slot, grad in zip(self.views, grads[1:], strict=True):
            slot.grad, slot.view = grad, None

    def activation_grads(self) -> dict:
        """`{site: gradient pytree}` once `torch.autograd.grad` has run."""
        return {name: tree_map(_Slot.result, tree) for name, tree in self.slots.items()}

    def perturb(self, name: str) -> Callable[[Any], Any]:
        # A value the model changes in place after the call: an in-place
        # change moves a view's gradient to the changed value, `_Catch`'s
        # stays with the value at the call.
        in_place = name in self._copied

        def catch(x: Any) -> tuple[Any, _Slot | None]:
            if not inexact(x):
                return x, None
            if x.requires_grad and x.layout == torch.strided and not in_place:
                # A view is a node of autograd's own: `torch.autograd.grad`
                # with the view among its inputs returns its gradient with no
                # Python in the backward pass (`_Catch` runs a Python forward
                # and backward per site).
                # Only the code after the call consumes the view, so the
                # gradient is the site's, as `_Catch`'s is.
                slot = _Slot(x, x.view_as(x))
                self.views.append(slot)
                return slot.view, slot
            slot = _Slot(x)
            return _Catch.apply(x, self.anchor, slot), slot

        def add(value: Any) -> Any:
            if not torch.is_grad_enabled():
                # Autograd would not see the catch: the gradient would read as
                # zero, a wrong number.
                raise BridgeRuntimeError(
                    f"Site {name!r} runs with autograd disabled (inside "
                    "`torch.no_grad()`, `torch.inference_mode()` or a reentrant "
                    "`torch.utils.checkpoint`), so the loss's gradient with respect "
                    "to it cannot be taken. Leave it out of `at` (select sites "
                    "outside that region), or use `probe.apply` for its activations."
                )
            if isinstance(value, torch.Tensor):
                caught, self.slots[name] = catch(value)
                return caught
            # The model goes on with a value of its own type (a `ModelOutput`
            # stays one): rebuilt by PyTorch's pytrees, which know its type.
            leaves, spec = internals.pytree.tree_flatten(value)
            pairs = [catch(x) for x in leaves]
            slots = [slot for _, slot in pairs]
            self.slots[name] = jax_tree(internals.pytree.tree_unflatten(slots, spec))
            return internals.pytree.tree_unflatten([x for x, _ in pairs], spec)

        return add
