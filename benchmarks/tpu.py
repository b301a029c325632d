"""bridge on an accelerator: GPT-2 small's shape in every library, on the chip.

    python benchmarks/tpu.py --out DIR [--models equinox,haiku] [--sizes 2x128,4x512]
                             [--dtypes float32,bfloat16,mixed] [--hlo]

For each model (`linen`, `nnx`, `equinox`, `haiku`: the pre-norm transformer
of `models.py` at GPT-2 small's width and depth; `hf`: Hugging Face's Flax
GPT-2; `keras`, not in the default set: KerasHub's `GPT2Backbone` on Keras 3's
JAX backend, needs `keras` and `keras-hub`), size and dtype, six jitted steps
compiled once each and run interleaved (the order rotated every repeat; a
model without a hand trick, `keras`, runs the other four):

- `plain`: `jax.value_and_grad` of the loss over the parameters;
- `hand`: the library's hand-written epsilon trick at the same sites
  (`models.py`), returning the activations it perturbs and their gradients;
- `one`: `probe.value_and_grad` at one site;
- `all`: every site, activations and activation gradients returned;
- `norms`: every site, reduced inside the step by `res.norms()` to two norms
  per site, returned as one `(sites, 2)` float32 array;
- `hand_norms`: the hand trick's arrays reduced the same way, to one array.

Not in the default set: `norms_per_site` (`--steps ...,norms_per_site`),
the same norms returned as one scalar each, as the rows of 2026-12-05 and
2026-12-06 measured `norms` (the host's cost per returned buffer).

Each row (appended to `DIR/rows.jsonl` as it is measured, so a run cut short
keeps what it measured): median runtime, compile seconds (lower + compile,
discovery warm; discovery timed apart; with `--compile-rounds N` the fastest
lowering plus the fastest compile of N, interleaved, and with
`--compile-clock process` timed by the process's CPU time: for a noisy host
such as a shared CPU), XLA memory (temporaries + outputs),
XLA FLOPs and bytes accessed, and the bytes the step returns beyond plain.
With `--hlo`, the device time of every XLA op and the optimised HLO of each
step go into one archive in `DIR`: what tells a probed program's cost apart
from plain's on the chip. The rows measured on 2026-12-05 are in
`benchmarks/tpu_runs/`.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import glob
import io
import json
import os
import pathlib
import platform
import statistics
import tarfile
import tempfile
import time

import jax
import jax.numpy as jnp
import models
import numpy as np
from jax.experimental.layout import Format, Layout

import bridge
from bridge._probe.discovery_cache import CACHE as DISCOVERIES

DTYPES = {
    # (parameter dtype, activation dtype)
    "float32": (jnp.float32, jnp.float32),
    "bfloat16": (jnp.bfloat16, jnp.bfloat16),
    "mixed": (jnp.float32, jnp.bfloat16),
}


def norms(res: bridge.ProbeResult) -> tuple:
    """What a gradient-flow diagnostic keeps: two numbers per site, as one
    array (`res.norms()`), beside the loss and the parameter gradients."""
    return res.loss, res.grads, res.norms()


def norms_per_site(res: bridge.ProbeResult) -> tuple:
    """The same norms, one returned scalar each (what `norms` measured before
    `res.norms()`): one output buffer per site and column."""
    return (
        res.loss,
        res.grads,
        jax.tree.map(
            lambda a: jnp.linalg.norm(a.astype(jnp.float32)),
            (res.activations, res.activation_grads),
        ),
    )


def stacked_norms(activations, gradients) -> jax.Array:
    """The hand trick's arrays reduced as `res.norms()` reduces a probe's
    (the same norm of each, `l2_norm`): one float32 `(sites, 2)` array, a row
    per perturbed array (the gradients' leaves in their own order: the cost,
    not the pairing, is what is measured)."""
    from bridge._probe.norms import l2_norm

    def column(tree):
        return jnp.stack([l2_norm(leaf) for leaf in jax.tree.leaves(tree)])

    activations, gradients = column(activations), column(gradients)
    if activations.shape != gradients.shape:  # no pairs: one column of both
        return jnp.concatenate([activations, gradients])
    return jnp.stack([activations, gradients], axis=-1)


def hand_norms(hand):
    """The hand trick reduced as `norms` reduces a probe's result: what the
    norms row costs when the epsilons are written by hand."""

    def step(*args):
        (loss, activations), (grads, activation_grads) = hand(*args)
        return loss, grads, stacked_norms(activations, activation_grads)

    return step


def array_bytes(tree) -> int:
    return sum(
        int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
        for leaf in jax.tree.leaves(tree)
    )


def cast_params(tree, dtype):
    return jax.tree.map(
        lambda a: (
            a.astype(dtype)
            if isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jnp.floating)
            else a
        ),
        tree,
    )


def library_steps(
    library: str, batch: int, tokens: int, dtype: str, width: int, depth: int
):
    """`(steps, first_args, x, returned bytes, sites)` of one library's model."""
    param_dtype, compute_dtype = DTYPES[dtype]
    sizes = models.Sizes(
        batch_tf=batch,
        tokens=tokens,
        width_tf=width,
        depth_tf=depth,
        dtype=compute_dtype,
        param_dtype=param_dtype,
    )
    workload = getattr(models, f"{library}_transformer")(sizes)
    probe, loss, at = workload.probe, workload.loss, workload.one_site
    steps = {
        "plain": workload.plain,
        "hand": workload.hand,
        "one": lambda p, x: p.value_and_grad(loss, x, at=at),
        "all": lambda p, x: p.value_and_grad(loss, x),
        "norms": lambda p, x: norms(p.value_and_grad(loss, x)),
        "hand_norms": hand_norms(workload.hand),
        "norms_per_site": lambda p, x: norms_per_site(p.value_and_grad(loss, x)),
    }
    first = dict.fromkeys(steps, probe) | {
        "plain": workload.params,
        "hand": workload.hand_params,
        "hand_norms": workload.hand_params,
    }
    sites = probe.sites(workload.x)
    return steps, first, (workload.x,), 2 * array_bytes(sites), len(sites)


