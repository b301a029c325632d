"""Flax Linen models for the conformance suite, with independent references."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from helpers import add_at_float_leaves, numpy_snapshot

import bridge
from cases import Case

APPLY_KEYWORDS = ("rngs", "mutable")


def _split_kwargs(kwargs):
    apply_kwargs = {k: v for k, v in kwargs.items() if k in APPLY_KEYWORDS}
    model_kwargs = {k: v for k, v in kwargs.items() if k not in APPLY_KEYWORDS}
    return apply_kwargs, model_kwargs


def _outputs(result, kwargs):
    return result[0] if kwargs.get("mutable") else result


def _call_name(context, counts) -> str | None:
    """The site name of a call, counted by this test's own interceptor."""
    module, method = context.module, context.method_name
    if module.path == () or method == "setup":
        return None
    base = "/".join(module.path)
    if method != "__call__":
        base = f"{base}.{method}"
    index = counts.get(base, 0)
    counts[base] = index + 1
    return base if index == 0 else f"{base}#{index}"


def perturbed_apply(module, variables, site, delta, args, kwargs):
    """`module.apply` with `delta` added to the output of call `site`."""
    counts: dict[str, int] = {}

    def interceptor(next_fun, call_args, call_kwargs, context):
        name = _call_name(context, counts)
        out = next_fun(*call_args, **call_kwargs)
        return add_at_float_leaves(out, delta) if name == site else out

    with nn.intercept_methods(interceptor):
        return module.apply(variables, *args, **kwargs)


def captured_activations(module, variables, args, kwargs):
    """Every call's output from Flax's own `capture_intermediates`."""
    apply_kwargs, model_kwargs = _split_kwargs(kwargs)
    mutable = apply_kwargs.pop("mutable", [])
    mutable = [mutable] if isinstance(mutable, str) else list(mutable)
    _, state = module.apply(
        variables,
        *args,
        capture_intermediates=lambda mdl, method: True,
        mutable=[*mutable, "intermediates"],
        **apply_kwargs,
        **model_kwargs,
    )
    found = {}

    def walk(tree, path):
        for key, value in tree.items():
            if isinstance(value, tuple):  # a method's outputs, one per call
                if not path:
                    continue  # the root model is not a site
                base = (
                    "/".join(path) if key == "__call__" else f"{'/'.join(path)}.{key}"
                )
                for index, output in enumerate(value):
                    found[base if index == 0 else f"{base}#{index}"] = output
            else:
                walk(value, (*path, key))

    walk(state["intermediates"], ())
    return found


def linen_case(
    module,
    args,
    expected_sites,
    loss_fn=lambda y: jnp.mean(jnp.square(y - 0.5)),
    kwargs=None,
    init_rngs=None,
    bias_sites=(),
):
    kwargs = dict(kwargs or {})
    _, model_kwargs = _split_kwargs(kwargs)
    variables = module.init(init_rngs or jax.random.key(0), *args, **model_kwargs)

    def run(params, args):
        return module.apply({**variables, "params": params}, *args, **kwargs)

    def reference_loss(params, args):
        return loss_fn(_outputs(run(params, args), kwargs))

    def perturbed_loss(site, delta):
        result = perturbed_apply(module, variables, site, delta, args, kwargs)
        return loss_fn(_outputs(result, kwargs))

    def reference_state():
        return run(variables["params"], args)[1] if kwargs.get("mutable") else None

    def bias_grad(site_path):
        def get(grads):
            node = grads
            for part in site_path.split("/"):
                node = node[part]
            return node["bias"]

        return get

    return Case(
        probe=bridge.probe(module, variables),
        args=args,
        kwargs=kwargs,
        loss_fn=loss_fn,
        expected_sites=expected_sites,
        trainable=variables["params"],
        reference_loss=reference_loss,
        perturbed_loss=perturbed_loss,
        snapshot=lambda: numpy_snapshot(variables),
        bias_sites={site: bias_grad(site) for site in bias_sites},
        reference_activations=lambda: captured_activations(
            module, variables, args, kwargs
        ),
        reference_state=reference_state,
    )


def _inputs(*shape, seed=1):
    return jax.random.normal(jax.random.key(seed), shape)


class SharedMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        shared = nn.Dense(8)
        x = nn.relu(shared(x))
        x = nn.Dense(8)(x)
        x = shared(nn.tanh(x))  # the same module, called a second time
        x = nn.LayerNorm()(x)
        return nn.Dense(3)(x)


class ConstructionOrder(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.gelu(nn.Dense(8)(x)))


class SmallCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3, 3))(x))
        x = nn.relu(nn.Conv(6, (3, 3), strides=2)(x))
        return nn.Dense(2)(x.mean(axis=(1, 2)))


class Attention(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(x)
        return nn.Dense(2)(x)


class BatchNormNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(6)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dense(2)(nn.relu(x))


class DropoutNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(16)(x))
        x = nn.Dropout(0.5, deterministic=False)(x)
        return nn.Dense(2)(x)


class Recurrent(nn.Module):
    @nn.compact
    def __call__(self, xs):
        cell = nn.LSTMCell(5)
        carry = cell.initialize_carry(jax.random.key(0), xs[:, 0].shape)
        outputs = []
        for t in range(xs.shape[1]):
            carry, y = cell(carry, xs[:, t])
            outputs.append(y)
        return carry, jnp.stack(outputs, axis=1)


