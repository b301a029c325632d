"""The run of an NNX probe's copy, and its sites inside NNX transforms.

NNX transforms in the model's own code (`nnx.scan` over layers built with
`nnx.vmap`, `nnx.vmap` over an ensemble, `nnx.remat`) split the copy and merge
it again: the body runs on new module objects, of the same reporting classes,
that carry their site path as a static attribute, and values seen there are
tracers of the transform's trace. So a site there keeps its epsilon and its
recording in bridge's own `nnx.Param` subclasses on the module, which the
transform carries exactly as it carries the module's parameters: an epsilon
placed on the copy before the call is sliced per iteration going in, and a
recording made inside comes out stacked, `(iterations, *value shape)`, read
back from the copy after the call. A transform that would not carry them (a
module broadcast with `in_axes=None`, `graph=False` or `graph_updates=False`,
`nnx.jit`, loops) raises an error naming it rather than drop or sum a site.

A module that `nnx.scan` CARRIES (`nnx.StateAxes({...: nnx.Carry})`, as
`nnx.RNN` scans its cell) keeps its parameters' full shape inside, and the
scan's carry must keep its structure: nothing may be added there. Its sites
work as Haiku's inside `hk.scan`: before the call the copy gets, per
selected site, the whole epsilon (and patch value) `(length, ...)`, a
recording buffer `(length, ...)` and an int32 step counter; inside, the
counter picks the step's row (`length - 1 - step` with `reverse`), the
recording is written with `.at[row].set` and the counter bumped; after the
call the recording is read off the copy. `length` and `reverse` come from
`lax.scan`'s frame (`bridge.adapters.shared.jax_internals.scan_frames`). Such a
site holds every step, `(length, *value shape)`, in the order of `xs`; a
patch value is given in that shape (its row is taken), a patch function
sees one step's value, and `with_inputs=True` records each step's inputs.

Carried and broadcast (`StateAxes({...: None})`, `in_axes=None`) look alike
inside the body, and NNX silently drops a broadcast module's updates. So
discovery never guesses: a call inside `nnx.scan` whose parameters keep
their outer shapes (or that has none) is only noted on the first pass,
changing nothing; if there was one, discovery runs again with a `(length,)`
int32 marker on each such module. Inside, a marker the scan sliced to `()`
belongs to a sliced module (the stacked route above); otherwise the body
bumps it, and after the call a marker still holding the very array placed
was dropped: the module was broadcast, and discovery raises. A carried
module inside nested scans or inside another transform within the scan
raises `NotImplementedError` naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from bridge.adapter_api import (
    BridgeNotImplementedError,
    BridgeValueError,
    Session,
    Site,
    SiteOrigin,
    add_epsilon,
    carrier_name,
    differentiable_part,
    is_carrier_name,
    positional_arrays,
)

from ..shared import jax_internals
from . import internals

jax_internals.require_scan_frame("Flax NNX")

#: The static attribute naming a module of the copy: it survives NNX's
#: split and merge inside transforms, where the module is a new object.
PATH_ATTRIBUTE = "_bridge_path"

#: NNX transforms (their update-context tags) that carry a module's `Param`
#: variables in and out, mapped or not, so they carry bridge's too.
_CARRYING = {"scan": "nnx.scan", "vmap": "nnx.vmap", "remat": "nnx.remat"}


class _BridgeVariable(nnx.Param):
    """bridge's variables on the private copy. Subclasses of `nnx.Param`, so
    they ride wherever the model's transforms send its parameters (a
    `StateAxes({nnx.Param: 0, ...: None})` too); never in `grads` or `state`."""


class _Carried(_BridgeVariable):
    """A site's epsilon or patch value, stacked like the site: sliced per
    iteration going in."""


class _Recording(_BridgeVariable):
    """A site's `(value, inputs)` recorded inside a transform: stacked coming out."""


class NeedsCarried(Exception):
    """Discovery met a module inside `nnx.scan` whose parameters keep their
    full shape there (carried or broadcast, not sliced): it runs again with a
    marker on each such module, to tell which."""


@dataclasses.dataclass(frozen=True)
class Origin(SiteOrigin):
    """Where an NNX site lives: the module's path, and whether its calls run
    inside an NNX transform of the model's own code (named in `transforms`).

    For a module that `nnx.scan` carries, `scan` is `(length, reverse)`, and
    `value` and `inputs` are the abstract value (floating leaves) and
    positional arguments of one step: its stacked epsilon, recording and step
    counter ride in the carry, shaped before the call.
    """

    path: str
    transforms: tuple[str, ...] = ()
    scan: tuple[int, bool] | None = None
    value: Any = None
    inputs: Any = None