def steps_of(model: str, batch: int, tokens: int, dtype: str, width: int, depth: int):
    """`(steps, first arguments, inputs, returned bytes, sites)` of a benchmark
    model: `hf`, `keras`, or one of the libraries' transformers."""
    if model == "hf":
        return hf_steps(batch, tokens, dtype, width, depth)
    if model == "keras":
        return keras_steps(batch, tokens, dtype, width, depth)
    return library_steps(model, batch, tokens, dtype, width, depth)


def hf_steps(batch: int, tokens: int, dtype: str, width: int, depth: int):
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    param_dtype, compute_dtype = DTYPES[dtype]
    config = GPT2Config(n_layer=depth, n_embd=width, n_head=width // 64)
    model = FlaxGPT2LMHeadModel(config, seed=0, dtype=compute_dtype)
    module = model.module
    params = cast_params(model.params, param_dtype)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (batch, tokens))
    inputs = (ids, np.ones_like(ids), np.broadcast_to(np.arange(tokens), ids.shape))

    def loss_of(outputs):
        logits = jax.nn.log_softmax(outputs.logits[:, :-1].astype(jnp.float32))
        return -jnp.take_along_axis(logits, ids[:, 1:, None], axis=-1).mean()

    def plain(params, *inputs):
        return jax.value_and_grad(
            lambda p: loss_of(module.apply({"params": p}, *inputs))
        )(params)

    def probed(at, reduce=lambda r: r):
        def step(params, *inputs):
            probe = bridge.probe(module, {"params": params})
            return reduce(probe.value_and_grad(loss_of, *inputs, at=at))

        return step

    sites = bridge.probe(module, {"params": params}).sites(*inputs)
    steps = {
        "plain": plain,
        "hand": hf_hand(module, loss_of, sites),
        "one": probed(f"transformer/h/{depth - 1}/mlp"),
        "all": probed(None),
        "norms": probed(None, norms),
        "norms_per_site": probed(None, norms_per_site),
    }
    steps["hand_norms"] = hand_norms(steps["hand"])
    return (
        steps,
        dict.fromkeys(steps, params),
        inputs,
        2 * array_bytes(sites),
        len(sites),
    )