class AutoEncoder(nn.Module):
    def setup(self):
        self.enc = nn.Dense(4)
        self.dec = nn.Dense(6)

    def encode(self, x):
        return self.enc(x)

    def decode(self, z):
        return self.dec(z)

    def __call__(self, x):
        return self.decode(self.encode(x))


class Methods(nn.Module):
    @nn.compact
    def __call__(self, x):
        autoencoder = AutoEncoder()
        z = nn.tanh(autoencoder.encode(x))
        return autoencoder(autoencoder.decode(z))


class ArgmaxHead(nn.Module):
    """Returns a pytree with an integer leaf, which gets no gradient."""

    @nn.compact
    def __call__(self, x):
        logits = nn.Dense(4)(x)
        return logits, jnp.argmax(logits, axis=-1)


class IntegerLeaves(nn.Module):
    @nn.compact
    def __call__(self, x):
        logits, label = ArgmaxHead()(x)
        return logits * (label[:, None] + 1).astype(logits.dtype)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.tanh(nn.Dense(x.shape[-1])(x))


class Rematerialised(nn.Module):
    """A rematerialised block, shared: its sites live inside `nn.remat`."""

    @nn.compact
    def __call__(self, x):
        block = nn.remat(Block)()
        x = block(block(nn.Dense(6)(x)))
        return nn.Dense(2)(x)


LSTM_GATES = ("ii", "hi", "if", "hf", "ig", "hg", "io", "ho")


def _lstm_sites(steps):
    names = []  # `initialize_carry` is `nn.nowrap`: not a module call
    for t in range(steps):
        suffix = "" if t == 0 else f"#{t}"
        names.append(f"LSTMCell_0{suffix}")
        names += [f"LSTMCell_0/{gate}{suffix}" for gate in LSTM_GATES]
    return names


def _recurrent_loss(outputs):
    (c, h), ys = outputs
    return jnp.mean(jnp.square(ys)) + jnp.mean(c * h)


CASES = {
    "shared_mlp": lambda: linen_case(
        SharedMLP(),
        (_inputs(4, 8),),
        ["Dense_0", "Dense_1", "Dense_0#1", "LayerNorm_0", "Dense_2"],
        bias_sites=("Dense_1", "Dense_2"),
    ),
    "construction_order": lambda: linen_case(
        ConstructionOrder(),
        (_inputs(3, 4),),
        ["Dense_1", "Dense_0"],
        bias_sites=("Dense_0", "Dense_1"),
    ),
    "conv": lambda: linen_case(
        SmallCNN(),
        (_inputs(2, 8, 8, 3),),
        ["Conv_0", "Conv_1", "Dense_0"],
        bias_sites=("Conv_0", "Conv_1", "Dense_0"),
    ),
    "attention": lambda: linen_case(
        Attention(),
        (_inputs(2, 5, 8),),
        [
            "MultiHeadDotProductAttention_0",
            "MultiHeadDotProductAttention_0/query",
            "MultiHeadDotProductAttention_0/key",
            "MultiHeadDotProductAttention_0/value",
            "MultiHeadDotProductAttention_0/out",
            "Dense_0",
        ],
        bias_sites=(
            "MultiHeadDotProductAttention_0/query",
            "MultiHeadDotProductAttention_0/out",
            "Dense_0",
        ),
    ),
    "batchnorm": lambda: linen_case(
        BatchNormNet(),
        (_inputs(8, 4),),
        ["Dense_0", "BatchNorm_0", "Dense_1"],
        kwargs={"mutable": ["batch_stats"]},
        bias_sites=("Dense_1",),
    ),
    "dropout": lambda: linen_case(
        DropoutNet(),
        (_inputs(4, 6),),
        ["Dense_0", "Dropout_0", "Dense_1"],
        kwargs={"rngs": {"dropout": jax.random.key(7)}},
        init_rngs={"params": jax.random.key(0), "dropout": jax.random.key(1)},
        bias_sites=("Dense_0", "Dense_1"),
    ),
    "lstm": lambda: linen_case(
        Recurrent(), (_inputs(2, 3, 4),), _lstm_sites(3), loss_fn=_recurrent_loss
    ),
    "methods": lambda: linen_case(
        Methods(),
        (_inputs(3, 6),),
        [
            "AutoEncoder_0.encode",
            "AutoEncoder_0/enc",
            "AutoEncoder_0.decode",
            "AutoEncoder_0/dec",
            "AutoEncoder_0",
            "AutoEncoder_0.encode#1",
            "AutoEncoder_0/enc#1",
            "AutoEncoder_0.decode#1",
            "AutoEncoder_0/dec#1",
        ],
    ),
    "remat": lambda: linen_case(
        Rematerialised(),
        (_inputs(3, 4),),
        [
            "Dense_0",
            "CheckpointBlock_0",
            "CheckpointBlock_0/Dense_0",
            "CheckpointBlock_0#1",
            "CheckpointBlock_0/Dense_0#1",
            "Dense_1",
        ],
        bias_sites=("Dense_0", "Dense_1"),
    ),
    "integer_leaves": lambda: linen_case(
        IntegerLeaves(), (_inputs(3, 5),), ["ArgmaxHead_0", "ArgmaxHead_0/Dense_0"]
    ),
}
