"""Small random architectures in all four libraries, with hand-inserted offsets.

The reliability tests (properties, dtypes, threads, mutation, errors) build
their models here. Each model's own code calls `hand(site, value)` after every
submodule call: inside `hand_inserted(offsets)` that adds `offsets[site]` to the
value and records it, elsewhere it is the identity. The references (the loss
and gradients of the model, the gradient with respect to each offset, `jax.jvp`
along offsets) are computed from these hooks with plain JAX, never with bridge.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from helpers import nnx_supported

LIBRARIES = tuple(
    library
    for library in ("linen", "nnx", "equinox", "haiku")
    if library != "nnx" or nnx_supported()
)

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "tanh": jnp.tanh,
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
    "sin": jnp.sin,
    "identity": lambda x: x,
}


@dataclasses.dataclass(frozen=True)
class Spec:
    """An architecture: Dense layers, a shared square layer called `repeats`
    times, and either a head or a pair of heads (a pytree site and a pytree
    output).

    `layers` holds `(width, activation)`; the model's input is `(batch, in_dim)`
    (one example `(in_dim,)` for Equinox, which is probed with `vmap=True`).
    """

    in_dim: int = 3
    batch: int = 2
    layers: tuple[tuple[int, str], ...] = ((4, "tanh"),)
    repeats: int = 0
    shared_activation: str = "tanh"
    pair: bool = False
    out: int = 2
    dtype: Any = jnp.float32
    #: The parameters' dtype where it differs from the computation's `dtype`
    #: (mixed precision: Linen and NNX `param_dtype`, a Haiku `jmp` policy).
    param_dtype: Any = None
    #: An `index` site with integer values (an argmax) after the layers.
    index: bool = False
    #: Count the forward passes that really run in `EXECUTIONS`.
    watch: bool = False


#: One entry per forward pass executed by a model built with `watch=True`;
#: abstract evaluation executes none.
EXECUTIONS: list[int] = []


def start(spec: Spec, x: jax.Array) -> jax.Array:
    if spec.watch:
        jax.debug.callback(lambda: EXECUTIONS.append(1))
    return x


def gate(h: jax.Array, index: jax.Array) -> jax.Array:
    """Use an integer site's value without changing any number."""
    return jnp.where(index[..., None] >= 0, h, 0.0)


# -- the hand-inserted perturbations --------------------------------------------

_HAND = threading.local()


@contextlib.contextmanager
def hand_inserted(offsets: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Add `offsets[site]` after each named call and record every site's value."""
    previous = getattr(_HAND, "frame", None)
    recorded: dict[str, Any] = {}
    _HAND.frame = (offsets, recorded)
    try:
        yield recorded
    finally:
        _HAND.frame = previous


def hand(site: str, value: Any) -> Any:
    frame = getattr(_HAND, "frame", None)
    if frame is None:
        return value
    offsets, recorded = frame
    delta = offsets.get(site)
    if delta is not None:
        value = jax.tree.map(jnp.add, value, delta)
    recorded[site] = value
    return value


def shared_name(base: str, k: int) -> str:
    return base if k == 0 else f"{base}#{k}"


def site_names(spec: Spec, library: str) -> list[str]:
    """Every site of the model, in call order, written from the contract."""
    layer = "layers/{}" if library == "equinox" else "layer{}"
    names = [layer.format(i) for i in range(len(spec.layers))]
    names += [shared_name("shared", k) for k in range(spec.repeats)]
    if spec.pair:
        names += ["pair", "pair/left", "pair/right"]
    else:
        names.append("head")
    return names


def loss_fn(outputs: Any) -> jax.Array:
    """A scalar from any pytree of outputs; float32 whatever their dtype."""
    return sum(
        jnp.mean(jnp.square(leaf.astype(jnp.float32) - 0.3))
        for leaf in jax.tree.leaves(outputs)
    )


# -- the four libraries ---------------------------------------------------------


@dataclasses.dataclass
class Built:
    """A model under probe and what its references need.

    Attributes:
      library: which library.
      model: the user's model object.
      variables: what `bridge.probe` takes beside the model.
      probe: `bridge.probe(model, *variables, vmap=...)`.
      x: the inputs (a batch).
      params: the trainable parameters, in the structure of `ProbeResult.grads`.
      forward: `(params, x, offsets) -> (outputs, recorded)`, the unprobed
        model with hand-inserted offsets (batched for Equinox by `jax.vmap`).
      names: every site in call order.
    """

    library: str
    model: Any
    variables: tuple
    probe: Any
    x: jax.Array
    params: Any
    forward: Callable[[Any, jax.Array, dict], tuple[Any, dict]]
    names: list[str]


def inputs(spec: Spec, seed: int = 1) -> jax.Array:
    struct = jax.ShapeDtypeStruct((spec.batch, spec.in_dim), spec.dtype)
    return random_values(struct, seed)


def build(library: str, spec: Spec, seed: int = 0) -> Built:
    return _BUILDERS[library](spec, seed)


def parameter_dtype(spec: Spec) -> Any:
    return spec.dtype if spec.param_dtype is None else spec.param_dtype


def filled(abstract: Any, dtype: Any, seed: int) -> Any:
    """Random values for the `ShapeDtypeStruct` leaves of a pytree, from numpy:
    no computation is compiled for them (jax.random would compile per shape)."""
    rng = np.random.default_rng(seed)

    def fill(leaf):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        scale = 1.0 / np.sqrt(leaf.shape[0]) if leaf.shape else 1.0
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):
            return jnp.asarray(rng.integers(0, 2, size=leaf.shape), leaf.dtype)
        value = rng.normal(size=leaf.shape) * scale
        if jnp.issubdtype(dtype, jnp.complexfloating):
            value = value + 1j * rng.normal(size=leaf.shape) * scale
        return jnp.asarray(value, dtype)

    return jax.tree.map(fill, abstract)