#: Keras's dtype policy for each of `DTYPES`' settings.
KERAS_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "mixed": "mixed_bfloat16"}


def keras_steps(batch: int, tokens: int, dtype: str, width: int, depth: int):
    """KerasHub's GPT-2 backbone built from its configuration (random weights,
    no download) at `width` and `depth`, GPT-2's vocabulary, 64-wide heads.

    The loss is next-token cross-entropy of the backbone's last hidden states
    through a fixed output projection (the token embedding's initial values,
    an input of every step, not trained: a probe's loss sees the model's
    outputs only), the same in every step. `plain` differentiates Keras's own
    pure call, `backbone.stateless_call`, over the trainable values; the
    probed steps go through `bridge.probe(backbone)`. No hand trick: Keras has
    no perturbation mechanism to write one with.
    """
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=50257,
        num_layers=depth,
        num_heads=width // 64,
        hidden_dim=width,
        intermediate_dim=4 * width,
        max_sequence_length=1024,
        dtype=KERAS_DTYPES[dtype],
    )
    ids = np.random.default_rng(0).integers(0, 50257, (batch, tokens), np.int32)
    inputs = {"token_ids": jnp.asarray(ids), "padding_mask": jnp.ones_like(ids)}
    head = jnp.asarray(backbone.token_embedding.embeddings.value)
    targets = jnp.asarray(ids[:, 1:])

    def loss_of(hidden, head):
        logits = jnp.einsum("btd,vd->btv", hidden[:, :-1], head.astype(hidden.dtype))
        logits = jax.nn.log_softmax(logits.astype(jnp.float32))
        return -jnp.take_along_axis(logits, targets[..., None], axis=-1).mean()

    values = (
        [v.value for v in backbone.trainable_variables],
        [v.value for v in backbone.non_trainable_variables],
    )

    def plain(values, inputs, head):
        trainable, non_trainable = values

        def loss(trainable):
            hidden, _ = backbone.stateless_call(trainable, non_trainable, inputs)
            return loss_of(hidden, head)

        return jax.value_and_grad(loss)(trainable)

    def probed(at, reduce=lambda r: r):
        def step(probe, inputs, head):
            res = probe.value_and_grad(lambda h: loss_of(h, head), inputs, at=at)
            return reduce(res)

        return step

    probe = bridge.probe(backbone)
    sites = probe.sites(inputs)
    steps = {
        "plain": plain,
        "one": probed(f"transformer_layer_{depth - 1}/feedforward_output_dense"),
        "all": probed(None),
        "norms": probed(None, norms),
        "norms_per_site": probed(None, norms_per_site),
    }
    first = dict.fromkeys(steps, probe) | {"plain": values}
    return steps, first, (inputs, head), 2 * array_bytes(sites), len(sites)


def hf_hand(module, loss_of, sites):
    """Flax's own `perturb` at every submodule's output (the Linen hand trick),
    returning the activations it perturbs and their gradients."""
    import flax.linen as nn

    def interceptor(activations):
        def intercept(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            if context.module.path == () or context.method_name != "__call__":
                return out
            if not isinstance(out, jax.Array):
                return out
            activations.append(out)
            return context.module.perturb("epsilon", out)

        return intercept

    def step(params, *inputs):
        def loss(params, perturbations):
            activations = []
            with nn.intercept_methods(interceptor(activations)):
                out = module.apply(
                    {"params": params, "perturbations": perturbations}, *inputs
                )
            return loss_of(out), activations

        perturbations = jax.eval_shape(
            lambda: module.apply(
                {"params": params},
                *inputs,
                mutable=["perturbations"],
                method=lambda m, *a: _perturbed_call(m, interceptor([]), *a),
            )[1]["perturbations"]
        )
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), perturbations)
        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, zeros)

    return step


