"""PyTorch behaviours beyond the conformance suite: library modules' own
quirks, nothing of the user's changed, hooks gone after a failure, the errors.

References are plain PyTorch: `loss.backward()` on a deep copy, forward hooks
of the test's own, `torch.utils.flop_counter`.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import bridge  # noqa: E402


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _x(*shape, seed=1):
    return torch.from_numpy(np.random.default_rng(seed).normal(size=shape)).float()


def _hook_counts(model):
    return [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]


def _plain(model, loss_fn, *args):
    replica = copy.deepcopy(model)
    loss = loss_fn(replica(*args))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in replica.named_parameters()}, replica


def test_results_are_detached_torch_tensors_keyed_like_the_module():
    model, x = _mlp(), _x(4, 6)
    res = bridge.probe(model).value_and_grad(
        lambda y: (y**2).mean(), x, with_inputs=True
    )
    assert list(res.grads) == [n for n, _ in model.named_parameters()]
    assert list(res.activations) == ["0", "1", "2"]
    for tensor in jax.tree.leaves(
        (res.loss, res.grads, res.activations, res.activation_grads, res.inputs)
    ):
        assert isinstance(tensor, torch.Tensor)
        assert not tensor.requires_grad and tensor.grad_fn is None
    assert res.state is None  # no buffers


def test_kfac_identity_weight_gradient_is_output_gradient_times_input():
    model, x = _mlp(), _x(4, 6)
    res = bridge.probe(model).value_and_grad(
        lambda y: (y**2).mean(), x, with_inputs=True
    )
    for site in ("0", "2"):
        (inputs,) = res.inputs[site]
        expected = res.activation_grads[site].T @ inputs
        torch.testing.assert_close(res.grads[f"{site}.weight"], expected)
    torch.testing.assert_close(res.inputs["0"][0], x)


def test_numpy_and_jax_inputs_give_the_torch_numbers():
    model, x = _mlp(), _x(4, 6)
    loss_fn = lambda y: (y**2).mean()
    probe = bridge.probe(model)
    expected = probe.value_and_grad(loss_fn, x)
    for given in (x.numpy(), jnp.asarray(x.numpy())):
        res = probe.value_and_grad(loss_fn, given)
        torch.testing.assert_close(res.loss, expected.loss)
        torch.testing.assert_close(res.activation_grads, expected.activation_grads)


def test_nothing_of_the_user_changes_in_training_mode_batchnorm():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).train()
    model[0].weight.grad = torch.ones_like(model[0].weight)  # a user's own .grad
    frozen = model[0].bias.requires_grad_(False)
    before = copy.deepcopy(model.state_dict())
    x = _x(2, 3, 6, 6)
    loss_fn = lambda y: (y**2).mean()
    res = bridge.probe(model).value_and_grad(loss_fn, x)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)
    assert model.training and all(m.training for m in model.modules())
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight))
    assert model[1].weight.grad is None and not frozen.requires_grad
    assert "0.bias" not in res.grads  # frozen: no gradient, as in plain autograd
    assert _hook_counts(model) == [0] * len(list(model.modules()))
    # The running statistics moved in `res.state`, as a plain step moves them.
    _, grads, stepped = _plain(model, loss_fn, x)
    assert list(res.state) == [n for n, _ in model.named_buffers()]
    for name, buffer in stepped.named_buffers():
        torch.testing.assert_close(res.state[name], buffer)
    assert int(res.state["1.num_batches_tracked"]) == 1
    for name, grad in res.grads.items():
        torch.testing.assert_close(grad, grads[name])


_CALLED_AS: list[nn.Module] = []  # outside the model: the probe copies its fields


class _Raises(nn.Module):
    """Raises on a batch of 5; keeps the module objects it was called as."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x):
        _CALLED_AS.append(self.linear)
        h = self.linear(x)
        if h.shape[0] == 5:
            raise RuntimeError("the model's own error")
        return h


