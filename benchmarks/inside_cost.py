"""What `inside=` costs: Hugging Face's Flax GPT-2 attention, traced with and
without its locals as sites.

    python benchmarks/inside_cost.py           # GPT-2 small's shape, 12 x 768
    python benchmarks/inside_cost.py --quick   # 2 layers, width 64

Interleaved repeats, medians:
- the one-off rewrite, at `bridge.probe(..., inside=...)` (parsing and
  compiling the attention's source, once per function per process);
- `probe.sites(...)` (abstract evaluation);
- tracing and lowering `jax.jit(step)` of `probe.value_and_grad` at one
  pattern site per layer, and compiling it;
- the compiled step's runtime (the rewrite exists only while tracing).
The baseline is the same probe without `inside`, selecting each layer's
attention output instead.
"""

from __future__ import annotations

import argparse
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from transformers import FlaxGPT2Model, GPT2Config
from transformers.models.gpt2 import modeling_flax_gpt2

import bridge
from bridge._probe import discovery_cache as _discovery_cache
from bridge._session import inside as _inside

SEQ = 128


def _seconds(function, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(function())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    quick = parser.parse_args().quick
    layers, width = (2, 64) if quick else (12, 768)
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=max(width // 64, 1))
    jax.config.update("jax_numpy_rank_promotion", "allow")
    model = FlaxGPT2Model(config, seed=0)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, SEQ))
    inputs = (ids, np.ones_like(ids), np.broadcast_to(np.arange(SEQ), ids.shape))
    variables = {"params": model.params}
    entries = [modeling_flax_gpt2.FlaxGPT2Attention, nn.dot_product_attention_weights]

    start = time.perf_counter()
    _inside.Inside(entries)
    rewrite = time.perf_counter() - start
    inside = bridge.probe(model.module, variables, inside=entries)
    plain = bridge.probe(model.module, variables)
    pattern = "h/{}/attn/dot_product_attention_weights/attn_weights#2"
    at = {
        "inside": [pattern.format(n) for n in range(layers)],
        "plain": [f"h/{n}/attn" for n in range(layers)],
    }
    probes = {"inside": inside, "plain": plain}

    def loss(outputs):
        return jnp.mean(outputs.last_hidden_state**2)

    def step(name):
        return jax.jit(lambda *xs: probes[name].value_and_grad(loss, *xs, at=at[name]))

    repeats = 3
    rows = {}
    for name in probes:  # a first, untimed trace fills the discovery caches
        probes[name].sites(*inputs)
    results = {name: {} for name in probes}
    for _ in range(repeats):
        for name, probe in probes.items():
            # Discovery is cached per structure: time it with the cache off.
            _discovery_cache.CACHE.clear()
            results[name].setdefault("sites", []).append(
                _seconds(lambda probe=probe: probe.sites(*inputs), 1)
            )
            start = time.perf_counter()
            lowered = step(name).lower(*inputs)
            results[name].setdefault("trace", []).append(time.perf_counter() - start)
            start = time.perf_counter()
            compiled = lowered.compile()
            results[name].setdefault("compile", []).append(time.perf_counter() - start)
            results[name].setdefault("run", []).append(
                _seconds(lambda compiled=compiled: compiled(*inputs), 3)
            )
    for name in probes:
        rows[name] = {k: statistics.median(v) for k, v in results[name].items()}
    sites = {name: len(probe.sites(*inputs)) for name, probe in probes.items()}
    print(
        f"Flax GPT-2, {layers} x {width}, batch 2 x {SEQ}; {repeats} interleaved "
        f"repeats; sites: {sites['plain']} plain, {sites['inside']} with inside="
    )
    print(
        f"one-off rewrite of the attention class and function: {rewrite * 1e3:.1f} ms"
    )
    print(f"{'':10s}{'plain':>10s}{'inside=':>10s}{'ratio':>8s}")
    for field in ("sites", "trace", "compile", "run"):
        a, b = rows["plain"][field], rows["inside"][field]
        print(f"{field:10s}{a * 1e3:9.1f}ms{b * 1e3:9.1f}ms{b / a:8.2f}")


if __name__ == "__main__":
    main()
