"""Discovery, reused: the sites of a call are found once per structure.

One cache for every framework. `ProbeFront._discover` asks the probe for a
key (`_discovery_key`) and, where nothing is kept under it, discovers afresh
(`_discover_afresh`). A JAX model is traced abstractly (`jax.eval_shape`) to
find its sites and shape their epsilons, and the real run then traces it
again; a PyTorch model runs on fake tensors, keyed by its own signature
(`bridge.adapters.torch`), its discoveries dropped with its probe
(`DiscoveryOwner`). Without reuse, every `sites`, `apply` and
`value_and_grad` discovered anew: a second `jax.jit` compilation of the same
step, a `sites()` after a `value_and_grad`, an `apply` after a `sites()`,
`bridge.compare`'s pass over the layers before its run. Under `jax.jit` the
probe object is rebuilt from its leaves on every trace, so neither the probe's
identity nor its leaves' values can tell two calls apart: only their
structure can, and structure is all that discovery sees.

The JAX key (`structure_key`) is what `jax.jit` keys its own trace cache on:

- the probe's pytree structure: its type and its static parts (a Linen
  module and its attributes, an NNX graph definition with its static
  attributes, an Equinox model's static fields and functions, a Haiku
  transformed function) and `vmap`;
- the abstract type of each of the probe's leaves (shape, dtype, weak type,
  and, where JAX's types carry them, sharding and the manual axes a value
  varies over inside `shard_map`);
- the same of the call's array inputs, their structure, and their other
  leaves by value (`train=True`, `mutable=["batch_stats"]`);
- the configuration that changes what a trace produces (x64, dtype
  promotion, the PRNG implementation, `jax.disable_jit`) and the mesh in
  context.

Never an array's values. Where a part is unhashable (a list among a Linen
module's attributes, an unhashable keyword argument), there is no key and
the call discovers afresh, as it always did.

What is kept (`Discovery`): the sites — names, shapes, `stacked`, the module
object (for selection by class or predicate, and for the porting layer's
hyperparameters), the adapter's `origin` — and the outputs' abstract
structure, so a loss function is checked against it without running the
model (`ProbeFront._abstract_loss`). A site's module is an object of a
finished trace whichever trace made it, as it always was; an `origin` is
used by the adapter in later runs, so a discovery is kept only where every
origin is plain data (`is_plain`: strings, numbers, tuples, frozen records
of them, `jax.ShapeDtypeStruct`s), never a tracer or an object of the trace
that made it.

Bounded: the `maxsize` most recently used discoveries are kept (LRU), behind
a lock. `CACHE.clear()` forgets them; `CACHE.maxsize = 0` turns reuse off,
for debugging a suspected stale discovery (say, a model whose code reads a
global that changed: `jax.jit` would reuse its trace there too).

A discovery for a run that records inputs (`with_inputs=True`) also marks
every call's inputs where they are (`marking_inputs`), so that the run reads
them there; it is kept apart from the plain one, which does not pay for it
(handing inputs out of the model's own `jax.vmap`s costs a first lowering
of Equinox's GPT-2 about a quarter more: docs/architecture.md).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import enum
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

from .._session.sites import (
    Site,
    abstract_array,
    device_invariant,
    is_array,
    type_of,
    varying_like,
)

_MARKING_INPUTS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "bridge_discovery_marks_inputs", default=False
)


@contextlib.contextmanager
def marking_inputs(marking: bool = True):
    """Discoveries made inside mark every call's inputs too."""
    token = _MARKING_INPUTS.set(marking)
    try:
        yield
    finally:
        _MARKING_INPUTS.reset(token)


def marks_inputs() -> bool:
    """Whether a discovery made now marks every call's inputs."""
    return _MARKING_INPUTS.get()


@dataclasses.dataclass(frozen=True, eq=False)
class Discovery:
    """What one discovery found.

    Attributes:
      sites: every site of the call, in call order.
      outputs: the model's outputs, abstractly, as the probe's
        `_abstract_loss` reads them: for a JAX model `(treedef, leaves)`
        (`abstract_outputs`). `None` where they cannot be kept (an output
        leaf that is neither an array nor plain data): then the loss was
        checked inside the discovery trace, and the discovery is not kept.
      replay: the discovery's trace, which a later run evaluates rather than
        tracing the model again (`bridge._session.computation.Replay`), or
        `None` where no run can.
    """

    sites: tuple[Site, ...]
    outputs: Any
    replay: Any = None

    @property
    def reusable(self) -> bool:
        return self.outputs is not None and all(
            is_plain(site.origin) for site in self.sites
        )


def abstract_loss(outputs: tuple[Any, list], loss_fn: Callable[[Any], Any]) -> Any:
    """`loss_fn`'s abstract value on the outputs `abstract_outputs` kept: a
    trace of the loss alone.

    Inside `shard_map` an output varying across devices is made varying
    inside the trace (`jax.eval_shape` takes no varying struct), so a
    collective in the loss sees what it sees in the real run.
    """
    treedef, leaves = outputs
    structs = [leaf for leaf in leaves if isinstance(leaf, jax.ShapeDtypeStruct)]

    def on_outputs(arrays: list) -> Any:
        given = iter(map(varying_like, arrays, structs))
        merged = [
            next(given) if isinstance(leaf, jax.ShapeDtypeStruct) else leaf
            for leaf in leaves
        ]
        return loss_fn(jax.tree.unflatten(treedef, merged))

    return jax.eval_shape(on_outputs, [device_invariant(s) for s in structs])


