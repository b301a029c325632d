"""Small models whose layers run inside JAX transforms, in all four libraries.

The trace-pattern fuzzer (`test_trace_fuzz.py`) builds its models here. A
model is a stack of layers and a head; layer `i` is a module call (site
`layer{i}`, Equinox `layers/{i}`), an activation, and a
`bridge.tap(f"t{i}", ...)` (site `t{i}`), either of the two sites optional,
and the whole layer optionally runs inside one transform (`Layer.wrap`):

- `jit`: a jitted function made once and kept, so that its trace is cached:
  the model is run once at the probe's shapes before it is probed
  (`Built.warm`), and then its Python does not run again.
- `checkpoint`: rematerialised.
- `scan`: a scan over `iterations` steps whose carry holds a Python `0` that
  the body turns into a float, so that JAX traces the body twice (or, where
  not `retrace`, a float: traced once).
- `cond`: a `cond` whose first branch, the layer, is the one that runs.
- `switch`: a `switch` of three branches, the layer first, then two without
  its sites (`siteless`, zeros), the data choosing which runs
  (`switch_index`: for the whole batch, or per example under `vmap`), so
  that a site holds zeros where its branch did not run.
- `fori_loop`: a `fori_loop` of `iterations` iterations with Python-int
  bounds, its carry a scan's (a Python `0` where `retrace`); a site holds one
  value per iteration, stacked first.
- `vmap`: mapped over a new leading axis holding two copies of the input.
- `while_loop` (Equinox only, `EQUINOX_ONLY`): Equinox's checkpointed while
  loop, `equinox.internal.while_loop(kind="checkpointed",
  max_steps=while_steps(layer))`, whose carry counts its steps and whose
  condition stops it, per example, after `stop_step` of its input (zero
  steps, some, or not before `max_steps` stops it); a site holds one value
  per step, stacked first, zeros where the step did not run.

`Layer.native` picks the library's own transform (`nn.jit`, `nnx.remat`,
`hk.scan`, `nn.switch`, `nnx.fori_loop`, `hk.switch`, `eqx.filter_jit`, ...)
over JAX's (`jax.jit`, `jax.checkpoint`, `lax.scan`, `lax.cond`,
`lax.switch`, `lax.fori_loop`, `jax.vmap`); where the library has none
(Linen's `fori_loop`; Equinox's `cond`, `switch`, `fori_loop` and `scan`),
JAX's (`uses_jax`); a `while_loop` is always Equinox's own. Linen and Haiku
create parameters when a module is first called, and inside a JAX transform
that leaks them at `init`: their module
calls run inside the library's own transform (Haiku has no `jit`: there the
module call runs before the cached jitted activation and tap), except inside
JAX's `vmap` and control flow. Before a branch or a loop, theirs or JAX's,
they call the module once at `init`, as their documentation asks
(`early_params`): a branch that creates parameters the others do not fails
`init`. A scan
slices one module per step where the library makes that idiomatic
(Equinox's `lax.scan` over a stack of layers, NNX's `nnx.scan` over a module
made by `nnx.vmap`), else it closes over one module whose parameters every
step shares (`nn.scan` broadcasting them, `hk.scan`, a `lax.scan` closing
over an NNX module); a `fori_loop` always shares them (NNX's carries the
module, the others close over it).

Each site's value passes through a test-owned hook (`hook`) that replaces it
by `iv["patch:" + name]` and adds `iv[name]` where given, and records it.
These values travel as arguments through every transform (never by side
effect), so that a cached trace, a scan or a vmap hands them in and out as it
does the model's own values; given `iv`, the model returns what its hooks
saw beside its output. A `fori_loop` hands iteration `i` row `i` of its
`iv` (indexed by the loop counter), and records row `i`; a branch records,
under `ran_key(name)`, whether each of its sites ran. The references are
computed from these hooks with plain JAX, never with bridge. The checkpointed
while loop has no forward mode, and bridge's route through it is what is under
test: given `iv`, a model runs it as its reference does (`unrolled_while`),
unrolled to `max_steps` in Python, each step applied where the loop's
condition holds (`jnp.where`), its hooks handed row `k` of `iv` on step `k`
and recording the value (zeros where the step did not run) and, under
`ran_key(name)`, whether it ran; without `iv` (as bridge runs it), the loop
itself runs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from reliability import ACTIVATIONS, filled, random_values

import bridge

WRAPS = (
    None,
    "jit",
    "checkpoint",
    "scan",
    "cond",
    "switch",
    "fori_loop",
    "vmap",
    "while_loop",
)

#: The wraps of JAX's control flow (and the libraries' own).
CONTROL_FLOW = ("cond", "switch", "fori_loop", "while_loop")
#: The wraps only one library has: Equinox's checkpointed while loop.
EQUINOX_ONLY = ("while_loop",)
#: The wraps whose body runs once per iteration, carrying the layer's input
#: into its output: a module there keeps its input's width.
LOOPS = ("scan", "fori_loop", "while_loop")


def wraps_of(library: str, wraps: tuple = WRAPS) -> tuple:
    """The wraps of `wraps` that `library` has, in their order."""
    return tuple(w for w in wraps if library == "equinox" or w not in EQUINOX_ONLY)


#: How many branches a `switch` layer has: the layer, then two without sites.
SWITCH_BRANCHES = 3


@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer: `module` (a Dense/Linear call), an activation, `tap` (a
    `bridge.tap` of the activation), all inside `wrap` (one of `WRAPS`),
    the library's own transform where `native`."""

    module: bool = True
    tap: bool = False
    width: int = 3
    act: str = "tanh"
    wrap: str | None = None
    native: bool = False
    iterations: int = 2
    #: A scan's carry starts as a Python `0` that the body turns into a float,
    #: so that JAX traces the body twice (else as a float: traced once).
    retrace: bool = True


