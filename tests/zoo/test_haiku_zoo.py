"""Model zoo, Haiku: networks Haiku ships, probed at every site.

`hk.nets.ResNet18` (training and inference), `hk.nets.MobileNetV1`,
`hk.nets.VectorQuantizerEMA` with its state, `hk.LSTM` under
`hk.dynamic_unroll` and `hk.MultiHeadAttention`, built from small configs.

Every reference is Haiku's own, written here and never through bridge:

- the loss, parameter gradients and new state: `jax.value_and_grad` of plain
  `apply`;
- the activations: an `hk.intercept_methods` interceptor of this file that
  records every module call's output;
- the activation gradients: `jax.jvp` of plain `apply`'s loss in `t`, where an
  interceptor of this file adds `t * delta` to the named call's output.
  `vdot(activation_grad, delta)` must equal it, for two or three single sites
  per model and for a random `delta` at every site at once.

`hk.dynamic_unroll` runs its core in `hk.scan`, where an interceptor sees one
traced step: its references come from `hk.static_unroll` of the same core (the
same parameters and numbers), whose step `k` is the call `lstm#k`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    add_at_float_leaves,
    assert_equals_plain,
    assert_tree_allclose,
    tree_vdot,
    value_and_grad_in,
)

import bridge

# -- the models, as Haiku's users write them


def _resnet18(is_training):
    def forward(x):
        return hk.nets.ResNet18(num_classes=10)(x, is_training=is_training)

    return forward


def _mobilenet(x, is_training=True):
    net = hk.nets.MobileNetV1(
        strides=(1, 2, 1, 2, 1), channels=(8, 16, 16, 32, 32), num_classes=10
    )
    return net(x, is_training=is_training)


def _vqvae(x, is_training=True):
    """Encoder, VQ-EMA bottleneck, decoder: the VQ-VAE pattern."""
    z = hk.Linear(6, name="encoder")(x)
    vq = hk.nets.VectorQuantizerEMA(
        embedding_dim=6, num_embeddings=5, commitment_cost=0.25, decay=0.9
    )(z, is_training=is_training)
    return hk.Linear(8, name="decoder")(vq["quantize"]), vq


def _lstm(unroll):
    def forward(xs):  # (time, batch, features)
        core = hk.LSTM(8)
        outputs, _ = unroll(core, xs, core.initial_state(xs.shape[1]))
        return hk.Linear(3)(outputs)

    return forward


def _attention(x):
    mha = hk.MultiHeadAttention(
        num_heads=2, key_size=4, w_init=hk.initializers.VarianceScaling(1.0)
    )
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    h = mha(x, x, x, mask=causal[None, None])
    return hk.Linear(3)(hk.LayerNorm(-1, True, True)(h + x))


def _cross_entropy(labels):
    def loss(logits):
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))

    return loss


def _mse(y):
    return jnp.mean(jnp.square(y - 0.5))


def _vq_loss(outputs):
    y, vq = outputs
    return (
        _mse(y)
        + vq["loss"]
        + 0.1 * vq["perplexity"]
        + 0.01 * jnp.mean(vq["distances"])
        + 0.01 * jnp.sum(vq["encodings"][0])
    )


@dataclasses.dataclass(frozen=True, eq=False)
class Zoo:
    transformed: Any  # without apply rng: apply(params, [state,] *args)
    params: Any
    state: Any  # None for hk.transform
    args: tuple
    loss_fn: Callable
    jvp_sites: tuple[str, ...]
    #: A transform with the same params and numbers whose calls an interceptor
    #: can see one by one (hk.static_unroll for hk.dynamic_unroll) ...
    unrolled: Any = None
    #: ... and, for each site stacked over its steps, the number of steps.
    steps: dict = dataclasses.field(default_factory=dict)

    def probe(self):
        variables = (self.params,) if self.state is None else (self.params, self.state)
        return bridge.probe(self.transformed, *variables)


def _plus_one(state):
    """A state that is not init's (zero variances, zero counters), so
    inference mode reads real moving averages and updates are visible."""
    return jax.tree.map(lambda v: v + 1, state)


@functools.cache
def _resnet_init():
    # 64x64, not 32x32: the last stage's BatchNorm then normalises over
    # 2x2x2 values, not 2, and the gradients are not rounding-dominated (at
    # 32x32 plain Haiku eager and jitted differ by 0.03 in `logits/w`).
    x = jax.random.normal(jax.random.key(0), (2, 64, 64, 3))
    init = hk.transform_with_state(_resnet18(True)).init
    params, state = jax.jit(init)(jax.random.key(1), x)
    return params, _plus_one(state), x


@functools.cache
def _build(name: str) -> Zoo:
    if name in ("resnet18-train", "resnet18-eval"):
        params, state, x = _resnet_init()
        forward = _resnet18(is_training=name == "resnet18-train")
        return Zoo(
            hk.without_apply_rng(hk.transform_with_state(forward)),
            params,
            state,
            (x,),
            _cross_entropy(jnp.array([3, 7])),
            (
                "res_net18/~/initial_conv",
                "res_net18/~/block_group_1/~/block_0/~/shortcut_batchnorm",
                "res_net18/~/block_group_3/~/block_1/~/conv_1",
            ),
        )
    if name == "mobilenet":
        x = jax.random.normal(jax.random.key(0), (2, 32, 32, 3))
        transformed = hk.without_apply_rng(hk.transform_with_state(_mobilenet))
        params, state = jax.jit(transformed.init)(jax.random.key(1), x)
        return Zoo(
            transformed,
            params,
            _plus_one(state),
            (x,),
            _cross_entropy(jnp.array([1, 9])),
            (
                "mobile_net_v1/mobile_net_v1_block/depthwise_conv",
                "mobile_net_v1/mobile_net_v1_block_3/batch_norm_1",
                "mobile_net_v1/logits",
            ),
        )
    if name == "vqvae":
        x = jax.random.normal(jax.random.key(0), (4, 3, 8))
        transformed = hk.without_apply_rng(hk.transform_with_state(_vqvae))
        params, state = transformed.init(jax.random.key(1), x)
        return Zoo(
            transformed,
            params,
            state,
            (x,),
            _vq_loss,
            ("encoder", "vector_quantizer_ema", "vector_quantizer_ema.quantize"),
        )
    if name == "lstm":
        xs = jax.random.normal(jax.random.key(0), (5, 2, 4))
        transformed = hk.without_apply_rng(hk.transform(_lstm(hk.dynamic_unroll)))
        params = transformed.init(jax.random.key(1), xs)
        return Zoo(
            transformed,
            params,
            None,
            (xs,),
            _mse,
            ("lstm.initial_state", "lstm", "lstm/linear"),
            unrolled=hk.without_apply_rng(hk.transform(_lstm(hk.static_unroll))),
            steps={"lstm": 5, "lstm/linear": 5},
        )
    if name == "attention":
        x = jax.random.normal(jax.random.key(0), (2, 5, 8))
        transformed = hk.without_apply_rng(hk.transform(_attention))
        params = transformed.init(jax.random.key(1), x)
        return Zoo(
            transformed,
            params,
            None,
            (x,),
            _mse,
            ("multi_head_attention/query", "multi_head_attention", "layer_norm"),
        )
    raise KeyError(name)


MODELS = ["resnet18-train", "resnet18-eval", "mobilenet", "vqvae", "lstm", "attention"]


#: The costliest models (ResNet-18's eval mode beside its training mode,
#: MobileNet's depthwise convolutions): local runs, CI's time is kept.
SLOW_MODELS = {"resnet18-eval", "mobilenet"}


def _model_params(models=MODELS):
    """One xdist group per model: one worker builds and compiles it once."""
    return [
        pytest.param(
            m,
            marks=[pytest.mark.xdist_group(f"zoo-haiku-{m}")]
            + ([pytest.mark.slow] if m in SLOW_MODELS else []),
        )
        for m in models
    ]


# -- the references: Haiku's own apply and interceptors, never bridge


def _site_name(context: hk.MethodContext, counts: dict[str, int]) -> str | None:
    """`module_name` (`.method` for a method other than `__call__`), `#k` for
    the k-th repeated call; None for what a researcher would not call a layer:
    `__init__`, private helpers, property reads."""
    method = context.method_name
    if method != "__call__" and (
        method.startswith("_")
        or isinstance(
            inspect.getattr_static(context.orig_class, method, None), property
        )
    ):
        return None
    base = context.module.module_name
    base = base if method == "__call__" else f"{base}.{method}"
    k = counts.get(base, 0)
    counts[base] = k + 1
    return base if k == 0 else f"{base}#{k}"


def _plain(model: Zoo, transformed, params, offsets: dict[str, Any], order=None):
    """Plain apply; `offsets[name]` is added to that call's output. Returns the
    loss, the new state, and every call's output by name, in call order."""
    outputs: dict[str, Any] = {}
    counts: dict[str, int] = {}

    def interceptor(next_fun, args, kwargs, context):
        name = _site_name(context, counts)
        if name is None:
            return next_fun(*args, **kwargs)
        if order is not None:
            order.append(name)  # call order is entry order
        out = next_fun(*args, **kwargs)
        if not jax.tree.leaves(out):  # `initialize()` returns nothing: no site
            counts[name.partition("#")[0]] -= 1
            if order is not None:
                order.remove(name)
            return out
        if name in offsets:
            out = add_at_float_leaves(out, offsets[name])
        outputs[name] = out
        return out

    with hk.intercept_methods(interceptor):
        if model.state is None:
            out, state = transformed.apply(params, *model.args), None
        else:
            out, state = transformed.apply(params, model.state, *model.args)
    return model.loss_fn(out), (state, outputs)


