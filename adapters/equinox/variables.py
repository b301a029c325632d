"""Equinox's leaves in the tree as the route of bridge's values inside
`lax.scan` over stacked layers and `jax.checkpoint`
(`bridge.adapters.equinox.transforms`).

Each wrapper called inside them holds, per call, its `Leaves`, stacked
`(L, *shape)` so that the scan slices them with the parameters: going in, a
zero epsilon (its gradient is the stacked activation gradient) and the patch
value, of which each iteration takes its row (a patch function needs no
leaf: it is applied to each iteration's value); coming out, zero "recorders"
of the value and, with `with_inputs=True`, of the positional inputs. Values
leave the scan backwards: the recorders enter through a `custom_vjp` identity
whose backward pass returns the recorded value and inputs themselves as the
recorders' cotangents (`record`), and `run_with_tree_leaves` pulls them out
with one `jax.vjp` of the model. Inputs that are not floating-point travel
as float32 numbers that a cotangent carries exactly (`as_floats`). Where
such a site lives is its `InTransform` origin.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from bridge.adapter_api import (
    BridgeAssertionError,
    BridgeValueError,
    Encoding,
    Session,
    SiteOrigin,
    abstract,
    as_floats,
    differentiable_part,
    from_floats,
    in_a_branch,
    merge_differentiable,
    positional_arrays,
    pulled_out,
    reaching,
    record,
    without_axis,
    zeros_like_struct,
)

from .jax_transforms import describe


class Leaves(eqx.Module):
    """A call's leaves inside a transform: array leaves of the tree, so a scan
    slices them per iteration as it slices the parameters. The epsilon and the
    patch value go in; the recorders of the value and of the positional
    inputs bring them out, as their cotangents (see `record`). `None` where
    the call has none."""

    epsilon: Any = None
    recorder: Any = None
    inputs: Any = None
    patch: Any = None
    ran: Any = None


def param_shapes(module: Any) -> tuple[tuple[int, ...], ...]:
    """Shapes of a module's arrays, bridge's own leaves left out."""
    arrays = eqx.filter(module, eqx.is_array, is_leaf=lambda x: isinstance(x, Leaves))
    return tuple(tuple(a.shape) for a in jax.tree.leaves(arrays))


def in_tree(session: Session) -> dict[str, Any]:
    """The selected sites whose epsilons live in the tree."""
    return {
        name: site
        for name, site in session.selected.items()
        if isinstance(site.origin, InTransform)
    }


def patches_in_tree(session: Session) -> dict[str, Any]:
    """The patch values of the sites inside transforms, which ride in the tree
    (sliced per iteration inside a scan). A patch function needs no leaf."""
    return {
        name: session.patches[name]
        for name, site in session.carrier.patched_with_values().items()
        if isinstance(site.origin, InTransform)
    }


def run_with_tree_leaves(
    call_model: Callable[[dict[str, Leaves]], tuple[Any, Any]],
    session: Session,
    vmap: bool,
    model_name: str,
) -> tuple[Any, Any]:
    """Run the model with the `Leaves` of the calls inside transforms
    (`call_model(leaves) -> (outputs, state)`), and record the selected sites
    there, whose values and inputs leave the scan as the recorders' cotangents
    (see `record`)."""
    patches = patches_in_tree(session)
    sites = in_tree(session)
    if not sites:  # nothing to record in there: no backward pass needed
        return call_model({name: Leaves(patch=p) for name, p in patches.items()})
    for site in sites.values():
        if site.origin.blocked:
            raise BridgeValueError(site.origin.blocked)

    def shaped(site: Any) -> Any:
        struct = site.value_struct
        if vmap:  # the probe's own vmap: one example here
            struct = jax.tree.map(lambda s: without_axis(s, site.stacked), struct)
        return zeros_like_struct(struct)

    def tree_leaves(recorders: dict) -> dict[str, Leaves]:
        """Each site's epsilon, patch value and recorders; the other patched
        calls' patch values."""
        leaves = {name: Leaves(patch=p) for name, p in patches.items()}
        for name, site in sites.items():
            value_recorder, inputs_recorder, ran_recorder = recorders[name]
            epsilon = session.epsilons.get(name)
            leaves[name] = Leaves(
                shaped(site) if epsilon is None else epsilon,
                value_recorder,
                inputs_recorder,
                patches.get(name),
                ran_recorder,
            )
        return leaves

    given = session.request.control_flow_recorders
    if given:
        # The step's own backward pass records them: their values leave as
        # the gradients of the recorders it differentiates
        # (`bridge._session.backward.recorders`, `InTransform.backward_recorders`),
        # or, in a forward pass that also records sites inside branches and
        # loops, as the cotangents of the one `jax.vjp` recording them all
        # (`bridge._session.backward.run_recording`).
        # A site without its recorder would come back as zeros: never.
        missing = [name for name in sites if name not in given]
        if missing:
            raise BridgeAssertionError(
                f"bridge bug: the step gives no recorder for {missing!r}"
            )
        return call_model(tree_leaves({name: given[name] for name in sites}))

    def shaped_inputs(site: Any) -> Any:
        if not session.with_inputs:
            return None
        # Shaped at discovery, where the probe's vmap had already taken the
        # batch axis away.
        return zeros_like_struct(site.origin.inputs_recorder)

    def shaped_ran(site: Any) -> Any:
        if not site.origin.in_branch:
            return None
        # One number per call: the value's stacked axes (a scan's iterations).
        first = jax.tree.leaves(site.value_struct)[0]
        return jnp.zeros(first.shape[: site.stacked], jnp.float32)

    recorders = {
        name: (shaped(site), shaped_inputs(site), shaped_ran(site))
        for name, site in sites.items()
    }

    def forward(recorders: dict) -> tuple[Any, Any]:
        # What the session records in here leaves `jax.vjp` as outputs.
        outputs, state = call_model(tree_leaves(recorders))
        return outputs, (state, session.carrier.recordings())

    outputs, (state, recorded), cotangents = pulled_out(
        forward, recorders, "jax.lax.scan or jax.checkpoint", model_name
    )
    session.carrier.adopt(recorded)
    for name, site in sites.items():
        value, inputs, ran = cotangents[name]
        if session.with_inputs:
            inputs = jax.tree.map(from_floats, site.origin.inputs, inputs)
        if ran is not None:
            ran = ran > 0
        session.carrier.carried_out(name, value, inputs, ran)
    return outputs, state


