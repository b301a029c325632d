"""PyTorch: a `torch.nn.Module` through the same protocol as the JAX libraries.

`probe`, `session` (the gradient catch at each call), `arrays` (torch
tensors as the core's arrays), `discovery` (discovery on fake tensors),
`internals` (version-checked), `porting` (with `converters`, one per layer
kind, `attention`, `nn.MultiheadAttention` as four dense layers, and
`layouts`, tensors in torch's or the canonical layout): each name as
`bridge.adapters` says.
"""

from .probe import TorchProbe as TorchProbe
from .probe import probe as probe
