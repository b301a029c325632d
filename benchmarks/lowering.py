"""Lowering time of a probed step against plain `jax.value_and_grad`'s.

`jax.jit(step).lower(...)` is the Python tracing a user waits for at every
new shape, before XLA's compile (which `benchmarks/tpu.py` and
`benchmarks/real_size.py` time with it). For each of the benchmark models
at GPT-2 small's shape (the four libraries' transformers of
`benchmarks/models.py`, Hugging Face's Flax GPT-2, and with `--models keras`
KerasHub's GPT-2 backbone on Keras 3: `tpu.py`'s models), the steps `plain`,
`one` (one site) and `all` (every site) are lowered `--rounds` times,
interleaved, each time a fresh function (no cache of JAX's serves it), the
discovery cache kept after the first round as in a training loop, and
again with JAX's caches and the discovery cache cleared before each
lowering (`plain_cold`, `one_cold`, `all_cold`: what the first lowering of
a new program costs, every `jax.numpy` function traced again, and for the
probed steps discovery's trace and the run); the fastest of each is
reported, and its ratio to `plain`'s (the cold ones to `plain_cold`'s).

    python benchmarks/lowering.py --out DIR [--models ...] [--rounds 3]

Writes `DIR/lowering.jsonl` (one row per model and variant) and prints a
table. `--profile` also writes `DIR/profile_MODEL_VARIANT.txt`: a cProfile of
one more lowering of each variant (discovery warm; the cold ones cold), its
top entries by cumulative and by own time. Tracing time depends on the host:
run it where users run (NOTES: 2 CPU cores and a 13-core host disagree).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tpu  # noqa: E402  (the benchmark models' steps)

from bridge._probe import discovery_cache  # noqa: E402

VARIANTS = ("plain", "one", "all")
#: The steps again with JAX's caches and the discovery cache cleared before
#: each lowering: what a new program costs the first time (plain: every
#: `jax.numpy` function traced and differentiated again; probed: discovery's
#: trace, then the run), each probed one as a ratio to `plain_cold`.
COLD = {"plain_cold": "plain", "one_cold": "one", "all_cold": "all"}


def lower_once(step, first, x, clock=time.perf_counter, cold=False) -> float:
    fresh = lambda *a: step(*a)  # noqa: E731  (a new function: no cache hit)
    if cold:
        jax.clear_caches()
        discovery_cache.CACHE.clear()
    gc.collect()
    start = clock()
    jax.jit(fresh).lower(first, *x)
    return clock() - start


def profile_once(step, first, x, path: str, top: int = 40, cold=False) -> None:
    """cProfile of one lowering of a fresh function, as `lower_once` times it."""
    import cProfile
    import io
    import pstats

    fresh = lambda *a: step(*a)  # noqa: E731
    if cold:
        jax.clear_caches()
        discovery_cache.CACHE.clear()
    gc.collect()
    profiler = cProfile.Profile()
    profiler.enable()
    jax.jit(fresh).lower(first, *x)
    profiler.disable()
    text = io.StringIO()
    for key in ("cumulative", "tottime"):
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(top)
    with open(path, "w") as file:
        file.write(text.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="equinox,haiku,linen,nnx,hf")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", default="2x128")
    parser.add_argument("--width-depth", default="768x12")
    parser.add_argument(
        "--profile", action="store_true", help="also a cProfile of each lowering"
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "process"),
        default="wall",
        help="wall time, or this process's CPU time (a host shared with others)",
    )
    options = parser.parse_args()
    batch, tokens = map(int, options.size.split("x"))
    clock = time.process_time if options.clock == "process" else time.perf_counter
    width, depth = map(int, options.width_depth.split("x"))
    os.makedirs(options.out, exist_ok=True)
    host = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {host}")
    for name in options.models.split(","):
        steps, first, x, _, _ = tpu.steps_of(
            name, batch, tokens, "float32", width, depth
        )
        times: dict[str, list[float]] = {v: [] for v in (*VARIANTS, *COLD)}
        for _ in range(options.rounds):
            for variant in VARIANTS:
                times[variant].append(
                    lower_once(steps[variant], first[variant], x, clock)
                )
        # After the warm rounds: clearing JAX's caches would make them cold.
        for _ in range(options.rounds):
            for variant, step in COLD.items():
                times[variant].append(
                    lower_once(steps[step], first[step], x, clock, cold=True)
                )
        best = {v: min(t) for v, t in times.items()}
        if options.profile:
            for variant in (*VARIANTS, *COLD):
                path = os.path.join(options.out, f"profile_{name}_{variant}.txt")
                step = COLD.get(variant, variant)
                profile_once(steps[step], first[step], x, path, cold=variant in COLD)
        row = {
            "model": name,
            "size": options.size,
            "width": width,
            "depth": depth,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_average": os.getloadavg()[0],
            "clock": options.clock,
            "backend": jax.default_backend(),
            "host": host,
            "jax": jax.__version__,
            "lower_s": best,
            "ratio": {
                v: best[v] / best["plain_cold" if v in COLD else "plain"] for v in best
            },
            "all_rounds_s": times,
        }
        with open(os.path.join(options.out, "lowering.jsonl"), "a") as file:
            file.write(json.dumps(row) + "\n")
        ratio = row["ratio"]
        print(
            f"{name:8s} plain {best['plain']:.2f} s  one {ratio['one']:.2f}x"
            f"  all {ratio['all']:.2f}x  (cold: plain {best['plain_cold']:.2f} s, "
            f"one {ratio['one_cold']:.2f}x, all {ratio['all_cold']:.2f}x)",
            flush=True,
        )


if __name__ == "__main__":
    main()