def _linen(spec: Spec, seed: int) -> Built:
    import flax.linen as nn

    import bridge

    class Pair(nn.Module):
        out: int
        dtype: Any

        @nn.compact
        def __call__(self, h):
            left = nn.Dense(self.out, dtype=self.dtype, name="left")(h)
            right = nn.Dense(self.out, dtype=self.dtype, name="right")(h)
            return hand("pair/left", left), hand("pair/right", right)

    class Index(nn.Module):
        def __call__(self, h):
            return jnp.argmax(h, -1)

    class Net(nn.Module):
        spec: Spec

        @nn.compact
        def __call__(self, x):
            s = self.spec
            h = start(s, x)
            for i, (width, act) in enumerate(s.layers):
                dense = nn.Dense(width, dtype=s.dtype, name=f"layer{i}")
                h = ACTIVATIONS[act](hand(f"layer{i}", dense(h)))
            if s.index:
                h = gate(h, Index(name="index")(h))
            if s.repeats:
                shared = nn.Dense(h.shape[-1], dtype=s.dtype, name="shared")
                for k in range(s.repeats):
                    h = hand(shared_name("shared", k), shared(h))
                    h = ACTIVATIONS[s.shared_activation](h)
            if s.pair:
                a, b = hand("pair", Pair(s.out, s.dtype, name="pair")(h))
                return {"a": a, "b": jnp.tanh(b)}
            return hand("head", nn.Dense(s.out, dtype=s.dtype, name="head")(h))

    model = Net(spec)
    x = inputs(spec)
    variables = filled(
        jax.eval_shape(model.init, jax.random.key(0), x), parameter_dtype(spec), seed
    )

    def forward(params, x, offsets):
        with hand_inserted(offsets) as recorded:
            return model.apply({"params": params}, x), recorded

    return Built(
        "linen",
        model,
        (variables,),
        bridge.probe(model, variables),
        x,
        variables["params"],
        forward,
        site_names(spec, "linen"),
    )


