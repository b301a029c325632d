"""Lowering with discovery's trace evaluated (`replay`) against the model's
Python run again (the route before it), interleaved in one process.

Each lowering is the first of a new program: JAX's caches and the discovery
cache are cleared before it (`jax.clear_caches()`), so every `jax.numpy`
function is traced and differentiated again, as at a new input shape; the
fastest of `ROUNDS` by the process's CPU time, over plain
`jax.value_and_grad`'s. With `warm` the caches are kept (a step lowered
again, a new `jax.jit` of the same step).

    python benchmarks/replay_ab.py [MODELS] [ROUNDS] [warm]
"""

from __future__ import annotations

import gc
import os
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tpu  # noqa: E402

import bridge._probe.jax_backend as backend  # noqa: E402
from bridge._probe import discovery_cache  # noqa: E402

REPLAYS = backend._replays


def lower(step, first, x, replay: bool, warm: bool = False) -> float:
    backend._replays = REPLAYS if replay else (lambda plan, with_inputs: False)
    fresh = lambda *a: step(*a)  # noqa: E731  (a new function)
    if not warm:
        jax.clear_caches()
        discovery_cache.CACHE.clear()
    gc.collect()
    start = time.process_time()
    jax.jit(fresh).lower(first, *x)
    return time.process_time() - start


def main() -> None:
    models = sys.argv[1] if len(sys.argv) > 1 else "equinox,haiku,linen,nnx,hf"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    warm = sys.argv[3:] == ["warm"]
    print(f"jax {jax.__version__}, {os.cpu_count()} cores, 2 × 128, 12 × 768")
    for name in models.split(","):
        if name == "hf":
            steps, first, x, _, _ = tpu.hf_steps(2, 128, "float32", 768, 12)
        else:
            steps, first, x, _, _ = tpu.library_steps(name, 2, 128, "float32", 768, 12)
        times: dict = {}
        for _ in range(rounds):
            for variant in ("plain", "one", "all"):
                for replay in (True,) if variant == "plain" else (True, False):
                    times.setdefault((variant, replay), []).append(
                        lower(steps[variant], first[variant], x, replay, warm)
                    )
        best = {key: min(value) for key, value in times.items()}
        plain = best[("plain", True)]
        print(
            f"{name:8s} {'' if warm else 'cold '}plain {plain:.2f}s  one: replay "
            f"{best[('one', True)] / plain:.2f}x, model's run "
            f"{best[('one', False)] / plain:.2f}x  all: replay "
            f"{best[('all', True)] / plain:.2f}x, model's run "
            f"{best[('all', False)] / plain:.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
