"""What a session does at each call: the one part that differs between a
discovery and a run, chosen once when the session is made.

`DiscoveryRecorder` lists every call as a `Site` with the abstract shape of
its value and changes nothing; `RunRecorder` patches the selected and patched
sites, adds their epsilons and records their values. An adapter never asks
which one it has: it asks the question it needs answered (`learns_sites`,
`needs_value`), and each recorder answers
for its pass. `Recorder` is the typed interface both implement (a
`typing.Protocol`, exported by `bridge.adapter_api`); each is made from what
it needs (`arrays`, or the run's `Request`), never from the session.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import jax

from . import backward, computation
from .naming import Call
from .sites import (
    JAX_ARRAYS,
    Arrays,
    Site,
    differentiable_part,
    patch_misfit,
    routes,
)

if TYPE_CHECKING:
    from .session import Request


class Recorder(Protocol):
    """The per-pass part of a `Session` (`session.recorder`): what happens at
    each call, in a discovery or in a run."""

    #: `{site: value}` and `{site: positional inputs}` recorded so far, and
    #: `{site: where it ran}` of the sites inside a branch or a while loop.
    activations: dict[str, Any]
    inputs: dict[str, tuple]
    ran: dict[str, Any]

    def entered(self, call: Call, args: tuple, record: bool) -> None:
        """A call starts (see `Session.enter`)."""

    def exited(
        self,
        call: Call,
        value: Any,
        perturb: Callable[[Any], Any] | None,
        record: bool,
        patch: Any,
    ) -> Any:
        """A call returned `value`: the value the model goes on with (see
        `Session.exit`)."""

    def check_reached(self) -> None:
        """After the model's call: raise where a site the pass acts on was
        never reached (a run's selected and patched sites)."""

    def learns_sites(self) -> bool:
        """Whether this pass learns what each site is (its shapes, its origin),
        rather than acting on sites already known: true at discovery, which
        is also the model's first trace on these inputs."""

    def needs_value(self, name: str) -> bool:
        """Whether this pass needs site `name`'s value where the session runs:
        at discovery every site's (its shape), in a run a selected or patched
        site's (to record or change it)."""

    def keeps(self, name: str) -> bool:
        """Whether this pass keeps something of site `name`'s value: at
        discovery every site's shape, in a run a selected site's recording."""

    def keeps_any(self, where: Callable[[Site], bool]) -> bool:
        """Whether this pass keeps the value of any site where `where(site)`:
        at discovery any site may be there (none is known yet)."""

    def kept_part(self, value: Any) -> Any:
        """What this pass keeps of a value: the whole value at discovery (its
        structure is the site's), the floating leaves in a run."""

    def carried_out(
        self, name: str, value: Any, inputs: tuple | None, ran: Any = None
    ) -> None:
        """Site `name`'s value (and inputs) as it left a lifted transform,
        stacked over iterations or layers: at discovery it reshapes the site,
        in a run it is recorded. `ran`: for a site inside a branch or a while
        loop, the boolean array of where its call ran (zeros elsewhere)."""

    def discovered(self) -> list[Site]:
        """The sites found, in call-entry order (none in a run)."""


class DiscoveryRecorder(Recorder):
    """Discovery: every call becomes a `Site` with the abstract shape of its
    value; nothing is changed or recorded."""

    def __init__(self, arrays: Arrays = JAX_ARRAYS, mark_inputs: bool = False):
        self._arrays = arrays
        self._mark_inputs = mark_inputs and arrays is JAX_ARRAYS
        self._sites: list[Site | None] = []
        self.activations = {}
        self.inputs = {}
        self.ran = {}
        # `{name: Structure}` of each call's inputs, marked where they are
        # for a discovery that asks it (`discovery_cache.marking_inputs`): a
        # run that records inputs reads them there (`Replay.inputs`).
        self.input_structures: dict[str, computation.Structure] = {}
        # The trace the model's call starts in, and `{name: JAX's name of
        # the trace}` of each call reported without an origin whose value
        # belongs to another (`computation.located` reads where).
        self._base = computation.current_trace()
        self.traced_apart: dict[str, str] = {}

    def entered(self, call: Call, args: tuple, record: bool) -> None:
        call.slot = len(self._sites)
        self._sites.append(None)
        if self._mark_inputs:
            _, self.input_structures[call.name] = computation.mark(
                call.name, self._arrays.positional(args), computation.INPUTS
            )

    def exited(self, call, value, perturb, record, patch):
        if self._arrays is JAX_ARRAYS:
            if not routes(call.origin):
                apart = computation.trace_apart(value, self._base)
                if apart is not None:
                    self.traced_apart[call.name] = apart
            value, _ = computation.mark(call.name, value)  # is it in what JAX keeps?
            computation.renew_traces(self._base)
        self._sites[call.slot] = Site(
            call.name,
            call.path,
            call.method,
            call.index,
            call.module,
            self._arrays.abstract(value),
            call.origin,
        )
        return value

    def check_reached(self) -> None:
        pass  # discovery learns which sites there are

    def learns_sites(self) -> bool:
        return True

    def needs_value(self, name: str) -> bool:
        return True

    def keeps(self, name: str) -> bool:
        return True

    def keeps_any(self, where: Callable[[Site], bool]) -> bool:
        return True

    def kept_part(self, value: Any) -> Any:
        return value

    def carried_out(
        self, name: str, value: Any, inputs: tuple | None, ran: Any = None
    ) -> None:
        self._restructure(name, value)

    def discovered(self) -> list[Site]:
        return [site for site in self._sites if site is not None]

    def _restructure(self, name: str, value: Any) -> None:
        """The site's value is `value`, as it leaves a lifted transform
        (stacked over a scan's iterations), not as seen inside it."""
        struct = self._arrays.abstract(value)
        for slot, site in enumerate(self._sites):
            if site is not None and site.name == name:
                added = _ndim(struct) - _ndim(site.struct)
                self._sites[slot] = dataclasses.replace(
                    site, struct=struct, stacked=site.stacked + added
                )


class RunRecorder(Recorder):
    """A run: the selected sites are recorded and, where the session has an
    epsilon for them, perturbed; patched sites take their patch."""

    def __init__(self, request: Request):
        self._selected = request.selected or {}
        self._epsilons = request.epsilons
        self._patches = request.patches
        self._with_inputs = request.with_inputs
        self._batch_axis = request.batch_axis
        self._arrays = request.arrays
        # Sites recorded through the backward pass (`bridge._session.backward`)
        # must stay reachable from the outputs through a patch.
        self._recording_backward = bool(request.control_flow_recorders)
        # The sites the computation routes (`bridge._session.computation`):
        # marked here, acted on where the jaxpr holds them.
        self._planted = request.planted
        self.structures: dict[str, computation.Structure] = {}
        self.activations = {}
        self.inputs = {}
        self.ran = {}
        # The selected and patched sites this run has reached.
        self._reached: set[str] = set()

    def entered(self, call: Call, args: tuple, record: bool) -> None:
        if not (self._with_inputs and call.name in self._selected):
            return
        inputs = self._arrays.positional(args)
        if call.name in self._planted:
            # The computation's site: its inputs are marked where they are,
            # whatever route the adapter would record them by.
            _, structure = computation.mark(call.name, inputs, computation.INPUTS)
            self.structures[f"{call.name}/inputs"] = structure
        elif record:
            self.inputs[call.name] = inputs

    def exited(self, call, value, perturb, record, patch):
        if call.name in self._planted:
            value, self.structures[call.name] = computation.mark(call.name, value)
            return value
        if patch is None:
            patch = self._patches.get(call.name)
        if patch is not None:
            value = self._apply_patch(call.name, patch, value)
            self._reached.add(call.name)
        if call.name in self._selected:
            self._reached.add(call.name)
            epsilon = self._epsilons.get(call.name)
            if epsilon is not None:
                if perturb is None:
                    value = self._arrays.add_epsilon(value, epsilon)
                else:
                    value = perturb(value)
            if record:
                self.activations[call.name] = self._arrays.recorded(value)
        return value

    def act(self, name: str, value: Any, patch: Any, epsilon: Any) -> Any:
        """Site `name`'s value patched and perturbed where the computation
        holds it (`bridge._session.computation`)."""
        if patch is not None:
            value = self._apply_patch(name, patch, value)
        if epsilon is not None:
            value = self._arrays.add_epsilon(value, epsilon)
        return value

    def record(self, name: str, value: Any, inputs: tuple | None = None) -> None:
        """A selected site's value (and inputs), recorded by the adapter."""
        self._reached.add(name)
        self.activations[name] = self._arrays.recorded(value)
        if inputs is not None and self._with_inputs:
            self.inputs[name] = self._arrays.positional(inputs)

    def check_reached(self) -> None:
        """Raise unless every selected and patched site was reached in this
        run: a site the model's code did not run this time (a trace JAX
        served from its cache, a branch of Python taken differently than in
        discovery) would otherwise come back as a zero gradient, a missing
        activation or an ignored patch."""
        missing = [
            name
            for name in [*self._selected, *self._patches]
            if name not in self._reached and name not in self._planted
        ]
        # The computation's sites are checked where it holds them: a trace
        # JAX served from its cache ran no Python, and holds their markers.
        if missing:
            raise computation.not_reached(missing)

    def learns_sites(self) -> bool:
        return False

    # A site the computation routes is acted on where the jaxpr holds it:
    # the adapter's route needs, keeps and carries nothing of it (it still
    # reports the call, whose value `exited` marks).

    def needs_value(self, name: str) -> bool:
        if name in self._planted:
            return False
        return name in self._selected or name in self._patches

    def keeps(self, name: str) -> bool:
        return name in self._selected and name not in self._planted

    def keeps_any(self, where: Callable[[Site], bool]) -> bool:
        return any(
            where(site)
            for name, site in self._selected.items()
            if name not in self._planted
        )

    def kept_part(self, value: Any) -> Any:
        return differentiable_part(value)

    def carried_out(
        self, name: str, value: Any, inputs: tuple | None, ran: Any = None
    ) -> None:
        self.record(name, value, inputs)
        if ran is not None:
            self.ran[name] = ran

    def discovered(self) -> list[Site]:
        return []

    def _apply_patch(self, name: str, patch: Any, value: Any) -> Any:
        if not callable(patch):
            new = patch
        elif self._batch_axis is None:
            new = patch(value)
        else:
            # Under the probe's vmap each example sees only itself; the contract
            # gives a patch function the whole batch: gather it, patch it, and
            # keep this example's row.
            axis = self._batch_axis
            whole = jax.tree.map(lambda v: jax.lax.all_gather(v, axis), value)
            index = jax.lax.axis_index(axis)
            new = jax.tree.map(lambda v: v[index], patch(whole))
        expected = self._arrays.abstract(value)
        if not self._arrays.fits(expected, new):
            raise patch_misfit(
                name,
                self._arrays.shapes_and_dtypes(value),
                self._arrays.shapes_and_dtypes(new),
                function=callable(patch),
            )
        if self._recording_backward:
            new = backward.reaching(value, new)
        return new


def _ndim(struct: Any) -> int:
    leaves = [leaf for leaf in jax.tree.leaves(struct) if leaf is not None]
    return len(leaves[0].shape) if leaves else 0
