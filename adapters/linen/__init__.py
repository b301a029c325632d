"""Flax Linen: `Module.perturb`, inserted from outside with `nn.intercept_methods`.

`probe` (the adapter), `porting` (its side of `transfer`/`compare`), `guest`
(Linen modules called inside another library's model).
"""

from .probe import LinenProbe as LinenProbe
from .probe import probe as probe