def _bridge_name(model: Zoo, call: str) -> tuple[str, int | None]:
    """The site a reference call belongs to, and its step for a stacked site."""
    base, _, k = call.partition("#")
    if base in model.steps:
        return base, int(k or 0)
    return call, None


def _float_part(value):
    return jax.tree.map(
        lambda v: v if jnp.issubdtype(v.dtype, jnp.inexact) else None, value
    )


def _random_delta(value, seed):
    """Random normal at the float leaves, None at the integer ones."""
    leaves, treedef = jax.tree.flatten(_float_part(value))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(
        treedef,
        [
            jax.random.normal(k, v.shape, v.dtype)
            for k, v in zip(keys, leaves, strict=True)
        ],
    )


@dataclasses.dataclass
class Expected:
    loss: Any
    grads: Any
    state: Any
    order: list[str]  # the sites, in call order
    activations: dict[str, Any]  # by site, stacked over steps where stacked
    deltas: list[dict[str, Any]]  # one per single jvp site, then all sites
    jvps: Any  # d loss(t * delta) / dt at 0, one per entry of `deltas`


@functools.cache
def _calls(name: str) -> tuple[list[str], dict[str, Any]]:
    """The reference's calls in order, and their output shapes (no FLOPs)."""
    model = _build(name)
    calls: list[str] = []  # eval_shape sorts dict keys: order from the calls
    _, (_, structs) = jax.eval_shape(
        lambda p: _plain(model, model.unrolled or model.transformed, p, {}, calls),
        model.params,
    )
    return calls, structs


