"""bridge's benchmark: what probing costs next to plain `jax.value_and_grad`.

    python benchmarks/run.py            # writes benchmarks/RESULTS.md
    python benchmarks/run.py --quick    # a smoke run (CI): tiny repeats

Runtime is the median of interleaved runs (plain, all sites, one site, the
library's hand-written epsilon trick, in turn), so drift in the machine hits
every variant alike. Memory is XLA's own accounting of the compiled program
(`memory_analysis`: arguments, outputs and temporaries), not a noisy RSS.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import pathlib
import platform
import statistics
import time

import jax
from models import BUILDERS, linen_scanned, linen_wide

import bridge

HERE = pathlib.Path(__file__).parent


def compile_seconds(fn, *args):
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return time.perf_counter() - start, compiled


def memory_bytes(compiled):
    stats = compiled.memory_analysis()
    return stats.temp_size_in_bytes + stats.output_size_in_bytes


def measure(workload, repeats):
    probe, x, loss = workload.probe, workload.x, workload.loss
    variants = {
        "plain": (workload.plain, (workload.params, x)),
        "all sites": (lambda p, x: p.value_and_grad(loss, x), (probe, x)),
        "one site": (
            lambda p, x: p.value_and_grad(loss, x, at=workload.one_site),
            (probe, x),
        ),
    }
    if workload.hand is not None:
        variants["hand trick"] = (workload.hand, (workload.params, x))
    compiled, compile_time, memory = {}, {}, {}
    for name, (fn, args) in variants.items():
        compile_time[name], compiled[name] = compile_seconds(fn, *args)
        memory[name] = memory_bytes(compiled[name])
        jax.block_until_ready(compiled[name](*args))  # warm up
    times = {name: [] for name in variants}
    for _ in range(repeats):
        for name, (_, args) in variants.items():
            start = time.perf_counter()
            jax.block_until_ready(compiled[name](*args))
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    start = time.perf_counter()
    probe.sites(x)
    sites_seconds = time.perf_counter() - start
    return median, compile_time, memory, sites_seconds


def tracing_rows(counts):
    rows = []
    for count in counts:
        module, variables, x = linen_wide(count)
        probe = bridge.probe(module, variables)
        start = time.perf_counter()
        jax.jit(lambda p, x: p.value_and_grad(lambda y: y.sum(), x)).trace(probe, x)
        rows.append((count, time.perf_counter() - start))
    return rows


def scanned_rows(depths):
    """Compile time of a scanned stack, probed and plain: flat in depth."""
    rows = []
    for depth in depths:
        module, variables, x = linen_scanned(depth)
        probe = bridge.probe(module, variables)

        def plain(params, x, module=module):
            return jax.value_and_grad(lambda p: mse(module.apply({"params": p}, x)))(
                params
            )

        plain_s, _ = compile_seconds(plain, variables["params"], x)
        probed_s, _ = compile_seconds(lambda p, x: p.value_and_grad(mse, x), probe, x)
        rows.append((depth, plain_s, probed_s))
    return rows


def mse(y):
    return (y**2).mean()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a smoke run for CI")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "RESULTS.md")
    options = parser.parse_args()
    repeats = 2 if options.quick else options.repeats

    lines = [
        "# bridge benchmark",
        "",
        f"{datetime.date.today()} · {platform.processor() or platform.machine()} · "
        f"{jax.device_count()} {jax.devices()[0].platform} device(s) · "
        f"Python {platform.python_version()} · jax {jax.__version__}",
        "",
        "Ratios against plain `jax.value_and_grad` of the same loss (jitted), "
        f"median of {repeats} interleaved runs.",
        "",
        "| library | model | plain ms | all sites | one site | hand trick "
        "| compile all | memory all | `sites()` ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for library, builders in BUILDERS.items():
        package = {"linen": "flax", "nnx": "flax"}.get(library, library)
        if importlib.util.find_spec(package) is None:
            continue
        for builder in builders:
            workload = builder()
            median, compile_time, memory, sites_seconds = measure(workload, repeats)
            base = median["plain"]
            hand = median.get("hand trick")
            row = (
                f"| {library} | {workload.model} | {base * 1e3:.2f} "
                f"| {median['all sites'] / base:.3f} | {median['one site'] / base:.3f} "
                f"| {'—' if hand is None else f'{hand / base:.3f}'} "
                f"| {compile_time['all sites'] / compile_time['plain']:.2f} "
                f"| {memory['all sites'] / memory['plain']:.2f} "
                f"| {sites_seconds * 1e3:.1f} |"
            )
            print(row, flush=True)
            lines.append(row)
    lines += [
        "",
        "Tracing time of a jitted `value_and_grad` as sites grow (Linen, tiny Dense "
        "layers):",
        "",
        "| sites | trace s | per site ms |",
        "|---|---|---|",
    ]
    for count, seconds in tracing_rows([10, 30] if options.quick else [10, 100, 1000]):
        lines.append(f"| {count} | {seconds:.2f} | {seconds / count * 1e3:.2f} |")
        print(lines[-1], flush=True)
    lines += [
        "",
        "Compile time (lower + compile) of a scanned stack (`nn.scan`, Linen), "
        "every site probed:",
        "",
        "| layers | plain s | probed s | ratio |",
        "|---|---|---|---|",
    ]
    for depth, plain_s, probed_s in scanned_rows([2, 6] if options.quick else [12, 48]):
        lines.append(
            f"| {depth} | {plain_s:.2f} | {probed_s:.2f} | {probed_s / plain_s:.2f} |"
        )
        print(lines[-1], flush=True)
    if not options.quick:
        options.out.write_text("\n".join(lines) + "\n")
        print(f"wrote {options.out}")


if __name__ == "__main__":
    main()