def test_no_hook_stays_registered_when_the_model_or_the_loss_raises():
    """The probe runs a weightless copy of the module (never the user's): the
    user's module has no hook even during the call, and the copy's hooks are
    removed however the call ends."""
    model = _Raises()
    probe = bridge.probe(model)
    _CALLED_AS.clear()
    with pytest.raises(RuntimeError, match="the model's own error"):
        probe.value_and_grad(lambda y: y.sum(), _x(5, 3))
    assert _hook_counts(model) == [0, 0]
    assert _CALLED_AS and all(m is not model.linear for m in _CALLED_AS)
    assert all(_hook_counts(m) == [0] for m in _CALLED_AS)

    def loss_fn(y):
        assert _hook_counts(model) == [0, 0]  # not even during the call
        if not isinstance(y, torch._subclasses.fake_tensor.FakeTensor):
            raise ValueError("the loss's own error")
        return y.sum()

    _CALLED_AS.clear()
    with pytest.raises(ValueError, match="the loss's own error"):
        probe.value_and_grad(loss_fn, _x(2, 3))
    assert len(_CALLED_AS) == 2  # discovery and the real run
    assert all(_hook_counts(m) == [0] for m in _CALLED_AS)
    # And the probe still works afterwards.
    probe.value_and_grad(lambda y: y.sum(), _x(2, 3))
    assert _hook_counts(model) == [0, 0]


