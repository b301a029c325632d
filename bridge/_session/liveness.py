"""Which discovered calls are in the computation that runs.

JAX runs the model's Python when it traces, and a trace is not a call: a
`lax.scan` or `while_loop` whose carry changes type (a Python `0` that
becomes a float) traces its body twice and keeps only the second trace. A
site seen in a discarded trace is no site. And a call whose value reaches
nothing (a model that calls a module twice and drops the first result) is a
site whose gradient is zero by construction: bridge says so (`Site.dead`)
rather than let a zero pass for a measurement.

Discovery is one abstract trace of the model to a jaxpr. There each site's
array value passes through `site_marker`, an identity primitive holding the
site's name (`computation.mark`, which a run binds the same way at the sites
the computation routes). A marker absent from the jaxpr was bound in a trace
JAX threw away; a marker that JAX's dead-code elimination removes, given the
model's outputs and state as what is used, belongs to a dead call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.interpreters import partial_eval as pe

from .context import PROBE_AXIS
from .naming import renumbered
from .sites import Site

site_marker = Primitive("bridge_site")
site_marker.multiple_results = True
site_marker.def_impl(lambda *values, **params: list(values))
site_marker.def_abstract_eval(lambda *avals, **params: list(avals))


def _marker_jvp(primals, tangents, **params):
    return site_marker.bind(*primals, **params), list(tangents)


def _mapped_first(values, dims):
    """The values with their mapped axis first: a site inside the model's own
    `jax.vmap` holds every mapped example, mapped axes outermost first."""
    moved = [
        value if dim is None else jnp.moveaxis(value, dim, 0)
        for value, dim in zip(values, dims, strict=True)
    ]
    return moved, [None if dim is None else 0 for dim in dims]


def _marker_batched(values, dims, **params):
    values, dims = _mapped_first(values, dims)
    params = {**params, "mapped": params.get("mapped", 0) + 1}
    return site_marker.bind(*values, **params), dims


def _marker_batched_on_axis(axis_data, values, dims, **params):
    # `mapped` counts the model's own vmaps around the marker, not the probe's.
    values, dims = _mapped_first(values, dims)
    mapped = params.get("mapped", 0) + (axis_data.name != PROBE_AXIS)
    return site_marker.bind(*values, **{**params, "mapped": mapped}), dims


def _marker_partial_eval(trace, *tracers, **params):
    """In a partial evaluation (`pe.trace_to_jaxpr_nounits`), a marker whose
    value is known passes it on unmarked. JAX's default would bind it in the
    enclosing trace, outside the function evaluated: Flax's pass over an
    `nn.scan` body before the scan (to find what the body broadcasts), whose
    jaxpr it discards, would leave there a marker of a call the scan makes,
    with one iteration's value. An unknown value is marked in the jaxpr
    built, as any primitive is: a discarded jaxpr takes its markers along."""
    if all(tracer.pval.is_known() for tracer in tracers):
        return list(tracers)
    return trace.default_process_primitive(site_marker, tracers, params)


ad.primitive_jvps[site_marker] = _marker_jvp
pe.custom_partial_eval_rules[site_marker] = _marker_partial_eval
if hasattr(batching, "fancy_primitive_batchers"):  # the axis's name: jax >= 0.4.36
    batching.fancy_primitive_batchers[site_marker] = _marker_batched_on_axis
else:  # pragma: no cover
    batching.primitive_batchers[site_marker] = _marker_batched
mlir.register_lowering(
    site_marker, mlir.lower_fun(lambda *values, **params: list(values), True)
)


def _sub_jaxprs(value: Any) -> Iterable[Any]:
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
        yield value.jaxpr
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _sub_jaxprs(item)


def _marked_names(jaxpr: Any, found: set[str]) -> set[str]:
    for eqn in jaxpr.eqns:
        if eqn.primitive is site_marker:
            found.add(eqn.params["name"])
        for param in eqn.params.values():
            for sub in _sub_jaxprs(param):
                _marked_names(sub, found)
    return found


def used_inputs(jaxpr: Any) -> list[bool]:
    """Which of `jaxpr`'s inputs its outputs depend on: JAX's own dead code
    elimination, which sees into the jaxprs of `jit`, `scan`, ...; where it
    is not at hand, a walk back from the outputs that counts every input of
    an equation whose output is used (more inputs used, never fewer)."""
    try:
        from jax._src.interpreters import partial_eval

        return list(partial_eval.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))[1])
    except (ImportError, AttributeError, TypeError):  # pragma: no cover
        from jax.extend.core import Var

        needed = {v for v in jaxpr.outvars if isinstance(v, Var)}
        for equation in reversed(jaxpr.eqns):
            if equation.effects or any(v in needed for v in equation.outvars):
                needed.update(v for v in equation.invars if isinstance(v, Var))
        return [v in needed for v in jaxpr.invars]


def present_and_live(closed_jaxpr: Any) -> tuple[set[str], set[str] | None]:
    """The names of the markers in the jaxpr, and of those that reach its
    outputs (`None` where this JAX's dead-code elimination is not found:
    every present marker then counts as live)."""
    jaxpr = closed_jaxpr.jaxpr
    present = _marked_names(jaxpr, set())
    try:
        from jax._src.interpreters import partial_eval as pe

        kept, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    except (ImportError, AttributeError, TypeError):  # pragma: no cover
        return present, None
    return present, _marked_names(kept, set())


def in_the_computation(sites: list[Site], closed_jaxpr: Any) -> list[Site]:
    """The sites of a discovery that JAX kept: a site marked nowhere in the
    jaxpr was seen only in a discarded trace and is dropped (the others
    numbered again, `renumbered`); a site whose marks do not reach the
    outputs is `dead`. Sites that carry nothing to mark (integer values, a
    framework's own tensors) and refused sites are kept as they are."""
    present, live = present_and_live(closed_jaxpr)

    def judged(site: Site) -> bool:
        return site.differentiable and not site.refused

    kept = renumbered(sites, lambda site: not judged(site) or site.name in present)
    if live is None:
        return kept
    return [
        dataclasses.replace(site, dead=True)
        if judged(site) and (site.traced_as or site.name) not in live
        else site
        for site in kept
    ]
