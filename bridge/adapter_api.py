"""What an adapter author needs, and nothing a user does.

`bridge` itself exports the user API (`probe`, `compare`, `transfer`, `tap`,
the results, the `ActivationProbe` protocol, `register_adapter`). A library
bridge does not know is added from outside with this module alone, as
`examples/penzai_adapter.py` adds Penzai:

1. Subclass `ProbeBase` and implement

   - `_trainable(self) -> pytree`: what `grads` differentiates;
   - `_run(self, trainable, args, kwargs, session) -> (outputs, state)`: call
     the model once (one example with `vmap=True`) with `trainable`, and
     report every submodule call to `session`: `call = session.enter(path,
     method, module, args)` before it and `value = session.exit(call, value)`
     after it (the value returned is the one to pass on: epsilon added,
     patched, recorded). `state` is `None` for a model without state;
   - optionally `_check_call(self, args, kwargs)` (validate the call before
     any work) and `_format_grads(self, grads)` (the library's structure);
   - optionally `reuses_discovery = True`, once the pytree flattening holds
     everything the sites depend on (static parts in the treedef) and every
     `origin` given to `session.enter` (a `SiteOrigin` subclass) is plain
     data: discovery is then reused across calls of the same structure;
   - optionally `_check_paths(self, at, patch)`: refuse, before any work,
     paths that can never be sites in this library, saying why.

   Inside `_run`, the session's declared hooks are the only things an
   adapter changes:

   - taps: `with session.tapping(handler):` routes `bridge.tap` through the
     adapter, which calls `session.tap_here` where the value is reachable,
     and inside a lifted transform may report the tap as a site of the
     module calling it (`session.enter(path, None, None)`, an origin with
     `tap=name`), carried like that module's own values;
   - patches: `session.exit(call, value, patch=row)` applies one iteration's
     row of a patch value the adapter carried into a lifted transform
     (`session.patched_with_values()` gives the `Site` of each).

   The carrier: a lifted transform (a scan, a layer stack, a remat) sees only
   what its library carries through it, so an adapter moves bridge's values
   through the library's own variables (Linen collections, Haiku state, NNX
   module attributes), and the session says what moves:

   - in: `session.to_carry_in(carried, patch_carried)` lists what to place
     before the call (epsilons, patch values, a scan's step counters and
     recording rows), each under its `name`,
     `carrier_name(kind, method, index)`; `is_carrier_name` tells them from
     the user's variables;
   - out: a site there carries `session.to_carry_out(value)`, says where with
     `session.defer(name, where)`, and after the call
     `session.hand_over(read)` reads each back (`read(where) -> (value,
     inputs)`): at discovery that reshapes the site to its stacked shape, in
     a run it records it;
   - through a transform of the adapter's own (Equinox records the sites in
     a scan through a `jax.vjp` of the model): `session.recordings()`
     leaves it as outputs and `session.adopt(...)` takes them back;
   - re-traces: a library that traces a body more than once keeps a
     `BodyTraces(session)` and calls `begin`/`again` (or `begin_or_again`)
     where a body's trace starts, so a repeated trace re-uses the first one's
     names.

   Register the subclass as a pytree whose leaves are the model's variables
   (`jax.tree_util.register_pytree_node_class`), so `jax.jit(step)(probe, x)`
   traces them.
2. For `bridge.transfer` and `bridge.compare`, name a module in the class's
   `_porting` attribute with two functions: `layers(probe, sites) ->
   list[Layer]` (each parameterised call, its weights in the canonical layout
   of `bridge._porting`'s table) and `with_weights(probe, [(Layer, {name:
   canonical array})]) -> probe`.
3. `register_adapter(ModelClass, factory)`, where `factory(model, *variables,
   vmap=bool)` returns the probe.

`Site` is what discovery finds (name, path, module, the value's shapes);
`Session` is the per-call bookkeeping an adapter reports to; `key_name`
turns a JAX key-path entry into a path component, as the built-in adapters
name sites.
"""

from ._porting import Layer as Layer
from ._probe import ProbeBase as ProbeBase
from ._registry import register_adapter as register_adapter
from ._session import BodyTraces as BodyTraces
from ._session import Session as Session
from ._sites import Site as Site
from ._sites import SiteOrigin as SiteOrigin
from ._sites import carrier_name as carrier_name
from ._sites import is_carrier_name as is_carrier_name
from ._sites import key_name as key_name

__all__ = [
    "BodyTraces",
    "Layer",
    "ProbeBase",
    "Session",
    "Site",
    "SiteOrigin",
    "carrier_name",
    "is_carrier_name",
    "key_name",
    "register_adapter",
]
