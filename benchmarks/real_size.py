"""bridge at real size: Hugging Face's Flax GPT-2 with GPT-2 small's shape.

    python benchmarks/real_size.py           # 12 x 768 (124M parameters), batch 2 x 128
    python benchmarks/real_size.py --quick   # 2 x 128

Random initialisation (no download), next-token loss. Three jitted steps,
compiled once each, then run interleaved (the order rotated every
repetition), medians as ratios to plain:
- plain `jax.value_and_grad` of the loss over the parameters;
- `probe.value_and_grad` with every site (activations and activation
  gradients of all of them returned);
- `probe.value_and_grad` at one site (the last block's MLP).
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
from transformers import FlaxGPT2LMHeadModel, GPT2Config

import bridge


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=7)
    options = parser.parse_args()
    layers, width, seq = (2, 128, 32) if options.quick else (12, 768, 128)
    jax.config.update("jax_numpy_rank_promotion", "allow")
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=max(width // 64, 1))
    model = FlaxGPT2LMHeadModel(config, seed=0)
    module, params = model.module, model.params
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, seq))
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
    steps = {"plain": plain, "all sites": probed(None), "one site": probed(last_mlp)}
    # Discovery (abstract evaluation, once per call structure, cached): timed
    # on its own, so that both probed steps compile with the cache warm.
    start = time.perf_counter()
    sites = bridge.probe(module, {"params": params}).sites(*inputs)
    discovery = time.perf_counter() - start
    compiled, compile_times, memory = {}, {}, {}
    for name, step in steps.items():
        start = time.perf_counter()
        compiled[name] = jax.jit(step).lower(params, *inputs).compile()
        compile_times[name] = time.perf_counter() - start
        analysis = compiled[name].memory_analysis()
        memory[name] = analysis.temp_size_in_bytes + analysis.output_size_in_bytes
    returned = 2 * sum(
        np.prod(leaf.shape) * leaf.dtype.itemsize
        for leaf in jax.tree.leaves(sites)
        if jnp.issubdtype(leaf.dtype, jnp.floating)
    )
    times = {name: [] for name in steps}
    order = list(steps)
    for repeat in range(options.repeats):
        for name in order[repeat % 3 :] + order[: repeat % 3]:
            start = time.perf_counter()
            jax.block_until_ready(compiled[name](params, *inputs))
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["plain"])
    print(
        f"Flax GPT-2 {layers} x {width}, batch 2 x {seq}, {len(sites)} sites "
        f"({returned / 2**20:.0f} MiB of activations and gradients returned); "
        f"{options.repeats} interleaved repeats"
    )
    print(f"discovery (probe.sites, cold): {discovery:.2f}s")
    print(
        f"{'step':12s}{'runtime':>10s}{'ratio':>7s}{'compile':>10s}{'ratio':>7s}"
        f"{'XLA MiB':>9s}{'ratio':>7s}"
    )
    for name in steps:
        run = statistics.median(times[name])
        seconds = compile_times[name]
        print(
            f"{name:12s}{run * 1e3:8.1f}ms{run / base:7.3f}"
            f"{seconds:9.1f}s{seconds / compile_times['plain']:7.2f}"
            f"{memory[name] / 2**20:9.0f}{memory[name] / memory['plain']:7.2f}"
        )


if __name__ == "__main__":
    main()