def is_bridge_attribute(name: str) -> bool:
    """Whether an attribute of a module of the copy is bridge's own."""
    return name == PATH_ATTRIBUTE or is_carrier_name(name)


class Run:
    """One run of the probe's copy: its modules, and the sites inside NNX
    transforms, whose values leave through variables on those modules.

    A module inside `nnx.scan` is sliced (its parameters lose the scan's axis
    inside), carried (they keep their full shape, and updates flow from one
    iteration to the next: `nnx.RNN`'s cell) or broadcast (full shape, updates
    dropped). Sliced modules are the stacked-layers route. Discovery tells the
    other two apart on a second pass (`markers`): each such call gets a
    `(length,)` marker on its module before the call; inside, the scan has
    sliced it (shape `()`) or not, and the body bumps it; after the call a
    marker still holding the very array placed was dropped: broadcast, which
    raises. A carried site's epsilon, recording and step counter ride in the
    carry whole, `(length, ...)`, and the counter picks the step's row.
    """

    def __init__(
        self,
        modules: dict[str, nnx.Module],
        stop: Any,
        candidates: dict[tuple[str, str], int] | None = None,
        markers: bool = False,
    ):
        self.modules = modules
        self.stop = stop  # the code of the probe's call of the model
        self.ids = {id(module): path for path, module in modules.items()}
        self.outer = internals.active_transforms()
        self.first_lifted: tuple[str, tuple[str, ...]] | None = None
        # `{(path, step key): scan length}`: calls whose module keeps its
        # parameters' shape inside nnx.scan, met by the first discovery pass.
        self.candidates = {} if candidates is None else candidates
        self.markers = markers
        # `(path, key) -> the array placed`: after the call, a variable still
        # holding it was not carried out (the module was broadcast).
        self.placed: dict[tuple[str, str], Any] = {}
        self.checks: list[tuple[str, str, tuple[str, ...]]] = []
        if markers:
            for (path, key), length in self.candidates.items():
                marker = jnp.zeros((length,), jnp.int32)
                setattr(self.modules[path], key, _Carried(marker))
                self.placed[path, key] = marker

    def place_variables(self, session: Session) -> None:
        """Put on its module what `Session.to_carry_in` gives for each selected
        or patched site inside a transform: its epsilon and patch value,
        stacked like the site, and for a site inside a carrying `nnx.scan` its
        step counter and, if selected, its recording rows."""

        def inside_transform(site: Site) -> bool:
            return isinstance(site.origin, Origin) and bool(site.origin.transforms)

        for carried in session.to_carry_in(inside_transform, inside_transform):
            module = self.modules[carried.site.origin.path]
            if carried.kind == "recording":
                setattr(module, carried.name, _Recording(carried.value))
                self.placed[carried.site.origin.path, carried.name] = carried.value
            else:
                setattr(module, carried.name, _Carried(carried.value))

    def tap(self, session: Session, name: str, value: Any) -> Any:
        """`bridge.tap` in the model's code: refused inside an NNX transform,
        where the value is a tracer of the transform's trace."""
        transforms = self.transforms()
        if transforms:
            raise BridgeNotImplementedError(
                f"bridge.tap({name!r}, ...) is called inside "
                f"{transform_name(transforms[-1])} in the model's own code; "
                "bridge does not carry taps out of NNX transforms yet. Tap the "
                "value outside the transform, or select the call of the module "
                "that computes it."
            )
        return session.tap_here(name, value)

    def transforms(self) -> tuple[str, ...]:
        """The NNX transforms of the model's own code running now."""
        return tuple(t for t in internals.active_transforms() if t not in self.outer)

    def innermost_transform(self) -> str | None:
        """The name of the innermost NNX transform of the model's code running
        now (`nnx.scan`), for errors about the calls inside it."""
        transforms = self.transforms()
        return transform_name(transforms[-1]) if transforms else None

    def report(self, module, method_name, method, args, kwargs, session):
        site_method = None if method_name == "__call__" else method_name
        path = self.ids.get(id(module))
        if path is not None:
            call = session.enter(path, site_method, module, args, origin=Origin(path))
            return session.exit(call, method(module, *args, **kwargs))
        return self._report_lifted(module, site_method, method, args, kwargs, session)

    def _report_lifted(self, module, site_method, method, args, kwargs, session):
        """A call inside an NNX transform, on the module's copy NNX merged."""
        path = vars(module).get(PATH_ATTRIBUTE)
        transforms = self.transforms()
        unsupported = [t for t in transforms if t not in _CARRYING]
        if path is None or not transforms or unsupported:
            named = ", ".join(transform_name(t) for t in unsupported)
            raise BridgeNotImplementedError(
                f"A {type(module).__name__} submodule"
                + (f" ('{path}')" if path else "")
                + " is called inside "
                + (
                    named
                    if unsupported
                    else "an NNX transform with graph=False or graph_updates=False"
                )
                + " in the model's own code; bridge sees through nnx.scan, "
                "nnx.vmap and nnx.remat (graph mode, the default) only, and will "
                "not silently drop the calls. Select sites outside it, or use "
                "one of those transforms."
            )
        names = tuple(_CARRYING[t] for t in transforms)
        call = session.enter(
            path, site_method, module, args, origin=Origin(path, names), record=False
        )
        if self.first_lifted is None:
            self.first_lifted = (path, names)
        step_key = carrier_name("step", site_method, call.index)
        if session.discovering and "nnx.scan" in names:
            if not self.markers and self._keeps_shape(module, path):
                # Carried or broadcast: the second pass tells which. Nothing
                # is set on the module, so the scan's carry keeps its structure.
                (length, _), *_ = jax_internals.scan_frames(self.stop)
                self.candidates[path, step_key] = length
                return session.exit(call, method(module, *args, **kwargs))
            marker = vars(module).get(step_key)
            if marker is not None and jnp.ndim(internals.get_value(marker)):
                return self._discover_carried(
                    module,
                    marker,
                    step_key,
                    call,
                    names,
                    method,
                    args,
                    kwargs,
                    session,
                )
        elif not session.discovering and step_key in vars(module):
            return self._run_carried(module, call, method, args, kwargs, session)
        value = method(module, *args, **kwargs)
        carried = vars(module)
        epsilon = carried.get(carrier_name("epsilon", site_method, call.index))
        patch = carried.get(carrier_name("patch", site_method, call.index))

        def perturb(value):
            return add_epsilon(value, internals.get_value(epsilon))

        value = session.exit(
            call,
            value,
            perturb if epsilon is not None else None,
            record=False,
            # this iteration's slice of the stacked patch
            patch=None if patch is None else internals.get_value(patch),
        )
        if session.discovering or call.name in session.selected:
            recording = session.to_carry_out(value)
            inputs = positional_arrays(args) if session.with_inputs else None
            key = carrier_name("recording", site_method, call.index)
            setattr(module, key, _Recording((recording, inputs)))
            session.defer(call.name, (path, key, names))
        return value

    def _keeps_shape(self, module: nnx.Module, path: str) -> bool:
        """Whether the module's parameters inside the transform have the shapes
        they have outside it (true of a module without any): not sliced."""
        return _param_shapes(module) == _param_shapes(self.modules[path])

    def _discover_carried(
        self, module, marker, step_key, call, names, method, args, kwargs, session
    ):
        """Discovery of a call whose module nnx.scan did not slice: the site
        holds every step, `(length, *value shape)`, as the scan's ys would."""
        frames = jax_internals.scan_frames(self.stop)
        depth = internals.depth("scan")
        if names != ("nnx.scan",) or len(frames) != 1 or depth > 1:
            inner = [n for n in names if n != "nnx.scan"]
            where = (
                f"inside {' inside '.join(reversed(inner))} inside nnx.scan"
                if inner
                else "inside nested scans (nnx.scan or lax.scan inside nnx.scan)"
            )
            raise BridgeNotImplementedError(
                f"'{call.path}' keeps its parameters' full shape inside nnx.scan "
                f"(the scan carries or broadcasts it) and is called {where}; "
                "bridge gives the sites of a carried module directly inside one "
                "nnx.scan only. Select sites outside it with `at=`."
            )
        length, reverse = frames[0]
        # Dropped if the scan broadcasts the module.
        internals.set_value(marker, internals.get_value(marker) + 1)
        self.checks.append((call.path, step_key, names))  # in call order
        value = method(module, *args, **kwargs)
        call.origin = Origin(
            call.path,
            names,
            (length, reverse),
            session.arrays.abstract(differentiable_part(value)),
            session.arrays.abstract(positional_arrays(args)),
        )
        value = session.exit(call, value, record=False)
        session.restructure(
            call.name,
            jax.tree.map(
                lambda v: jnp.broadcast_to(v, (length, *jnp.shape(v))),
                jax.tree.map(
                    lambda v: v if session.arrays.is_array(v) else None, value
                ),
            ),
        )
        return value

    def _run_carried(self, module, call, method, args, kwargs, session):
        """A selected (or patched) call whose module nnx.scan carries: its
        epsilon, patch value and recording hold every step; the carried
        counter picks the row."""
        site = session.selected.get(call.name) or session.patched[call.name]
        length, reverse = site.origin.scan
        variables = vars(module)

        def key(kind):
            return carrier_name(kind, call.method, call.index)

        counter = variables[key("step")]
        step = internals.get_value(counter)
        row = length - 1 - step if reverse else step
        epsilon = variables.get(key("epsilon"))
        patch = variables.get(key("patch"))

        def perturb(value):
            return add_epsilon(
                value, jax.tree.map(lambda e: e[row], internals.get_value(epsilon))
            )

        value = method(module, *args, **kwargs)
        rows = (  # this step's row of the stacked patch
            None
            if patch is None
            else jax.tree.map(lambda p: p[row], internals.get_value(patch))
        )
        value = session.exit(
            call,
            value,
            perturb if epsilon is not None else None,
            record=False,
            patch=rows,
        )
        internals.set_value(counter, step + 1)
        if call.name not in session.selected:
            return value
        recording = variables[key("recording")]
        values, inputs = internals.get_value(recording)
        values = _set_row(values, row, differentiable_part(value))
        if inputs is not None:
            inputs = _set_row(inputs, row, positional_arrays(args))
        internals.set_value(recording, (values, inputs))
        session.defer(call.name, (call.path, key("recording"), ("nnx.scan",)))
        return value

    def hand_over(self, session: Session) -> None:
        """Give the session the values recorded inside transforms, as they left."""
        for path, key, names in self.checks:
            if (
                internals.get_value(vars(self.modules[path]).get(key))
                is self.placed[path, key]
            ):
                raise self._broadcast_error(path, names)
        session.hand_over(self._recorded)

    def _recorded(self, where: tuple) -> tuple[Any, Any]:
        """A value recorded inside transforms, as it left them on the copy."""
        path, key, names = where
        recording = vars(self.modules[path]).get(key)
        if recording is None:
            raise BridgeValueError(
                f"bridge cannot see through {' inside '.join(reversed(names))} "
                f"around '{path}': its values did not come out with the module's "
                "parameters, so a perturbation there would be silently dropped. "
                "Select sites outside it."
            )
        if internals.get_value(recording) is self.placed.get((path, key)):
            raise self._broadcast_error(path, names)
        return internals.get_value(recording)

    def explain(self, error: ValueError) -> None:
        """NNX's own error when a transform broadcasts a module bridge records in."""
        message = str(error)
        if self.first_lifted is None or not (
            "Incorrect number of leaves" in message
            or "got axis spec None but output was batched" in message
        ):
            return
        raise self._broadcast_error(*self.first_lifted) from error

    @staticmethod
    def _broadcast_error(path: str, names: tuple[str, ...]) -> ValueError:
        return BridgeValueError(
            f"bridge cannot see through this {names[-1]} around '{path}': it "
            "broadcasts the module (in_axes=None for it, or None for its "
            "parameters in nnx.StateAxes), so one epsilon would serve every "
            "iteration (or mapped example) and their gradients would be summed. "
            "Select sites outside it, or map the module over its stacked "
            "parameters (in_axes=0)"
            + (
                ", or carry it (nnx.Carry for it in nnx.StateAxes)."
                if names[-1] == "nnx.scan"
                else "."
            )
        )


def _param_shapes(module: nnx.Module) -> dict:
    """The shapes of a module's parameters (its submodules' too), not bridge's."""
    return {
        path: jnp.shape(internals.get_value(variable))
        for path, variable in nnx.iter_graph(module)
        if isinstance(variable, nnx.Param) and not isinstance(variable, _BridgeVariable)
    }


def _set_row(rows: Any, row: Any, values: Any) -> Any:
    return jax.tree.map(lambda r, v: r.at[row].set(v), rows, values)


def transform_name(tag: Any) -> str:
    if isinstance(tag, str):
        return f"nnx.{tag.removesuffix('_body')}"
    name = type(tag).__name__.lower()
    for transform in ("jit", "shard_map", "pmap", "cond", "switch"):
        if transform in name:
            return f"nnx.{transform}"
    return f"an NNX transform ({type(tag).__name__})"
