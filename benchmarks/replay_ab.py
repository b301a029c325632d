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

import os
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lowering  # noqa: E402
import tpu  # noqa: E402

import bridge._probe.jax_backend as backend  # noqa: E402

REPLAYS = backend._replays


def lower(step, first, x, replay: bool, warm: bool = False) -> float:
    backend._replays = REPLAYS if replay else (lambda plan, with_inputs: False)
    return lowering.lower_once(step, first, x, time.process_time, cold=not warm)


def main() -> None:
    models = sys.argv[1] if len(sys.argv) > 1 else "equinox,haiku,linen,nnx,hf"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    warm = sys.argv[3:] == ["warm"]
    print(f"jax {jax.__version__}, {os.cpu_count()} cores, 2 × 128, 12 × 768")
    for name in models.split(","):
        steps, first, x, _, _ = tpu.steps_of(name, 2, 128, "float32", 768, 12)
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