def test_has_aux_returns_the_aux_detached():
    model, x = _mlp(), _x(4, 6)
    res = bridge.probe(model).value_and_grad(
        lambda y: ((y**2).mean(), {"logits": y}), x, has_aux=True
    )
    torch.testing.assert_close(res.aux["logits"], model(x).detach())
    assert not res.aux["logits"].requires_grad


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_transformer_encoder_layer_sites_and_outputs(train):
    """In `eval()` under `torch.no_grad()`, PyTorch takes a fused fast path that
    calls no submodule: the probe runs with autograd on, so every submodule is
    a site, and its output equals the fast path's."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    layer.train(train)
    x = _x(2, 5, 16)
    probe = bridge.probe(layer)
    fwd = probe.apply(x)
    assert list(fwd.activations) == [
        "self_attn",
        "dropout1",
        "norm1",
        "linear1",
        "dropout",
        "linear2",
        "dropout2",
        "norm2",
    ]
    with torch.no_grad():
        expected = layer(x)
    torch.testing.assert_close(fwd.outputs, expected, rtol=1e-5, atol=1e-5)
    res = probe.value_and_grad(lambda y: (y**2).mean(), x)
    loss, grads, _ = _plain(layer, lambda y: (y**2).mean(), x)
    torch.testing.assert_close(res.loss, loss)
    torch.testing.assert_close(res.grads, grads)
    # nn.MultiheadAttention returns (output, weights); the encoder asks for no
    # weights, so the second leaf is None and has no gradient.
    assert res.activation_grads["self_attn"][1] is None


def test_dropout_with_a_fixed_seed_draws_the_plain_mask_and_advances_the_rng():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.Linear(32, 2))
    x, loss_fn = _x(16, 8), lambda y: (y**2).mean()
    torch.manual_seed(123)
    loss, grads, _ = _plain(model, loss_fn, x)
    after_plain = torch.random.get_rng_state()
    torch.manual_seed(123)
    res = bridge.probe(model).value_and_grad(loss_fn, x)
    torch.testing.assert_close(res.loss, loss)
    torch.testing.assert_close(res.grads, grads)
    assert torch.equal(torch.random.get_rng_state(), after_plain)
    mask = res.activations["1"] != 0
    assert 0.3 < mask.float().mean() < 0.7
    # The gradient at the dropout's output is zero exactly where it dropped.
    assert torch.all(res.activation_grads["0"][~mask] == 0)


def test_lstm_site_is_a_pytree_with_a_gradient_per_leaf():
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 8, batch_first=True)
    model = nn.Sequential()
    model.add_module("lstm", lstm)
    x = _x(2, 3, 4)

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = lstm

        def forward(self, x):
            out, (h, c) = self.lstm(x)
            return out.sum() + 2 * h.sum() + 3 * c.sum()

    res = bridge.probe(Head()).value_and_grad(lambda y: y, x)
    out_grad, (h_grad, c_grad) = res.activation_grads["lstm"]
    # d loss / d output leaf is the loss's own coefficient, leaf by leaf.
    torch.testing.assert_close(out_grad, torch.ones_like(out_grad))
    torch.testing.assert_close(h_grad, 2 * torch.ones_like(h_grad))
    torch.testing.assert_close(c_grad, 3 * torch.ones_like(c_grad))


def test_patch_ablates_and_gradients_flow_through_the_patched_value():
    model, x = _mlp(), _x(4, 6)
    probe = bridge.probe(model)
    res = probe.value_and_grad(
        lambda y: (y**2).mean(), x, patch={"1": torch.zeros_like}
    )
    assert torch.all(res.activations["1"] == 0)
    # Nothing upstream of an ablated value reaches the loss.
    assert torch.all(res.grads["0.weight"] == 0)
    expected = model[2].bias.detach().expand(4, 3)
    torch.testing.assert_close(
        probe.apply(x, patch={"1": torch.zeros(4, 16)}).outputs, expected
    )


def test_unselected_sites_add_no_flops():
    """Counted by PyTorch's own FLOP counter: a probed step at every site costs
    the matrix products of a plain forward and backward, nothing more. The
    counter also counts the discovery pass on fake tensors (shapes only, no
    arithmetic), which is exactly what `probe.sites` counts."""
    from torch.utils.flop_counter import FlopCounterMode

    model, x = _mlp(), _x(64, 6)
    loss_fn = lambda y: (y**2).mean()
    probe = bridge.probe(model)
    probe.value_and_grad(loss_fn, x)  # warm

    def count(step):
        with FlopCounterMode(display=False) as counter:
            step()
        return counter.get_total_flops()

    plain = count(lambda: _plain(model, loss_fn, x))
    discovery = count(lambda: probe.sites(x))
    assert plain > 0 and discovery < plain
    assert count(lambda: probe.value_and_grad(loss_fn, x)) == plain + discovery
    at_one = count(lambda: probe.value_and_grad(loss_fn, x, at="2"))
    assert at_one == plain + discovery


def test_two_threads_probe_the_same_module():
    model = _mlp()
    xs = [_x(4, 6, seed=s) for s in (1, 2)]
    loss_fn = lambda y: (y**2).mean()
    expected = [bridge.probe(model).value_and_grad(loss_fn, x) for x in xs]
    results = [None, None]

    def work(i):
        for _ in range(5):
            results[i] = bridge.probe(model).value_and_grad(loss_fn, xs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for got, want in zip(results, expected, strict=True):
        torch.testing.assert_close(got.activation_grads, want.activation_grads)
        torch.testing.assert_close(got.grads, want.grads)
    assert _hook_counts(model) == [0] * 4


def test_tap_outside_a_probe_is_the_tensor_itself():
    x = _x(2, 3)
    assert bridge.tap("t", x) is x


# -- errors, each before any work ------------------------------------------------


def test_vmap_true_is_refused():
    with pytest.raises(ValueError, match=r"vmap=True does not apply to a PyTorch"):
        bridge.probe(_mlp(), vmap=True)


def test_variables_are_refused():
    with pytest.raises(
        TypeError, match=r"carries its own parameters.*bridge.probe\(module\)"
    ):
        bridge.probe(_mlp(), {"params": 1})


def test_jax_jit_is_refused_saying_why():
    probe = bridge.probe(_mlp())
    step = jax.jit(lambda probe, x: probe.value_and_grad(lambda y: y.sum(), x))
    with pytest.raises(TypeError, match=r"jax.jit, jax.vmap and jax.grad cannot trace"):
        step(probe, jnp.ones((2, 6)))


def test_a_loss_that_is_not_a_tensor_is_refused():
    with pytest.raises(
        TypeError, match=r"must return a scalar torch tensor; it returned a float"
    ):
        bridge.probe(_mlp()).value_and_grad(lambda y: 1.0, _x(2, 6))


def test_a_loss_that_is_not_a_scalar_is_refused():
    with pytest.raises(ValueError, match=r"must return a real floating-point scalar"):
        bridge.probe(_mlp()).value_and_grad(lambda y: y, _x(2, 6))


def test_has_aux_mismatch_is_refused():
    with pytest.raises(ValueError, match=r"has_aux=True, but `loss_fn` did not"):
        bridge.probe(_mlp()).value_and_grad(lambda y: y.sum(), _x(2, 6), has_aux=True)


def test_a_selection_that_matches_nothing_names_the_closest_sites():
    with pytest.raises(
        ValueError, match=re.escape("matches no site. Closest paths: '2'")
    ):
        bridge.probe(_mlp()).value_and_grad(lambda y: y.sum(), _x(2, 6), at="3")


def test_a_patch_of_the_wrong_shape_is_refused():
    probe = bridge.probe(_mlp())
    with pytest.raises(ValueError, match=r"patch for site '1' does not fit"):
        probe.apply(_x(2, 6), patch={"1": torch.zeros(3, 16)})
    with pytest.raises(ValueError, match=r"patch for site '1' does not fit.*function"):
        probe.apply(_x(2, 6), patch={"1": lambda v: v[:, :4]})


class _FrozenBackbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        with torch.no_grad():
            features = self.backbone(x)
        return self.head(features)


def test_a_site_without_autograd_is_refused_not_given_a_zero_gradient():
    probe = bridge.probe(_FrozenBackbone())
    with pytest.raises(RuntimeError, match=r"Site 'backbone' runs with autograd"):
        probe.value_and_grad(lambda y: y.sum(), _x(2, 4))
    res = probe.value_and_grad(lambda y: y.sum(), _x(2, 4), at="head")
    assert list(res.activation_grads) == ["head"]
    assert list(probe.apply(_x(2, 4)).activations) == ["backbone", "head"]


def test_discovery_is_reused_for_the_same_signature_and_redone_otherwise(
    monkeypatch,
):
    from bridge.adapters import torch as adapter

    afresh = []
    original = adapter.TorchProbe._discover_afresh
    monkeypatch.setattr(
        adapter.TorchProbe,
        "_discover_afresh",
        lambda self, *a: afresh.append(1) or original(self, *a),
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.Linear(16, 3))
    probe, loss_fn = bridge.probe(model), lambda y: (y**2).mean()
    for seed in (1, 2):  # new values, same shapes: discovered once
        probe.value_and_grad(loss_fn, _x(4, 6, seed=seed))
    assert len(afresh) == 1
    probe.value_and_grad(loss_fn, _x(5, 6))  # a new batch size
    assert len(afresh) == 2
    model.eval()  # a new mode: discovered again, and the run is in eval mode
    res = probe.value_and_grad(loss_fn, _x(4, 6))
    assert len(afresh) == 3
    torch.testing.assert_close(res.loss, loss_fn(model(_x(4, 6))).detach())
    # A bad loss on a known signature is still refused before the run.
    with pytest.raises(ValueError, match=r"must return a real floating-point scalar"):
        probe.value_and_grad(lambda y: y, _x(4, 6))
    assert len(afresh) == 3


def test_a_submodule_returning_a_hugging_face_model_output_is_a_site():
    """`ResNetModel` and its encoder return `ModelOutput`s (a dict subclass
    JAX's pytrees do not know): they are sites, recorded as dicts, and the
    model goes on with the `ModelOutput`. Their gradients follow from the
    layers after them: the classifier flattens `resnet`'s `pooler_output`,
    which nothing else reads (its `last_hidden_state` reaches no loss), and the
    pooler averages the encoder's `last_hidden_state` over its 4 x 4 pixels."""
    transformers = pytest.importorskip("transformers")
    config = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3
    )
    torch.manual_seed(0)
    model = transformers.ResNetForImageClassification(config).eval()
    x = _x(2, 3, 32, 32)
    probe = bridge.probe(model)
    assert set(probe.sites(x)["resnet"]) == {"last_hidden_state", "pooler_output"}
    res = probe.value_and_grad(
        lambda out: out.logits.square().mean(),
        x,
        at=["resnet", "resnet.encoder", "classifier.0"],
    )
    resnet = res.activation_grads["resnet"]
    flat = res.activation_grads["classifier.0"]
    torch.testing.assert_close(resnet["pooler_output"], flat.reshape(2, 16, 1, 1))
    assert torch.all(resnet["last_hidden_state"] == 0)
    torch.testing.assert_close(
        res.activation_grads["resnet.encoder"]["last_hidden_state"],
        (resnet["pooler_output"] / 16).expand(2, 16, 4, 4),
    )
    expected = model(x).logits.square().mean()
    torch.testing.assert_close(res.loss, expected.detach())
    fwd = probe.apply(x, patch={"resnet": lambda out: out})
    assert type(fwd.outputs).__name__ == "ImageClassifierOutputWithNoAttention"


