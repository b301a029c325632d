"""`ProbeFront`: the part of every probe that is the same in every framework.

The checks before any work, discovery and its cache, selection, patch
resolution and the result in call order are written once here. What depends
on the framework is a hook, implemented by a backend: `ProbeBase`
(`bridge._probe.jax_backend`) for a model that runs in JAX, `TorchProbe`
(`bridge.adapters.torch.probe`) for a PyTorch one.

- `_prepare_inputs`, `_prepare_patch`: the user's values as the model takes
  them (a PyTorch probe converts NumPy and JAX arrays to tensors);
- `_discovery_key`, `_discover_afresh`, `_abstract_loss`: discovery and the
  loss on its outputs;
- `_arrays`: the framework's values, as the session and the patch checks see
  them;
- `_forward`, `_differentiate`: the real run of a checked `CallPlan`.

The porting contract (`bridge.adapter_api.PortableProbe`) is public here too:
`porting_side`, `discovered_sites` and `unreached_sites`, so that
`bridge.transfer` and `bridge.compare` call no private method of a probe.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from .._errors import BridgeNotImplementedError
from .._session.inside import looking_inside
from .._session.sites import JAX_ARRAYS, Arrays, Site
from . import discovery_cache
from .checks import (
    UNCHECKED_LOSS,
    check_batch_patches_in_checkpointed_loops,
    check_loss,
    check_loss_fn,
    check_patch_kind,
    resolve_patches,
)
from .result import ForwardResult, ProbeResult, in_order
from .selection import check_selection, select

if TYPE_CHECKING:
    from .._session.inside import Inside


class CallPlan(NamedTuple):
    """A checked call, ready to run: what `_forward` and `_differentiate` get.

    Attributes:
      args: the model's positional inputs, as `_prepare_inputs` made them.
      kwargs: its keyword inputs, likewise.
      discovered: every site of the call, in call order.
      chosen: the sites `at` selects, in call order.
      patches: `{site name: value or function}`, resolved and checked.
      replay: the discovery's trace, which a run may evaluate rather than
        trace the model again (`bridge._session.computation.Replay`), or
        `None`.
    """

    args: tuple
    kwargs: dict
    discovered: list[Site]
    chosen: list[Site]
    patches: dict
    replay: Any = None


class ProbeFront:
    """Implements `sites`, `value_and_grad` and `apply` over a backend's hooks."""

    vmap: bool = False

    #: Whether the model runs in JAX, so that `jax.jit` can trace the probe
    #: (`bridge.compare` runs such probes under one `jax.jit`, and hands them a
    #: PyTorch tensor given for both models as NumPy); `False` for a probe of
    #: another framework's model.
    runs_in_jax: ClassVar[bool] = True

    #: The module path of the adapter's side of `bridge.transfer` and
    #: `bridge.compare` (a `bridge.adapter_api.PortingSide`), imported on first
    #: use: a porting side builds probes, so a probe's module never imports it.
    #: `None`: the probe's library cannot be ported.
    porting_side: ClassVar[str | None] = None

    #: The framework's values, as the session and the patch checks see them.
    _arrays: Arrays = JAX_ARRAYS

    #: The functions whose assignments are sites (`bridge.probe(...,
    #: inside=...)`, `bridge._session.inside.Inside`); `None`: none.
    _inside: Inside | None = None

    def _looking_inside(self, inside: Inside | None) -> ProbeFront:
        """This probe, its assignments' sites those of `inside` (set by
        `bridge.probe`). The core carries `inside` through the probe's pytree
        and hands it to every session (`bridge._session.inside`): an
        adapter's flattening need not know of it. A new probe made from this
        one's parts (a porting side's `with_weights`) is given it like its
        other parts: `new._looking_inside(probe._inside)`."""
        return looking_inside(self, inside)

    # -- the protocol ------------------------------------------------------------

    def sites(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {
            s.name: s.value_struct
            for s in self.discovered_sites(*args, **kwargs)
            if s.differentiable
        }

    def apply(
        self,
        *args: Any,
        at: Any = None,
        patch: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> ForwardResult:
        plan = self._plan(at, patch, args, kwargs)
        outputs, activations, state, ran = self._forward(plan)
        return ForwardResult(
            outputs,
            in_order(activations, plan.chosen),
            state,
            in_order(ran, plan.chosen),
        )

    def value_and_grad(
        self,
        loss_fn: Callable[[Any], Any],
        *args: Any,
        at: Any = None,
        has_aux: bool = False,
        patch: Mapping[str, Any] | None = None,
        with_inputs: bool = False,
        **kwargs: Any,
    ) -> ProbeResult:
        check_loss_fn(loss_fn)
        plan = self._plan(at, patch, args, kwargs, loss_fn, has_aux, with_inputs)
        result = self._differentiate(loss_fn, plan, has_aux, with_inputs)
        return result._replace(
            activations=in_order(result.activations, plan.chosen),
            activation_grads=in_order(result.activation_grads, plan.chosen),
            inputs=in_order(result.inputs, plan.chosen) if with_inputs else None,
            ran=in_order(result.ran, plan.chosen),
        )

    def unwrap(self) -> tuple:
        """The positional arguments `bridge.probe` takes for this probe's
        model, carrying its weights (see `ActivationProbe.unwrap`). An adapter
        implements it; this default says that one has not."""
        raise BridgeNotImplementedError(
            f"{type(self).__qualname__} does not implement unwrap(): its adapter "
            "gives no way to take the model out of the probe. Keep the model "
            "and the variables you passed to bridge.probe instead."
        )

    # -- the porting contract (`bridge.adapter_api.PortableProbe`) ---------------

    def discovered_sites(self, *args: Any, **kwargs: Any) -> list[Site]:
        """Every site of one forward pass on these inputs, as `Site` records
        in call order (the module, the origin, the shapes): what `sites`
        summarises, and what a porting side's `layers` reads. No FLOPs."""
        args, kwargs = self._prepare_inputs(args, kwargs)
        return self._discover(args, kwargs)[0]

    def unreached_sites(
        self,
        loss_fn: Callable[[Any], Any],
        names: Sequence[str],
        *args: Any,
        **kwargs: Any,
    ) -> set[str]:
        """The sites among `names` whose value has no path to the loss, told
        from the computation's structure, never from a zero gradient. This
        default knows of none; a backend that can tell overrides it."""
        return set()

    # -- the checks and discovery, before any work ---------------------------

    def _plan(
        self,
        at: Any,
        patch: Mapping[str, Any] | None,
        args: tuple,
        kwargs: dict,
        loss_fn: Callable | None = None,
        has_aux: bool = False,
        with_inputs: bool = False,
    ) -> CallPlan:
        """Every check of a call, before any work, and what its run needs."""
        check_selection(at)
        check_patch_kind(patch)
        self._check_paths(at, patch)
        args, kwargs = self._prepare_inputs(args, kwargs)
        discovered, loss_struct, replay = self._discover(
            args, kwargs, loss_fn, with_inputs
        )
        if loss_fn is not None and loss_struct is not UNCHECKED_LOSS:
            check_loss(loss_struct, has_aux)
        # Patches first: a refused patch raises before `at=None` warns.
        patches = (
            resolve_patches(self._prepare_patch(patch), discovered, self._arrays)
            if patch
            else {}
        )
        if patches and loss_fn is not None and getattr(self, "vmap", False):
            check_batch_patches_in_checkpointed_loops(patches, discovered)
        chosen = select(at, discovered)
        return CallPlan(args, kwargs, discovered, chosen, patches, replay)

    def _discover(
        self,
        args: tuple,
        kwargs: dict,
        loss_fn: Callable | None = None,
        with_inputs: bool = False,
    ) -> tuple[list[Site], Any, Any]:
        """Every site of one forward pass, without running the model.

        Also returns the abstract loss when `loss_fn` is given, so a bad loss
        fails here, before any work, and the discovery's trace a run may
        evaluate again (`Discovery.replay`; `None` for a probe with `inside=`,
        whose runs rewrite functions a discovery's trace does not know). A
        discovery of a call with the same key (`_discovery_key`) is reused;
        the loss is then checked on the outputs' abstract structure alone
        (`_abstract_loss`). For a run that records inputs (`with_inputs`),
        the discovery marks every call's inputs too, and is kept apart.
        """
        key = self._discovery_key(args, kwargs)
        if key is not None and self._inside is not None:
            key = (key, self._inside.keys)  # more sites than the plain model's
        if key is not None and with_inputs:
            key = (key, "inputs marked")
        found = discovery_cache.CACHE.get(key)
        loss_struct = None
        if found is None:
            with discovery_cache.marking_inputs(with_inputs):
                found, loss_struct = self._discover_afresh(args, kwargs, loss_fn)
            if self._inside is not None:
                self._inside.discovered(found.sites)  # before it is kept
            discovery_cache.CACHE.put(key, found)
        if loss_fn is not None and found.outputs is not None:
            loss_struct = self._abstract_loss(found.outputs, loss_fn)
        replay = found.replay if self._inside is None else None
        return list(found.sites), loss_struct, replay

    # -- the backend's hooks -------------------------------------------------------

    def _check_paths(self, at: Any, patch: Mapping[str, Any] | None) -> None:
        """Refuse, before any work, paths in `at` or `patch` that can never be
        sites (say, inside a module of a library the adapter cannot see
        into), with the reason."""

    def _prepare_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Check the call's inputs before any work, and return them as the model
        takes them."""
        raise NotImplementedError

    def _prepare_patch(self, patch: Mapping[str, Any]) -> Mapping[str, Any]:
        """The patch values as the model's values (unchanged by default)."""
        return patch

    def _discovery_key(self, args: tuple, kwargs: dict) -> Hashable | None:
        """What this probe's sites on these inputs depend on, or `None`: discover
        afresh."""
        return None

    def _discover_afresh(
        self, args: tuple, kwargs: dict, loss_fn: Callable | None = None
    ) -> tuple[discovery_cache.Discovery, Any]:
        """The sites and the outputs' abstract structure, without FLOPs where
        the framework allows; and `loss_fn`'s abstract value where the
        outputs cannot be kept (else `None`)."""
        raise NotImplementedError

    def _abstract_loss(self, outputs: Any, loss_fn: Callable[[Any], Any]) -> Any:
        """`loss_fn`'s abstract value on the outputs a discovery kept, or
        `UNCHECKED_LOSS` where it cannot be evaluated abstractly."""
        return discovery_cache.abstract_loss(outputs, loss_fn)

    def _forward(self, plan: CallPlan) -> tuple[Any, dict, Any, dict]:
        """One forward pass: `(outputs, activations, state, ran)`, the
        activations and where the sites in branches ran in any order."""
        raise NotImplementedError

    def _differentiate(
        self,
        loss_fn: Callable[[Any], Any],
        plan: CallPlan,
        has_aux: bool,
        with_inputs: bool,
    ) -> ProbeResult:
        """One forward and backward pass, its dicts in any order."""
        raise NotImplementedError
