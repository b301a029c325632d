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

    `ProbeBase` is the JAX backend of `ProbeFront`, the front every
    framework shares: the checks, selection, patch resolution, the discovery
    cache and the result in call order. The front's framework steps are
    hooks, which `ProbeBase` implements for JAX; a probe of a model of
    another framework (the built-in PyTorch adapter's) subclasses
    `ProbeFront` and implements them instead of `_trainable` and `_run`:

    - `runs_in_jax = False` (`bridge.compare` runs it outside `jax.jit`), and
      `_arrays`, its values as the core sees them (an `Arrays`);
    - `_prepare_inputs(self, args, kwargs) -> (args, kwargs)` and
      `_prepare_patch(self, patch) -> patch`: the checks of the inputs, and
      the user's values converted to the model's;
    - `_discovery_key(self, args, kwargs)`: its key in the one discovery
      cache, or `None`; a key `(DiscoveryOwner(probe), ...)` makes the
      discoveries go with the probe (they may hold the model's weights);
    - `_discover_afresh(self, args, kwargs, loss_fn) -> (Discovery, abstract
      loss or None)` and `_abstract_loss(self, outputs, loss_fn)`: the loss
      on the outputs the `Discovery` kept, `UNCHECKED_LOSS` where it cannot
      be told without a real run (check the real loss with `check_loss`);
    - `_forward(self, plan) -> (outputs, activations, state, ran)` and
      `_differentiate(self, loss_fn, plan, has_aux, with_inputs) ->
      ProbeResult`: the real run of a checked `CallPlan`, dicts in any order.

    Inside `_run`, the session is the one object an adapter reports to: a
    facade over small parts, each an attribute with one job. The same adapter
    code serves a discovery (every call listed as a `Site`, nothing changed)
    and a run (the selected sites perturbed and recorded, the patched ones
    patched): an adapter never asks which, it asks what it needs to know.

    - what was asked: `session.selected` (`{name: Site}`), `epsilons`,
      `patches`, `patched` (the `Site` of each patched site), `with_inputs`,
      `batch_axis`, `arrays`; a discovery asks for nothing (all empty);
      `session.enclosing` gives the paths of the calls running now;
    - naming (`session.naming`): each call's name, `path[.method][#k]`;
    - the recorder (`session.recorder`), the one part that differs between a
      discovery and a run, answers: `learns_sites()` (whether this pass learns
      each site's shapes and origin, which a run then relies on: also the
      model's first trace on these inputs) and `needs_value(name)` (whether
      the site's value must reach the session: every site's at discovery, a
      selected or patched one's in a run);
    - taps (`session.taps`): `with session.taps.tapping(handler):` routes
      `bridge.tap` through the adapter, which calls `session.tap_here`.

    Report every call plainly, wherever it runs: inside the model's own
    `jax.vmap`, `lax.scan` (however spelled), `lax.cond`, `jax.checkpoint`,
    `jax.jit` or a library's lifted transforms built on them, the core reads
    where the call runs from the computation JAX builds (each value passes
    through a marker primitive, and one rule per higher-order primitive
    carries the site's epsilon, patch and value across it: a site per
    iteration of a scan, per example of the model's vmap, `ran` for a
    branch) and refuses, with one sentence, a call inside a primitive no
    rule crosses (a `while_loop`). An adapter decides no route. What the
    core cannot see in the computation — a `custom_vjp` whose backward
    pass calls the body again (Equinox's checkpointed while loop) — has one
    fallback: `session.call_in_control_flow(..., flow, run)`, given where
    the call runs (a `ControlFlow`: the transforms, and each loop's length
    and counter), which closes the body over the epsilon and brings the
    value out through the backward pass.

    Register the subclass as a pytree whose leaves are the model's variables
    (`jax.tree_util.register_pytree_node_class`), so `jax.jit(step)(probe, x)`
    traces them.

2. For `bridge.transfer` and `bridge.compare`, name a module, the
    adapter's `PortingSide`, in the class's `porting_side` attribute. It has
    two functions: `layers(probe, sites) -> list[Layer]` (each parameterised
    call, its weights in the canonical layout of `bridge._porting.transfer`'s
    table) and `with_weights(probe, [(Layer, {name: canonical array})]) ->
    probe`; optionally `in_float64(probe) -> probe` for
    `bridge.compare(..., dtype="float64")`. `ProbeFront` makes the probe a
    `PortableProbe`: porting calls nothing else of it.

3. `register_adapter(ModelClass, factory)`, where `factory(model, *variables,
    vmap=bool)` returns the probe.

`Site` is what discovery finds (name, path, module, the value's shapes);
`Session` is the per-call bookkeeping an adapter reports to; `key_name`
turns a JAX key-path entry into a path component, as the built-in adapters
name sites.

The built-in adapters (`bridge.adapters.*`) import from bridge only this
module, so everything they rely on is here, documented, and a core change that
breaks it breaks a tested API, not an adapter's private import:

- the probe: `ProbeBase` (JAX), `ProbeFront` (the front every backend
  extends), `BATCH_AXIS` (the probe's own `jax.vmap` axis name with
  `vmap=True`), `register_adapter`; for the framework's steps, `CallPlan`,
  `ProbeResult`, `Discovery`, `DiscoveryOwner`, `UNCHECKED_LOSS` and
  `check_loss`;
- the session: `Session`, `Request` (what one trace is asked to do, from
  which a backend of its own makes its sessions), `Recorder` (what
  `session.recorder` answers), `Call` (what `enter` returns),
  `current_session()` (the session tracing the model now, or `None`),
  `positional_arrays(args)` (a call's inputs as a recording keeps them);
- sites and values: `Site`, `SiteOrigin`, `Arrays` (a framework's values as
  the core sees them), `register_norms` (how `ProbeResult.norms()` takes the
  norms of a framework's values that are not JAX arrays), `key_name`,
  `strip_call_index`, `add_epsilon`,
  `abstract`, `is_array`, `differentiable_part`, `merge_differentiable`,
  `zeros_like_struct`, `without_axis`;
- porting (`transfer`/`compare`): `PortingSide` and `PortableProbe` (what
  porting needs of an adapter and of its probe), `Layer` (with `tied`, the
  path of the module whose tensors a tied layer holds, left unpaired); the
  table of a library's
  layer kinds, `LayerKinds` (`{module class: converter}`, looked up along the
  class's MRO; a key may be a class's qualified name, so that another library's
  class is listed without importing it), whose converters read a
  `ParameterisedCall` into `Converted` canonical `Weight`s, `weight_by_weight`
  (the `weights:<names>` kind), `weight_rmsnorm` (an RMSNorm keeping its scale
  as `weight`, less an offset) and `placed` (what `with_weights` writes, and
  where); the canonical-layout helpers `dense_kernel`,
  `channel_first_kernel_axes`, `flatten_trailing`, `flattened`,
  `replace_leaves`, and the hyperparameter readers `as_float`,
  `conv_hyperparameters`, `torch_named_conv_hyperparameters`,
  `conv_padding_mode`, `norm_hyperparameters`, `AsGiven`;
- versions: `unsupported(distribution, adapter, missing)`, the error for a
  library release whose private internals an adapter cannot find;
- errors: `BridgeError` and its concrete kinds (`BridgeValueError`,
  `BridgeTypeError`, `BridgeRuntimeError`, `BridgeNotImplementedError`,
  `BridgeImportError`, `BridgeAssertionError`), each also the built-in type
  its name says: every error an adapter raises is one of them.
"""

from ._errors import BridgeAssertionError as BridgeAssertionError
from ._errors import BridgeError as BridgeError
from ._errors import BridgeImportError as BridgeImportError
from ._errors import BridgeNotImplementedError as BridgeNotImplementedError
from ._errors import BridgeRuntimeError as BridgeRuntimeError
from ._errors import BridgeTypeError as BridgeTypeError
from ._errors import BridgeValueError as BridgeValueError
from ._porting.contract import PortableProbe as PortableProbe
from ._porting.contract import PortingSide as PortingSide
from ._porting.hyperparameters import AsGiven as AsGiven
from ._porting.hyperparameters import as_float as as_float
from ._porting.hyperparameters import conv_hyperparameters as conv_hyperparameters
from ._porting.hyperparameters import conv_padding_mode as conv_padding_mode
from ._porting.hyperparameters import norm_hyperparameters as norm_hyperparameters
from ._porting.hyperparameters import (
    torch_named_conv_hyperparameters as torch_named_conv_hyperparameters,
)
from ._porting.layer_kinds import Converted as Converted
from ._porting.layer_kinds import LayerKinds as LayerKinds
from ._porting.layer_kinds import ParameterisedCall as ParameterisedCall
from ._porting.layer_kinds import Weight as Weight
from ._porting.layer_kinds import placed as placed
from ._porting.layer_kinds import weight_by_weight as weight_by_weight
from ._porting.layer_kinds import weight_rmsnorm as weight_rmsnorm
from ._porting.transfer import Layer as Layer
from ._porting.transfer import channel_first_kernel_axes as channel_first_kernel_axes
from ._porting.transfer import dense_kernel as dense_kernel
from ._porting.transfer import flatten_trailing as flatten_trailing
from ._porting.transfer import flattened as flattened
from ._porting.transfer import replace_leaves as replace_leaves
from ._probe.batching import BATCH_AXIS as BATCH_AXIS
from ._probe.checks import UNCHECKED_LOSS as UNCHECKED_LOSS
from ._probe.checks import check_loss as check_loss
from ._probe.discovery_cache import Discovery as Discovery
from ._probe.discovery_cache import DiscoveryOwner as DiscoveryOwner
from ._probe.front import CallPlan as CallPlan
from ._probe.front import ProbeFront as ProbeFront
from ._probe.jax_backend import ProbeBase as ProbeBase
from ._probe.norms import register_norms as register_norms
from ._probe.registry import register_adapter as register_adapter
from ._probe.result import ProbeResult as ProbeResult
from ._session.backward import BOUNDED_WHILE as BOUNDED_WHILE
from ._session.backward import CHECKPOINTED_WHILE as CHECKPOINTED_WHILE
from ._session.backward import FORI_LOOP as FORI_LOOP
from ._session.backward import ControlFlow as ControlFlow
from ._session.backward import record as record
from ._session.naming import Call as Call
from ._session.recorders import Recorder as Recorder
from ._session.routing import BRANCH as BRANCH
from ._session.routing import CONVERTED as CONVERTED
from ._session.routing import CONVERTED_FIX as CONVERTED_FIX
from ._session.routing import JAX_RULES as JAX_RULES
from ._session.routing import LOOP_AMONG as LOOP_AMONG
from ._session.routing import UNBOUNDED_LOOP as UNBOUNDED_LOOP
from ._session.routing import Refused as Refused
from ._session.routing import Rule as Rule
from ._session.routing import Transform as Transform
from ._session.routing import blocked as blocked
from ._session.routing import refusal as refusal
from ._session.session import Request as Request
from ._session.session import Session as Session
from ._session.session import current as current_session
from ._session.session import positional_arrays as positional_arrays
from ._session.sites import Arrays as Arrays
from ._session.sites import Site as Site
from ._session.sites import SiteOrigin as SiteOrigin
from ._session.sites import abstract as abstract
from ._session.sites import add_epsilon as add_epsilon
from ._session.sites import differentiable_part as differentiable_part
from ._session.sites import is_array as is_array
from ._session.sites import key_name as key_name
from ._session.sites import merge_differentiable as merge_differentiable
from ._session.sites import strip_call_index as strip_call_index
from ._session.sites import without_axis as without_axis
from ._session.sites import zeros_like_struct as zeros_like_struct
from ._versions import unsupported as unsupported

__all__ = [
    "BOUNDED_WHILE",
    "blocked",
    "Transform",
    "Rule",
    "Refused",
    "LOOP_AMONG",
    "JAX_RULES",
    "Arrays",
    "register_norms",
    "AsGiven",
    "BATCH_AXIS",
    "BRANCH",
    "BridgeAssertionError",
    "BridgeError",
    "BridgeImportError",
    "BridgeNotImplementedError",
    "BridgeRuntimeError",
    "BridgeTypeError",
    "BridgeValueError",
    "CONVERTED",
    "CONVERTED_FIX",
    "Call",
    "CallPlan",
    "ControlFlow",
    "Converted",
    "Discovery",
    "DiscoveryOwner",
    "CHECKPOINTED_WHILE",
    "FORI_LOOP",
    "Layer",
    "LayerKinds",
    "ParameterisedCall",
    "PortableProbe",
    "PortingSide",
    "ProbeBase",
    "ProbeFront",
    "ProbeResult",
    "Recorder",
    "Request",
    "Session",
    "Site",
    "SiteOrigin",
    "UNBOUNDED_LOOP",
    "UNCHECKED_LOSS",
    "Weight",
    "abstract",
    "add_epsilon",
    "as_float",
    "channel_first_kernel_axes",
    "check_loss",
    "conv_hyperparameters",
    "conv_padding_mode",
    "current_session",
    "dense_kernel",
    "differentiable_part",
    "flatten_trailing",
    "flattened",
    "is_array",
    "key_name",
    "merge_differentiable",
    "norm_hyperparameters",
    "placed",
    "positional_arrays",
    "record",
    "refusal",
    "register_adapter",
    "replace_leaves",
    "strip_call_index",
    "torch_named_conv_hyperparameters",
    "unsupported",
    "weight_by_weight",
    "weight_rmsnorm",
    "without_axis",
    "zeros_like_struct",
]