class _Aliasing(nn.Module):
    """Values the model holds elsewhere: a module returning its input (used
    again later), a container returning its last child's output, a module
    returning its parameter (used again later), and an in-place change of a
    site's output."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.identity = nn.Identity()
        self.block = nn.Sequential(nn.Tanh(), nn.Linear(3, 3))

    def forward(self, x):
        h = self.linear(x)
        s = self.identity(h)  # the same tensor as h
        b = self.block(s)  # the same tensor as block.1's output
        b += 1.0  # in place, after both sites (Linear keeps no output)
        return 2 * s + 3 * h + b


def test_values_held_elsewhere_get_the_gradient_of_their_own_uses():
    torch.manual_seed(0)
    model, x = _Aliasing(), _x(4, 3)
    res = bridge.probe(model).value_and_grad(lambda y: y.sum(), x)
    ones = torch.ones(4, 3)
    weight = model.block[1].weight.detach()
    h = model.linear(x).detach()
    # d loss / d identity's output: its own uses only (2, and through the
    # block); d loss / d linear's output adds the direct use (3).
    torch.testing.assert_close(res.activation_grads["block"], ones)
    torch.testing.assert_close(res.activation_grads["block.1"], ones)
    torch.testing.assert_close(res.activation_grads["block.0"], ones @ weight)
    through_block = (ones @ weight) * (1 - torch.tanh(h) ** 2)
    torch.testing.assert_close(res.activation_grads["identity"], 2 + through_block)
    torch.testing.assert_close(
        res.activation_grads["linear"], res.activation_grads["identity"] + 3
    )
    # Recorded before the in-place `+= 1`.
    torch.testing.assert_close(res.activations["block"], res.activations["block.1"])
    torch.testing.assert_close(res.activations["block"], model.block(h).detach())


def test_gradients_run_no_python_in_the_backward_pass_but_where_they_must(
    monkeypatch,
):
    """A site's gradient is taken at a view of its value, an input of the one
    `torch.autograd.grad`: no Python runs per site in the backward pass. The
    site whose value an in-place ReLU rewrites goes through `_Catch` (found
    by its version counter, once), whose gradient is the value's before the
    rewrite: checked against `retain_grad` on a copy without the in-place op."""
    from bridge.adapters.torch import session

    backward_calls = []
    original = session._Catch.backward

    def counted(ctx, grad):
        backward_calls.append(ctx.slot)
        return original(ctx, grad)

    monkeypatch.setattr(session._Catch, "backward", staticmethod(counted))
    torch.manual_seed(0)
    model, x = _mlp(), _x(4, 6)
    bridge.probe(model).value_and_grad(lambda y: y.sum(), x)
    assert backward_calls == []

    rewriting = nn.Sequential(nn.Linear(6, 16), nn.ReLU(inplace=True), nn.Linear(16, 3))
    probe = bridge.probe(rewriting)
    probe.value_and_grad(lambda y: y.sum(), x)  # finds "0" rewritten: runs again
    backward_calls.clear()
    res = probe.value_and_grad(lambda y: y.sum(), x)
    assert len(backward_calls) == 1  # site "0" only

    h = rewriting[0](x)
    h.retain_grad()
    rewriting[2](torch.relu(h)).sum().backward()
    torch.testing.assert_close(res.activation_grads["0"], h.grad)
    assert (res.activations["0"] < 0).any()  # recorded before the ReLU


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
def test_sites_before_any_trainable_parameter_have_gradients(frozen):
    """The input does not require grad, nor (frozen) any parameter: the
    gradients at the sites are still taken, the parameters' are not."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity(), nn.Linear(3, 2)).requires_grad_(not frozen)
    res = bridge.probe(model).value_and_grad(lambda y: y.sum(), _x(4, 3))
    weight = model[1].weight.detach()
    torch.testing.assert_close(res.activation_grads["0"], torch.ones(4, 2) @ weight)
    torch.testing.assert_close(res.activation_grads["1"], torch.ones(4, 2))
    assert list(res.grads) == ([] if frozen else ["1.weight", "1.bias"])


