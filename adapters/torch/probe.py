"""PyTorch: a `torch.nn.Module` through the same protocol as the JAX libraries.

Most ports into JAX start from a PyTorch model, so `bridge.transfer` and
`bridge.compare` must see a PyTorch model the way they see a JAX one. The
mechanism is the epsilon trick in PyTorch's own terms:

- The model runs on a *shell*, made per call: a shallow copy of each module
  with its own containers (parameters, buffers, submodules, hooks), so
  nothing of the user's module is touched, not even for the length of a
  call, and no weight is copied. Each submodule of the shell (every entry of
  `named_modules()` but the root) gets a forward pre-hook and a forward hook,
  removed in a `finally`, also when the model or the loss raises. The
  pre-hook reports
  the call's entry to the `Session` (sites are ordered by call entry, named by
  `named_modules()` paths, `#k` for repeated calls); the forward hook hands the
  output to the session, which patches it, records a detached copy and hands
  the model, in its place, the output passed through `_Catch`: an identity
  whose backward keeps the gradient it is given — what a zero epsilon added
  there would get, without the zeros, the add or a copy.
- One `torch.autograd.grad` of the loss with respect to the parameters gives
  both gradient sets in one backward pass. Each call has a catch of its own,
  consumed only by the code after the call, so the gradients of a module
  called twice are never summed.
- The shell runs through `torch.func.functional_call` with detached aliases
  of the user's parameters (no copy; `.grad` of the user's parameters is never
  touched) and clones of the buffers (a training-mode BatchNorm updates the
  clones, returned in `res.state`, never the user's running statistics).
- Discovery (`sites`, and the checks before a call) runs the model on fake
  tensors (`FakeTensorMode`): shapes without FLOPs. A model that fake tensors
  cannot run (data-dependent shapes, an operator without a meta kernel) is
  discovered by a real forward pass instead, with the RNG state restored.
  Discovery is kept per input signature (`_signature`) and reused.

Every forward pass runs with autograd enabled and the parameters'
`requires_grad` as the user set them, in discovery and in `apply` too: fused
inference fast paths (`nn.TransformerEncoderLayer`, `nn.MultiheadAttention`
in `eval()` without grad) skip their submodules, and the sites must not
change between discovery and the real run.

Torch tensors as the core's arrays are `_torch_arrays`; the catch is
`_torch_catch`; PyTorch's private internals are `_torch_internals`.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import torch
from torch.func import functional_call

from bridge.adapter_api import (
    BridgeTypeError,
    BridgeValueError,
    Call,
    ForwardResult,
    ProbeResult,
    Site,
    check_loss,
    check_loss_fn,
    check_patch_kind,
    check_selection,
    current_session,
    in_order,
    resolve_patches,
    select,
)

from . import internals
from .arrays import (
    TORCH_ARRAYS,
    Spec,
    TensorLeaf,
    detached,
    to_torch,
)
from .session import TorchSession


class TorchProbe:
    """A `torch.nn.Module` under probe. Results are detached torch tensors."""

    _porting = "bridge.adapters.torch.porting"
    vmap = False

    def __init__(self, module: torch.nn.Module, *variables: Any, vmap: bool = False):
        if vmap:
            raise BridgeValueError(
                "vmap=True does not apply to a PyTorch model: the probe calls it "
                "on the whole batch, as PyTorch models are written. Use "
                "bridge.probe(module) and pass batched inputs."
            )
        if variables:
            raise BridgeTypeError(
                "A PyTorch module carries its own parameters and buffers: call "
                f"bridge.probe(module) without variables; got {len(variables)} "
                "more argument(s)."
            )
        self.module = module
        self._discovered: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"TorchProbe({type(self.module).__name__})"

    # -- the protocol ------------------------------------------------------------

    def sites(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        args, kwargs = self._check_inputs(args, kwargs)
        discovered, _ = self._discover(args, kwargs)
        return {s.name: s.value_struct for s in discovered if s.differentiable}

    def apply(
        self,
        *args: Any,
        at: Any = None,
        patch: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> ForwardResult:
        args, kwargs, chosen, patches, _ = self._prepare(at, patch, args, kwargs)
        outputs, session, _, buffers = self._run(
            args, kwargs, chosen, patches, with_inputs=False
        )
        return ForwardResult(
            detached(outputs),
            in_order(session.activations, chosen),
            _state(buffers),
        )

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
        args, kwargs, chosen, patches, loss_struct = self._prepare(
            at, patch, args, kwargs, loss_fn
        )
        if loss_struct is not _UNCHECKED:
            check_loss(loss_struct, has_aux)
        outputs, session, params, buffers = self._run(
            args, kwargs, chosen, patches, with_inputs, catch=True
        )
        with torch.enable_grad():
            loss_out = loss_fn(outputs)
        _check_loss_is_a_tensor(loss_out)
        check_loss(TORCH_ARRAYS.abstract(loss_out), has_aux)
        loss, aux = loss_out if has_aux else (loss_out, None)
        trainable = {n: p for n, p in params.items() if p.requires_grad}
        # One backward pass: the parameters' gradients are returned, the
        # sites' are caught on the way (`_Catch`), reached through the anchor.
        wrt = [*trainable.values(), session.anchor]
        if loss.requires_grad:
            found = torch.autograd.grad(loss, wrt, allow_unused=True)[:-1]
        else:
            found = [None] * len(trainable)
        grads = {
            name: torch.zeros_like(p) if g is None else g
            for (name, p), g in zip(trainable.items(), found, strict=True)
        }
        activation_grads = session.activation_grads()
        return ProbeResult(
            loss=loss.detach(),
            aux=detached(aux),
            grads=grads,
            activations=in_order(session.activations, chosen),
            activation_grads=in_order(activation_grads, chosen),
            state=_state(buffers),
            inputs=in_order(session.inputs, chosen) if with_inputs else None,
        )

    # -- the machinery -----------------------------------------------------------

    def _prepare(self, at, patch, args, kwargs, loss_fn=None) -> tuple:
        """The checks before any work, and what the run needs: `(args, kwargs,
        chosen sites, patches, abstract loss)`."""
        check_selection(at)
        check_patch_kind(patch)
        args, kwargs = self._check_inputs(args, kwargs)
        discovered, loss_struct = self._discover(args, kwargs, loss_fn)
        chosen = select(at, discovered)
        patches = resolve_patches(to_torch(patch), discovered, TORCH_ARRAYS)
        return args, kwargs, chosen, patches, loss_struct

    def _check_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The inputs as detached torch tensors (a probe returns no gradient
        for them, nor adds to their `.grad`); refuses JAX tracers, before any
        work."""
        return detached(to_torch(tuple(args))), detached(to_torch(dict(kwargs)))

    def _discover(
        self, args: tuple, kwargs: dict, loss_fn: Callable | None = None
    ) -> tuple[list[Site], Any]:
        """Every site of one forward pass, on fake tensors: no FLOPs.

        Also returns the abstract loss when `loss_fn` is given (`_UNCHECKED`
        where fake tensors cannot run it: the real loss is checked instead).
        Discovery is reused for later calls with the same signature (see
        `_signature`): on fake tensors it costs about as much Python time as a
        real forward pass.
        """
        args, kwargs = to_torch(args), to_torch(kwargs)
        key = _signature(self.module, (args, kwargs))
        with self._lock:
            found = self._discovered.get(key) if key is not None else None
            if found is not None:
                self._discovered.move_to_end(key)
        if found is None:
            found = (*self._discover_afresh(args, kwargs), {})
            if key is not None:
                with self._lock:
                    self._discovered[key] = found
                    while len(self._discovered) > _DISCOVERIES_KEPT:
                        self._discovered.popitem(last=False)
        sites, outputs, losses = found
        if loss_fn is None:
            return sites, None
        # The same loss function on the same outputs: checked already. A weak
        # reference tells a new function from a dead one whose id was reused.
        known = losses.get(id(loss_fn))
        if known is not None and known[0]() is loss_fn:
            return sites, known[1]
        struct = _abstract_loss(outputs, loss_fn)
        with contextlib.suppress(TypeError), self._lock:  # TypeError: no weakref
            losses[id(loss_fn)] = (weakref.ref(loss_fn), struct)
            while len(losses) > _DISCOVERIES_KEPT:
                del losses[next(iter(losses))]
        return sites, struct

    def _discover_afresh(self, args: tuple, kwargs: dict) -> tuple[list, Spec]:
        """`(sites, the outputs' spec)` from one forward pass on fake tensors,
        or, where fake tensors cannot run the model, a real one. The global RNG
        is left as it was, so a dropout mask is the one a plain call draws."""
        module = self.module
        try:
            with internals.fake_mode() as mode, _restored_rng(module):
                fake = jax.tree.map(
                    lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x,
                    (args, kwargs),
                )
                state = _live_state(module, mode.from_tensor, mode.from_tensor)
                return self._discover_with(*state, *fake)
        except Exception:  # noqa: BLE001 - fake tensors cannot run every model
            pass
        with _restored_rng(module):
            return self._discover_with(*_live_state(module), args, kwargs)

    def _discover_with(self, params, buffers, args, kwargs) -> tuple[list, Spec]:
        session = TorchSession()
        with torch.enable_grad():
            outputs = self._call(session, params, buffers, args, kwargs)
        return session.discovered(), Spec.of(outputs)

    def _run(
        self,
        args: tuple,
        kwargs: dict,
        chosen: list[Site],
        patches: dict,
        with_inputs: bool,
        catch: bool = False,
    ) -> tuple[Any, TorchSession, dict, dict]:
        """One real forward pass: `(outputs, session, parameters, buffers)`;
        with `catch`, the selected sites' gradients are caught (`_Catch`)."""
        selected = {site.name: site for site in chosen}
        params, buffers = _live_state(self.module)
        session = TorchSession(
            selected,
            # The session's "epsilons": which sites `TorchSession.perturb`
            # catches (their gradients, no epsilon is added).
            {name: site.struct for name, site in selected.items()} if catch else {},
            patches,
            with_inputs,
            device=next((p.device for p in params.values()), None),
        )
        with torch.enable_grad():
            outputs = self._call(session, params, buffers, args, kwargs)
        return outputs, session, params, buffers

    def _call(self, session, params, buffers, args, kwargs) -> Any:
        """Call the model on `params` and `buffers`, every submodule call
        reported to `session`.

        The call runs on a shell of the module (`_shell`), never on the user's
        module: hooks, parameters and buffers are swapped in on the shell only,
        so another thread calling or probing the same module meanwhile sees
        nothing of it. A shell is made per call: it has the module's current
        attributes and training flags.
        """
        shell = internals.shell(self.module)
        with _hooked(session, self.module, shell), session.active():
            return functional_call(shell, (params, buffers), args, kwargs)


