"""`ProbeBase`: the one implementation of `ActivationProbe`.

The front — the checks before any work, discovery and its cache, selection,
patch resolution, the result in call order — is written once here, for every
framework. What depends on the framework is a hook of `ProbeBase`, declared
below with its JAX implementation as the default:

- `_prepare_inputs`, `_prepare_patch`: the user's values as the model takes
  them (a PyTorch probe converts NumPy and JAX arrays to tensors);
- `_discovery_key`, `_discover_afresh`, `_abstract_loss`: discovery (JAX:
  abstract evaluation, keyed by structure) and the loss on its outputs;
- `_arrays`: the framework's values, as the session and the patch checks see
  them;
- `_forward`, `_differentiate`: the real run (JAX: `jax.value_and_grad`).

A JAX adapter supplies only the model's side: the trainable leaves
(`_trainable`), a call of the model reporting each submodule call to the
active `Session` (`_run`), and the pytree plumbing. A probe of another
framework (`bridge.adapters.torch`) overrides the hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax

from .._session import liveness as liveness
from .._session.inside import looking_inside
from .._session.naming import renames_of
from .._session.session import Session
from .._session.sites import JAX_ARRAYS, Arrays, Site, split_arrays, zeros_like_struct
from . import discovery_cache as discovery_cache
from .batching import (
    BATCH_AXIS,
    batch_axis_to,
    batch_sharding,
    batch_size,
    per_example_keys,
    with_batch_axis,
)
from .checks import (
    UNCHECKED_LOSS,
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
    """

    args: tuple
    kwargs: dict
    discovered: list[Site]
    chosen: list[Site]
    patches: dict