@pytest.mark.parametrize("family", ["bert-train", "gpt2-eval"])
def test_hugging_face_pytorch_models_probe_with_plain_numbers(family):
    """Real models nobody here wrote, from small configs: loss and parameter
    gradients equal plain `backward()` (dropout reseeded alike), and every
    layer adding a bias last (`nn.Linear`, GPT-2's `Conv1D`, `nn.LayerNorm`)
    called once has its bias gradient equal to its output gradient summed
    over the broadcast axes."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (2, 7))
    if family == "bert-train":
        config = transformers.BertConfig(
            vocab_size=100,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            num_labels=3,
        )
        model = transformers.BertForSequenceClassification(config).train()
    else:
        config = transformers.GPT2Config(
            vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=16
        )
        model = transformers.GPT2LMHeadModel(config).eval()
    loss_fn = lambda out: out.logits.square().mean()
    probe = bridge.probe(model)
    torch.manual_seed(1)
    res = probe.value_and_grad(loss_fn, input_ids=ids)
    torch.manual_seed(1)
    loss, grads, _ = _plain(model, lambda out: loss_fn(out), ids)
    torch.testing.assert_close(res.loss, loss)
    torch.testing.assert_close(
        res.grads, {n: g for n, g in grads.items() if g is not None}
    )
    biased = [
        name
        for name, module in model.named_modules()
        if type(module).__name__ in ("Linear", "Conv1D", "LayerNorm")
        and getattr(module, "bias", None) is not None
        and name in res.activation_grads
        and f"{name}#1" not in res.activation_grads
    ]
    assert len(biased) >= 8
    for name in biased:
        output_grad = res.activation_grads[name]
        summed = output_grad.reshape(-1, output_grad.shape[-1]).sum(0)
        torch.testing.assert_close(summed, res.grads[f"{name}.bias"])


class _SeesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x):
        _SEEN.append(type(x).__name__)
        return self.linear(x)


_SEEN: list[str] = []


def test_sites_runs_the_model_on_fake_tensors_only():
    """Discovery runs no arithmetic: the model sees fake tensors, not a real
    forward pass (the fallback, for models fake tensors cannot run)."""
    _SEEN.clear()
    bridge.probe(_SeesItsInput()).sites(_x(4, 3))
    assert _SEEN == ["FakeTensor"]


def test_a_deleted_probe_leaves_no_discovery_holding_its_model():
    """Discoveries are shared by every probe, and a torch site holds its
    submodule (with its weights): the entries go with the probe."""
    import gc
    import weakref

    from bridge._probe.discovery_cache import CACHE

    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    probe = bridge.probe(model)
    probe.value_and_grad(lambda y: (y**2).mean(), _x(4, 6))
    held = len(CACHE)
    assert held >= 1
    alive = weakref.ref(model)
    del probe, model
    gc.collect()
    assert alive() is None, "a discovery kept the model alive"
    assert len(CACHE) < held


def test_a_forward_set_on_the_module_runs_on_the_shell():
    import types

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    first = model[0]

    def doubled(self, x):  # a user's monkeypatch, bound to the module
        return 2.0 * nn.functional.linear(x, self.weight, self.bias)

    first.forward = types.MethodType(doubled, first)
    x = torch.randn(5, 3)
    res = bridge.probe(model).value_and_grad(lambda out: (out**2).sum(), x)
    loss = (model(x) ** 2).sum()
    loss.backward()
    np.testing.assert_allclose(res.loss.numpy(), loss.detach().numpy(), rtol=1e-5)
    np.testing.assert_allclose(
        res.grads["0.weight"].numpy(), first.weight.grad.numpy(), rtol=1e-5
    )
    assert set(res.activation_grads) == {"0", "1", "2"}
    assert first.forward.__self__ is first  # the user's module is untouched


def test_a_wrapper_replacing_forward_is_refused_not_silently_zero():
    class Controller:  # as nnsight's NNsight sets on every module it wraps
        def __init__(self, module):
            self.module = module
            self.original = module.forward

        def __call__(self, *args, **kwargs):
            return self.original(*args, **kwargs)

    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    probe = bridge.probe(model)
    model[0].forward = Controller(model[0])
    with pytest.raises(TypeError, match="copy.deepcopy of the model") as error:
        probe.value_and_grad(lambda out: (out**2).sum(), torch.randn(5, 3))
    assert isinstance(error.value, bridge.BridgeError)
    assert "Linear module's `forward` is replaced" in str(error.value)


class _InPlaceAfterDropout(nn.Module):
    """A site (the dropout's output) changed in place afterwards, with
    random draws in the step: recorded as an alias, it would read the
    changed value."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 8)
        self.dropout = nn.Dropout(0.5)
        self.head = nn.Linear(8, 2)
        self.calls = [0]  # shared with the probe's shell of the module

    def forward(self, x):
        self.calls[0] += 1
        h = self.dropout(self.linear(x))
        h.relu_()  # in place, after the dropout's site
        return self.head(h)


def test_a_value_changed_in_place_is_recorded_as_it_was_with_the_same_draws():
    torch.manual_seed(0)
    model, x = _InPlaceAfterDropout().train(), _x(16, 3)
    probe = bridge.probe(model)
    probe.sites(x)

    def loss(y):
        return (y**2).sum()

    torch.manual_seed(7)
    calls = model.calls[0]
    res = probe.value_and_grad(loss, x)
    after_probe = torch.get_rng_state()
    # The first run found the site changed and ran again from the same draws.
    assert model.calls[0] == calls + 2
    torch.manual_seed(7)
    pre = model.dropout(model.linear(x)).detach()
    want = loss(model.head(pre.relu()))
    assert torch.equal(torch.get_rng_state(), after_probe)  # drawn once
    torch.testing.assert_close(res.activations["dropout"], pre)
    assert (res.activations["dropout"] < 0).any()  # before the ReLU
    torch.testing.assert_close(res.loss, want.detach())
    # From then on the site is copied at its call: one run a step.
    probe.value_and_grad(loss, x)
    assert model.calls[0] == calls + 3


def test_a_step_leaves_no_cycle_holding_its_tensors():
    """A session's parts refer back to it weakly: with the garbage collector
    off, nothing of a step stays alive once its result is dropped."""
    import gc

    from bridge.adapters.torch.session import TorchSession

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), _x(5, 3)
    probe = bridge.probe(model)
    probe.value_and_grad(lambda y: y.sum(), x)  # discovery done
    gc.collect()
    gc.disable()
    try:
        result = probe.value_and_grad(lambda y: y.sum(), x)
        del result
        alive = [o for o in gc.get_objects() if type(o) is TorchSession]
    finally:
        gc.enable()
    assert alive == []