@dataclasses.dataclass(frozen=True)
class Spec:
    layers: tuple[Layer, ...] = (Layer(),)
    in_dim: int = 3
    batch: int = 2
    out: int = 2

    def widths(self) -> list[tuple[int, int]]:
        """`(input width, output width)` of each layer: a layer without a
        module, or one inside a loop (`LOOPS`), keeps its input's width."""
        widths, width = [], self.in_dim
        for layer in self.layers:
            new = layer.width if layer.module and layer.wrap not in LOOPS else width
            widths.append((width, new))
            width = new
        return widths


def module_name(library: str, i: int) -> str:
    return f"layers/{i}" if library == "equinox" else f"layer{i}"


def layer_sites(library: str, i: int, layer: Layer) -> list[str]:
    return [module_name(library, i)] * layer.module + [f"t{i}"] * layer.tap


def site_names(spec: Spec, library: str) -> list[str]:
    """Every site in call order, written from the contract."""
    names = []
    for i, layer in enumerate(spec.layers):
        names += layer_sites(library, i, layer)
    return [*names, "head"]


def layer_of(spec: Spec, library: str, name: str) -> Layer | None:
    """The layer site `name` belongs to (`None` for the head)."""
    for i, layer in enumerate(spec.layers):
        if name in layer_sites(library, i, layer):
            return layer
    return None


def uses_jax(library: str, layer: Layer) -> bool:
    """Whether the layer runs inside JAX's transform (else the library's own).

    Linen and Haiku run a module call inside their own transform, but for
    JAX's `vmap` and control flow (their parameters made first,
    `early_params`); Linen has no `fori_loop` of its own, nor Equinox a
    `cond`, `switch`, `fori_loop` or `scan`: there JAX's runs. Equinox's
    checkpointed `while_loop` is its own."""
    if layer.wrap is None:
        return True
    if layer.wrap in EQUINOX_ONLY:
        assert library == "equinox", (library, layer.wrap)
        return False
    if library == "equinox" and layer.wrap in (*CONTROL_FLOW, "scan"):
        return True
    if library == "linen" and layer.wrap == "fori_loop":
        return True
    if layer.native:
        return False
    if library in ("linen", "haiku") and layer.module:
        return layer.wrap in ("vmap", *CONTROL_FLOW)
    return True


def early_params(library: str, layer: Layer) -> bool:
    """Whether Linen or Haiku call the layer's module once at `init` before
    its branch or loop, as their documentation asks: a branch that creates
    parameters the other branches do not fails `init` (`nn.cond` and
    `nn.switch` too, for a module made in `setup`), and JAX's transforms
    would create them inside their trace. Haiku's own `fori_loop` runs its
    first iteration outside the loop at `init` by itself."""
    if library not in ("linen", "haiku") or not layer.module:
        return False
    if library == "haiku" and layer.wrap == "fori_loop" and layer.native:
        return False
    return layer.wrap in CONTROL_FLOW


# -- the test-owned hook ----------------------------------------------------------


def patch_key(name: str) -> str:
    return "patch:" + name


def patch_function_key(name: str) -> str:
    return "patch_function:" + name


def patch_function(value: jax.Array) -> jax.Array:
    """What a patch by a function does to a site's value."""
    return 1.5 * value - 0.25


