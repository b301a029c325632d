"""bridge at real size: Hugging Face's Flax GPT-2 with GPT-2 small's shape.

    python benchmarks/real_size.py              # 12 x 768, 124M parameters
    python benchmarks/real_size.py --quick      # 2 x 128
    python benchmarks/real_size.py --libraries  # that size in all four libraries
    python benchmarks/real_size.py --batch 8 --tokens 1024  # GPT-2's training batch
    python benchmarks/real_size.py --libraries --models linen,haiku \
        --steps "plain,norms,norms per site,hand norms"  # the norms rows

`--libraries`: the pre-norm transformer of `benchmarks/models.py` (4 heads,
a dense head on the mean token, mean squared loss) at GPT-2 small's width,
depth and tokens (12 x 768, batch 2 x 128), in Flax Linen, Flax NNX,
Equinox and Haiku, each written as that library's users write it.

Random initialisation (no download), next-token loss. Jitted steps,
compiled once each, then run interleaved (the order rotated every
repetition), medians as ratios to plain (`--steps` picks some):
- `plain`: `jax.value_and_grad` of the loss over the parameters;
- `all sites`: `probe.value_and_grad` with every site (activations and
  activation gradients of all of them returned);
- `one site`: `probe.value_and_grad` at one site (the last block's MLP);
- `norms`: every site again, reduced inside the step by `res.norms()` to the
  norm of each activation and activation gradient (what a gradient-flow
  diagnostic keeps), returned as one `(sites, 2)` array: the memory the
  returned arrays cost, and no more, is what sets this apart from "all
  sites";
- `norms per site`: the same norms returned as one scalar each (one output
  buffer per site and column);
- `hand norms`: the library's hand-written epsilon trick (`models.py`; for
  the Hugging Face GPT-2, Flax's `perturb` at every submodule output),
  reduced to one `(sites, 2)` array by the same norm (`tpu.hand_norms`).
Also the compile time of each (`lower(...).compile()`, tracing included,
with the discovery cache warm; discovery's own time is printed apart) and
XLA's memory
accounting of each compiled program (temporaries plus outputs), with the
bytes of the returned activations and gradients, which the contract asks for.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from tpu import hand_norms, hf_hand, norms_per_site
from transformers import FlaxGPT2LMHeadModel, GPT2Config

import bridge

#: The steps, in the order they are printed.
STEPS = ("plain", "all sites", "one site", "norms", "norms per site", "hand norms")


def timed(steps: dict, first: dict, x: tuple, repeats: int) -> dict:
    """`{step: (median runtime, compile seconds, XLA bytes)}` of jitted
    `steps[name](first[name], *x)`, compiled once each, run interleaved."""
    compiled, compile_times, memory = {}, {}, {}
    for name, step in steps.items():
        start = time.perf_counter()
        compiled[name] = jax.jit(step).lower(first[name], *x).compile()
        compile_times[name] = time.perf_counter() - start
        analysis = compiled[name].memory_analysis()
        memory[name] = analysis.temp_size_in_bytes + analysis.output_size_in_bytes
    times = {name: [] for name in steps}
    order = list(steps)
    for repeat in range(repeats):
        for name in order[repeat % len(order) :] + order[: repeat % len(order)]:
            start = time.perf_counter()
            jax.block_until_ready(compiled[name](first[name], *x))
            times[name].append(time.perf_counter() - start)
    return {
        name: (statistics.median(times[name]), compile_times[name], memory[name])
        for name in steps
    }


def norms(res: bridge.ProbeResult) -> tuple:
    """What a diagnostic keeps of every site, reduced inside the jitted step:
    the loss, the parameter gradients (for the update) and two numbers per
    site, as one array. XLA frees each activation and gradient once its norm
    is taken."""
    return res.loss, res.grads, res.norms()


def print_rows(rows: dict) -> None:
    print(
        f"{'step':16s}{'runtime':>10s}{'ratio':>7s}{'compile':>10s}{'ratio':>7s}"
        f"{'XLA MiB':>9s}{'ratio':>7s}"
    )
    base_run, base_compile, base_memory = rows["plain"]
    for name, (run, seconds, memory) in rows.items():
        print(
            f"{name:16s}{run * 1e3:8.1f}ms{run / base_run:7.3f}"
            f"{seconds:9.1f}s{seconds / base_compile:7.2f}"
            f"{memory / 2**20:9.0f}{memory / base_memory:7.2f}"
        )


def libraries(
    repeats: int, batch: int, tokens: int, names: list[str], wanted: list[str]
) -> None:
    """The same transformer at GPT-2 small's size in the four libraries."""
    import models

    sizes = models.Sizes(batch_tf=batch, tokens=tokens, width_tf=768, depth_tf=12)
    for library in names:
        workload = getattr(models, f"{library}_transformer")(sizes)
        probe, loss, at = workload.probe, workload.loss, workload.one_site
        steps = {
            "plain": workload.plain,
            "all sites": lambda p, x, loss=loss: p.value_and_grad(loss, x),
            "one site": lambda p, x, loss=loss, at=at: p.value_and_grad(loss, x, at=at),
            "norms": lambda p, x, loss=loss: norms(p.value_and_grad(loss, x)),
            "norms per site": lambda p, x, loss=loss: norms_per_site(
                p.value_and_grad(loss, x)
            ),
            "hand norms": hand_norms(workload.hand),
        }
        steps = {name: steps[name] for name in wanted}
        first = dict.fromkeys(steps, probe) | {
            "plain": workload.params,
            "hand norms": workload.hand_params,
        }
        probe.sites(workload.x)  # discovery warm for the probed steps
        rows = timed(steps, first, (workload.x,), repeats)
        print(f"\n{library}: {len(probe.sites(workload.x))} sites")
        print_rows(rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--libraries", action="store_true")
    parser.add_argument("--repeats", type=int, default=7)
    # GPT-2 small's shape is the default; on an accelerator, its training
    # batch (8 x 1024) is the size worth timing.
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument(
        "--steps",
        default=",".join(STEPS),
        help=f"comma-separated, plain first; of: {', '.join(STEPS)}",
    )
    parser.add_argument(
        "--models",
        default="linen,nnx,equinox,haiku",
        help="with --libraries: which libraries",
    )
    options = parser.parse_args()
    wanted = [step.strip() for step in options.steps.split(",")]
    if wanted[0] != "plain" or not set(wanted) <= set(STEPS):
        parser.error(f"--steps: plain first, then any of {STEPS}")
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
    if options.libraries:
        names = options.models.split(",")
        libraries(options.repeats, options.batch, options.tokens, names, wanted)
        return
    batch = options.batch
    layers, width, seq = (2, 128, 32) if options.quick else (12, 768, options.tokens)
    jax.config.update("jax_numpy_rank_promotion", "allow")
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=max(width // 64, 1))
    model = FlaxGPT2LMHeadModel(config, seed=0)
    module, params = model.module, model.params
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (batch, seq))
    inputs = (ids, np.ones_like(ids), np.broadcast_to(np.arange(seq), ids.shape))

    def loss_of(outputs):
        logits = jax.nn.log_softmax(outputs.logits[:, :-1])
        return -jnp.take_along_axis(logits, ids[:, 1:, None], axis=-1).mean()

    def plain(params, *inputs):
        return jax.value_and_grad(
            lambda p: loss_of(module.apply({"params": p}, *inputs))
        )(params)

    def probed(at):
        def step(params, *inputs):
            probe = bridge.probe(module, {"params": params})
            return probe.value_and_grad(loss_of, *inputs, at=at)

        return step

    last_mlp = f"transformer/h/{layers - 1}/mlp"
    # Discovery (abstract evaluation, once per call structure, cached): timed
    # on its own, so that the probed steps compile with the cache warm.
    start = time.perf_counter()
    sites = bridge.probe(module, {"params": params}).sites(*inputs)
    discovery = time.perf_counter() - start
    steps = {
        "plain": plain,
        "all sites": probed(None),
        "one site": probed(last_mlp),
        "norms": lambda *a: norms(probed(None)(*a)),
        "norms per site": lambda *a: norms_per_site(probed(None)(*a)),
        "hand norms": hand_norms(hf_hand(module, loss_of, sites)),
    }
    steps = {name: steps[name] for name in wanted}
    returned = 2 * sum(
        np.prod(leaf.shape) * leaf.dtype.itemsize
        for leaf in jax.tree.leaves(sites)
        if jnp.issubdtype(leaf.dtype, jnp.floating)
    )
    rows = timed(steps, dict.fromkeys(steps, params), inputs, options.repeats)
    print(
        f"Flax GPT-2 {layers} x {width}, batch {batch} x {seq}, {len(sites)} sites "
        f"({returned / 2**20:.0f} MiB of activations and gradients returned); "
        f"{options.repeats} interleaved repeats"
    )
    print(f"discovery (probe.sites, cold): {discovery:.2f}s")
    print_rows(rows)


if __name__ == "__main__":
    main()