# -- results are detached in every container --------------------------------------


def _tensors_in(tree, seen=None):
    """Every tensor reachable in `tree`: through mappings (a `ModelOutput`),
    dataclasses, sequences and the attributes of other objects (a Hugging Face
    `Cache`)."""
    import dataclasses

    seen = set() if seen is None else seen
    if id(tree) in seen:
        return
    seen.add(id(tree))
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors_in(value, seen)
    elif isinstance(tree, list | tuple):
        for value in tree:
            yield from _tensors_in(value, seen)
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        for field in dataclasses.fields(tree):
            yield from _tensors_in(getattr(tree, field.name), seen)
    elif hasattr(tree, "__dict__") and not isinstance(tree, type | nn.Module):
        for value in vars(tree).values():
            yield from _tensors_in(value, seen)


def _assert_detached(*trees):
    found = [t for tree in trees for t in _tensors_in(tree)]
    assert found
    attached = [tuple(t.shape) for t in found if t.requires_grad or t.grad_fn]
    assert attached == []


def _assert_results_detached_and_plain(model, loss_fn, *args):
    """`apply`'s outputs and activations, `value_and_grad`'s aux (the whole
    outputs), gradients and activations: no tensor requires grad or holds a
    graph, in the outputs' own containers, with plain autograd's numbers."""
    probe = bridge.probe(model)
    fwd = probe.apply(*args)
    res = probe.value_and_grad(lambda out: (loss_fn(out), out), *args, has_aux=True)
    plain_out = copy.deepcopy(model)(*args)
    loss, grads, _ = _plain(model, loss_fn, *args)
    _assert_detached(fwd.outputs, fwd.activations)
    _assert_detached(
        res.loss, res.aux, res.grads, res.activations, res.activation_grads
    )
    for outputs in (fwd.outputs, res.aux):
        assert type(outputs) is type(plain_out)
        torch.testing.assert_close(
            list(_tensors_in(outputs)), [t.detach() for t in _tensors_in(plain_out)]
        )
    torch.testing.assert_close(res.loss, loss)
    torch.testing.assert_close(res.grads, grads)
    return fwd, res, plain_out


