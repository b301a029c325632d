"""Discovery of a PyTorch model's sites, as bridge's discovery cache keeps it.

A PyTorch model is discovered on fake tensors (`TorchProbe._discover_afresh`),
which costs about as much Python time as a real forward pass: the discovery
is kept in bridge's one cache under the call's `signature`, and a loss
function is run on its fake outputs once (`FakeOutputs`).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from bridge.adapter_api import UNCHECKED_LOSS, BridgeTypeError

from . import internals
from .arrays import TORCH_ARRAYS, Spec, TensorLeaf

#: Loss functions whose abstract loss a discovery keeps (the latest).
_LOSSES_KEPT = 16


def signature(module: torch.nn.Module, inputs: Any) -> tuple | None:
    """What the sites of a call depend on: the inputs' structure, shapes,
    dtypes and devices (and any other input, where hashable), which modules the
    model holds and their training flags, the parameters' and buffers' shapes
    and `requires_grad`. `None` (no reuse) for an unhashable input. A change of
    a module's attributes that alters its calls (say `norm_first`) is not
    seen: make a new probe after one."""
    leaves, treedef = internals.pytree.tree_flatten(inputs)
    described = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            described.append(TensorLeaf.of(leaf))
            continue
        try:
            hash(leaf)
        except TypeError:
            return None
        described.append((type(leaf), leaf))
    return (
        str(treedef),
        tuple(described),
        tuple((id(m), m.training) for m in module.modules()),
        tuple(
            (id(p), tuple(p.shape), p.dtype, p.requires_grad)
            for p in module.parameters()
        ),
        tuple((id(b), tuple(b.shape), b.dtype) for b in module.buffers()),
    )


class FakeOutputs:
    """A model's outputs as a discovery keeps them: their structure, to run a
    loss function on fake tensors, and the abstract losses found so far.

    Args:
      spec: the outputs' structure, tensors as shapes, dtypes and devices.
    """

    def __init__(self, spec: Spec):
        self.spec = spec
        self._losses: dict[int, tuple[weakref.ref, Any]] = {}
        self._lock = threading.Lock()

    def abstract_loss(self, loss_fn: Callable[[Any], Any]) -> Any:
        """The loss's abstract value, from `loss_fn` on fake outputs: no FLOPs.
        `UNCHECKED_LOSS` where fake tensors cannot run it (the real loss is
        checked instead)."""
        # The same loss function on the same outputs: checked already. A weak
        # reference tells a new function from a dead one whose id was reused.
        known = self._losses.get(id(loss_fn))
        if known is not None and known[0]() is loss_fn:
            return known[1]
        struct = self._evaluate(loss_fn)
        with contextlib.suppress(TypeError), self._lock:  # TypeError: no weakref
            self._losses[id(loss_fn)] = (weakref.ref(loss_fn), struct)
            while len(self._losses) > _LOSSES_KEPT:
                del self._losses[next(iter(self._losses))]
        return struct

    def _evaluate(self, loss_fn: Callable[[Any], Any]) -> Any:
        try:
            with internals.fake_mode() as mode, restored_rng(None):
                loss_out = loss_fn(self.spec.fake(mode))
        except Exception:  # noqa: BLE001 - checked on the real loss instead
            return UNCHECKED_LOSS
        check_loss_is_a_tensor(loss_out)
        return TORCH_ARRAYS.abstract(loss_out)


def _cuda_devices(module: torch.nn.Module | None) -> list[int]:
    """The CUDA devices the model's parameters are on: whose random states a
    run draws from, beside the CPU's."""
    if module is None or not torch.cuda.is_initialized():
        return []  # no CUDA state to keep, and no parameter scan each step
    parameters = module.parameters()
    return sorted({p.device.index or 0 for p in parameters if p.device.type == "cuda"})


@contextlib.contextmanager
def restored_rng(module: torch.nn.Module | None) -> Iterator[None]:
    """The global RNG state (CPU, and the model's CUDA devices) as it was."""
    with torch.random.fork_rng(devices=_cuda_devices(module)):
        yield


def random_state(module: torch.nn.Module) -> tuple:
    """The global random state a run draws from (CPU, the model's CUDA
    devices), to run it again with the same draws (dropout)."""
    return (
        torch.get_rng_state(),
        {d: torch.cuda.get_rng_state(d) for d in _cuda_devices(module)},
    )


def restore_random_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    for device, device_state in cuda.items():
        torch.cuda.set_rng_state(device_state, device)


def check_loss_is_a_tensor(loss_out: Any) -> None:
    loss = loss_out[0] if isinstance(loss_out, tuple | list) else loss_out
    if not isinstance(loss, torch.Tensor):
        raise BridgeTypeError(
            "`loss_fn` receives the PyTorch model's outputs as torch tensors and "
            f"must return a scalar torch tensor; it returned a {type(loss).__name__}. "
            "Compute the loss with torch operations, e.g. "
            "`lambda y: ((y - target) ** 2).mean()` with a torch `target`."
        )
