"""PyTorch models for the conformance suite, with independent references.

The references never go through bridge: plain `loss.backward()` on a deep
copy of the model for the loss and parameter gradients; forward hooks of this
file's own (counting calls per `named_modules()` path, `#k` for repeats) to
record outputs and to add a perturbation at a site; a central finite
difference in float64 along that perturbation for the directional derivative.
Models with dropout reseed the global RNG at their entry, so every forward
pass, probed or not, draws the same masks. References run with autograd on,
as the probe does: without it, `nn.TransformerEncoderLayer` in `eval()` takes
its fused fast path and calls none of its submodules.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import torch
from torch import nn

import bridge
from cases import Case


def host(tree: Any) -> Any:
    """Torch tensors as NumPy arrays, dicts in their order; each tensor must be
    detached."""
    if isinstance(tree, torch.Tensor):
        assert not tree.requires_grad and tree.grad_fn is None, "not detached"
        return tree.numpy()
    if isinstance(tree, dict):
        return {key: host(value) for key, value in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(host(value) for value in tree))
    if isinstance(tree, tuple | list):
        return type(tree)(host(value) for value in tree)
    return tree


def to_torch(tree: Any, dtype: torch.dtype | None = None) -> Any:
    def convert(x):
        if x is None:
            return None
        t = torch.tensor(np.asarray(x))
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    return jax.tree.map(convert, tree)


def _add_at_floats(value: Any, delta: Any) -> Any:
    deltas = iter(jax.tree.leaves(delta))
    return jax.tree.map(
        lambda v: v + next(deltas).to(v.dtype) if v.is_floating_point() else v, value
    )


@contextlib.contextmanager
def hooked(model: nn.Module, on_output: Callable[[str, Any], Any]) -> Iterator[None]:
    """`on_output(site, output) -> output or None` at every submodule call."""
    counts: dict[str, int] = {}
    handles = []

    def hook(module, args, output, path):
        index = counts.get(path, 0)
        counts[path] = index + 1
        return on_output(path if index == 0 else f"{path}#{index}", output)

    for path, module in model.named_modules():
        if path:
            handles.append(
                module.register_forward_hook(
                    lambda m, a, o, path=path: hook(m, a, o, path)
                )
            )
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def perturbed(model: nn.Module, site: str, delta: Any) -> Iterator[None]:
    """`delta` added to the value of `site`: a module's output by a hook, a
    `bridge.tap` by the model's own `offsets` (hooks cannot reach a tap)."""
    if site in getattr(model, "offsets", {}):
        model.offsets[site] = delta
        try:
            yield
        finally:
            model.offsets[site] = None
        return
    add = lambda name, out: _add_at_floats(out, delta) if name == site else None
    with hooked(model, add):
        yield


class TorchCase(Case):
    modes = ("eager",)

    def reference_value_and_grad(self):
        model = copy.deepcopy(self.probe.module)
        loss = self.loss_fn(model(*self.torch_args))
        loss.backward()
        grads = {
            name: p.grad.numpy()
            for name, p in model.named_parameters()
            if p.requires_grad
        }
        return loss.detach().numpy(), grads

    def directional_derivative(self, site, delta, step=1e-4):
        model = copy.deepcopy(self.probe.module).double()
        delta = to_torch(delta, torch.float64)

        def loss_at(t):
            offset = jax.tree.map(lambda d: t * d, delta)
            with perturbed(model, site, offset):
                outputs = model(*to_torch(self.args, torch.float64))
                return float(self.loss_fn(outputs).detach())

        return (loss_at(step) - loss_at(-step)) / (2 * step)

    def adding(self, delta):
        delta = to_torch(delta)
        return lambda value: _add_at_floats(value, delta)

    def to_host(self, tree):
        return host(tree)

    @property
    def torch_args(self):
        return to_torch(self.args)


