"""The PyTorch internals the PyTorch adapter relies on: all of them, and only here.

- `torch._subclasses.fake_tensor.FakeTensorMode`: sites are discovered on fake
  tensors, with no FLOPs. `torch.func` and `torch.export` trace with it too,
  but expose no public handle on the mode itself.
- `torch.utils._pytree`: outputs and site values in any container torch's own
  transforms know (`ModelOutput`, named tuples), as `torch.func` flattens
  them. The public `torch.utils.pytree` is newer than some releases.
- `nn.Module`'s instance containers (`_parameters`, `_buffers`, `_modules`,
  the hook dicts): `shell` copies a module tree shallowly with containers of
  its own, so hooks and swapped tensors never touch the user's module.
  `copy.copy` shares the containers and `copy.deepcopy` copies the weights.
  `forward_pre_hooks` reads a module's forward pre-hooks (a weight norm's),
  `non_persistent_buffers` the buffers `state_dict` leaves out.
- `Tensor._version`, a tensor's version counter (`version`): a value the
  model changes in place after a call is caught another way.
- `nn.MultiheadAttention._qkv_same_embed_dim`: whether its query, key and
  value projections are one `in_proj_weight` (`qkv_same_embed_dim`).
- the private base classes of PyTorch's layers, `porting`'s table keys:
  `_ConvNd`, `_ConvTransposeNd`, `_BatchNorm` (`ConvBase`,
  `ConvTransposeBase`, `BatchNormBase`), and the parametrization of
  `torch.nn.utils.parametrizations.weight_norm` (`is_weight_norm`).

At import this module checks that each exists and raises an error naming the
supported versions where one does not: an unsupported PyTorch fails at
`bridge.probe`, never with a hook left on the user's module.
"""

from __future__ import annotations

import copy
import inspect
import types
from collections import OrderedDict
from typing import Any

import torch

from bridge.adapter_api import BridgeTypeError, unsupported


def _missing() -> list[str]:
    missing = []
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError:
        missing.append("torch._subclasses.fake_tensor.FakeTensorMode")
    else:
        parameters = inspect.signature(FakeTensorMode.__init__).parameters
        if "allow_non_fake_inputs" not in parameters:
            missing.append("FakeTensorMode(allow_non_fake_inputs=...)")
    try:
        from torch.utils import _pytree
    except ImportError:
        missing.append("torch.utils._pytree")
    else:
        if not hasattr(_pytree, "tree_flatten") or not hasattr(
            _pytree, "tree_unflatten"
        ):
            missing.append("torch.utils._pytree.tree_flatten / tree_unflatten")
    if not isinstance(vars(torch.nn.Module()).get("_modules"), dict):
        missing.append("nn.Module()._modules")
    return missing


_MISSING = _missing()
if _MISSING:
    raise unsupported("torch", "PyTorch", _MISSING)

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402 (checked)
from torch.nn.modules.batchnorm import _BatchNorm  # noqa: E402
from torch.nn.modules.conv import _ConvNd, _ConvTransposeNd  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402, F401 (re-exported)

#: Every convolution, every transposed convolution, every batch norm.
ConvBase = _ConvNd
ConvTransposeBase = _ConvTransposeNd
BatchNormBase = _BatchNorm


def fake_mode() -> Any:
    return FakeTensorMode(allow_non_fake_inputs=True)


#: The containers `nn.Module.__init__` gives every module: parameters,
#: buffers, submodules, hooks. A shell has its own copy of each.
_MODULE_CONTAINERS = tuple(
    name
    for name, value in vars(torch.nn.Module()).items()
    if isinstance(value, dict | set)
)


def _copied(container: Any) -> Any:
    """A shallow copy of a module's container. The hooks' `OrderedDict`s are
    copied by their constructor: `copy.copy` takes the pickling path for
    them, recomputing the type's slot names at every call (a builtin type
    cannot cache them), ten times slower, for a dozen containers a module."""
    if type(container) in (dict, OrderedDict, set):
        return type(container)(container)
    return copy.copy(container)


def shell(module: torch.nn.Module, memo: dict | None = None) -> torch.nn.Module:
    """A copy of the module tree that shares no container with it.

    Each module is copied shallowly, and each container `nn.Module` keeps its
    state in (parameters, buffers, submodules, hooks) is copied, so
    `functional_call` can swap tensors in and hooks can be added on the shell
    without touching the user's module; submodules are shells too (a shared
    one once). Other attributes are the module's own, as in a plain call.
    """
    memo = {} if memo is None else memo
    if id(module) in memo:
        return memo[id(module)]
    copied = memo[id(module)] = object.__new__(type(module))
    copied.__dict__.update(module.__dict__)
    for name in _MODULE_CONTAINERS:
        if name in module.__dict__:
            copied.__dict__[name] = _copied(module.__dict__[name])
    copied.__dict__["_modules"] = type(module._modules)(
        (name, None if child is None else shell(child, memo))
        for name, child in module._modules.items()
    )
    _rebind_forward(module, copied)
    return copied


def _rebind_forward(module: torch.nn.Module, copied: torch.nn.Module) -> None:
    """A `forward` set on the module itself runs on the shell too: a method
    bound to the module is bound to the shell instead. Any other callable
    object (nnsight's `NNsight` puts one on every module it wraps) would run
    the user's module, not the shell: no site would be seen and every
    gradient would be zero, so it is refused."""
    forward = module.__dict__.get("forward")
    if forward is None or isinstance(forward, types.FunctionType):
        return
    if isinstance(forward, types.MethodType) and forward.__self__ is module:
        copied.__dict__["forward"] = types.MethodType(forward.__func__, copied)
        return
    raise BridgeTypeError(
        f"The {type(module).__qualname__} module's `forward` is replaced on the "
        f"module itself by a {type(forward).__qualname__} (a wrapper such as "
        "nnsight's NNsight does this), which calls the module directly, so "
        "bridge cannot see its calls or its parameters' gradients. Probe a "
        "copy.deepcopy of the model made before wrapping it."
    )


def forward_pre_hooks(module: torch.nn.Module) -> list[Any]:
    """The forward pre-hooks registered on `module`, in order."""
    return list(module._forward_pre_hooks.values())


def non_persistent_buffers(module: torch.nn.Module) -> set[str]:
    """The names of `module`'s own buffers registered with `persistent=False`."""
    return getattr(module, "_non_persistent_buffers_set", set())


def version(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter, bumped by each in-place change; `None`
    where it keeps none (an inference-mode tensor)."""
    try:
        return tensor._version
    except RuntimeError:
        return None


def qkv_same_embed_dim(attention: torch.nn.MultiheadAttention) -> bool:
    """Whether the attention's query, key and value projections are one
    `in_proj_weight` (else `q_proj_weight`, `k_proj_weight`, `v_proj_weight`)."""
    return attention._qkv_same_embed_dim


def is_weight_norm(parametrization: Any) -> bool:
    """Whether a parametrization is `torch.nn.utils.parametrizations.weight_norm`'s."""
    from torch.nn.utils.parametrizations import _WeightNorm

    return isinstance(parametrization, _WeightNorm)