def hook(name: str, value: jax.Array, iv: dict, rec: dict) -> jax.Array:
    """The site's value, replaced by `iv["patch:" + name]` (or by
    `patch_function` of it where `iv` has `"patch_function:" + name`), then
    shifted by `iv[name]` where given; recorded in `rec`."""
    patch = iv.get(patch_key(name))
    if patch is not None:
        value = patch.astype(value.dtype)
    if patch_function_key(name) in iv:
        value = patch_function(value)
    offset = iv.get(name)
    if offset is not None:
        value = value + offset
    rec[name] = value
    return value


def ran_key(name: str) -> str:
    """Where a branch records whether the site `name` ran (a boolean)."""
    return "ran:" + name


def own(iv: dict, names: list[str]) -> dict:
    """The entries of `iv` that belong to the sites `names`."""
    keys = {*names, *map(patch_key, names), *map(patch_function_key, names)}
    return {k: v for k, v in iv.items() if k in keys}


def module_part(mod_name: str, call: Callable, h, iv) -> tuple[jax.Array, dict]:
    rec: dict = {}
    return hook(mod_name, call(h), iv, rec), rec


def tail(i: int, layer: Layer, h, iv) -> tuple[jax.Array, dict]:
    """The activation and the tap of layer `i`."""
    rec: dict = {}
    h = ACTIVATIONS[layer.act](h)
    if layer.tap:
        h = hook(f"t{i}", bridge.tap(f"t{i}", h), iv, rec)
    return h, rec


def body(i: int, layer: Layer, mod_name: str, call, h, iv) -> tuple[jax.Array, dict]:
    """Layer `i` without its transform; `call` is the module (or `None`)."""
    rec: dict = {}
    if layer.module:
        h, rec = module_part(mod_name, call, h, iv)
    h, more = tail(i, layer, h, iv)
    return h, {**rec, **more}


# -- the transforms -----------------------------------------------------------------


#: The keys of `cached_jit` functions, one entry each time JAX traces one.
JIT_TRACES: list[tuple] = []


def _counted(key: tuple, fn: Callable) -> Callable:
    def traced(*args):
        JIT_TRACES.append(key)
        return fn(*args)

    return traced


@functools.cache
def cached_jit(kind: str, i: int, layer: Layer, mod_name: str) -> Callable:
    """The jitted function of layer `i`, made once: its trace is cached.

    `kind`: `jax` (`jax.jit` of `(module, h, iv)`), `tail` (`jax.jit` of the
    activation and tap, `(h, iv)`), `eqx` (`eqx.filter_jit`), `nnx`
    (`nnx.jit`), `linen` (`nn.jit` of `(mdl, h, iv)`, `mdl` the model)."""
    key = (kind, i, layer, mod_name)
    run = _counted(key, functools.partial(body, i, layer, mod_name))
    if kind == "jax":
        return jax.jit(run)
    if kind == "tail":
        return jax.jit(_counted(key, functools.partial(tail, i, layer)))
    if kind == "eqx":
        import equinox as eqx

        return eqx.filter_jit(run)
    if kind == "nnx":
        from flax import nnx

        return nnx.jit(run)
    if kind == "linen":
        import flax.linen as nn

        return nn.jit(lambda mdl, h, iv: run(getattr(mdl, mod_name, None), h, iv))
    raise ValueError(kind)


def taken_branch(run: Callable, names: list[str]) -> Callable:
    """The branch that runs the layer (`run`), recording that its sites ran."""

    def branch(*args):
        h, rec = run(*args)
        return h, {**rec, **{ran_key(name): jnp.array(True) for name in names}}

    return branch


def skipped_branch(
    names: list[str], width_out: int, value: Callable | None = None
) -> Callable:
    """A branch without the layer: `value(h, width_out)` (zeros where `None`);
    its sites hold zeros and did not run, as the contract has them."""

    def branch(*args):
        h = args[-2]
        zeros = jnp.zeros((*h.shape[:-1], width_out), h.dtype)
        out = -zeros if value is None else value(h, width_out)
        recorded = {name: zeros for name in names}
        return out, {**recorded, **{ran_key(name): jnp.array(False) for name in names}}

    return branch


def siteless(h, width_out):
    """A branch's value without sites that depends on its input, so that the
    gradients of the layers before it flow through it."""
    mean = jnp.mean(jnp.sin(h), axis=-1, keepdims=True)
    return jnp.broadcast_to(mean, (*h.shape[:-1], width_out))


def switch_branches(run: Callable, names: list[str], width_out: int) -> list:
    """A `switch` layer's branches: the layer, then two without its sites."""
    return [
        taken_branch(run, names),
        skipped_branch(names, width_out, siteless),
        skipped_branch(names, width_out),
    ]