def _nnx(spec: Spec, seed: int) -> Built:
    from flax import nnx

    import bridge

    class Pair(nnx.Module):
        def __init__(self, width, out, rngs):
            kinds = {"dtype": spec.dtype, "param_dtype": parameter_dtype(spec)}
            self.left = nnx.Linear(width, out, rngs=rngs, **kinds)
            self.right = nnx.Linear(width, out, rngs=rngs, **kinds)

        def __call__(self, h):
            return hand("pair/left", self.left(h)), hand("pair/right", self.right(h))

    class Index(nnx.Module):
        def __call__(self, h):
            return jnp.argmax(h, -1)

    class Net(nnx.Module):
        def __init__(self, rngs):
            width = spec.in_dim
            if spec.index:
                self.index = Index()
            for i, (new_width, _) in enumerate(spec.layers):
                linear = nnx.Linear(
                    width,
                    new_width,
                    rngs=rngs,
                    dtype=spec.dtype,
                    param_dtype=parameter_dtype(spec),
                )
                setattr(self, f"layer{i}", linear)
                width = new_width
            if spec.repeats:
                self.shared = nnx.Linear(
                    width,
                    width,
                    rngs=rngs,
                    dtype=spec.dtype,
                    param_dtype=parameter_dtype(spec),
                )
            if spec.pair:
                self.pair = Pair(width, spec.out, rngs)
            else:
                self.head = nnx.Linear(
                    width,
                    spec.out,
                    rngs=rngs,
                    dtype=spec.dtype,
                    param_dtype=parameter_dtype(spec),
                )

        def __call__(self, x):
            h = start(spec, x)
            for i, (_, act) in enumerate(spec.layers):
                h = ACTIVATIONS[act](hand(f"layer{i}", getattr(self, f"layer{i}")(h)))
            if spec.index:
                h = gate(h, self.index(h))
            for k in range(spec.repeats):
                h = hand(shared_name("shared", k), self.shared(h))
                h = ACTIVATIONS[spec.shared_activation](h)
            if spec.pair:
                a, b = hand("pair", self.pair(h))
                return {"a": a, "b": jnp.tanh(b)}
            return hand("head", self.head(h))

    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Net(nnx.Rngs(0))))
    model = nnx.merge(graphdef, filled(abstract, parameter_dtype(spec), seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def forward(params, x, offsets):
        with hand_inserted(offsets) as recorded:
            return nnx.merge(graphdef, params, rest, copy=True)(x), recorded

    return Built(
        "nnx",
        model,
        (),
        bridge.probe(model),
        inputs(spec),
        params,
        forward,
        site_names(spec, "nnx"),
    )


def _equinox(spec: Spec, seed: int) -> Built:
    import equinox as eqx

    import bridge

    class Pair(eqx.Module):
        left: eqx.nn.Linear
        right: eqx.nn.Linear

        def __call__(self, h):
            return hand("pair/left", self.left(h)), hand("pair/right", self.right(h))

    class Index(eqx.Module):
        def __call__(self, h):
            return jnp.argmax(h, -1)

    class Net(eqx.Module):
        layers: list
        index: Index | None
        shared: eqx.nn.Linear | None
        pair: Pair | None
        head: eqx.nn.Linear | None
        spec: Spec = eqx.field(static=True)

        def __call__(self, x):
            h = start(self.spec, x)
            for i, ((_, act), layer) in enumerate(
                zip(self.spec.layers, self.layers, strict=True)
            ):
                h = ACTIVATIONS[act](hand(f"layers/{i}", layer(h)))
            if self.index is not None:
                h = gate(h, self.index(h))
            for k in range(self.spec.repeats):
                h = hand(shared_name("shared", k), self.shared(h))
                h = ACTIVATIONS[self.spec.shared_activation](h)
            if self.pair is not None:
                a, b = hand("pair", self.pair(h))
                return {"a": a, "b": jnp.tanh(b)}
            return hand("head", self.head(h))

    def make(key):
        def linear(width, out):
            return eqx.nn.Linear(width, out, key=key, dtype=spec.dtype)

        layers, width = [], spec.in_dim
        for new_width, _ in spec.layers:
            layers.append(linear(width, new_width))
            width = new_width
        shared = linear(width, width) if spec.repeats else None
        pair = head = None
        if spec.pair:
            pair = Pair(linear(width, spec.out), linear(width, spec.out))
        else:
            head = linear(width, spec.out)
        index = Index() if spec.index else None
        return Net(layers, index, shared, pair, head, spec)

    model = filled(eqx.filter_eval_shape(make, jax.random.key(0)), spec.dtype, seed)
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def forward(params, x, offsets):
        def one(x, offsets):
            with hand_inserted(offsets) as recorded:
                return eqx.combine(params, static)(x), recorded

        return jax.vmap(one)(x, offsets)

    return Built(
        "equinox",
        model,
        (),
        bridge.probe(model, vmap=True),
        inputs(spec),
        params,
        forward,
        site_names(spec, "equinox"),
    )


def _haiku(spec: Spec, seed: int) -> Built:
    import haiku as hk

    import bridge

    Linear = hk.Linear
    if spec.param_dtype is not None:
        import jmp

        class Linear(hk.Linear):
            """`hk.Linear` under a mixed-precision policy of its own (Haiku's
            policies are global per class)."""

        policy = jmp.Policy(
            param_dtype=spec.param_dtype,
            compute_dtype=spec.dtype,
            output_dtype=spec.dtype,
        )
        hk.mixed_precision.set_policy(Linear, policy)

    class Pair(hk.Module):
        def __init__(self, out, name=None):
            super().__init__(name=name)
            self.out = out

        def __call__(self, h):
            left = Linear(self.out, name="left")(h)
            right = Linear(self.out, name="right")(h)
            return hand("pair/left", left), hand("pair/right", right)

    class Index(hk.Module):
        def __call__(self, h):
            return jnp.argmax(h, -1)

    def net(x):
        h = start(spec, x)
        for i, (width, act) in enumerate(spec.layers):
            h = ACTIVATIONS[act](hand(f"layer{i}", Linear(width, name=f"layer{i}")(h)))
        if spec.index:
            h = gate(h, Index(name="index")(h))
        if spec.repeats:
            shared = Linear(h.shape[-1], name="shared")
            for k in range(spec.repeats):
                h = hand(shared_name("shared", k), shared(h))
                h = ACTIVATIONS[spec.shared_activation](h)
        if spec.pair:
            a, b = hand("pair", Pair(spec.out, name="pair")(h))
            return {"a": a, "b": jnp.tanh(b)}
        return hand("head", Linear(spec.out, name="head")(h))

    transformed = hk.without_apply_rng(hk.transform(net))
    x = inputs(spec)
    params = filled(
        jax.eval_shape(transformed.init, jax.random.key(0), x),
        parameter_dtype(spec),
        seed,
    )

    def forward(params, x, offsets):
        with hand_inserted(offsets) as recorded:
            return transformed.apply(params, x), recorded

    return Built(
        "haiku",
        transformed,
        (params,),
        bridge.probe(transformed, params),
        x,
        params,
        forward,
        site_names(spec, "haiku"),
    )


_BUILDERS = {"linen": _linen, "nnx": _nnx, "equinox": _equinox, "haiku": _haiku}


# -- references -----------------------------------------------------------------


def site_structs(built: Built) -> dict[str, Any]:
    """Every site's shape and dtype, from the hand-inserted hooks (not bridge)."""
    return jax.eval_shape(
        lambda p, x: built.forward(p, x, {})[1], built.params, built.x
    )


def reference(
    built: Built,
    deltas: dict[str, Any],
    jit: bool = True,
    objective: Callable = loss_fn,
) -> dict:
    """Loss, parameter gradients, recorded values, the gradient with respect to
    a zero offset at every site, and `jax.jvp` of the loss along `deltas`."""
    run = reference_fn(built, objective)
    return (jax.jit(run) if jit else run)(built.params, built.x, deltas)


def reference_fn(
    built: Built, objective: Callable = loss_fn
) -> Callable[[Any, jax.Array, dict], dict]:
    """`(params, x, deltas) -> references`, to trace inside a larger program."""
    structs = site_structs(built)

    def run(params, x, deltas):
        def loss_of(params, offsets):
            outputs, recorded = built.forward(params, x, offsets)
            return objective(outputs), recorded

        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), structs)
        (loss, recorded), (grads, offset_grads) = jax.value_and_grad(
            loss_of, argnums=(0, 1), has_aux=True
        )(params, zeros)
        _, directional = jax.jvp(
            lambda t: loss_of(params, _scaled(t, deltas))[0],
            (jnp.float32(0.0),),
            (jnp.float32(1.0),),
        )
        return {
            "loss": loss,
            "grads": grads,
            "activations": recorded,
            "activation_grads": offset_grads,
            "directional": directional,
        }

    return run