def _order(name: str) -> list[str]:
    """The sites a researcher expects, in call order."""
    model = _build(name)
    return list(dict.fromkeys(_bridge_name(model, c)[0] for c in _calls(name)[0]))


@functools.cache
def _expected(name: str) -> Expected:
    model = _build(name)
    unrolled = model.unrolled or model.transformed
    calls, structs = _calls(name)
    order = _order(name)
    # The deltas, shaped like the sites (stacked over steps where stacked).
    site_structs = {}
    for call in calls:
        site, step = _bridge_name(model, call)
        if step is None:
            site_structs[site] = structs[call]
        elif step == 0:
            n = model.steps[site]
            site_structs[site] = jax.tree.map(
                lambda s, n=n: jax.ShapeDtypeStruct((n, *s.shape), s.dtype),
                structs[call],
            )
    single = [
        {s: _random_delta(site_structs[s], seed=i)}
        for i, s in enumerate(model.jvp_sites)
    ]
    everywhere = {
        site: _random_delta(struct, seed=100 + i)
        for i, (site, struct) in enumerate(site_structs.items())
    }
    deltas = [*single, everywhere]

    def call_offsets(ts):
        """Per reference call: the sum over k of ts[k] * deltas[k][site]."""
        offsets = {}
        for call in calls:
            site, step = _bridge_name(model, call)
            terms = [
                jax.tree.map(
                    lambda d, t=t, step=step: t * (d if step is None else d[step]),
                    ds[site],
                )
                for t, ds in zip(ts, deltas, strict=True)
                if site in ds
            ]
            if terms:
                offsets[call] = jax.tree.map(lambda *a: sum(a), *terms)
        return offsets

    def compute(params):
        (loss, (state, outputs)), grads = jax.value_and_grad(
            lambda p: _plain(model, model.transformed, p, {}), has_aux=True
        )(params)
        if model.unrolled is not None:
            _, (_, outputs) = _plain(model, unrolled, params, {})
        activations = {}
        for site in order:
            if site in model.steps:
                steps = [outputs[site]] + [
                    outputs[f"{site}#{k}"] for k in range(1, model.steps[site])
                ]
                activations[site] = jax.tree.map(lambda *s: jnp.stack(s), *steps)
            else:
                activations[site] = outputs[site]
        # Forward mode: one jvp per delta set, batched by jacfwd.
        jvps = jax.jacfwd(
            lambda ts: _plain(model, unrolled, params, call_offsets(ts))[0]
        )(jnp.zeros(len(deltas), jnp.float32))
        return loss, grads, state, _float_part(activations), jvps

    loss, grads, state, activations, jvps = jax.jit(compute)(model.params)
    return Expected(loss, grads, state, order, activations, deltas, jvps)