def switch_index(h):
    """Which branch a `switch` takes: the feature with the largest total
    over the batch (per example under `vmap`), so that the data decide it and
    each branch runs for some models. Not a threshold on a value: bridge's
    run and the reference could only disagree on a near tie between two
    features (an exact one, zeros after a `relu`, takes the first)."""
    totals = jnp.sum(h.reshape(-1, h.shape[-1]), axis=0)
    return jnp.argmax(totals) % SWITCH_BRANCHES


def pair(h):
    """Two copies of the input, for a `vmap` layer to map over."""
    return jnp.stack([h, 0.5 * h])


def unpair(ys):
    return ys[0] - 0.5 * ys[1]


def predicate(h):
    return jnp.all(jnp.isfinite(h))


def scan_start(layer: Layer) -> int | float:
    """The total a scan layer's carry starts with."""
    return 0 if layer.retrace else 0.0


def scan_step(run: Callable) -> Callable:
    """A scan body around `run(sliced, h, iv)`: its carry `(h, total)` starts
    with `total` a Python `0` that it turns into a float."""

    def step(carry, xs):
        h, total = carry
        sliced, iv_t = xs
        h, rec = run(sliced, h, iv_t)
        return (h, total + jnp.mean(h)), rec

    return step


def unscanned(carry):
    h, total = carry
    return h + 0.1 * total


def fori_layer(loop: Callable, run: Callable, layer: Layer, names, module, h, iv):
    """A `fori_loop` of `layer.iterations` iterations of `run(module, h, iv)`.

    Its carry is a scan's (`scan_start`, `unscanned`), and the rows its hooks
    record, one per iteration: a site's value has the input's shape, the
    layer keeping its width. Each iteration hands its hooks row `i` of `iv`
    (whose leading axis is the iterations'), `i` the loop counter.
    `loop(iterations, step, module, init)` runs `step(i, module, carry)`.
    """
    rows = {name: jnp.zeros((layer.iterations, *h.shape), h.dtype) for name in names}

    def step(i, module, carry):
        h, total, rows = carry
        h, rec = run(module, h, jax.tree.map(lambda a: a[i], iv))
        rows = {name: rows[name].at[i].set(value) for name, value in rec.items()}
        return h, total + jnp.mean(h), rows

    h, total, rows = loop(layer.iterations, step, module, (h, scan_start(layer), rows))
    return unscanned((h, total)), rows


def closing_over(fori_loop: Callable) -> Callable:
    """The `loop` of `fori_layer` from a `fori_loop(lower, upper, body, init)`
    whose body closes over the module."""

    def loop(iterations, step, module, init):
        return fori_loop(0, iterations, lambda i, c: step(i, module, c), init)

    return loop


def while_steps(layer: Layer) -> int:
    """The `max_steps` of a `while_loop` layer."""
    return layer.iterations + 1


def stop_step(h, max_steps: int):
    """After how many steps a `while_loop` layer's condition stops it, from
    its input (one example): `0` to `max_steps + 1`, where past `max_steps`
    the loop's bound stops it. The position of the largest entry of
    `[h, -h]`, so that the examples of a batch stop at different steps; not a
    threshold on a value, as `switch_index`."""
    both = jnp.concatenate([h, -h], axis=-1)
    return (jnp.argmax(both, axis=-1) % (max_steps + 2)).astype(jnp.int32)


def checkpointed_while(run: Callable, layer: Layer, module, h) -> jax.Array:
    """A `while_loop` layer as bridge runs it: `run(module, h, {})` in
    Equinox's checkpointed while loop, its carry `(h, step, stop)`."""
    import equinox.internal as eqxi

    max_steps = while_steps(layer)

    def going_on(carry):
        _, step, stop = carry
        return step < stop

    def step(carry):
        h, step, stop = carry
        return run(module, h, {})[0], step + 1, stop

    start = (h, jnp.zeros((), jnp.int32), stop_step(h, max_steps))
    h, _, _ = eqxi.while_loop(
        going_on, step, start, kind="checkpointed", max_steps=max_steps
    )
    return h


