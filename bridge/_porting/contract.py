"""The porting contract: what `bridge.transfer` and `bridge.compare` need of
a probe and of its adapter, as typed protocols (exported by
`bridge.adapter_api`). Porting calls nothing else of a probe.

A probe that can be ported (`PortableProbe`) is an `ActivationProbe` that
also lists its sites as `Site` records, tells which sites a loss cannot
reach, says whether it runs in JAX, and names its adapter's `PortingSide`:
the module that knows the library's parameterised layers.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from .._errors import BridgeTypeError
from .._probe.protocol import ActivationProbe

if TYPE_CHECKING:
    from .._session.sites import Site
    from .layer import Layer


class PortingSide(Protocol):
    """An adapter's side of porting: a module of two functions (and optional
    ones), named by its probe class's `porting_side`.

    - `layers(probe, sites) -> list[Layer]`: each call of a parameterised
      module among `sites` (`PortableProbe.discovered_sites`), in call order,
      its weights in the canonical layout (`bridge._porting.transfer`);
    - `with_weights(probe, [(Layer, {name: canonical array})]) -> probe`: a
      new probe of the model with those weights, the given probe untouched;
    - optionally `in_float64(probe) -> probe`: a float64 copy of the model,
      the library's own way (`bridge.compare(..., dtype="float64")`); without
      it, a JAX probe's floating leaves are cast.

    A library whose values are not JAX or NumPy arrays (PyTorch's tensors)
    says how to read them; porting asks the side whose model a value belongs
    to (its inputs, outputs and logits), and for the inputs given to a JAX
    model, the other side too. Each answers `None` for a value that is not
    its library's; without them, a side's values are read as JAX's:
    - optionally `to_host(value) -> np.ndarray | None`: one of the library's
      arrays as a NumPy array on the host, in its own dtype (bfloat16 as
      `jnp.bfloat16`);
    - optionally `numpy_dtype(dtype) -> np.dtype | None`: one of the
      library's dtypes (or its name, `"torch.float64"`) as NumPy's;
    - optionally `to_float64(value) -> value | None`: one of the library's
      arrays as float64, still the library's (other dtypes as they are), for
      `dtype="float64"`.
    """

    def layers(self, probe: Any, sites: Sequence[Site]) -> list[Layer]: ...

    def with_weights(
        self, probe: Any, updates: Sequence[tuple[Layer, Mapping[str, Any]]]
    ) -> Any: ...


@runtime_checkable
class PortableProbe(ActivationProbe, Protocol):
    """A probe `bridge.transfer` and `bridge.compare` can port
    (`bridge.adapter_api.ProbeFront` implements it; an adapter names its
    `porting_side`)."""

    #: Whether the model runs in JAX (`compare` runs it under `jax.jit`).
    runs_in_jax: ClassVar[bool]
    #: The module path of the adapter's `PortingSide`, imported on first use.
    porting_side: ClassVar[str | None]

    def discovered_sites(self, *args: Any, **kwargs: Any) -> list[Site]:
        """Every site of one forward pass, as `Site` records, in call order."""
        ...

    def unreached_sites(
        self,
        loss_fn: Callable[[Any], Any],
        names: Sequence[str],
        *args: Any,
        **kwargs: Any,
    ) -> set[str]:
        """The sites among `names` whose value has no path to the loss."""
        ...


#: The libraries `transfer` and `compare` know, for error messages.
_KNOWN = "Flax Linen, Flax NNX, Equinox, Haiku, Keras 3 and PyTorch"


def porting_side(probe: Any, argument: str) -> PortingSide:
    """The `PortingSide` of `probe`'s adapter, imported on first use; raises,
    naming `argument`, for a probe that cannot be ported."""
    name = getattr(type(probe), "porting_side", None)
    if not isinstance(probe, PortableProbe) or not isinstance(name, str):
        raise BridgeTypeError(
            f"`{argument}` is a {type(probe).__name__}, whose library bridge cannot "
            f"port: transfer and compare know probes of {_KNOWN} models, made with "
            "bridge.probe(model, ...). A third-party adapter supports porting by "
            "subclassing bridge.adapter_api.ProbeBase (or ProbeFront) and naming, "
            "in its class's `porting_side` attribute, a module with "
            "`layers(probe, sites)` and `with_weights(probe, updates)` "
            "(bridge.adapter_api.PortingSide)."
        )
    return importlib.import_module(name)