def _perturbed_call(module, interceptor, *inputs):
    import flax.linen as nn

    with nn.intercept_methods(interceptor):
        return module(*inputs)


def device_op_times(run, repeats: int = 3) -> dict:
    """Device time (ns) per XLA op name over `repeats` runs of `run()`."""
    from jax.profiler import ProfileData

    directory = tempfile.mkdtemp()
    run()
    with jax.profiler.trace(directory):
        for _ in range(repeats):
            run()
    (path,) = glob.glob(f"{directory}/**/*.xplane.pb", recursive=True)
    totals: collections.Counter = collections.Counter()
    for plane in ProfileData.from_file(path).planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            if line.name != "XLA Ops":
                continue
            for event in line.events:
                totals[event.name] += event.duration_ns / repeats
    return dict(totals.most_common())


def compile_all(lowered: dict, threads: int) -> tuple[dict, dict]:
    """`(compiled, seconds)` per variant; with `threads > 1` the compilations
    run concurrently (XLA compiles outside the GIL), and their seconds are not
    comparable with one another."""

    def one(variant):
        start = COMPILE_CLOCK[0]()
        compiled = lowered[variant].compile()
        return compiled, COMPILE_CLOCK[0]() - start

    if threads <= 1:
        done = {variant: one(variant) for variant in lowered}
    else:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            done = dict(zip(lowered, pool.map(one, lowered), strict=True))
    return (
        {variant: compiled for variant, (compiled, _) in done.items()},
        {variant: seconds for variant, (_, seconds) in done.items()},
    )


def again(steps, first, x, rows, seconds, rounds: int) -> None:
    """Lower and compile every step `rounds` more times, fresh functions
    interleaved (the order rotated), one after another; keep the fastest
    lowering and compile of each (for a noisy host: `--compile-rounds`)."""
    order = list(steps)
    for repeat in range(rounds):
        for variant in order[repeat % len(order) :] + order[: repeat % len(order)]:
            fresh = lambda *a, step=steps[variant]: step(*a)  # noqa: E731
            out = Format(Layout.AUTO) if variant.endswith("_auto") else None
            start = COMPILE_CLOCK[0]()
            lowered = jax.jit(fresh, out_shardings=out).lower(first[variant], *x)
            middle = COMPILE_CLOCK[0]()
            lowered.compile()
            end = COMPILE_CLOCK[0]()
            rows[variant]["lower_s"] = min(rows[variant]["lower_s"], middle - start)
            seconds[variant] = min(seconds[variant], end - middle)