def unrolled_while(run: Callable, layer: Layer, names, module, h, iv):
    """The reference of a `while_loop` layer: the loop unrolled to
    `max_steps`, step `k` applied where it runs (`k < stop_step`, the loop's
    condition) with its hooks handed row `k` of `iv`. Returns the output and
    the hooks' rows, one per step (zeros where the step did not run), and
    under `ran_key(name)` whether each step ran."""
    max_steps = while_steps(layer)
    stop = stop_step(h, max_steps)
    rows: dict = {name: [] for name in names}
    ran = []
    for k in range(max_steps):
        running = k < stop
        new, rec = run(module, h, jax.tree.map(lambda a, k=k: a[k], iv))
        h = jnp.where(running, new, h)
        for name, value in rec.items():
            rows[name].append(jnp.where(running, value, jnp.zeros_like(value)))
        ran.append(running)
    recorded = {name: jnp.stack(values) for name, values in rows.items()}
    return h, {**recorded, **{ran_key(name): jnp.stack(ran) for name in names}}


def jax_layer(
    i, layer, mod_name, module, h, iv, width_out, *, pytree, rebuild=None
) -> tuple[jax.Array, dict]:
    """Layer `i` inside JAX's own transform.

    `module` is the module (`None` without one); `pytree`: it can be an
    argument of `jax.jit` and `jax.checkpoint` (Equinox, NNX), else it is
    closed over. `rebuild`: for a scan, `module` holds one layer per step and
    `rebuild(module)` returns `(arrays, make)`, the arrays to slice and how to
    make a step's module of a slice (Equinox).
    """
    names = layer_sites_of(layer, i, mod_name)
    iv = own(iv, names)
    run = functools.partial(body, i, layer, mod_name)
    wrap = layer.wrap
    if wrap is None:
        return run(module, h, iv)
    if wrap == "jit":
        assert pytree or module is None
        return cached_jit("jax", i, layer, mod_name)(module, h, iv)
    if wrap == "checkpoint":
        if pytree:
            return jax.checkpoint(run)(module, h, iv)
        return jax.checkpoint(lambda h, iv: run(module, h, iv))(h, iv)
    if wrap == "vmap":
        ys, rec = jax.vmap(lambda h, iv: run(module, h, iv))(pair(h), iv)
        return unpair(ys), rec
    if wrap == "cond":
        return jax.lax.cond(
            predicate(h),
            taken_branch(lambda h, iv: run(module, h, iv), names),
            skipped_branch(names, width_out),
            h,
            iv,
        )
    if wrap == "switch":
        branches = switch_branches(lambda h, iv: run(module, h, iv), names, width_out)
        return jax.lax.switch(switch_index(h), branches, h, iv)
    if wrap == "fori_loop":
        loop = closing_over(jax.lax.fori_loop)
        return fori_layer(loop, run, layer, names, module, h, iv)
    if wrap == "scan":
        if rebuild is not None and module is not None:
            arrays, make = rebuild(module)
        else:
            arrays, make = None, lambda _: module
        step = scan_step(lambda sliced, h, iv: run(make(sliced), h, iv))
        carry, rec = jax.lax.scan(
            step, (h, scan_start(layer)), (arrays, iv), length=layer.iterations
        )
        return unscanned(carry), rec
    raise ValueError(wrap)


def layer_sites_of(layer: Layer, i: int, mod_name: str) -> list[str]:
    return [mod_name] * layer.module + [f"t{i}"] * layer.tap


# -- the four libraries -------------------------------------------------------------


@dataclasses.dataclass
class Built:
    """A model under probe and what its references need.

    Attributes:
      library: which library.
      spec: the architecture.
      probe: `bridge.probe(...)` of the model.
      x: the inputs (a batch).
      params: the trainable parameters, in the structure of `ProbeResult.grads`.
      forward: `(params, x, iv) -> (outputs, recorded)`: the unprobed model
        with `iv` handed to its hooks, each site's value in the contract's
        layout (`iv`'s too); a checkpointed while loop unrolled
        (`unrolled_while`).
      plain: `(params, x) -> outputs`: the unprobed model as bridge runs it.
      names: every site in call order.
    """

    library: str
    spec: Spec
    probe: Any
    x: jax.Array
    params: Any
    forward: Callable[[Any, jax.Array, dict], tuple[Any, dict]]
    plain: Callable[[Any, jax.Array], Any]
    names: list[str]

    def warm(self) -> None:
        """Run the model as bridge will, at the probe's shapes: the cached
        jitted functions inside it hold their traces."""
        jax.eval_shape(self.plain, self.params, self.x)


def inputs(spec: Spec) -> jax.Array:
    struct = jax.ShapeDtypeStruct((spec.batch, spec.in_dim), jnp.float32)
    return random_values(struct, 1)


def build(library: str, spec: Spec, seed: int = 0) -> Built:
    built = _BUILDERS[library](spec, seed)
    built.warm()
    return built