def test_a_hugging_face_model_output_is_detached_cache_and_all():
    """GPT-2's `CausalLMOutputWithCrossAttentions` (a dict subclass JAX's
    pytrees do not know) holds the logits and a `DynamicCache` of key and
    value tensors: all detached, the output and the cache of their own
    types."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 50, (2, 5))
    fwd, res, plain = _assert_results_detached_and_plain(
        model, lambda out: out.logits.square().mean(), ids
    )
    for outputs in (fwd.outputs, res.aux):
        assert not outputs.logits.requires_grad
        assert outputs["logits"] is outputs.logits
        assert type(outputs.past_key_values) is type(plain.past_key_values)


@dataclasses.dataclass(frozen=True)
class _Frozen:
    logits: torch.Tensor
    hidden: list
    label: str = "frozen"


class _Mapping(dict):
    """A dict subclass JAX's pytrees do not know."""


_Pair = collections.namedtuple("_Pair", "first rest")


class _DataclassOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.linear(x))
        extra = _Mapping(scaled=h * 2, pair=_Pair(h.sum(-1), [h.mean()]))
        return _Frozen(self.head(h), [h, extra])


class _NamedTupleOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 4)

    def forward(self, x):
        h = self.linear(x)
        nested = collections.OrderedDict(inner=_Frozen(h * h, [h.exp()]))
        return _Pair(h, (nested, torch.max(h, -1)))


@pytest.mark.parametrize("model_class", [_DataclassOutput, _NamedTupleOutput])
def test_dataclass_and_named_tuple_outputs_are_detached(model_class):
    torch.manual_seed(0)
    model, x = model_class(), _x(2, 3)
    loss_fn = (
        (lambda out: out.logits.square().sum() + out.hidden[1]["pair"].rest[0])
        if model_class is _DataclassOutput
        else (lambda out: out.first.sin().sum() + out.rest[1].values.sum())
    )
    fwd, res, _ = _assert_results_detached_and_plain(model, loss_fn, x)
    for outputs in (fwd.outputs, res.aux):
        if model_class is _DataclassOutput:
            assert type(outputs.hidden[1]) is _Mapping
            assert type(outputs.hidden[1]["pair"]) is _Pair
            assert outputs.label == "frozen"
        else:
            inner = outputs.rest[0]["inner"]
            assert type(inner) is _Frozen and type(outputs.rest[0]) is type(
                collections.OrderedDict()
            )
            assert type(outputs.rest[1]) is torch.return_types.max