class ProbeBase:
    """Implements `sites`, `value_and_grad` and `apply` for every adapter."""

    vmap: bool = False

    #: Whether a discovery may be reused for a later call of the same
    #: structure (`bridge._probe.discovery_cache`): same probe type, pytree structure
    #: and leaf types, same abstract inputs. An adapter opts in when its pytree
    #: flattening holds everything its sites depend on (the model's static
    #: parts in the treedef, its arrays as leaves) and its sites' `origin` is
    #: plain data; off by default, so an adapter that keeps something outside
    #: its pytree is never handed another model's sites.
    reuses_discovery: bool = False

    #: Whether the model runs in JAX, so that `jax.jit` can trace the probe
    #: (`bridge.compare` runs such probes under one `jax.jit`, and hands them a
    #: PyTorch tensor given for both models as NumPy); `False` for a probe of
    #: another framework's model.
    runs_in_jax: bool = True

    #: The framework's values, as the session and the patch checks see them.
    _arrays: Arrays = JAX_ARRAYS

    #: The functions whose assignments are sites (`bridge.probe(...,
    #: inside=...)`, `bridge._session.inside.Inside`); `None`: none.
    _inside: Inside | None = None

    def _looking_inside(self, inside: Inside | None) -> ProbeBase:
        """This probe, its assignments' sites those of `inside` (set once, by
        `bridge.probe`). The core carries `inside` through the probe's pytree
        and hands it to every session (`bridge._session.inside.looking_inside`): an
        adapter need not know of it."""
        return looking_inside(self, inside)

    # -- what a JAX adapter supplies ---------------------------------------------

    def _trainable(self) -> Any:
        """The pytree differentiated for `grads`."""
        raise NotImplementedError

    def _run(
        self, trainable: Any, args: tuple, kwargs: dict, session: Session
    ) -> tuple[Any, Any]:
        """Call the model on one batch (one example with `vmap=True`).

        Must report every submodule call to `session` (`enter`/`exit`) and
        return `(outputs, state)`, `state` being `None` where there is none.
        """
        raise NotImplementedError

    def _check_call(self, args: tuple, kwargs: dict) -> None:
        """Adapter-specific validation of the call arguments, before any work."""

    def _format_grads(self, grads: Any) -> Any:
        """Parameter gradients in the library's own structure."""
        return grads

    def _check_paths(self, at: Any, patch: Mapping[str, Any] | None) -> None:
        """Adapter-specific refusal of paths in `at` or `patch` that can never
        be sites (say, inside a module of a library the adapter cannot see
        into), before any work, with the reason."""

    # -- the protocol: the front, for every framework ----------------------------

    def sites(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        args, kwargs = self._prepare_inputs(args, kwargs)
        discovered, _ = self._discover(args, kwargs)
        return {s.name: s.value_struct for s in discovered if s.differentiable}

    def apply(
        self,
        *args: Any,
        at: Any = None,
        patch: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> ForwardResult:
        plan = self._plan(at, patch, args, kwargs)
        outputs, activations, state = self._forward(plan)
        return ForwardResult(outputs, in_order(activations, plan.chosen), state)

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
        plan = self._plan(at, patch, args, kwargs, loss_fn, has_aux)
        result = self._differentiate(loss_fn, plan, has_aux, with_inputs)
        return result._replace(
            activations=in_order(result.activations, plan.chosen),
            activation_grads=in_order(result.activation_grads, plan.chosen),
            inputs=in_order(result.inputs, plan.chosen) if with_inputs else None,
        )

    def _plan(
        self,
        at: Any,
        patch: Mapping[str, Any] | None,
        args: tuple,
        kwargs: dict,
        loss_fn: Callable | None = None,
        has_aux: bool = False,
    ) -> CallPlan:
        """Every check of a call, before any work, and what its run needs."""
        check_selection(at)
        check_patch_kind(patch)
        self._check_paths(at, patch)
        args, kwargs = self._prepare_inputs(args, kwargs)
        discovered, loss_struct = self._discover(args, kwargs, loss_fn)
        if loss_fn is not None and loss_struct is not UNCHECKED_LOSS:
            check_loss(loss_struct, has_aux)
        chosen = select(at, discovered)
        patches = (
            resolve_patches(self._prepare_patch(patch), discovered, self._arrays)
            if patch
            else {}
        )
        return CallPlan(args, kwargs, discovered, chosen, patches)

    def _discover(
        self, args: tuple, kwargs: dict, loss_fn: Callable | None = None
    ) -> tuple[list[Site], Any]:
        """Every site of one forward pass, without running the model.

        Also returns the abstract loss when `loss_fn` is given, so a bad loss
        fails here, before any work. A discovery of a call with the same key
        (`_discovery_key`) is reused; the loss is then checked on the outputs'
        abstract structure alone (`_abstract_loss`).
        """
        key = self._discovery_key(args, kwargs)
        if key is not None and self._inside is not None:
            key = (key, self._inside.keys)  # more sites than the plain model's
        found = discovery_cache.CACHE.get(key)
        loss_struct = None
        if found is None:
            found, loss_struct = self._discover_afresh(args, kwargs, loss_fn)
            if self._inside is not None:
                self._inside.discovered(found.sites)  # before it is kept
            discovery_cache.CACHE.put(key, found)
        if loss_fn is not None and found.outputs is not None:
            loss_struct = self._abstract_loss(found.outputs, loss_fn)
        return list(found.sites), loss_struct

    # -- the framework's steps: JAX by default -----------------------------------

    def _prepare_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Check the call's inputs before any work, and return them as the model
        takes them (a JAX model: unchanged)."""
        self._check_call(args, kwargs)
        if self.vmap:
            batch_size(args)
        return args, kwargs

    def _prepare_patch(self, patch: Mapping[str, Any]) -> Mapping[str, Any]:
        """The patch values as the model's values (a JAX model: unchanged)."""
        return patch

    def _discovery_key(self, args: tuple, kwargs: dict) -> Hashable | None:
        """What this probe's sites on these inputs depend on, or `None`: discover
        afresh. An adapter overrides it to add what its sites depend on beyond
        its pytree, or to return `None` where a discovery must not be reused."""
        if not self.reuses_discovery:
            return None
        return discovery_cache.structure_key(self, args, kwargs)

    def _discover_afresh(
        self, args: tuple, kwargs: dict, loss_fn: Callable | None = None
    ) -> tuple[discovery_cache.Discovery, Any]:
        """One abstract trace of the instrumented model to a jaxpr: the sites
        and the outputs' abstract structure; no FLOPs. A call seen only in a
        trace JAX discarded is no site, and a call whose value reaches no
        output is marked `dead` (`bridge._session.liveness`).

        The inputs' array leaves are traced, never closed over, so no operation
        on them can run eagerly. Where an output cannot leave the trace as
        plain data, `loss_fn` is evaluated inside it and its abstract value
        returned too (else `None`).
        """
        dynamic, rebuild = split_arrays((args, kwargs))
        sessions: list[Session] = []
        outputs_found: list[Any] = []

        def trace(probe, dynamic):
            args, kwargs = rebuild(dynamic)
            outputs, state, _, _ = probe._call(
                probe._trainable(), args, kwargs, sessions=sessions
            )
            outputs_found.append(discovery_cache.abstract_outputs(outputs))
            # What the model computes for: its outputs and its new state, the
            # ends against which a call is live or dead (`bridge._session.liveness`).
            computed = [
                leaf
                for leaf in jax.tree.leaves((outputs, state))
                if isinstance(leaf, jax.Array)
            ]
            if outputs_found[-1] is None and loss_fn is not None:
                return computed, loss_fn(outputs)
            return computed, None

        jaxpr, (_, loss_struct) = jax.make_jaxpr(trace, return_shape=True)(
            self, dynamic
        )
        (session,) = sessions
        discovered = liveness.in_the_computation(session.discovered(), jaxpr)
        if self.vmap:
            batch, spec = batch_size(args), batch_sharding(args)
            discovered = [with_batch_axis(site, batch, spec) for site in discovered]
        found = discovery_cache.Discovery(tuple(discovered), outputs_found[-1])
        return found, loss_struct

    def _abstract_loss(self, outputs: Any, loss_fn: Callable[[Any], Any]) -> Any:
        """`loss_fn`'s abstract value on the outputs a discovery kept, or
        `UNCHECKED_LOSS` where it cannot be evaluated abstractly."""
        return discovery_cache.abstract_loss(outputs, loss_fn)

    def _forward(self, plan: CallPlan) -> tuple[Any, dict, Any]:
        """One forward pass: `(outputs, activations, state)`, the activations
        in any order."""
        outputs, state, activations, _ = self._call(
            self._trainable(),
            plan.args,
            plan.kwargs,
            chosen=plan.chosen,
            patches=plan.patches,
            discovered=plan.discovered,
        )
        return outputs, activations, state

    def _differentiate(
        self,
        loss_fn: Callable[[Any], Any],
        plan: CallPlan,
        has_aux: bool,
        with_inputs: bool,
    ) -> ProbeResult:
        """One forward and backward pass, its dicts in any order: the gradients
        with respect to the trainable leaves and to a zero epsilon added at
        each chosen site, by `jax.value_and_grad`."""
        epsilons = {
            site.name: zeros_like_struct(site.value_struct) for site in plan.chosen
        }

        def objective(trainable, epsilons):
            outputs, state, activations, inputs = self._call(
                trainable,
                plan.args,
                plan.kwargs,
                chosen=plan.chosen,
                epsilons=epsilons,
                patches=plan.patches,
                with_inputs=with_inputs,
                discovered=plan.discovered,
            )
            loss_out = loss_fn(outputs)
            loss, aux = loss_out if has_aux else (loss_out, None)
            return loss, (aux, activations, inputs, state)

        (loss, (aux, activations, inputs, state)), (grads, activation_grads) = (
            jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)(
                self._trainable(), epsilons
            )
        )
        return ProbeResult(
            loss=loss,
            aux=aux,
            grads=self._format_grads(grads),
            activations=activations,
            activation_grads=activation_grads,
            state=state,
            inputs=inputs,
        )

    # -- the JAX machinery -------------------------------------------------------

    def _call(
        self,
        trainable: Any,
        args: tuple,
        kwargs: dict,
        *,
        chosen: list[Site] | None = None,
        epsilons: Mapping[str, Any] | None = None,
        patches: Mapping[str, Any] | None = None,
        with_inputs: bool = False,
        discovered: Sequence[Site] = (),
        sessions: list[Session] | None = None,
    ) -> tuple[Any, Any, dict, dict]:
        """Run the model under a session: `(outputs, state, activations, inputs)`.

        `chosen=None` discovers (and `sessions` collects the session). The
        session knows the `Site` of every patched site too (`Session.patched`):
        an adapter carrying a patch value into a lifted transform needs its
        stacking and origin. With `vmap=True` the model runs under the
        probe's own `jax.vmap`, and epsilons and patch values, which have the
        batch axis first (after a stacked site's iteration axes), are mapped
        with the inputs, and so are the random keys among the keywords, one
        per example (`per_example_keys`).
        """
        selected = None if chosen is None else {site.name: site for site in chosen}
        epsilons = dict(epsilons or {})
        patches = patches or {}
        patch_values = {k: v for k, v in patches.items() if not callable(v)}
        patch_functions = {k: v for k, v in patches.items() if callable(v)}
        patched = {site.name: site for site in discovered if site.name in patches}
        renames = renames_of(discovered)

        def single(dynamic_args, keys, epsilons, patch_values):
            call_kwargs = rebuild_kwargs(keys)
            session = Session(
                selected,
                epsilons,
                {**patch_values, **patch_functions},
                with_inputs,
                BATCH_AXIS if self.vmap else None,
                patched=patched,
                renames=renames,
            )
            if sessions is not None:
                sessions.append(session)
            with session.active():
                outputs, state = self._run(
                    trainable, rebuild_args(dynamic_args), call_kwargs, session
                )
            session.recorder.check_reached()
            return outputs, state, session.activations, session.inputs

        dynamic_args, rebuild_args = split_arrays(args)
        if not self.vmap:
            rebuild_kwargs = lambda keys: kwargs
            return single(dynamic_args, [], epsilons, patch_values)
        # Each example draws its own randomness, as in a batched model.
        keys, rebuild_kwargs = per_example_keys(kwargs, batch_size(args))
        stacked = {site.name: site.stacked for site in discovered}
        outputs, state, activations, inputs = jax.vmap(
            single,
            in_axes=(
                0,
                0,
                {name: stacked[name] for name in epsilons},
                {name: stacked[name] for name in patch_values},
            ),
            out_axes=(0, None, 0, 0),
            axis_name=BATCH_AXIS,
        )(dynamic_args, keys, epsilons, patch_values)
        return (
            outputs,
            state,
            batch_axis_to(activations, stacked),
            batch_axis_to(inputs, stacked),
        )

    def unwrap(self) -> tuple:
        """The positional arguments `bridge.probe` takes for this probe's
        model, carrying its weights (see `ActivationProbe.unwrap`). An adapter
        implements it; this default says that one has not."""
        from .._errors import BridgeNotImplementedError

        raise BridgeNotImplementedError(
            f"{type(self).__qualname__} does not implement unwrap(): its adapter "
            "gives no way to take the model out of the probe. Keep the model "
            "and the variables you passed to bridge.probe instead."
        )
