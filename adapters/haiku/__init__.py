"""dm-haiku: an epsilon read from Haiku state, added by `hk.intercept_methods`.

`probe` (the adapter), `transforms` (Haiku state through `layer_stack`,
`hk.scan`, `hk.remat`), `internals` (Haiku's private API, version-checked),
`porting`, `guest`.
"""

from .probe import HaikuProbe as HaikuProbe
from .probe import probe as probe