# -- the tests


def _run(model: Zoo, mode: str, **options):
    return value_and_grad_in(mode, model.probe(), model.loss_fn, model.args, options)


@functools.cache
def _result(name: str, mode: str):
    """The probe at every site: computed once per model and mode."""
    return _run(_build(name), mode)


@pytest.mark.parametrize("mode", [pytest.param("eager", marks=pytest.mark.slow), "jit"])
@pytest.mark.parametrize("name", _model_params())
def test_every_site_equals_plain_haiku(name, mode):
    model = _build(name)
    res = _result(name, mode)
    expected = _expected(name)

    assert_equals_plain(
        res,
        expected.loss,
        expected.grads,
        None if model.state is None else expected.state,
    )

    # Every site, and nothing else; activations equal the recorded outputs.
    # (A dict leaving `jax.jit` has sorted keys: order is checked by `sites`.)
    assert sorted(res.activations) == sorted(expected.order)
    assert sorted(res.activation_grads) == sorted(expected.order)
    for site in expected.order:
        assert_tree_allclose(
            _float_part(res.activations[site]),
            expected.activations[site],
            rtol=1e-4,
            atol=1e-5,
        )
        assert jax.tree.structure(res.activation_grads[site]) == jax.tree.structure(
            expected.activations[site]
        ), site

    # Activation gradients against jvp: each single site, then all at once.
    for deltas, jvp in zip(expected.deltas, expected.jvps, strict=True):
        got = sum(tree_vdot(res.activation_grads[s], d) for s, d in deltas.items())
        np.testing.assert_allclose(got, jvp, rtol=2e-3, atol=1e-5 * (1 + abs(jvp)))


