"""Where a probed step's memory goes on an accelerator: compile only, no runs.

    python benchmarks/tpu_memory.py [--libraries linen,equinox]

For each library's small CNN (`models.py`: 8 × 32 × 32 images, 16
channels), the plain, all-sites and hand-trick steps compiled twice: with
row-major outputs (JAX's default) and with the outputs in the layouts XLA
picks (`Format(Layout.AUTO)`). Per step: XLA's temporaries and outputs
(`memory_analysis`), and the outputs' logical bytes (elements × itemsize). On
a TPU an array is stored in tiles of its last two dimensions (8 × 128 for
float32), so a 16-channel activation takes 8× its logical bytes in HBM: the
output column over the logical one shows it. Then the cold compile time of
each library's scanned stack of 12 layers, probed over plain (`run.py`'s
`scanned_rows`), and the same again phase by phase (trace, lower, compile,
discovery; the compiled program's size).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import models
import run
from jax.experimental.layout import Format, Layout


def logical_bytes(tree) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def cnn_rows(library: str) -> dict:
    workload = getattr(models, f"{library}_cnn")()
    rows = {}
    for variant, (step, first) in run.variants(workload).items():
        for layouts, out in (("row-major", None), ("auto", Format(Layout.AUTO))):
            compiled = (
                jax.jit(step, out_shardings=out).lower(first, workload.x).compile()
            )
            memory = compiled.memory_analysis()
            shapes = jax.eval_shape(step, first, workload.x)
            rows[f"{variant} / {layouts}"] = {
                "temp": memory.temp_size_in_bytes,
                "output": memory.output_size_in_bytes,
                "output_logical": logical_bytes(shapes),
            }
    return rows


def phases(step, *args) -> dict:
    """Seconds to trace, lower and compile `step`, and the size of what XLA
    compiled: where a cold compile's time goes."""
    seconds = {}
    start = time.perf_counter()
    traced = jax.jit(step).trace(*args)
    seconds["trace"] = time.perf_counter() - start
    start = time.perf_counter()
    lowered = traced.lower()
    seconds["lower"] = time.perf_counter() - start
    start = time.perf_counter()
    compiled = lowered.compile()
    seconds["compile"] = time.perf_counter() - start
    text = compiled.as_text()
    return seconds | {
        "hlo_instructions": sum(" = " in line for line in text.splitlines()),
        "while_loops": text.count(" while("),
        "fusions": text.count(" fusion("),
    }


def scanned_phases(library: str, depth: int = 12) -> dict:
    """Plain and probed (cold: discovery cache cleared; then warm), phase by
    phase, for `run.py`'s scanned stack."""
    probe, plain, params, x = run.SCANNED[library](depth, models.FULL)
    rows = {"plain": phases(plain, params, x)}
    run.DISCOVERIES.clear()
    start = time.perf_counter()
    probe.sites(x)
    discovery = time.perf_counter() - start
    for name in ("cold", "warm"):
        rows[name] = phases(lambda p, x: p.value_and_grad(models.mse, x), probe, x)
    rows["cold"]["discovery"] = discovery
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--libraries", default="linen,nnx,equinox,haiku")
    parser.add_argument("--out", default=None)
    options = parser.parse_args()
    device = jax.devices()[0]
    print(device.device_kind, jax.__version__, flush=True)
    for library in options.libraries.split(","):
        rows = cnn_rows(library)
        for name, row in rows.items():
            print(
                f"{library} cnn {name}: temp {row['temp'] / 2**20:.2f} MiB, "
                f"output {row['output'] / 2**20:.2f} MiB "
                f"(logical {row['output_logical'] / 2**20:.2f})",
                flush=True,
            )
        start = time.perf_counter()
        scanned = run.scanned_rows(library, (12,), models.FULL)
        for depth, plain_s, cold_s, warm_s in scanned:
            print(
                f"{library} scanned {depth}: plain {plain_s:.2f} s, "
                f"cold {cold_s / plain_s:.2f}x, warm {warm_s / plain_s:.2f}x",
                flush=True,
            )
        breakdown = scanned_phases(library)
        for name, row in breakdown.items():
            print(f"{library} scanned 12 {name}: {row}", flush=True)
        record = {
            "library": library,
            "device": device.device_kind,
            "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cnn": rows,
            "scanned": scanned,
            "scanned_s": time.perf_counter() - start,
            "scanned_phases": breakdown,
        }
        if options.out:
            with open(options.out, "a") as f:
                f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
