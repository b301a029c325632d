"""dm-haiku models for the conformance suite, with independent references.

The references use Haiku's own `hk.intercept_methods` with this file's own
call naming and counting: one hook adds a perturbation at one call (for
`jax.jvp`), another records every call's output.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from helpers import add_at_float_leaves, numpy_snapshot

import bridge
from cases import Case


def call_name(context, counts) -> str | None:
    """The site name of a module method call, counted by this test's own hook.

    Haiku also intercepts `__init__`, private helpers and property reads: those
    are not sites.
    """
    method = context.method_name
    if method.startswith("_") and method != "__call__":
        return None
    if isinstance(inspect.getattr_static(context.orig_class, method), property):
        return None
    base = context.module.module_name
    if method != "__call__":
        base = f"{base}.{method}"
    index = counts.get(base, 0)
    counts[base] = index + 1
    return base if index == 0 else f"{base}#{index}"


class Model:
    """A transformed function and how to call its `apply` without bridge."""

    def __init__(self, fn, args, with_state, apply_rng, rng, seed=0):
        transform = hk.transform_with_state if with_state else hk.transform
        self.transformed = transform(fn)
        if not apply_rng:
            self.transformed = hk.without_apply_rng(self.transformed)
        self.with_state, self.apply_rng, self.rng = with_state, apply_rng, rng
        # Values drawn with numpy in init's abstract shapes: Haiku's own
        # initializers cost seconds of compilation per shape on a small CPU.
        shapes = jax.eval_shape(self.transformed.init, jax.random.key(0), *args)
        params, state = shapes if with_state else (shapes, None)
        self.params = _random_params(params, seed)
        self.state = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), state)

    def apply(self, params, args, interceptor=None):
        """`(outputs, state)` of plain apply, under `interceptor` if given."""
        leading = (self.state,) if self.with_state else ()
        leading += (self.rng,) if self.apply_rng else ()
        hook = hk.intercept_methods(interceptor) if interceptor else nullcontext()
        with hook:
            result = self.transformed.apply(params, *leading, *args)
        return result if self.with_state else (result, None)

    def perturbed(self, site, delta, args):
        counts: dict[str, int] = {}

        def interceptor(next_fun, call_args, call_kwargs, context):
            name = call_name(context, counts)
            out = next_fun(*call_args, **call_kwargs)
            return add_at_float_leaves(out, delta) if name == site else out

        return self.apply(self.params, args, interceptor)[0]

    def recorded(self, args):
        counts: dict[str, int] = {}
        found = {}

        def interceptor(next_fun, call_args, call_kwargs, context):
            name = call_name(context, counts)
            out = next_fun(*call_args, **call_kwargs)
            if name is not None:
                found[name] = out
            return out

        self.apply(self.params, args, interceptor)
        return found


def _random_params(shapes, seed):
    """Weights scaled by their fan-in, small vectors (biases, offsets)."""
    generator = np.random.default_rng(seed)

    def draw(struct):
        scale = 1 / np.sqrt(np.prod(struct.shape[:-1])) if struct.ndim > 1 else 0.1
        return (scale * generator.standard_normal(struct.shape)).astype(struct.dtype)

    return jax.tree.map(draw, shapes)


def haiku_case(
    fn,
    args,
    expected_sites,
    loss_fn=lambda y: jnp.mean(jnp.square(y - 0.5)),
    with_state=False,
    apply_rng=True,
    rng=None,
    bias_sites=(),
):
    """`bias_sites` are `(site, parameter name)` pairs: `("linear", "b")`."""
    model = Model(fn, args, with_state, apply_rng, rng)
    probe_variables = (model.params, model.state) if with_state else (model.params,)

    def bias_grad(site, parameter):
        return lambda grads: grads[site.partition("#")[0]][parameter]

    return Case(
        probe=bridge.probe(model.transformed, *probe_variables),
        args=args,
        kwargs={} if rng is None else {"rng": rng},
        loss_fn=loss_fn,
        expected_sites=expected_sites,
        trainable=model.params,
        reference_loss=lambda params, args: loss_fn(model.apply(params, args)[0]),
        perturbed_loss=jax.jit(
            lambda site, delta: loss_fn(model.perturbed(site, delta, args)),
            static_argnums=0,
        ),
        snapshot=lambda: numpy_snapshot(probe_variables),
        bias_sites={site: bias_grad(site, name) for site, name in bias_sites},
        reference_activations=lambda: model.recorded(args),
        reference_state=lambda: model.apply(model.params, args)[1],
    )


def _inputs(*shape, seed=1):
    # numpy, then one transfer: jax.random would compile once per shape.
    values = np.random.default_rng(seed).standard_normal(shape, np.float32)
    return jnp.asarray(values)


def shared_mlp(x):
    shared = hk.Linear(8, name="shared")
    head = hk.Linear(3)  # built before the middle layer: named `linear`
    x = jax.nn.relu(shared(x))
    x = hk.Linear(8)(x)  # `linear_1`, though called first
    x = shared(jnp.tanh(x))  # the same module, called a second time
    x = hk.LayerNorm(-1, create_scale=True, create_offset=True)(x)
    return head(x)


def mlp_with_dropout(x):
    return hk.nets.MLP([8, 8, 3])(x, dropout_rate=0.5, rng=hk.next_rng_key())


def small_cnn(x):
    x = jax.nn.relu(hk.Conv2D(4, 3)(x))
    x = jax.nn.relu(hk.Conv2D(6, 3, stride=2)(x))
    return hk.Linear(3)(x.mean(axis=(1, 2)))


def embed_attention(ids):
    x = hk.Embed(vocab_size=10, embed_dim=8)(ids)
    x = hk.MultiHeadAttention(
        num_heads=2, key_size=4, w_init=hk.initializers.VarianceScaling(1.0)
    )(x, x, x)
    return hk.Linear(3)(x)


def batchnorm_net(x):
    x = hk.Linear(8)(x)
    x = hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9)(
        x, is_training=True
    )
    return hk.Linear(3)(jax.nn.relu(x))


class AutoEncoder(hk.Module):
    def __init__(self, name=None):
        super().__init__(name=name)
        self.enc = hk.Linear(3, name="enc")
        self.dec = hk.Linear(8, name="dec")

    def encode(self, x):
        return self.enc(x)

    def decode(self, z):
        return self.dec(z)

    def __call__(self, x):
        return self.decode(self.encode(x))


def methods(x):
    autoencoder = AutoEncoder()
    z = jnp.tanh(autoencoder.encode(x))
    return autoencoder(autoencoder.decode(z))


class ArgmaxHead(hk.Module):
    """Returns a pytree with an integer leaf, which gets no gradient."""

    def __call__(self, x):
        logits = hk.Linear(3)(x)  # built in a method: named `argmax_head/linear`
        return logits, jnp.argmax(logits, axis=-1)


def integer_leaves(x):
    logits, label = ArgmaxHead()(x)
    return logits * (label[:, None] + 1).astype(logits.dtype)


CASES = {
    "mlp_dropout": lambda: haiku_case(
        mlp_with_dropout,
        (_inputs(4, 8),),
        ["mlp", "mlp/~/linear_0", "mlp/~/linear_1", "mlp/~/linear_2"],
        rng=jax.random.key(7),
        bias_sites=[(f"mlp/~/linear_{i}", "b") for i in range(3)],
    ),
    "shared_mlp": lambda: haiku_case(
        shared_mlp,
        (_inputs(4, 8),),
        ["shared", "linear_1", "shared#1", "layer_norm", "linear"],
        bias_sites=[("linear", "b"), ("linear_1", "b"), ("layer_norm", "offset")],
    ),
    "conv": lambda: haiku_case(
        small_cnn,
        (_inputs(2, 8, 8, 3),),
        ["conv2_d", "conv2_d_1", "linear"],
        apply_rng=False,
        bias_sites=[("conv2_d", "b"), ("conv2_d_1", "b"), ("linear", "b")],
    ),
    "embed_attention": lambda: haiku_case(
        embed_attention,
        (jnp.asarray(np.random.default_rng(2).integers(0, 10, (2, 5), np.int32)),),
        [
            "embed",
            "multi_head_attention",
            "multi_head_attention/query",
            "multi_head_attention/key",
            "multi_head_attention/value",
            "multi_head_attention/linear",
            "linear",
        ],
        apply_rng=False,
        bias_sites=[
            ("multi_head_attention/query", "b"),
            ("multi_head_attention/linear", "b"),
            ("linear", "b"),
        ],
    ),
    "batchnorm": lambda: haiku_case(
        batchnorm_net,
        (_inputs(4, 8),),
        [
            "linear",
            "batch_norm",
            "batch_norm/~/mean_ema",
            "batch_norm/~/var_ema",
            "linear_1",
        ],
        with_state=True,
        apply_rng=False,
        bias_sites=[("linear", "b"), ("batch_norm", "offset"), ("linear_1", "b")],
    ),
    "methods": lambda: haiku_case(
        methods,
        (_inputs(4, 8),),
        [
            "auto_encoder.encode",
            "auto_encoder/~/enc",
            "auto_encoder.decode",
            "auto_encoder/~/dec",
            "auto_encoder",
            "auto_encoder.encode#1",
            "auto_encoder/~/enc#1",
            "auto_encoder.decode#1",
            "auto_encoder/~/dec#1",
        ],
        with_state=True,
    ),
    "integer_leaves": lambda: haiku_case(
        integer_leaves,
        (_inputs(4, 8),),
        ["argmax_head", "argmax_head/linear"],
        with_state=True,
        apply_rng=False,
    ),
}