def _linen(spec: Spec, seed: int) -> Built:
    import flax.linen as nn

    widths = spec.widths()

    def native(mdl, i, layer, h, iv):
        """Layer `i` inside Linen's own transform, `mdl` the model."""
        mod_name = f"layer{i}"
        names = layer_sites_of(layer, i, mod_name)
        iv = own(iv, names)

        def run(mdl, h, iv):
            return body(i, layer, mod_name, getattr(mdl, mod_name, None), h, iv)

        wrap = layer.wrap
        if wrap == "jit":
            return cached_jit("linen", i, layer, mod_name)(mdl, h, iv)
        if wrap == "checkpoint":
            return nn.remat(run)(mdl, h, iv)
        if wrap == "vmap":
            mapped = nn.vmap(
                run, variable_axes={"params": None}, split_rngs={"params": False}
            )
            ys, rec = mapped(mdl, pair(h), iv)
            return unpair(ys), rec
        if wrap == "cond":
            taken = taken_branch(run, names)
            skipped = skipped_branch(names, widths[i][1])
            return nn.cond(predicate(h), taken, skipped, mdl, h, iv)
        if wrap == "switch":
            branches = switch_branches(run, names, widths[i][1])
            return nn.switch(switch_index(h), branches, mdl, h, iv)
        if wrap == "scan":
            step = scan_step(lambda mdl, h, iv: run(mdl, h, iv))
            scanned = nn.scan(
                lambda mdl, carry, iv: step(carry, (mdl, iv)),
                variable_broadcast="params",
                split_rngs={"params": False},
                length=layer.iterations,
            )
            carry, rec = scanned(mdl, (h, scan_start(layer)), iv)
            return unscanned(carry), rec
        raise ValueError(wrap)

    class Net(nn.Module):
        def setup(self):
            for i, layer in enumerate(spec.layers):
                if layer.module:
                    setattr(self, f"layer{i}", nn.Dense(widths[i][1]))
            self.head = nn.Dense(spec.out)

        def __call__(self, x, iv=None):
            given, rec, h = iv, {}, x
            iv = iv or {}
            for i, layer in enumerate(spec.layers):
                module = getattr(self, f"layer{i}", None)
                if early_params("linen", layer) and self.is_initializing():
                    module(h)
                if uses_jax("linen", layer):
                    h, more = jax_layer(
                        i, layer, f"layer{i}", module, h, iv, widths[i][1], pytree=False
                    )
                else:
                    h, more = native(self, i, layer, h, iv)
                rec.update(more)
            out = hook("head", self.head(h), iv, rec)
            return out if given is None else (out, rec)

    model = Net()
    x = inputs(spec)
    variables = filled(
        jax.eval_shape(model.init, jax.random.key(0), x), jnp.float32, seed
    )

    def forward(params, x, iv):
        return model.apply({"params": params}, x, iv)

    def plain(params, x):
        return model.apply({"params": params}, x)

    return Built(
        "linen",
        spec,
        bridge.probe(model, variables),
        x,
        variables["params"],
        forward,
        plain,
        site_names(spec, "linen"),
    )


