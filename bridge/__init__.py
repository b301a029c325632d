"""bridge: activation gradients for Flax Linen, Flax NNX, Equinox and Haiku models.

One call returns the loss, the parameter gradients, the activations and the
gradients of the loss with respect to those activations, without editing the
model's code. PyTorch models go through the same protocol, so a JAX port can be
checked against its PyTorch original layer by layer (`transfer`, `compare`).
"""

from . import testing as testing
from ._compare import ComparisonReport as ComparisonReport
from ._compare import PairComparison as PairComparison
from ._compare import compare as compare
from ._porting import transfer as transfer
from ._probe import ProbeBase as ProbeBase
from ._protocol import ActivationProbe as ActivationProbe
from ._registry import probe as probe
from ._registry import register_adapter as register_adapter
from ._result import ForwardResult as ForwardResult
from ._result import ProbeResult as ProbeResult
from ._session import Session as Session
from ._session import tap as tap
from ._sites import Site as Site

__version__ = "0.1.0"

__all__ = [
    "ActivationProbe",
    "ComparisonReport",
    "ForwardResult",
    "PairComparison",
    "ProbeBase",
    "ProbeResult",
    "Session",
    "Site",
    "__version__",
    "compare",
    "probe",
    "register_adapter",
    "tap",
    "testing",
    "transfer",
]
