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
  output to the session, which patches it, records it and hands the model,
  in its place, a view of it: a node of autograd's own whose gradient is
  what a zero epsilon added there would get, without the zeros, the add or
  a copy. (A value that requires no grad, or that the model changes in place
  later, goes through `_Catch` instead, an identity whose backward keeps the
  gradient it is given.)
- One `torch.autograd.grad` of the loss with respect to the parameters and
  the views gives both gradient sets in one backward pass. Each call has a
  view of its own, consumed only by the code after the call, so the
  gradients of a module called twice are never summed.
- The shell runs through `torch.func.functional_call` with detached aliases
  of the user's parameters (no copy; `.grad` of the user's parameters is never
  touched) and clones of the buffers (a training-mode BatchNorm updates the
  clones, returned in `res.state`, never the user's running statistics).
- Discovery (`sites`, and the checks before a call) runs the model on fake
  tensors (`FakeTensorMode`): shapes without FLOPs. A model that fake tensors
  cannot run (data-dependent shapes, an operator without a meta kernel) is
  discovered by a real forward pass instead, with the RNG state restored.
  Discovery is kept in bridge's discovery cache under the call's signature
  (`discovery.signature`), for as long as the probe lives.

Every forward pass runs with autograd enabled and the parameters'
`requires_grad` as the user set them, in discovery and in `apply` too: fused
inference fast paths (`nn.TransformerEncoderLayer`, `nn.MultiheadAttention`
in `eval()` without grad) skip their submodules, and the sites must not
change between discovery and the real run.

`TorchProbe` is the PyTorch backend of `ProbeFront`: the checks, selection,
patches, the discovery cache and the result in call order are the core's, as
for the JAX libraries; it implements the framework's steps (`_prepare_inputs`,
`_prepare_patch`, `_discovery_key`, `_discover_afresh`, `_abstract_loss`,
`_forward`, `_differentiate`) and the porting contract's `unreached_sites`.
Torch tensors as the core's arrays are `arrays`; the catch is `session`; the
fake-tensor discovery is `discovery`; PyTorch's private internals are
`internals`.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import torch
from torch.func import functional_call

from bridge.adapter_api import (
    BridgeTypeError,
    BridgeValueError,
    Call,
    CallPlan,
    Discovery,
    DiscoveryOwner,
    ProbeFront,
    ProbeResult,
    check_loss,
    current_session,
)

from . import internals
from .arrays import TORCH_ARRAYS, Spec, detached, to_torch
from .discovery import (
    FakeOutputs,
    check_loss_is_a_tensor,
    random_state,
    restore_random_state,
    restored_rng,
    signature,
)
from .session import TorchSession