@dataclasses.dataclass(frozen=True)
class InTransform(SiteOrigin):
    """Where a site lives that takes its epsilon and patch value from the tree
    and records through it: `iterations` of the enclosing scan (`None` when
    only a checkpoint encloses it)."""

    iterations: int | None
    transforms: tuple[str, ...]
    #: Why a call there cannot be a site (raised where it is selected).
    blocked: str | None = None
    #: How each positional array input comes back from its float32 transport
    #: (an `_Encoding`, `None` for other arguments), and the abstract zeros of
    #: its recorder, stacked like the site.
    inputs: Any = None
    inputs_recorder: Any = None

    @property
    def described(self) -> str:
        return describe(self.transforms)

    @property
    def in_branch(self) -> bool:
        """Inside a `lax.cond` or `lax.switch`: a call that may not run, whose
        result says where it ran (`ProbeResult.ran`)."""
        return in_a_branch(self.transforms)

    def backward_recorders(self, site: Any, with_inputs: bool) -> tuple:
        """One example's zeros (see `SiteOrigin.backward_recorders`): the
        inputs recorder was shaped at discovery, where the probe's vmap had
        already taken the batch axis away; where it ran, one number per call
        (the value's stacked axes: a scan's iterations)."""
        inputs = zeros_like_struct(self.inputs_recorder) if with_inputs else None
        ran = None
        if self.in_branch:
            first = jax.tree.leaves(site.value_struct)[0]
            ran = jnp.zeros(first.shape[: site.stacked], jnp.float32)
        return inputs, ran


def through_tree(value: Any, inputs: Any, leaves: Leaves) -> Any:
    """`value` recorded through the tree with its `inputs` (see `record`),
    and its epsilon added. The value recorded is the patched one, before its
    epsilon."""
    floats = differentiable_part(value)
    if leaves.recorder is not None:
        floats = record(floats, inputs, (leaves.recorder, leaves.inputs, leaves.ran))
    floats = jax.tree.map(jnp.add, floats, leaves.epsilon)
    return merge_differentiable(value, floats)


def through_patch(session: Session, name: str, original: Any, patched: Any) -> Any:
    """`patched`, the value of patched site `name`, through which the backward
    pass still reaches `original` (with zero cotangents). Values recorded
    inside a scan or checkpoint leave through the backward pass of the
    model's outputs (`run_with_tree_leaves`): a patch downstream of them
    would cut that pass, and their activations would come out as zeros."""
    if name not in session.patches or not in_tree(session):
        return patched
    return reaching(original, patched)


def inputs_origin(args: tuple, iterations: int | None) -> dict[str, Any]:
    """Discovery: how a call's positional inputs are recorded inside a
    transform (see `InTransform.inputs`)."""
    inputs = positional_arrays(args)
    transported = jax.tree.map(as_floats, inputs)
    if iterations:
        # Broadcast, not zeros, as for the value (`holds_iterations` in
        # `call_in_transform`): inputs varying across devices stay varying.
        transported = jax.tree.map(
            lambda a: jnp.broadcast_to(a, (iterations, *a.shape)), transported
        )
    return {
        "inputs": jax.tree.map(Encoding.of, inputs),
        "inputs_recorder": abstract(transported),
    }
