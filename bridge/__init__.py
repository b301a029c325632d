"""bridge: activation gradients for Flax Linen, Flax NNX, Equinox, Haiku and
PyTorch models.

One call returns the loss, the parameter gradients, the activations and the
gradients of the loss with respect to those activations, without editing the
model's code. PyTorch models go through the same protocol, so a JAX port can be
checked against its PyTorch original layer by layer (`transfer`, `compare`).
"""

from . import adapter_api as adapter_api
from . import testing as testing
from ._errors import BridgeAssertionError as BridgeAssertionError
from ._errors import BridgeError as BridgeError
from ._errors import BridgeImportError as BridgeImportError
from ._errors import BridgeNotImplementedError as BridgeNotImplementedError
from ._errors import BridgeRuntimeError as BridgeRuntimeError
from ._errors import BridgeTypeError as BridgeTypeError
from ._errors import BridgeValueError as BridgeValueError
from ._errors import BridgeWarning as BridgeWarning
from ._porting.compare import compare as compare
from ._porting.report import ComparisonReport as ComparisonReport
from ._porting.report import LogitsComparison as LogitsComparison
from ._porting.report import PairComparison as PairComparison
from ._porting.transfer import transfer as transfer
from ._probe.norms import SiteNorms as SiteNorms
from ._probe.protocol import ActivationProbe as ActivationProbe
from ._probe.registry import probe as probe
from ._probe.registry import register_adapter as register_adapter
from ._probe.result import ForwardResult as ForwardResult
from ._probe.result import ProbeResult as ProbeResult
from ._session.inside import SiteSource as SiteSource
from ._session.inside import site_sources as site_sources
from ._session.session import tap as tap

__version__ = "0.1.0"

__all__ = [
    "ActivationProbe",
    "BridgeAssertionError",
    "BridgeError",
    "BridgeImportError",
    "BridgeNotImplementedError",
    "BridgeRuntimeError",
    "BridgeTypeError",
    "BridgeValueError",
    "BridgeWarning",
    "ComparisonReport",
    "ForwardResult",
    "LogitsComparison",
    "PairComparison",
    "ProbeResult",
    "SiteNorms",
    "SiteSource",
    "__version__",
    "adapter_api",
    "compare",
    "probe",
    "register_adapter",
    "site_sources",
    "tap",
    "testing",
    "transfer",
]
