"""Sites inside control flow: values that leave through the backward pass.

A value computed inside a `lax.cond` or `lax.switch` branch, or in the body
of a `lax.fori_loop` of static bounds, is a tracer of that body's trace:
recorded by side effect, it would leak. The epsilon needs no route in: the
body closes over it (inside a loop, over every iteration's epsilon, and
takes its iteration's row by the loop's counter), and JAX gives it a zero
gradient where a branch did not run. The value leaves as a gradient: it
passes through `record`, an identity whose backward pass returns the value
itself (and the call's inputs, and ones) as the cotangents of zero-valued
recorders the body closes over (a loop's row of them). In a differentiated
step the recorders are differentiated beside the epsilons, so the step's
own backward pass brings the values out as their gradients (`recorders`,
`adopt`), and reaches every output for it (`reaching_every_output`); in a
forward-only run (`apply`) one `jax.vjp` of the model (`run_recording`)
pulls them out (no number of that backward pass is read but what `record`
gives, so a `lax.while_loop` the model runs after the sites, which JAX
cannot transpose, passes zeros back there: `recording_pullback`). Where a
branch did not run, its backward pass never reaches `record`: the value,
the inputs and the ones stay zeros, so the ones say where it ran
(`ProbeResult.ran`). Under a `vmap` whose predicate
varies, JAX runs every branch and selects each operand's gradient by the
predicate, so this holds per example. Equinox's checkpointed while loop is
such a loop too (`CHECKPOINTED_WHILE`): its steps take their rows by its
counter, and a step an example did not run records zeros (`record`'s
`runs`).

One backward pass, never a backward pass differentiated again: JAX drops
the `custom_jvp` rules inside a scan when it differentiates a `jax.vjp` of
it (relu's derivative at 0 becomes 1/2), and Equinox's checkpointed loop
has a custom backward pass JAX cannot differentiate. An adapter with a
route of its own that records the same way (Equinox's scanned stacks)
gives its sites' recorders (`SiteOrigin.backward_recorders`) and takes
them from the step (`Request.control_flow_recorders`), or from
`run_recording` where an `apply` records them beside sites in branches and
loops: one `jax.vjp` for all, never one inside another.

The adapter reads where a call runs (`ControlFlow`, from JAX's trace stack)
and hands the call to `Session.call_in_control_flow`; the core records a
selected site whose origin is an `InControlFlow` as above. An adapter
with a route of its own (the Equinox tree, which a scan over stacked
layers slices) uses `record` directly. Inputs that are not floating-point
travel as float32 numbers a cotangent carries exactly (`as_floats`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from .._errors import BridgeValueError
from .cotangent_floats import Encoding, as_floats, from_floats
from .recording_pullback import while_loops_pass_zeros
from .sites import (
    JAX_ARRAYS,
    SiteOrigin,
    abstract,
    add_epsilon,
    differentiable_part,
    is_array,
    merge_differentiable,
    zeros_like_struct,
)

#: JAX's names (a trace's `traced_for`) of the branches, of a loop of static
#: bounds, and of what is traced through (a `jax.jit` inside the model).
BRANCHES = frozenset({"cond", "switch"})
FORI_LOOP = "fori_loop"
#: The names a `ControlFlow` gives a while loop of at most `max_steps`
#: steps, which may stop before (a call there, as in a branch, may not run):
#: the checkpointed kind, whose backward pass traces its body again, and the
#: bounded kind, a nest of scans of branches JAX differentiates natively.
CHECKPOINTED_WHILE = "while_loop (checkpointed)"
BOUNDED_WHILE = "while_loop (bounded)"
WHILE_LOOPS = frozenset({CHECKPOINTED_WHILE, BOUNDED_WHILE})
LOOPS = frozenset({FORI_LOOP, *WHILE_LOOPS})
_TRACED_THROUGH = frozenset({"jit", "pjit"})


@jax.custom_vjp
def record(value: Any, inputs: Any, recorders: Any, runs: Any = None) -> Any:
    """`value`; the cotangent of `recorders = (value recorder, inputs
    recorder, ran recorder)` is `(value, inputs, ones)` (`None` where a
    recorder is). `runs`, a boolean scalar where given, says whether the
    call runs for this example: a vmapped while loop runs its body for an
    example that has stopped, and selects its old carry (Equinox's
    checkpointed loop); there the cotangent is zeros."""
    del inputs, recorders, runs
    return value


def _record_forward(
    value: Any, inputs: Any, recorders: Any, runs: Any
) -> tuple[Any, Any]:
    _, _, ran = recorders
    return value, (value, inputs, ran, runs)


def _record_backward(recorded: Any, cotangent: Any) -> tuple[Any, Any, Any, None]:
    value, inputs, ran, runs = recorded
    ran = jax.tree.map(jnp.ones_like, ran)
    kept = (value, inputs, ran)
    if runs is not None:
        kept = jax.tree.map(lambda leaf: jnp.where(runs, leaf, 0), kept)
    return cotangent, jax.tree.map(jnp.zeros_like, inputs), kept, None


record.defvjp(_record_forward, _record_backward)


@dataclasses.dataclass(frozen=True)
class ControlFlow:
    """Where a call runs: inside branches and loops of static bounds only.

    Attributes:
      transforms: JAX's names of the transforms around the call, innermost
        first (`cond`, `switch`, `fori_loop`, a `jit` inside the model).
      lengths: each loop's iterations, outermost first.
      rows: each loop's iteration now (a tracer of its body), outermost first.
      runs: whether the call runs for this example (a boolean scalar), where
        a while loop around it runs its body for examples that have stopped;
        `None` where it always runs.
    """

    transforms: tuple[str, ...]
    lengths: tuple[int, ...] = ()
    rows: tuple[Any, ...] = ()
    runs: Any = None

    @staticmethod
    def expressible(transforms: tuple[str, ...]) -> bool:
        """Whether a call inside `transforms` (innermost first) is a site of
        this route: branches and loops of static bounds, and nothing else
        bridge must see through."""
        seen = [t for t in transforms if t not in _TRACED_THROUGH]
        return bool(seen) and all(t in BRANCHES or t in LOOPS for t in seen)

    def row(self, tree: Any) -> Any:
        """This iteration's row of `tree`, whose leaves have the loops'
        iterations first."""
        if not self.rows:
            return tree
        return jax.tree.map(lambda leaf: leaf[tuple(self.rows)], tree)


@dataclasses.dataclass(frozen=True)
class InControlFlow(SiteOrigin):
    """The origin of a call inside branches and loops of static bounds
    (`ControlFlow`): its epsilon and patch value are closed over, its value
    and inputs leave through the backward pass (see the module docstring).
    The core's one fallback: this route, not the computation, carries it.

    Attributes:
      transforms: as `ControlFlow.transforms`.
      iterations: the loops' lengths, outermost first: the value's leading
        axes.
      inputs: how each positional array input comes back from its float32
        transport (an `Encoding`, `None` for other arguments).
      inputs_recorder: the abstract zeros one call's inputs are recorded
        through.
      inner: the adapter's own origin of the call, where it has one.
    """

    routes: ClassVar[bool] = True

    transforms: tuple[str, ...] = ()
    iterations: tuple[int, ...] = ()
    inputs: Any = None
    inputs_recorder: Any = None
    inner: SiteOrigin | None = None

    @classmethod
    def of(
        cls, flow: ControlFlow, args: tuple, inner: SiteOrigin | None = None
    ) -> InControlFlow:
        """The origin of a call at `flow` with positional `args`."""
        arrays = JAX_ARRAYS.positional(args)
        return cls(
            flow.transforms,
            flow.lengths,
            jax.tree.map(Encoding.of, arrays),
            abstract(jax.tree.map(as_floats, arrays)),
            inner,
        )

    @property
    def in_branch(self) -> bool:
        """Inside a `cond` or `switch`: where it ran is part of the result."""
        return in_a_branch(self.transforms)

    def backward_recorders(self, site: Any, with_inputs: bool) -> tuple:
        inputs = None
        if with_inputs:
            inputs = jax.tree.map(
                lambda s: jnp.zeros((*self.iterations, *s.shape), s.dtype),
                self.inputs_recorder,
            )
        ran = jnp.zeros(self.iterations, jnp.float32) if self.in_branch else None
        return inputs, ran

    def __getattr__(self, name: str) -> Any:
        # What the adapter's own origin says of the call (its bundle, its
        # scope), for the adapter's code that reads every site's origin.
        if name.startswith("__") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def call_in_control_flow(
    session: Any,
    path: str,
    method: str | None,
    module: Any,
    args: tuple,
    flow: ControlFlow,
    run: Callable[[], Any],
    origin: SiteOrigin | None = None,
) -> Any:
    """`Session.call_in_control_flow`: at discovery a site holding every
    iteration of the loops around it, whose origin is an `InControlFlow`; in
    a run, the epsilon added (this iteration's row), the patch applied, and
    the value recorded through the backward pass (`record`) where the
    session holds its recorders."""
    if session.recorder.learns_sites():
        call = session.enter(
            path,
            method,
            module,
            args,
            InControlFlow.of(flow, args, origin),
        )
        value = session.exit(call, run(), perturb=lambda v: v, record=False)
        if flow.lengths:  # the site holds every iteration, loops first
            session.recorder.carried_out(
                call.name,
                jax.tree.map(
                    lambda v: (
                        jnp.broadcast_to(v, (*flow.lengths, *jnp.shape(v)))
                        if is_array(v)
                        else v
                    ),
                    value,
                ),
                None,
            )
        return value
    call = session.enter(path, method, module, args, origin, record=False)
    value = run()
    if not session.recorder.needs_value(call.name):
        return session.exit(call, value, record=False)
    name = call.name
    patch = session.patches.get(name)
    value = session.exit(
        call,
        value,
        # Applied only where the site has an epsilon.
        perturb=lambda v: add_epsilon(v, flow.row(session.epsilons[name])),
        record=False,
        # A patch function applies to this iteration's value as it is.
        patch=None if patch is None or callable(patch) else flow.row(patch),
    )
    recorders = session.request.control_flow_recorders.get(name)
    if name not in session.selected or recorders is None:
        return value
    inputs = None
    if session.with_inputs:
        inputs = jax.tree.map(as_floats, JAX_ARRAYS.positional(args))
    floats = record(differentiable_part(value), inputs, flow.row(recorders), flow.runs)
    return merge_differentiable(value, floats)


def run_recording(
    run: Callable[[Any], tuple[Any, Any, dict, dict, dict]],
    sites: Mapping[str, Any],
    with_inputs: bool,
    without_batch: Callable[[Any], Any],
) -> tuple[Any, Any, dict, dict, dict]:
    """`run(recorders)` -> `(outputs, state, activations, inputs, ran)`, run
    inside one `jax.vjp` whose pullback brings the values, inputs and
    where-they-ran of `sites` (`{name: Site}`, each recorded through the
    backward pass: `recorded_backward`) out of their branches and loops, and
    out of an adapter's own route (Equinox's scanned stacks), which takes its
    recorders from the run (`Request.control_flow_recorders`) as from a
    differentiated step: all of them, or one `jax.vjp` would run inside
    another. `without_batch(site)` is the site's abstract value as one trace
    sees it (one example's, under the probe's vmap)."""

    def made(site: Any) -> tuple:
        inputs, ran = site.origin.backward_recorders(site, with_inputs)
        return zeros_like_struct(without_batch(site)), inputs, ran

    recorders = {name: made(site) for name, site in sites.items()}

    def split(recorders: dict) -> tuple[Any, Any]:
        outputs, state, *recorded = run(recorders)
        return (outputs, state), recorded

    (outputs, state), recorded, cotangents = pulled_out(
        split, recorders, "branches and loops"
    )
    activations, inputs, ran = (dict(part) for part in recorded)
    adopt(cotangents, list(sites.values()), with_inputs, activations, inputs, ran)
    return outputs, state, activations, inputs, ran


def recorded_backward(sites: Sequence[Any]) -> list:
    """The sites of `sites` that the step's own backward pass records
    (`SiteOrigin.backward_recorders`)."""
    return [
        site
        for site in sites
        # The computation routes a site it took from an adapter's route.
        if site.computed is None
        # A third-party adapter's origin may be any value.
        and callable(getattr(site.origin, "backward_recorders", None))
        and site.origin.backward_recorders(site, False) is not None
    ]


def recorders(sites: Sequence[Any], with_inputs: bool, batched: bool) -> dict:
    """`{name: (value recorder, inputs recorder, ran recorder)}` of `sites`
    (`recorded_backward`), zeros as the result holds them: the loops'
    iterations first, then (`batched`: under the probe's `jax.vmap`) the
    batch axis, which a site's `value_struct` has already. A caller that
    differentiates them gets the values, inputs and where-they-ran of the
    sites as their gradients (`adopt`)."""

    def with_batch(site: Any, tree: Any) -> Any:
        if not batched:
            return tree
        batch = jax.tree.leaves(site.value_struct)[0].shape[site.stacked]
        return jax.tree.map(
            lambda leaf: jnp.zeros(
                (*leaf.shape[: site.stacked], batch, *leaf.shape[site.stacked :]),
                leaf.dtype,
            ),
            tree,
        )

    made = {}
    for site in sites:
        inputs, ran = site.origin.backward_recorders(site, with_inputs)
        made[site.name] = (
            zeros_like_struct(site.value_struct),
            with_batch(site, inputs),
            with_batch(site, ran),
        )
    return made


def adopt(
    recorded: Mapping[str, Any],
    sites: Sequence[Any],
    with_inputs: bool,
    activations: dict,
    inputs: dict,
    ran: dict,
) -> None:
    """Into `activations`, `inputs` and `ran`: what the gradients of
    `recorders` hold for `sites`."""
    for site in sites:
        value, site_inputs, site_ran = recorded[site.name]
        activations[site.name] = value
        if with_inputs:
            inputs[site.name] = jax.tree.map(
                from_floats, site.origin.inputs, site_inputs
            )
        if site_ran is not None:
            ran[site.name] = site_ran > 0


def reaching_every_output(loss: Any, outputs: Any) -> Any:
    """`loss`, whose backward pass also reaches every floating output (with
    zero cotangents): a site recorded through the backward pass whose value
    reaches an output but not the loss would otherwise come out as zeros.
    A `select` of nothing, so that an infinite or NaN output leaves the loss
    as it is."""
    loss = jnp.asarray(loss)
    for leaf in jax.tree.leaves(differentiable_part(outputs)):
        if not is_array(leaf) or not jnp.issubdtype(leaf.dtype, jnp.floating):
            continue
        nothing = jax.lax.select(
            jnp.zeros(leaf.shape, bool), leaf, jnp.zeros_like(leaf)
        )
        loss = loss + jnp.sum(nothing).astype(loss.dtype)
    return loss


def pulled_out(
    run: Callable[[Any], tuple[Any, Any]],
    recorders: Any,
    where: str,
    model: str = "the model",
) -> tuple[Any, Any, Any]:
    """`run(recorders) -> (outputs, aux)` inside one `jax.vjp`, pulled back
    from the sum of the floating leaves of `outputs`: `(outputs, aux,
    cotangents of recorders)`, the cotangents what `record` put there
    (whatever reached it: a `lax.while_loop` on the way passes zeros back,
    `bridge._session.recording_pullback`).
    `where` (the transforms the sites are in) and `model` name them in the
    error raised where the outputs hold no floating-point array."""

    def forward(recorders: Any) -> tuple[Any, Any]:
        outputs, aux = run(recorders)
        floats = [
            jnp.sum(leaf.astype(jnp.float32))
            for leaf in jax.tree.leaves(differentiable_part(outputs))
            if leaf is not None
        ]
        if not floats:
            raise BridgeValueError(
                f"bridge records the sites inside {where} through the backward "
                f"pass of the model's outputs, but {model} returned no "
                "floating-point array."
            )
        return sum(floats, jnp.zeros(())), (outputs, aux)

    total, pullback, (outputs, aux) = jax.vjp(forward, recorders, has_aux=True)
    # Only the recorders' cotangents are read, which `record` gives whatever
    # reaches it: a while loop after the sites passes zeros back.
    with while_loops_pass_zeros():
        (cotangents,) = pullback(jnp.ones_like(total))
    return outputs, aux, cotangents


def in_a_branch(transforms: tuple[str, ...]) -> bool:
    """Whether `transforms` (JAX's names) hold a `cond`, a `switch` or a
    while loop with a bound of steps: a call there may not run, and its
    result says where it ran."""
    return any(t in BRANCHES or t in WHILE_LOOPS for t in transforms)


def reaching(original: Any, patched: Any) -> Any:
    """`patched`, through which the backward pass still reaches `original`
    (with zero cotangents): a patch value downstream of a site recorded
    through the backward pass would otherwise cut that pass, and the site's
    value would come out as zeros."""

    def keep(before: Any, after: Any) -> Any:
        if not (is_array(before) and is_array(after)):
            return after
        if not (
            jnp.issubdtype(before.dtype, jnp.inexact)
            and before.shape == after.shape
            and before.dtype == after.dtype
        ):
            return after
        return jax.lax.select(jnp.zeros(after.shape, bool), before, after)

    return jax.tree.map(keep, original, patched, is_leaf=lambda x: x is None)
