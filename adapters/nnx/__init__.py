"""Flax NNX: graph surgery on a copy of the module, made inside the traced call.

`probe` (the adapter), `transforms` (sites inside NNX's lifted transforms),
`internals` (NNX's private API, version-checked), `porting`, `guest`.
"""

from .probe import NnxProbe as NnxProbe
from .probe import probe as probe