def torch_case(model, args, loss_fn, expected_sites, bias_sites=()) -> TorchCase:
    """A case over `model` and NumPy `args`; `loss_fn` takes torch outputs."""

    def perturbed_loss(site, delta):
        replica = copy.deepcopy(model)
        with perturbed(replica, site, to_torch(delta)):
            return loss_fn(replica(*to_torch(args))).detach().numpy()

    def reference_activations():
        replica, recorded = copy.deepcopy(model), {}

        def record(name, output):
            # A copy: an in-place operation later (ReLU) would rewrite it.
            recorded[name] = jax.tree.map(lambda o: o.detach().numpy().copy(), output)

        with hooked(replica, record):
            replica(*to_torch(args))
        return recorded

    def reference_state():
        replica = copy.deepcopy(model)
        replica(*to_torch(args))
        return {n: b.numpy() for n, b in replica.named_buffers()} or None

    def snapshot():
        return {
            "parameters": {
                n: p.detach().numpy().copy() for n, p in model.named_parameters()
            },
            "grads": [p.grad is None for p in model.parameters()],
            "buffers": {n: b.numpy().copy() for n, b in model.named_buffers()},
            "training": [m.training for m in model.modules()],
            "hooks": [
                len(m._forward_hooks) + len(m._forward_pre_hooks)
                for m in model.modules()
            ],
        }

    return TorchCase(
        probe=bridge.probe(model),
        args=args,
        kwargs={},
        loss_fn=loss_fn,
        expected_sites=expected_sites,
        trainable=None,
        reference_loss=None,
        perturbed_loss=perturbed_loss,
        snapshot=snapshot,
        bias_sites={
            site: (lambda grads, site=site: grads[f"{site}.bias"])
            for site in bias_sites
        },
        reference_activations=reference_activations,
        reference_state=reference_state,
    )


def _inputs(*shape, seed=1):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _mean_square(outputs):
    return (outputs**2).mean()


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(6, 16)
        self.act = nn.Tanh()
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        return self.out(self.act(self.hidden(x)))


class Shared(nn.Module):
    """One Linear called twice, a `bridge.tap` in its own code."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(5, 8)
        self.block = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)
        self.offsets = {"mid": None}  # the tests' own perturbation of the tap

    def forward(self, x):
        h = torch.relu(self.embed(x))
        h = h + self.block(h)
        h = torch.sin(h)
        if self.offsets["mid"] is not None:
            h = h + self.offsets["mid"]
        h = bridge.tap("mid", h)
        return self.head(self.block(h))


class ConvBatchNorm(nn.Module):
    """NCHW convolution, BatchNorm in training mode (running statistics move),
    an in-place ReLU that rewrites the BatchNorm's output, a residual."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.head = nn.Linear(4 * 5 * 6, 3)

    def forward(self, x):
        h = self.relu(self.norm(self.conv(x)))
        h = self.conv2(h)
        h += x.mean(dim=1, keepdim=True)
        return self.head(h.flatten(1))


class Seeded(nn.Module):
    """Reseeds the global RNG at each call: the same dropout masks every time."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args):
        torch.manual_seed(0)
        return self.model(*args)


class Recurrent(nn.Module):
    """`nn.LSTM` returns `(outputs, (h, c))`: a pytree site."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 8, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        outputs, (h, _) = self.lstm(x)
        return self.head(outputs).mean(1) + self.head(h[0])


def _build(model_class, seed=0):
    torch.manual_seed(seed)
    return model_class()


def _encoder_layer(train: bool):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
    return Seeded(layer).train(train)


_ENCODER_SITES = [
    "model",
    "model.self_attn",
    "model.dropout1",
    "model.norm1",
    "model.linear1",
    "model.dropout",
    "model.linear2",
    "model.dropout2",
    "model.norm2",
]

CASES: dict[str, Callable[[], Case]] = {
    "mlp": lambda: torch_case(
        _build(MLP),
        (_inputs(4, 6),),
        _mean_square,
        ["hidden", "act", "out"],
        bias_sites=("hidden", "out"),
    ),
    "shared_module_and_tap": lambda: torch_case(
        _build(Shared),
        (_inputs(3, 5),),
        _mean_square,
        ["embed", "block", "mid", "block#1", "head"],
        bias_sites=("embed", "head"),
    ),
    "conv_batchnorm_train": lambda: torch_case(
        _build(ConvBatchNorm).train(),
        (_inputs(2, 3, 5, 6),),
        _mean_square,
        ["conv", "norm", "relu", "conv2", "head"],
        bias_sites=("head",),
    ),
    "transformer_encoder_eval": lambda: torch_case(
        _encoder_layer(train=False),
        (_inputs(2, 5, 16),),
        _mean_square,
        _ENCODER_SITES,
    ),
    "transformer_encoder_train_dropout": lambda: torch_case(
        _encoder_layer(train=True),
        (_inputs(2, 5, 16),),
        _mean_square,
        _ENCODER_SITES,
    ),
    "lstm": lambda: torch_case(
        _build(Recurrent),
        (_inputs(2, 3, 4),),
        _mean_square,
        ["lstm", "head", "head#1"],
    ),
}