def _scaled(t: jax.Array, deltas: Any) -> Any:
    return jax.tree.map(lambda d: (t * d).astype(d.dtype), deltas)


def random_values(struct: Any, seed: int) -> Any:
    """Random normal values shaped like a pytree of `ShapeDtypeStruct`, from numpy."""
    rng = np.random.default_rng(seed)

    def fill(s):
        value = rng.normal(size=s.shape)
        if jnp.issubdtype(s.dtype, jnp.complexfloating):
            value = value + 1j * rng.normal(size=s.shape)
        return jnp.asarray(value, s.dtype)

    return jax.tree.map(fill, struct)


def probe_and_reference(
    built: Built, objective: Callable = loss_fn, at: Any = None, seed: int = 0
) -> tuple[Any, dict, dict]:
    """`(result, references, deltas)`: bridge's `value_and_grad` and the
    references along random `deltas` at the selected sites, in one jitted
    program (one compilation)."""
    structs = site_structs(built)
    result_struct = jax.eval_shape(
        lambda probe, x: probe.value_and_grad(objective, x, at=at), built.probe, built.x
    )
    deltas = {
        name: random_values(structs[name], seed + i)
        for i, name in enumerate(sorted(result_struct.activation_grads))
    }
    expected_fn = reference_fn(built, objective)

    @jax.jit
    def run(probe, params, x, deltas):
        return probe.value_and_grad(objective, x, at=at), expected_fn(params, x, deltas)

    result, expected = run(built.probe, built.params, built.x, deltas)
    return result, expected, deltas