@pytest.mark.parametrize("name", _model_params())
def test_sites_are_in_call_order_with_their_shapes(name):
    model = _build(name)
    sites = model.probe().sites(*model.args)
    assert list(sites) == _order(name)


@pytest.mark.xdist_group("zoo-haiku-resnet18-train")
def test_resnet18_sites_are_what_a_researcher_expects():
    model = _build("resnet18-train")
    sites = model.probe().sites(*model.args)
    names = list(sites)
    assert len(names) == 94
    assert names[:5] == [
        "res_net18",
        "res_net18/~/initial_conv",
        "res_net18/~/initial_batchnorm",
        "res_net18/~/initial_batchnorm/~/mean_ema",
        "res_net18/~/initial_batchnorm/~/var_ema",
    ]
    assert names[-1] == "res_net18/~/logits"
    for group, (size, channels) in enumerate([(16, 64), (8, 128), (4, 256), (2, 512)]):
        for block in (0, 1):
            prefix = f"res_net18/~/block_group_{group}/~/block_{block}"
            for layer in ("conv_0", "batchnorm_0", "conv_1", "batchnorm_1"):
                assert sites[f"{prefix}/~/{layer}"].shape == (2, size, size, channels)
            # A block is entered before its layers, its convs before its norms.
            assert names.index(prefix) < names.index(f"{prefix}/~/conv_0")
            assert names.index(f"{prefix}/~/conv_0") < names.index(
                f"{prefix}/~/batchnorm_0"
            )
    shortcut = "res_net18/~/block_group_1/~/block_0/~/shortcut_conv"
    assert sites[shortcut].shape == (2, 8, 8, 128)
    assert sites["res_net18/~/logits"].shape == (2, 10)
    # Inference updates no moving average: no EMA call, no EMA site.
    eval_sites = _build("resnet18-eval").probe().sites(*_build("resnet18-eval").args)
    assert len(eval_sites) == 94 - 2 * 20
    assert not any(s.endswith("_ema") for s in eval_sites)


@pytest.mark.xdist_group("zoo-haiku-lstm")
def test_the_lstm_step_under_dynamic_unroll_is_one_site_stacked_over_steps():
    model = _build("lstm")
    sites = model.probe().sites(*model.args)
    assert list(sites) == ["lstm.initial_state", "lstm", "lstm/linear", "linear"]
    output, state = sites["lstm"]
    assert output.shape == (5, 2, 8)  # (steps, batch, hidden)
    assert isinstance(state, hk.LSTMState)
    assert state.hidden.shape == state.cell.shape == (5, 2, 8)
    assert sites["lstm/linear"].shape == (5, 2, 32)
    assert sites["lstm.initial_state"].hidden.shape == (2, 8)


@pytest.mark.xdist_group("zoo-haiku-vqvae")
def test_vq_ema_sites_leave_out_the_integer_indices():
    model = _build("vqvae")
    sites = model.probe().sites(*model.args)
    assert list(sites) == [
        "encoder",
        "vector_quantizer_ema",
        "vector_quantizer_ema.quantize",
        "vector_quantizer_ema/~/ema_cluster_size",
        "vector_quantizer_ema/~/ema_dw",
        "decoder",
    ]
    vq = sites["vector_quantizer_ema"]
    assert vq["quantize"].shape == (4, 3, 6)
    assert vq["encodings"].shape == (12, 5)
    res = _result("vqvae", "jit")
    # The integer indices get no gradient, and no activation either.
    assert res.activation_grads["vector_quantizer_ema"]["encoding_indices"] is None
    assert res.activations["vector_quantizer_ema"]["encoding_indices"] is None