def _live_state(
    module: torch.nn.Module,
    parameter: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.detach,
    buffer: Callable[[torch.Tensor], torch.Tensor] = lambda b: b.detach().clone(),
) -> tuple[dict, dict]:
    """The parameters and buffers a call runs on: by default detached aliases
    of the user's parameters (no copy), requiring grad as theirs do, so
    autograd never touches their `.grad`, and clones of the buffers, which the
    call may update (a training-mode BatchNorm's running statistics);
    discovery passes fake-tensor conversions instead."""
    params = {
        name: parameter(p).requires_grad_(p.requires_grad)
        for name, p in module.named_parameters()
    }
    buffers = {name: buffer(b) for name, b in module.named_buffers()}
    return params, buffers


@contextlib.contextmanager
def _hooked(
    session: TorchSession, module: torch.nn.Module, shell: torch.nn.Module
) -> Iterator[None]:
    """Report every submodule call of `shell` to `session` as a call of the
    user's `module` at the same path, for the length of the block; the hooks
    are removed however the block ends."""
    handles = []
    open_calls: dict[int, list[Call]] = {}

    def enter(copied, args, kwargs, path, original):
        if current_session() is session:
            call = session.enter(path, None, original, args)
            open_calls.setdefault(id(copied), []).append(call)

    def leave(copied, args, kwargs, output):
        if current_session() is session:
            return session.exit(open_calls[id(copied)].pop(), output)
        return None

    try:
        named = zip(module.named_modules(), shell.modules(), strict=True)
        for (path, original), copied in named:
            if not path:  # the root model is no site
                continue
            handles.append(
                copied.register_forward_pre_hook(
                    lambda m, a, k, path=path, original=original: enter(
                        m, a, k, path, original
                    ),
                    with_kwargs=True,
                )
            )
            handles.append(copied.register_forward_hook(leave, with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _restored_rng(module: torch.nn.Module | None) -> Iterator[None]:
    """The global RNG state (CPU, and the model's CUDA devices) as it was."""
    parameters = [] if module is None else module.parameters()
    devices = sorted(
        {p.device.index or 0 for p in parameters if p.device.type == "cuda"}
    )
    with torch.random.fork_rng(devices=devices):
        yield


def _check_loss_is_a_tensor(loss_out: Any) -> None:
    loss = loss_out[0] if isinstance(loss_out, tuple | list) else loss_out
    if not isinstance(loss, torch.Tensor):
        raise BridgeTypeError(
            "`loss_fn` receives the PyTorch model's outputs as torch tensors and "
            f"must return a scalar torch tensor; it returned a {type(loss).__name__}. "
            "Compute the loss with torch operations, e.g. "
            "`lambda y: ((y - target) ** 2).mean()` with a torch `target`."
        )


def _state(buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The buffers after the call, keyed like `named_buffers()`; `None` where the
    model has none."""
    return {name: b.detach() for name, b in buffers.items()} or None


#: Discoveries a probe keeps (most recently used first), one per signature.
_DISCOVERIES_KEPT = 16

#: The loss could not be evaluated on fake tensors: it is checked when real.
_UNCHECKED = object()


def _signature(module: torch.nn.Module, inputs: Any) -> tuple | None:
    """What the sites of a call depend on: the inputs' structure, shapes,
    dtypes and devices (and any other input, where hashable), which modules the
    model holds and their training flags, the parameters' and buffers' shapes
    and `requires_grad`. `None` (no reuse) for an unhashable input. A change of
    a module's attributes that alters its calls (say `norm_first`) is not
    seen: make a new probe after one."""
    leaves, treedef = internals.pytree.tree_flatten(inputs)
    described = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            described.append(TensorLeaf.of(leaf))
            continue
        try:
            hash(leaf)
        except TypeError:
            return None
        described.append((type(leaf), leaf))
    return (
        str(treedef),
        tuple(described),
        tuple((id(m), m.training) for m in module.modules()),
        tuple(
            (id(p), tuple(p.shape), p.dtype, p.requires_grad)
            for p in module.parameters()
        ),
        tuple((id(b), tuple(b.shape), b.dtype) for b in module.buffers()),
    )


def _abstract_loss(outputs: Spec, loss_fn: Callable) -> Any:
    """The loss's abstract value, from `loss_fn` on fake outputs: no FLOPs."""
    try:
        with internals.fake_mode() as mode, _restored_rng(None):
            loss_out = loss_fn(outputs.fake(mode))
    except Exception:  # noqa: BLE001 - checked on the real loss instead
        return _UNCHECKED
    _check_loss_is_a_tensor(loss_out)
    return TORCH_ARRAYS.abstract(loss_out)


def probe(module: Any, *variables: Any, vmap: bool = False) -> TorchProbe:
    return TorchProbe(module, *variables, vmap=vmap)


jax.tree_util.register_pytree_node(
    TorchProbe,
    # No JAX leaves: a torch model cannot be traced. Under `jax.jit` the probe is
    # static, and its inputs, then tracers, are refused with `NOT_JAX`.
    lambda probe: ((), probe),
    lambda probe, _: probe,
)