def _nnx(spec: Spec, seed: int) -> Built:
    from flax import nnx

    widths = spec.widths()

    def native(module, i, layer, h, iv):
        """Layer `i` inside NNX's own transform, the module an argument."""
        mod_name = f"layer{i}"
        names = layer_sites_of(layer, i, mod_name)
        iv = own(iv, names)
        run = functools.partial(body, i, layer, mod_name)
        wrap = layer.wrap
        if wrap == "jit":
            return cached_jit("nnx", i, layer, mod_name)(module, h, iv)
        if wrap == "checkpoint":
            return nnx.remat(run)(module, h, iv)
        if wrap == "vmap":
            ys, rec = nnx.vmap(run, in_axes=(None, 0, 0))(module, pair(h), iv)
            return unpair(ys), rec
        if wrap == "cond":
            taken = taken_branch(run, names)
            skipped = skipped_branch(names, widths[i][1])
            return nnx.cond(predicate(h), taken, skipped, module, h, iv)
        if wrap == "switch":
            branches = switch_branches(run, names, widths[i][1])
            return nnx.switch(switch_index(h), branches, module, h, iv)
        if wrap == "fori_loop":
            # The module travels in the carry, as `nnx.fori_loop` has it.
            def loop(iterations, step, module, init):
                return nnx.fori_loop(
                    0, iterations, lambda i, c: (c[0], step(i, *c)), (module, init)
                )[1]

            return fori_layer(loop, run, layer, names, module, h, iv)
        if wrap == "scan":
            # A stack of modules, one per step (made by `nnx.vmap`).
            step = scan_step(run)
            carry, rec = nnx.scan(
                lambda module, carry, iv: step(carry, (module, iv)),
                in_axes=(0, nnx.Carry, 0),
                out_axes=(nnx.Carry, 0),
                length=layer.iterations,
            )(module, (h, scan_start(layer)), iv)
            return unscanned(carry), rec
        raise ValueError(wrap)

    def stacked_linear(width, new, key):
        return nnx.Linear(width, new, rngs=nnx.Rngs(key))

    def stacked_scan(layer):
        return layer.native and layer.module and layer.wrap == "scan"

    class Net(nnx.Module):
        def __init__(self, rngs):
            for i, layer in enumerate(spec.layers):
                if not layer.module:
                    continue
                if stacked_scan(layer):
                    keys = jax.random.split(jax.random.key(i), layer.iterations)
                    make = functools.partial(stacked_linear, *widths[i])
                    linear = nnx.vmap(make)(keys)
                else:
                    linear = nnx.Linear(*widths[i], rngs=rngs)
                setattr(self, f"layer{i}", linear)
            self.head = nnx.Linear(widths[-1][1], spec.out, rngs=rngs)

        def __call__(self, x, iv=None):
            given, rec, h = iv, {}, x
            iv = iv or {}
            for i, layer in enumerate(spec.layers):
                module = getattr(self, f"layer{i}", None)
                if not uses_jax("nnx", layer):
                    h, more = native(module, i, layer, h, iv)
                else:
                    h, more = jax_layer(
                        i,
                        layer,
                        f"layer{i}",
                        module,
                        h,
                        iv,
                        widths[i][1],
                        pytree=True,
                    )
                rec.update(more)
            out = hook("head", self.head(h), iv, rec)
            return out if given is None else (out, rec)

    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Net(nnx.Rngs(0))))
    model = nnx.merge(graphdef, filled(abstract, jnp.float32, seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def forward(params, x, iv):
        return nnx.merge(graphdef, params, rest, copy=True)(x, iv)

    def plain(params, x):
        return nnx.merge(graphdef, params, rest, copy=True)(x)

    return Built(
        "nnx",
        spec,
        bridge.probe(model),
        inputs(spec),
        params,
        forward,
        plain,
        site_names(spec, "nnx"),
    )


def _equinox(spec: Spec, seed: int) -> Built:
    import equinox as eqx

    widths = spec.widths()

    def rebuild(module):
        arrays, static = eqx.partition(module, eqx.is_array)
        return arrays, lambda a: eqx.combine(a, static)

    def native(module, i, layer, h, iv, reference):
        """Layer `i` inside Equinox's own transform, the module an argument;
        `reference`: the model runs as its reference (`unrolled_while`)."""
        mod_name = f"layers/{i}"
        names = layer_sites_of(layer, i, mod_name)
        iv = own(iv, names)
        run = functools.partial(body, i, layer, mod_name)
        if layer.wrap == "while_loop":
            if reference:
                return unrolled_while(run, layer, names, module, h, iv)
            return checkpointed_while(run, layer, module, h), {}
        if layer.wrap == "jit":
            return cached_jit("eqx", i, layer, mod_name)(module, h, iv)
        if layer.wrap == "checkpoint":
            return eqx.filter_checkpoint(run)(module, h, iv)
        if layer.wrap == "vmap":
            ys, rec = eqx.filter_vmap(run, in_axes=(None, 0, 0))(module, pair(h), iv)
            return unpair(ys), rec
        raise ValueError(layer.wrap)

    class Net(eqx.Module):
        layers: list
        head: eqx.nn.Linear

        def __call__(self, x, iv=None):
            given, rec, h = iv, {}, x
            iv = iv or {}
            for i, layer in enumerate(spec.layers):
                if not uses_jax("equinox", layer):
                    reference = given is not None
                    h, more = native(self.layers[i], i, layer, h, iv, reference)
                else:
                    h, more = jax_layer(
                        i,
                        layer,
                        f"layers/{i}",
                        self.layers[i],
                        h,
                        iv,
                        widths[i][1],
                        pytree=True,
                        rebuild=rebuild,
                    )
                rec.update(more)
            out = hook("head", self.head(h), iv, rec)
            return out if given is None else (out, rec)

    def make(key):
        layers = []
        for (width, new), layer in zip(widths, spec.layers, strict=True):
            if not layer.module:
                layers.append(None)
            elif layer.wrap == "scan":
                # One layer per step, sliced by the scan.
                keys = jax.random.split(key, layer.iterations)
                layers.append(
                    eqx.filter_vmap(lambda k, w=width: eqx.nn.Linear(w, w, key=k))(keys)
                )
            else:
                layers.append(eqx.nn.Linear(width, new, key=key))
        return Net(layers, eqx.nn.Linear(widths[-1][1], spec.out, key=key))

    model = filled(eqx.filter_eval_shape(make, jax.random.key(0)), jnp.float32, seed)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    looped = {
        name
        for i, layer in enumerate(spec.layers)
        if layer.wrap in LOOPS
        for name in layer_sites("equinox", i, layer)
    }

    def swap(tree):
        # The reference maps the model over the batch: a looped site's
        # iterations come after the batch axis, where the contract puts them
        # first.
        return {
            k: jnp.swapaxes(v, 0, 1) if k.split(":")[-1] in looped and v.ndim else v
            for k, v in tree.items()
        }

    def forward(params, x, iv):
        def one(x, iv):
            return eqx.combine(params, static)(x, iv)

        out, rec = jax.vmap(one)(x, swap(iv))
        return out, swap(rec)

    def plain(params, x):
        return jax.vmap(eqx.combine(params, static))(x)

    return Built(
        "equinox",
        spec,
        bridge.probe(model, vmap=True),
        inputs(spec),
        params,
        forward,
        plain,
        site_names(spec, "equinox"),
    )


def _haiku(spec: Spec, seed: int) -> Built:
    import haiku as hk

    widths = spec.widths()

    def native(linear, i, layer, h, iv):
        """Layer `i` inside Haiku's own transform (the module closed over)."""
        mod_name = f"layer{i}"
        names = layer_sites_of(layer, i, mod_name)
        iv = own(iv, names)

        def run(h, iv):
            return body(i, layer, mod_name, linear, h, iv)

        wrap = layer.wrap
        if wrap == "jit":
            # No `hk.jit`: the module call runs outside the cached function.
            rec = {}
            if layer.module:
                h, rec = module_part(mod_name, linear, h, iv)
            h, more = cached_jit("tail", i, layer, mod_name)(h, iv)
            return h, {**rec, **more}
        if wrap == "checkpoint":
            return hk.remat(run)(h, iv)
        if wrap == "vmap":
            ys, rec = hk.vmap(run, split_rng=False)(pair(h), iv)
            return unpair(ys), rec
        if wrap == "cond":
            taken = taken_branch(run, names)
            skipped = skipped_branch(names, widths[i][1])
            return hk.cond(predicate(h), taken, skipped, h, iv)
        if wrap == "switch":
            branches = switch_branches(run, names, widths[i][1])
            return hk.switch(switch_index(h), branches, h, iv)
        if wrap == "fori_loop":
            loop = closing_over(hk.fori_loop)
            return fori_layer(
                loop, lambda _, h, iv: run(h, iv), layer, names, None, h, iv
            )
        if wrap == "scan":
            step = scan_step(lambda _, h, iv: run(h, iv))
            carry, rec = hk.scan(
                lambda carry, iv: step(carry, (None, iv)),
                (h, scan_start(layer)),
                iv,
                length=layer.iterations,
            )
            return unscanned(carry), rec
        raise ValueError(wrap)

    def net(x, iv=None):
        given, rec, h = iv, {}, x
        iv = iv or {}
        for i, layer in enumerate(spec.layers):
            linear = hk.Linear(widths[i][1], name=f"layer{i}") if layer.module else None
            if early_params("haiku", layer) and hk.running_init():
                linear(h)
            if uses_jax("haiku", layer):
                h, more = jax_layer(
                    i, layer, f"layer{i}", linear, h, iv, widths[i][1], pytree=False
                )
            else:
                h, more = native(linear, i, layer, h, iv)
            rec.update(more)
        out = hook("head", hk.Linear(spec.out, name="head")(h), iv, rec)
        return out if given is None else (out, rec)

    transformed = hk.without_apply_rng(hk.transform(net))
    x = inputs(spec)
    params = filled(
        jax.eval_shape(transformed.init, jax.random.key(0), x), jnp.float32, seed
    )

    def forward(params, x, iv):
        return transformed.apply(params, x, iv)

    def plain(params, x):
        return transformed.apply(params, x)

    return Built(
        "haiku",
        spec,
        bridge.probe(transformed, params),
        x,
        params,
        forward,
        plain,
        site_names(spec, "haiku"),
    )


_BUILDERS = {"linen": _linen, "nnx": _nnx, "equinox": _equinox, "haiku": _haiku}