def abstract_outputs(outputs: Any) -> tuple[Any, list] | None:
    """`(treedef, leaves)` of the outputs, arrays made abstract (`None` where a
    leaf is neither an array nor plain data: it may belong to the trace)."""
    leaves, treedef = jax.tree.flatten(outputs)
    abstract = []
    for leaf in leaves:
        if is_array(leaf):
            # A weak type changes dtype promotion in the loss.
            abstract.append(abstract_array(leaf, weak_type=True))
        elif isinstance(leaf, _PLAIN_SCALARS):
            abstract.append(leaf)
        else:
            return None
    return treedef, abstract


_PLAIN_SCALARS = (bool, int, float, complex, str, bytes, type(None), np.dtype)


def is_plain(value: Any) -> bool:
    """Whether `value` is data only, safe to use in another trace: no tracer,
    no object of the trace that made it."""
    if isinstance(value, (*_PLAIN_SCALARS, enum.Enum, jax.ShapeDtypeStruct)):
        return True
    if isinstance(value, tuple | list | frozenset):
        return all(is_plain(item) for item in value)
    if isinstance(value, dict):
        return all(is_plain(k) and is_plain(v) for k, v in value.items())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return all(
            is_plain(getattr(value, field.name)) for field in dataclasses.fields(value)
        )
    return False


# -- the key ---------------------------------------------------------------------

#: Configuration that changes what a trace produces: abstract types, and
#: `jax.disable_jit`, under which a `lax.scan` runs as a Python loop (one call
#: per layer, so other sites).
_CONFIG = (
    "jax_disable_jit",
    "jax_enable_x64",
    "jax_numpy_dtype_promotion",
    "jax_numpy_rank_promotion",
    "jax_default_prng_impl",
)


def structure_key(probe: Any, args: tuple, kwargs: dict) -> Hashable | None:
    """What a discovery of `probe` on these inputs depends on, never array
    values; `None` where some part is unhashable (discover afresh)."""
    try:
        leaves, treedef = jax.tree.flatten(probe)
        inputs, inputs_treedef = jax.tree.flatten((args, kwargs))
        key = (
            type(probe),
            treedef,
            tuple(_abstract_type(leaf) for leaf in leaves),
            getattr(probe, "vmap", False),
            inputs_treedef,
            tuple(
                _abstract_type(leaf) if is_array(leaf) else (type(leaf), leaf)
                for leaf in inputs
            ),
            _context(),
        )
        hash(key)
    except TypeError:  # unhashable, or a leaf JAX has no type for
        return None
    return key


def _abstract_type(leaf: Any) -> Any:
    """The leaf's type as JAX sees it: shape, dtype, weak type, sharding, and
    the manual axes it varies over (as `jax.jit` keys its traces)."""
    aval = type_of(leaf)
    if hasattr(aval, "val"):  # a `ConcreteArray` (older jax): the type, not the value
        return (aval.shape, aval.dtype, aval.weak_type)
    return aval


def _context() -> tuple:
    mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    return (
        tuple(getattr(jax.config, name, None) for name in _CONFIG),
        mesh() if mesh is not None else None,
    )


# -- the cache -------------------------------------------------------------------


class DiscoveryCache:
    """The `maxsize` most recently used discoveries, by key (`structure_key`
    for a JAX model).

    Thread-safe: two threads may discover the same key at once (both trace;
    the second store wins, with an equal discovery).
    """

    def __init__(self, maxsize: int = 16):
        self.maxsize = maxsize
        self.hits = 0
        self.misses = 0
        self._entries: collections.OrderedDict[Hashable, Discovery] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()
        # Owners gone (`discard`) whose entries are still to be dropped.
        self._gone: list[DiscoveryOwner] = []

    def get(self, key: Hashable | None) -> Discovery | None:
        if key is None or self.maxsize <= 0:
            return None
        with self._lock:
            if self._gone:
                self._drop_gone()
            try:
                found = self._entries.get(key)
            except (TypeError, ValueError):
                # An `==` between static parts that is not a plain bool (an
                # elementwise comparison): treat as a different structure.
                found = None
            if found is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return found

    def put(self, key: Hashable | None, discovery: Discovery) -> None:
        if key is None or self.maxsize <= 0 or not discovery.reusable:
            return
        with self._lock:
            if self._gone:
                self._drop_gone()
            try:
                self._entries[key] = discovery
                self._entries.move_to_end(key)
            except (TypeError, ValueError):
                return
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)

    def discard(self, owner: DiscoveryOwner) -> None:
        """Forget the discoveries whose key starts with `owner`.

        Called by a finalizer, which may run in the middle of this cache's own
        work in the same thread (a garbage collection): it never waits for the
        lock, and what it cannot drop now is dropped by the next `get` or
        `put`.
        """
        self._gone.append(owner)
        if self._lock.acquire(blocking=False):
            try:
                self._drop_gone()
            finally:
                self._lock.release()

    def _drop_gone(self) -> None:
        gone = []
        while self._gone:
            gone.append(self._gone.pop())
        dropped = [
            key
            for key in self._entries
            if isinstance(key, tuple) and key and any(key[0] is g for g in gone)
        ]
        for key in dropped:
            del self._entries[key]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)


class DiscoveryOwner:
    """The first item of the discovery keys of a probe whose discoveries must
    not outlive it: a PyTorch model's sites hold its submodules, and with
    them its weights. They are dropped from `CACHE` when the probe is garbage
    collected.

    Args:
      probe: the probe whose discoveries this owner's keys name.
    """

    __slots__ = ()

    def __init__(self, probe: Any):
        weakref.finalize(probe, CACHE.discard, self)


#: The process's discoveries, shared by every probe.
CACHE = DiscoveryCache()