def measure(name, steps, first, x, options, archive) -> dict:
    """Per variant: compile, memory and cost analyses; unless
    `options.compile_only`, three runtimes, interleaved over the variants:

    - `latency_s`: one call, waited for (what a loop that reads every result
      on the host sees: the host's dispatch and the device's work in series);
    - `step_s`: `PIPELINE` calls dispatched back to back, per call (what a
      training loop sees: the host dispatches ahead while the device works);
    - `device_s`: the device's time in XLA ops per call (profiler).
    """
    lowered, rows = {}, {}
    for variant, step in steps.items():
        start = COMPILE_CLOCK[0]()
        # `_auto`: the same step, its outputs in the layouts XLA picks (on a
        # TPU its own tiling) rather than row-major: what returning arrays
        # costs once the relayout copies to row-major are left out.
        out = Format(Layout.AUTO) if variant.endswith("_auto") else None
        jitted = jax.jit(step, out_shardings=out)
        lowered[variant] = jitted.lower(first[variant], *x)
        rows[variant] = {"lower_s": COMPILE_CLOCK[0]() - start}
    try:
        compiled, seconds = compile_all(lowered, options.compile_threads)
    except Exception as error:  # noqa: BLE001 -- out of memory is a result
        print(f"  does not compile: {error}"[:300], flush=True)
        return {"error": str(error)[:2000]}
    if options.compile_rounds > 1:
        again(steps, first, x, rows, seconds, options.compile_rounds - 1)
    for variant in steps:
        memory = compiled[variant].memory_analysis()
        cost = compiled[variant].cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        rows[variant] |= {
            "compile_s": rows[variant]["lower_s"] + seconds[variant],
            "compiled_concurrently": options.compile_threads > 1,
            "compile_rounds": options.compile_rounds,
            "compile_clock": options.compile_clock,
            "memory": memory.temp_size_in_bytes + memory.output_size_in_bytes,
            "temp": memory.temp_size_in_bytes,
            "output": memory.output_size_in_bytes,
            "flops": cost.get("flops", 0.0),
            "bytes_accessed": cost.get("bytes accessed", 0.0),
        }
        if archive is not None:
            text = compiled[variant].as_text().encode()
            info = tarfile.TarInfo(f"hlo/{name}_{variant}.txt")
            info.size = len(text)
            archive.addfile(info, io.BytesIO(text))
    if options.compile_only:
        return rows
    calls = {v: (lambda v=v: compiled[v](first[v], *x)) for v in steps}
    latency = {variant: [] for variant in steps}
    step = {variant: [] for variant in steps}
    order = list(steps)
    for variant in order:  # the first call of each outside the timings
        jax.block_until_ready(calls[variant]())
    for repeat in range(options.repeats):
        for variant in order[repeat % len(order) :] + order[: repeat % len(order)]:
            start = time.perf_counter()
            jax.block_until_ready(calls[variant]())
            latency[variant].append(time.perf_counter() - start)
            start = time.perf_counter()
            for _ in range(PIPELINE):
                # As a training loop does: each result replaces the last,
                # whose buffers XLA frees once its computation is done.
                result = calls[variant]()
            jax.block_until_ready(result)
            step[variant].append((time.perf_counter() - start) / PIPELINE)
            del result
    for variant in steps:
        ops = device_op_times(lambda v=variant: jax.block_until_ready(calls[v]()))
        rows[variant] |= {
            "latency_s": statistics.median(latency[variant]),
            "step_s": statistics.median(step[variant]),
            "device_s": sum(ops.values()) / 1e9,
            "top_ops_ns": dict(list(ops.items())[:15]),
        }
        if archive is not None:
            text = json.dumps(ops).encode()
            info = tarfile.TarInfo(f"ops/{name}_{variant}.json")
            info.size = len(text)
            archive.addfile(info, io.BytesIO(text))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="equinox,haiku,linen,nnx,hf")
    parser.add_argument("--sizes", default="2x128")
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--steps", default=",".join(VARIANTS))
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--compile-threads",
        type=int,
        default=1,
        help="compile a model's steps concurrently (faster; compile times then "
        "not comparable)",
    )
    parser.add_argument(
        "--compile-rounds",
        type=int,
        default=1,
        help="lower and compile each step this many times, interleaved, and keep "
        "the fastest (a noisy host); 1: the compilation that runs",
    )
    parser.add_argument(
        "--compile-clock",
        choices=("wall", "process"),
        default="wall",
        help="time lowering and compiling by wall time or by this process's CPU "
        "time (a shared host)",
    )
    parser.add_argument(
        "--compile-only",
        action="store_true",
        help="memory and cost analyses only: for sizes whose steps may not fit",
    )
    parser.add_argument(
        "--width-depth",
        default="768x12",
        help="the transformers' width and depth (a smaller one for a quick "
        "check on the CPU)",
    )
    parser.add_argument(
        "--auto-layouts",
        action="store_true",
        help="also `hand` and `all` with their outputs in XLA's own layouts",
    )
    parser.add_argument(
        "--hlo", action="store_true", help="optimised HLO and per-op device times"
    )
    options = parser.parse_args()
    if options.compile_clock == "process":
        COMPILE_CLOCK[0] = time.process_time
    out = pathlib.Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    width, depth = map(int, options.width_depth.split("x"))
    device = jax.devices()[0]
    versions = {
        "device": device.device_kind,
        "platform": device.platform,
        "jax": jax.__version__,
        "jaxlib": jaxlib_version(),
        "libtpu": package_version("libtpu"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": host(),
    }
    print(versions, flush=True)
    archive = None
    if options.hlo:
        archive = tarfile.open(out / f"hlo_{int(time.time())}.tar.gz", "w:gz")
    wanted = options.steps.split(",")
    try:
        for size in options.sizes.split(","):
            batch, tokens = map(int, size.split("x"))
            for dtype in options.dtypes.split(","):
                for model in options.models.split(","):
                    name = f"{model}_{size}_{dtype}"
                    print(name, flush=True)
                    DISCOVERIES.clear()
                    start = time.perf_counter()
                    built = steps_of(model, batch, tokens, dtype, width, depth)
                    steps, first, x, returned, sites = built
                    steps = {v: steps[v] for v in wanted if v in steps}
                    if options.auto_layouts:
                        for v in [v for v in ("hand", "all") if v in steps]:
                            steps[v + "_auto"], first[v + "_auto"] = steps[v], first[v]
                    build = time.perf_counter() - start
                    rows = measure(name, steps, first, x, options, archive)
                    record = {
                        "load_average": os.getloadavg()[0],
                        "model": model,
                        "batch": batch,
                        "tokens": tokens,
                        "dtype": dtype,
                        "width": width,
                        "depth": depth,
                        "sites": sites,
                        "returned_bytes": returned,
                        "build_and_discovery_s": build,
                        "hand_returns": "activations and gradients",
                        "norms_returns": "one (sites, 2) array (res.norms())",
                        **versions,
                        **(keras_versions() if model == "keras" else {}),
                        "rows": rows,
                    }
                    with open(out / "rows.jsonl", "a") as f:
                        f.write(json.dumps(record) + "\n")
                    if "plain" in rows and "step_s" in rows["plain"]:
                        print("  " + summary(rows), flush=True)
    finally:
        if archive is not None:
            archive.close()


VARIANTS = ("plain", "hand", "one", "all", "norms", "hand_norms")

#: Calls dispatched back to back for `step_s`.
PIPELINE = 10

#: What lowering and compiling are timed by: wall time, or with
#: `--compile-clock process` the process's CPU time (all its threads), which
#: a host shared with other work disturbs less.
COMPILE_CLOCK = [time.perf_counter]


def summary(rows: dict) -> str:
    def ratio(row, key):
        plain = rows["plain"][key]
        return f"{row[key] / plain:.3f}" if plain else "-"

    return "  ".join(
        f"{v} step {ratio(r, 'step_s')} device {ratio(r, 'device_s')}"
        for v, r in rows.items()
    )


def host() -> str:
    """The CPU's model name and the cores this process may use."""
    name = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {len(os.sched_getaffinity(0))} cores"


def keras_versions() -> dict:
    """Keras's and KerasHub's versions, and a digest of the Keras adapter that
    ran (its files as imported): which adapter a row measured."""
    import hashlib

    import bridge.adapters.keras as adapter

    digest = hashlib.sha256()
    for path in sorted(pathlib.Path(adapter.__file__).parent.glob("*.py")):
        digest.update(path.read_bytes())
    return {
        "keras": package_version("keras"),
        "keras_hub": package_version("keras-hub"),
        "keras_adapter_sha256": digest.hexdigest()[:12],
    }


def jaxlib_version() -> str:
    import jaxlib

    return jaxlib.__version__


def package_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