class TorchProbe(ProbeFront):
    """A `torch.nn.Module` under probe. Results are detached torch tensors."""

    porting_side = "bridge.adapters.torch.porting"
    _arrays = TORCH_ARRAYS
    runs_in_jax = False

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
        # The discoveries hold the model's submodules (each site's `module`),
        # and with them its weights: they are dropped with the probe.
        self._discovery_owner = DiscoveryOwner(self)
        # The sites the model changes in place after their call, recorded as
        # copies (`_fresh`); every other recording is an alias.
        self._copied: frozenset[str] = frozenset()

    def __repr__(self) -> str:
        return f"TorchProbe({type(self.module).__name__})"

    # -- the framework's steps of `ProbeFront` -----------------------------------

    def _prepare_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The inputs as detached torch tensors (a probe returns no gradient
        for them, nor adds to their `.grad`); refuses JAX tracers, before any
        work."""
        return detached(to_torch(tuple(args))), detached(to_torch(dict(kwargs)))

    def _prepare_patch(self, patch: Mapping[str, Any]) -> Mapping[str, Any]:
        return to_torch(patch)

    def _discovery_key(self, args: tuple, kwargs: dict) -> tuple | None:
        """The call's `signature`, under this probe's owner: on fake tensors a
        discovery costs about as much Python time as a real forward pass."""
        found = signature(self.module, (args, kwargs))
        return None if found is None else (self._discovery_owner, found)

    def _discover_afresh(
        self, args: tuple, kwargs: dict, loss_fn: Callable | None = None
    ) -> tuple[Discovery, None]:
        """The sites and the outputs' structure from one forward pass on fake
        tensors, or, where fake tensors cannot run the model, a real one. The
        global RNG is left as it was, so a dropout mask is the one a plain call
        draws. The loss is checked on the outputs kept (`_abstract_loss`)."""
        module = self.module
        try:
            with internals.fake_mode() as mode, restored_rng(module):
                fake = jax.tree.map(
                    lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x,
                    (args, kwargs),
                )
                state = _live_state(module, mode.from_tensor, mode.from_tensor)
                return self._discover_with(*state, *fake), None
        except Exception:  # noqa: BLE001 - fake tensors cannot run every model
            pass
        with restored_rng(module):
            return self._discover_with(*_live_state(module), args, kwargs), None

    def _discover_with(self, params, buffers, args, kwargs) -> Discovery:
        session = TorchSession()
        with torch.enable_grad():
            outputs = self._call_shell(session, params, buffers, args, kwargs)
        return Discovery(tuple(session.discovered()), FakeOutputs(Spec.of(outputs)))

    def _abstract_loss(self, outputs: FakeOutputs, loss_fn: Callable) -> Any:
        return outputs.abstract_loss(loss_fn)

    def _forward(self, plan: CallPlan) -> tuple[Any, dict, Any, dict]:
        outputs, session, _, buffers = self._fresh(
            lambda: self._run_model(plan, with_inputs=False)
        )
        # PyTorch runs the branch taken and no other: a site in a branch not
        # taken is not reached, and says so, so no site needs `ran`.
        return detached(outputs), session.activations, _state(buffers), {}

    def _fresh(self, run: Callable[[], tuple]) -> tuple:
        """`run()`'s result, its recordings those of the calls: where the
        model changed a recorded value in place afterwards (an alias now
        holding the changed value), the run is made again from the same
        random state with those sites copied, as they are from then on.
        Copying only those sites spares a copy of every value of every step.
        """
        state = random_state(self.module)
        result = run()
        stale = result[1].stale()
        if not stale:
            return result
        self._copied = self._copied | stale
        restore_random_state(state)
        return run()

    def _differentiate(
        self,
        loss_fn: Callable[[Any], Any],
        plan: CallPlan,
        has_aux: bool,
        with_inputs: bool,
    ) -> ProbeResult:
        """One real forward pass, and one `torch.autograd.grad` for both
        gradient sets."""

        def forward_and_loss():
            outputs, session, params, buffers = self._run_model(
                plan, with_inputs, catch=True
            )
            with torch.enable_grad():
                return outputs, session, params, buffers, loss_fn(outputs)

        # The loss may change the outputs in place too: checked after it.
        _, session, params, buffers, loss_out = self._fresh(forward_and_loss)
        check_loss_is_a_tensor(loss_out)
        check_loss(TORCH_ARRAYS.abstract(loss_out), has_aux)
        loss, aux = loss_out if has_aux else (loss_out, None)
        trainable = {n: p for n, p in params.items() if p.requires_grad}
        # One backward pass: the parameters' gradients and the views' are
        # returned, the other sites' are caught on the way (`_Catch`).
        wrt = [*trainable.values(), *session.inputs_to_differentiate()]
        if loss.requires_grad:
            found = torch.autograd.grad(loss, wrt, allow_unused=True)
        else:
            found = [None] * len(wrt)
        session.receive(found[len(trainable) :])
        grads = {
            name: torch.zeros_like(p) if g is None else g
            for (name, p), g in zip(
                trainable.items(), found[: len(trainable)], strict=True
            )
        }
        return ProbeResult(
            loss=loss.detach(),
            aux=detached(aux),
            grads=grads,
            activations=session.activations,
            activation_grads=session.activation_grads(),
            state=_state(buffers),
            inputs=session.inputs,
            ran={},
        )

    def unreached_sites(
        self, loss_fn: Callable, names: Any, *args: Any, **kwargs: Any
    ) -> set[str]:
        """The sites among `names` whose value has no path to the loss in
        autograd's graph (a call whose output the model drops): one forward
        pass, and one `torch.autograd.grad` with `allow_unused=True`, which
        answers `None`, not zeros, for a value the loss does not use."""
        plan = self._plan(list(names), None, args, kwargs, loss_fn)
        outputs, session, _, _ = self._run_model(plan, with_inputs=False, catch=True)
        with torch.enable_grad():
            loss = loss_fn(outputs)
        wrt = session.inputs_to_differentiate()
        found = (
            torch.autograd.grad(loss, wrt, allow_unused=True)
            if isinstance(loss, torch.Tensor) and loss.requires_grad
            else [None] * len(wrt)
        )
        session.receive(list(found))
        return {
            name
            for name, tree in session.slots.items()
            if (slots := jax.tree.leaves(tree))  # none at integer leaves
            and all(slot.grad is None for slot in slots)
        }

    # -- the machinery -----------------------------------------------------------

    def _run_model(
        self, plan: CallPlan, with_inputs: bool, catch: bool = False
    ) -> tuple[Any, TorchSession, dict, dict]:
        """One real forward pass: `(outputs, session, parameters, buffers)`;
        with `catch`, the selected sites' gradients are caught (`perturb`)."""
        selected = {site.name: site for site in plan.chosen}
        params, buffers = _live_state(self.module)
        session = TorchSession(
            selected,
            # The session's "epsilons": which sites `TorchSession.perturb`
            # catches (their gradients, no epsilon is added).
            {name: site.struct for name, site in selected.items()} if catch else {},
            plan.patches,
            with_inputs,
            device=next((p.device for p in params.values()), None),
            copied=self._copied,
        )
        with torch.enable_grad():
            outputs = self._call_shell(session, params, buffers, plan.args, plan.kwargs)
        return outputs, session, params, buffers

    def _call_shell(self, session, params, buffers, args, kwargs) -> Any:
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

    # -- taking the model out (`ActivationProbe.unwrap`) -------------------------

    def unwrap(self) -> tuple:
        """`(module,)`, what `bridge.probe` takes: a deep copy of the probe's
        module (after `bridge.transfer`, holding the ported weights), in its
        mode (`train()`/`eval()`), without the `.grad` of its parameters."""
        module = copy.deepcopy(self.module)
        for parameter in module.parameters():
            parameter.grad = None
        return (module,)


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


def _state(buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The buffers after the call, keyed like `named_buffers()`; `None` where the
    model has none."""
    return {name: b.detach() for name, b in buffers.items()} or None


def probe(module: Any, *variables: Any, vmap: bool = False) -> TorchProbe:
    return TorchProbe(module, *variables, vmap=vmap)


jax.tree_util.register_pytree_node(
    TorchProbe,
    # No JAX leaves: a torch model cannot be traced. Under `jax.jit` the probe is
    # static, and its inputs, then tracers, are refused with `NOT_JAX`.
    lambda probe: ((), probe),
    lambda probe, _: probe,
)
