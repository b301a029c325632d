"""`ProbeBase`: the JAX backend of `ProbeFront`.

A JAX adapter supplies only the model's side: the trainable leaves
(`_trainable`) and a call of the model reporting each submodule call to the
active `Session` (`_run`). This backend does the rest: discovery is one
abstract trace to a jaxpr (no FLOPs; `bridge._session.liveness` drops the
calls of discarded traces and marks dead ones), and the real run is one
`jax.value_and_grad` with respect to the trainable leaves and a zero epsilon
at each chosen site: of discovery's jaxpr evaluated again with the epsilons
and patches planted at its markers where it serves every site asked for
(`replay_model`, `bridge._session.computation.Replay`: the model's Python
runs once per call structure), else of the model run under a session
(`call_model`: under the probe's own `jax.vmap` where `vmap=True`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax

from .._session import backward, computation, liveness
from .._session.naming import renames_of
from .._session.session import Request, Session
from .._session.sites import (
    Site,
    abstract_array,
    split_arrays,
    without_axis,
    zeros_like_struct,
)
from . import discovery_cache, reverse_mode
from .batching import (
    BATCH_AXIS,
    batch_axis_to,
    batch_sharding,
    batch_size,
    mapped_call,
    per_example_keys,
    with_batch_axis,
    with_leading_axis,
)
from .checks import UNCHECKED_LOSS
from .front import CallPlan, ProbeFront
from .result import ProbeResult


class ProbeBase(ProbeFront):
    """A probe of a model that runs in JAX: `sites`, `value_and_grad` and
    `apply` from the adapter's `_trainable` and `_run`."""

    #: Whether a discovery may be reused for a later call of the same
    #: structure (`bridge._probe.discovery_cache`): same probe type, pytree
    #: structure and leaf types, same abstract inputs. An adapter opts in when
    #: its pytree flattening holds everything its sites depend on (the model's
    #: static parts in the treedef, its arrays as leaves) and its sites'
    #: `origin` is plain data; off by default, so an adapter that keeps
    #: something outside its pytree is never handed another model's sites.
    reuses_discovery: bool = False

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

    # -- the front's hooks, in JAX -------------------------------------------------

    def _prepare_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._check_call(args, kwargs)
        if self.vmap:
            batch_size(args)
        return args, kwargs

    def _discovery_key(self, args: tuple, kwargs: dict) -> Hashable | None:
        """The structure `jax.jit` would key on, where the adapter opts in
        (`reuses_discovery`); an adapter overrides it to add what its sites
        depend on beyond its pytree, or to return `None`."""
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
        returned too (else `None`; `UNCHECKED_LOSS` with `vmap=True`, whose
        trace holds one example).
        """
        # With `vmap=True` discovery traces one example (the probe's batch
        # axis named in the trace's axis environment, for a model's
        # collectives over it) and a run maps that trace over the batch: a
        # branch on a per-example predicate stays a `cond` in the jaxpr (under
        # the probe's vmap JAX computes both branches and selects), so the
        # computation knows where each example's branch ran.
        mapped: list[bool] | None = None
        axis_env = None
        if self.vmap:
            kwargs, mapped = mapped_call(args, kwargs)
            batch = batch_size(args)
            axis_env = [(BATCH_AXIS, batch)]
        dynamic, rebuild = split_arrays((args, kwargs))
        traced_dynamic = [
            without_axis(abstract_array(leaf), 0) if mapped and mapped[i] else leaf
            for i, leaf in enumerate(dynamic)
        ]
        sessions: list[Session] = []
        outputs_found: list[Any] = []
        # `(treedef, leaves)` of the model's `(outputs, state)`, `None` where
        # an array leaf goes: what a later run's `computation.replay` rebuilds;
        # and how many of those arrays are the outputs'.
        computed_as: list[tuple[Any, list] | None] = []
        output_arrays: list[int] = []

        def trace(probe, trainable, dynamic):
            args, kwargs = rebuild(dynamic)
            outputs, state, _, _, _ = call_model(
                probe,
                trainable,
                args,
                kwargs,
                with_inputs=discovery_cache.marks_inputs(),
                sessions=sessions,
                one_example=True,
            )
            found = discovery_cache.abstract_outputs(outputs)
            if found is not None and self.vmap:
                found = (found[0], [with_leading_axis(v, batch) for v in found[1]])
            outputs_found.append(found)
            # What the model computes for: its outputs and its new state, the
            # ends against which a call is live or dead.
            leaves, treedef = jax.tree.flatten((outputs, state))
            computed = [leaf for leaf in leaves if isinstance(leaf, jax.Array)]
            kept = [None if isinstance(leaf, jax.Array) else leaf for leaf in leaves]
            plain = all(discovery_cache.is_plain(leaf) for leaf in kept)
            computed_as.append((treedef, kept) if plain else None)
            output_arrays.append(
                sum(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(outputs))
            )
            if outputs_found[-1] is None and loss_fn is not None and not self.vmap:
                return computed, loss_fn(outputs)
            return computed, None

        with computation.fresh_traces():
            jaxpr, (_, loss_struct) = jax.make_jaxpr(
                trace, return_shape=True, axis_env=axis_env
            )(self, self._trainable(), traced_dynamic)
        if outputs_found[-1] is None and loss_fn is not None and self.vmap:
            # The loss takes the whole batch's outputs, which one example's
            # trace does not hold.
            loss_struct = UNCHECKED_LOSS
        (session,) = sessions
        discovered = liveness.in_the_computation(session.discovered(), jaxpr)
        discovered = computation.located(
            discovered, jaxpr, session.recorder.traced_apart
        )
        replay = None
        if outputs_found[-1] is not None and computed_as[-1] is not None:
            vmapped = None
            if mapped is not None:
                fixed = len(jax.tree.leaves((self, self._trainable())))
                computed = len(jaxpr.jaxpr.outvars)
                vmapped = computation.ProbeVmap(
                    BATCH_AXIS,
                    inputs=(*[None] * fixed, *[0 if m else None for m in mapped]),
                    outputs=tuple(
                        0 if i < output_arrays[-1] else None for i in range(computed)
                    ),
                )
            replay = computation.Replay.of_discovery(
                jaxpr,
                computed_as[-1],
                discovered,
                vmapped=vmapped,
                input_structures=session.recorder.input_structures,
            )
        if self.vmap:
            spec = batch_sharding(args)
            discovered = [with_batch_axis(site, batch, spec) for site in discovered]
        found = discovery_cache.Discovery(tuple(discovered), outputs_found[-1], replay)
        return found, loss_struct

    def _forward(self, plan: CallPlan) -> tuple[Any, dict, Any, dict]:
        if _replays(plan, with_inputs=False):
            run = replay_model(self, self._trainable(), plan, {})
        else:
            run = call_model(
                self,
                self._trainable(),
                plan.args,
                plan.kwargs,
                chosen=plan.chosen,
                patches=plan.patches,
                discovered=plan.discovered,
            )
        outputs, state, activations, _, ran = run
        return outputs, activations, state, ran

    def _differentiate(
        self,
        loss_fn: Callable[[Any], Any],
        plan: CallPlan,
        has_aux: bool,
        with_inputs: bool,
    ) -> ProbeResult:
        """The gradients with respect to the trainable leaves and to a zero
        epsilon added at each chosen site, by one `jax.value_and_grad`."""
        epsilons = _zero_epsilons(plan.chosen)
        # One Python trace per call structure: where discovery's trace serves
        # every site asked for, the run evaluates it (`computation.Replay`).
        replays = _replays(plan, with_inputs)
        # Else the sites inside branches and loops (and Equinox's scanned
        # stacks) record through the step's own backward pass: their
        # recorders are differentiated beside the epsilons, and their
        # gradients are the values (`backward.record`).
        recorded = [] if replays else backward.recorded_backward(plan.chosen)
        recorders = backward.recorders(recorded, with_inputs, self.vmap)

        def objective(trainable, epsilons, recorders):
            if replays:
                run = replay_model(self, trainable, plan, epsilons, with_inputs)
            else:
                run = call_model(
                    self,
                    trainable,
                    plan.args,
                    plan.kwargs,
                    chosen=plan.chosen,
                    epsilons=epsilons,
                    patches=plan.patches,
                    with_inputs=with_inputs,
                    discovered=plan.discovered,
                    recorders=recorders or None,
                )
            outputs, state, activations, inputs, ran = run
            loss_out = loss_fn(outputs)
            loss, aux = loss_out if has_aux else (loss_out, None)
            if recorders:
                # A site whose value reaches an output but not the loss is
                # recorded all the same, as `apply` records it.
                loss = backward.reaching_every_output(loss, (outputs, state))
            return loss, (aux, activations, inputs, state, ran)

        try:
            (
                (loss, (aux, activations, inputs, state, ran)),
                (grads, activation_grads, values),
            ) = jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True)(
                self._trainable(), epsilons, recorders
            )
        except ValueError as error:
            # JAX's refusal to go back through a while loop, in bridge's words.
            refusal = reverse_mode.through_a_while_loop(error)
            if refusal is None:
                raise
            raise refusal from error
        backward.adopt(values, recorded, with_inputs, activations, inputs, ran)
        return ProbeResult(
            loss=loss,
            aux=aux,
            grads=self._format_grads(grads),
            activations=activations,
            activation_grads=activation_grads,
            state=state,
            inputs=inputs,
            ran=ran,
        )

    def unreached_sites(
        self,
        loss_fn: Callable[[Any], Any],
        names: Sequence[str],
        *args: Any,
        **kwargs: Any,
    ) -> set[str]:
        """The loss as a function of a zero epsilon at each site, traced
        (`jax.make_jaxpr`: no FLOPs); a site is dead where the loss's jaxpr,
        dead code eliminated, does not use its epsilon. (Discovery's own
        `Site.dead` judges against the model's outputs, not a loss: a
        pooler's output is live there and dead for a loss on the logits.)"""
        plan = self._plan(list(names), None, args, kwargs, loss_fn)
        epsilons = _zero_epsilons(plan.chosen)
        dynamic, rebuild = split_arrays((plan.args, plan.kwargs))

        def loss_of(epsilons, trainable, dynamic):
            call_args, call_kwargs = rebuild(dynamic)
            outputs = call_model(
                self,
                trainable,
                call_args,
                call_kwargs,
                chosen=plan.chosen,
                epsilons=epsilons,
                discovered=plan.discovered,
            )[0]
            return loss_fn(outputs)

        closed = jax.make_jaxpr(loss_of)(epsilons, self._trainable(), dynamic)
        used = liveness.used_inputs(closed.jaxpr)
        flat = jax.tree_util.tree_flatten_with_path(epsilons)[0]
        reached = {
            path[0].key for (path, _), use in zip(flat, used, strict=False) if use
        }
        return {path[0].key for path, _ in flat} - reached


def call_model(
    probe: ProbeBase,
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
    recorders: Mapping[str, Any] | None = None,
    one_example: bool = False,
) -> tuple[Any, Any, dict, dict, dict]:
    """Run `probe`'s model under a session: `(outputs, state, activations,
    inputs, ran)`.

    `chosen=None` discovers (and `sessions` collects the session). With
    `vmap=True` the model runs under the probe's own `jax.vmap`, and
    epsilons and patch values, which have the batch axis first (after a
    stacked site's iteration axes), are mapped with the inputs, and so are
    the random keys among the keywords, one per example
    (`per_example_keys`).

    `recorders`: the sites recorded through the caller's backward pass
    (`backward.recorded_backward`: inside branches and loops, and the
    adapters' own routes through their transforms), `{name: recorders}` as
    `backward.recorders` makes them, which the caller differentiates; their
    gradients are the values (`backward.adopt`). Else such sites are
    recorded through a `jax.vjp` of the model of their own
    (`backward.run_recording`, or the adapter's).

    `one_example`: with `vmap=True`, `args` and `kwargs` are one example's
    (discovery's trace, which a run maps over the batch): the model runs on
    them under the session, without the probe's `jax.vmap`.
    """
    patches = patches or {}
    # The sites the computation routes: the run marks them, and its jaxpr
    # acts on them (`bridge._session.computation`).
    planted = frozenset(
        site.name
        for site in [*(chosen or ()), *discovered]
        if (site in (chosen or ()) or site.name in patches)
        and site.computed is not None
    )
    request = Request(
        selected=None if chosen is None else {site.name: site for site in chosen},
        epsilons=dict(epsilons or {}),
        patches=dict(patches),
        patched={site.name: site for site in discovered if site.name in patches},
        with_inputs=with_inputs,
        batch_axis=BATCH_AXIS if probe.vmap else None,
        renames=renames_of(discovered),
        planted=planted,
    )

    # The sites recorded through the backward pass: where one is inside
    # branches and loops, one `jax.vjp` of the model records them all, the
    # adapters' own routes included (which then take their recorders from
    # the run as from a differentiated step); else an adapter's route
    # records its own.
    recorded_backward = backward.recorded_backward(chosen or ())
    if not any(isinstance(s.origin, backward.InControlFlow) for s in recorded_backward):
        recorded_backward = []

    def run(
        trainable,
        dynamic_args,
        call_kwargs,
        epsilons,
        patch_values,
        recorders,
    ):
        held: list[Session] = []

        def traced():
            session = Session(request.varied(epsilons, patch_values, recorders))
            held.append(session)
            if sessions is not None:
                sessions.append(session)
            with session.active():
                outputs, state = probe._run(
                    trainable, rebuild_args(dynamic_args), call_kwargs, session
                )
            session.check_reached()
            return outputs, state, session.activations, session.inputs, session.ran

        if not planted:
            return traced()
        # One trace of the model to a jaxpr, evaluated again with the
        # planted sites acted on where the computation holds them.
        closed, shapes = jax.make_jaxpr(traced, return_shape=True)()
        recorder = held[-1].recorder
        outputs, state, activations, inputs, ran = computation.run_planted(
            closed,
            shapes,
            computation.Planted(
                # A site in a trace JAX served from its cache was marked
                # there, not in this run: its structure is discovery's.
                structures={
                    **{
                        site.name: computation.Structure.of_struct(site.struct)
                        for site in discovered
                        if site.name in planted
                    },
                    **recorder.structures,
                },
                epsilons={n: e for n, e in epsilons.items() if n in planted},
                patch_values={n: v for n, v in patch_values.items() if n in planted},
                patch_functions={
                    n: f
                    for n, f in request.patches.items()
                    if n in planted and callable(f)
                },
                recorded=planted & set(request.selected or ()),
                act=recorder.act,
                stacked={site.name: site.stacked for site in discovered},
                dead=frozenset(site.name for site in discovered if site.dead),
                patched=bool(request.patches),
            ),
        )
        return outputs, state, activations, inputs, ran

    def recorded(trainable, dynamic_args, call_kwargs, epsilons, patch_values):
        """One run recording every selected site; the values inside branches
        and loops leave through the backward pass."""
        arguments = (trainable, dynamic_args, call_kwargs, epsilons, patch_values)
        if not recorded_backward:
            return run(*arguments, None)
        return backward.run_recording(
            lambda recorders: run(*arguments, recorders),
            {site.name: site for site in recorded_backward},
            with_inputs,
            lambda site: (
                jax.tree.map(lambda s: without_axis(s, site.stacked), site.value_struct)
                if probe.vmap
                else site.value_struct
            ),
        )

    def single(dynamic_args, call_kwargs, epsilons, patch_values, given):
        arguments = (trainable, dynamic_args, call_kwargs, epsilons, patch_values)
        if given is not None:
            return run(*arguments, given)
        return recorded(*arguments)

    dynamic_args, rebuild_args = split_arrays(args)
    patch_values = request.patch_values()
    if not probe.vmap or one_example:
        return single(dynamic_args, kwargs, request.epsilons, patch_values, recorders)
    # Each example draws its own randomness, as in a batched model.
    keys, rebuild_kwargs = per_example_keys(kwargs, batch_size(args))
    stacked = {site.name: site.stacked for site in discovered}
    outputs, state, activations, inputs, ran = jax.vmap(
        lambda args, keys, *mapped: single(args, rebuild_kwargs(keys), *mapped),
        in_axes=(
            0,
            0,
            {name: stacked[name] for name in request.epsilons},
            {name: stacked[name] for name in patch_values},
            None if recorders is None else {name: stacked[name] for name in recorders},
        ),
        out_axes=(0, None, 0, 0, 0),
        axis_name=BATCH_AXIS,
    )(dynamic_args, keys, request.epsilons, patch_values, recorders)
    return (
        outputs,
        state,
        batch_axis_to(activations, stacked),
        batch_axis_to(inputs, stacked),
        batch_axis_to(ran, stacked),
    )


def _replays(plan: CallPlan, with_inputs: bool) -> bool:
    """Whether the run evaluates discovery's trace (`replay_model`): every
    selected and patched site is acted on at its marker there, and the
    inputs of each selected call are read at theirs where they are asked."""
    chosen = {site.name for site in plan.chosen}
    return plan.replay is not None and plan.replay.serves(
        chosen | set(plan.patches), chosen if with_inputs else ()
    )


def replay_model(
    probe: ProbeBase,
    trainable: Any,
    plan: CallPlan,
    epsilons: Mapping[str, Any],
    with_inputs: bool = False,
) -> tuple[Any, Any, dict, dict, dict]:
    """`call_model`'s `(outputs, state, activations, inputs, ran)`, from
    discovery's jaxpr evaluated with the epsilons and patches planted at the
    markers (`computation.replay`): the model's Python does not run. Under
    `vmap=True` the jaxpr is one example's, mapped over the batch as the
    model's run is: each epsilon, patch value and recorded value holds the
    whole batch after the iterations of the scans around its site, as the
    result does, and a patch function is given the whole batch."""
    chosen = {site.name: site for site in plan.chosen}
    asked = frozenset(chosen) | frozenset(plan.patches)
    patched = {site.name: site for site in plan.discovered if site.name in plan.patches}
    # The session's recorder patches and perturbs a value at its marker, as
    # it does in a run of the model's Python.
    session = Session(
        Request(
            selected=chosen,
            epsilons=dict(epsilons),
            patches=dict(plan.patches),
            patched=patched,
            batch_axis=BATCH_AXIS if probe.vmap else None,
            planted=asked,
        )
    )
    kwargs = mapped_call(plan.args, plan.kwargs)[0] if probe.vmap else plan.kwargs
    dynamic, _ = split_arrays((plan.args, kwargs))
    structures = {
        site.name: computation.Structure.of_struct(site.struct)
        for site in plan.discovered
        if site.name in asked
    }
    if with_inputs:
        structures.update(
            (f"{name}/inputs", plan.replay.inputs[name]) for name in chosen
        )
    planted = computation.Planted(
        structures=structures,
        epsilons=dict(epsilons),
        patch_values={n: v for n, v in plan.patches.items() if not callable(v)},
        patch_functions={n: f for n, f in plan.patches.items() if callable(f)},
        recorded=frozenset(chosen),
        act=session.recorder.act,
        stacked={site.name: site.stacked for site in plan.discovered},
        dead=frozenset(site.name for site in plan.discovered if site.dead),
        patched=bool(plan.patches),
    )
    return computation.replay(
        plan.replay, jax.tree.leaves((probe, trainable, dynamic)), planted
    )


def _zero_epsilons(chosen: Sequence[Site]) -> dict[str, Any]:
    return {site.name: zeros_like_struct(site.value_struct) for site in chosen}
