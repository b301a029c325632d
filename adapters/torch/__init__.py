"""PyTorch: a `torch.nn.Module` through the same protocol as the JAX libraries.

`probe` (the adapter), `session` (the gradient catch at each call), `arrays`
(torch tensors as the core's arrays), `internals` (PyTorch's private API,
version-checked), `porting`.
"""

from .probe import TorchProbe as TorchProbe
from .probe import probe as probe
