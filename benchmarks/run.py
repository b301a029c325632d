"""bridge's benchmark: what probing costs next to plain `jax.value_and_grad`.

    python benchmarks/run.py            # writes benchmarks/RESULTS.md
    python benchmarks/run.py --quick    # a smoke run (CI): tiny models, 2 repeats

For each library (Flax Linen, Flax NNX, Equinox, Haiku) and model (an 8-layer
MLP of width 1024, a small ResNet-style CNN, a 4-layer transformer), four
jitted variants of one training step: plain `jax.value_and_grad` of the loss,
`probe.value_and_grad` with every site and with one site, and the library's
hand-written epsilon trick (see `models.py`).

- Runtime: the median of interleaved runs (each variant in turn), so drift in
  the machine's load hits every variant alike; reported as ratios.
- Compile time: `jax.jit(f).lower(...).compile()`, probed over plain.
- Memory: XLA's own accounting of the compiled program (`memory_analysis`:
  temporaries plus outputs), and, for the MLPs, the peak resident memory of
  one step run in a fresh subprocess (Linux `VmHWM`, reset after compiling).
  "Over returned" subtracts the bytes of the activations and activation
  gradients the probe returns: the target is that nothing else grows.
- FLOPs: XLA's `cost_analysis` of the compiled programs; equal FLOPs mean the
  zero epsilons were folded away.
- `sites()`: its wall time and the number of XLA compilations it triggers
  (zero: it is abstract evaluation, no FLOPs).
- Tracing time of `probe.value_and_grad` as sites grow from 10 to 1,000, and
  compile time of a scanned stack at 12 and 48 layers, probed and plain.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.metadata
import importlib.util
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import time

import jax
import models
from models import BUILDERS, FULL, QUICK, SCANNED, linen_wide

import bridge
from bridge._probe.discovery_cache import CACHE as DISCOVERIES

HERE = pathlib.Path(__file__).parent
LIBRARIES = {"linen": "flax", "nnx": "flax", "equinox": "equinox", "haiku": "haiku"}

ANALYSIS_MARKER = "<!-- analysis: kept when run.py rewrites the tables -->"

_COMPILES = [0]


def _count_compiles(event, duration, **_):
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


def compile_seconds(fn, *args):
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return time.perf_counter() - start, compiled


def fresh(fn):
    """A new function object calling `fn`: `jax.jit` traces it again."""
    return lambda *args: fn(*args)


def memory_bytes(compiled):
    stats = compiled.memory_analysis()
    return stats.temp_size_in_bytes + stats.output_size_in_bytes


def flops(compiled):
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return cost.get("flops", float("nan"))


def nbytes(structs):
    return sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(structs))


def variants(workload):
    probe, loss = workload.probe, workload.loss
    chosen = {
        "plain": (workload.plain, workload.params),
        "all sites": (lambda p, x: p.value_and_grad(loss, x), probe),
        "one site": (
            lambda p, x: p.value_and_grad(loss, x, at=workload.one_site),
            probe,
        ),
    }
    if workload.hand is not None:
        chosen["hand trick"] = (workload.hand, workload.hand_params)
    return chosen


def measure(workload, repeats):
    x = workload.x
    chosen = variants(workload)
    compiled, compile_time, memory, flop = {}, {}, {}, {}
    for name, (fn, first) in chosen.items():
        if name == "all sites":
            DISCOVERIES.clear()  # the builder's `sites()` discovered already
        compile_time[name], compiled[name] = compile_seconds(fn, first, x)
        memory[name] = memory_bytes(compiled[name])
        flop[name] = flops(compiled[name])
        jax.block_until_ready(compiled[name](first, x))  # warm up
    # Compile time is noisy on a busy machine: each takes the fastest of
    # interleaved compilations of fresh functions (no hit in `jax.jit`'s own
    # cache). The probed step is compiled cold (bridge's discovery cache
    # cleared: the model is traced twice, abstractly then for real) and warm
    # (a discovery of this structure kept: a second compilation of a step).
    (plain, params), (probed, probe) = chosen["plain"], chosen["all sites"]
    compiles = {
        "plain": [compile_time["plain"]],
        "cold": [compile_time["all sites"]],
        "warm": [],
    }
    for _ in range(3):
        compiles["plain"].append(compile_seconds(fresh(plain), params, x)[0])
        DISCOVERIES.clear()
        compiles["cold"].append(compile_seconds(fresh(probed), probe, x)[0])
        compiles["warm"].append(compile_seconds(fresh(probed), probe, x)[0])
    compile_time = {name: min(seconds) for name, seconds in compiles.items()}
    times = {name: [] for name in chosen}
    for _ in range(repeats):
        for name, (_, first) in chosen.items():
            start = time.perf_counter()
            jax.block_until_ready(compiled[name](first, x))
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    fastest = {name: min(t) for name, t in times.items()}
    compiles_before = _COMPILES[0]
    DISCOVERIES.clear()
    start = time.perf_counter()
    sites = workload.probe.sites(x)
    sites_seconds = time.perf_counter() - start
    start = time.perf_counter()
    workload.probe.sites(x)
    sites_again_seconds = time.perf_counter() - start
    sites_compiles = _COMPILES[0] - compiles_before
    returned = 2 * nbytes(sites)  # activations and their gradients
    return dict(
        median=median,
        fastest=fastest,
        compile=compile_time,
        memory=memory,
        flops=flop,
        sites=sites,
        sites_seconds=sites_seconds,
        sites_again_seconds=sites_again_seconds,
        sites_compiles=sites_compiles,
        returned=returned,
    )


# -- peak resident memory, one step in a fresh process --------------------------------


def _resident_kib(field):
    status = pathlib.Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", status).group(1))


def peak_rss_child(library, model, variant, quick):
    """Run in a subprocess: the peak resident memory one step adds, in bytes."""
    builder = next(b for b in BUILDERS[library] if b.__name__ == f"{library}_{model}")
    workload = builder(QUICK if quick else FULL)
    fn, first = variants(workload)[variant]
    compiled = jax.jit(fn).lower(first, workload.x).compile()
    pathlib.Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM
    before = _resident_kib("VmRSS")
    jax.block_until_ready(compiled(first, workload.x))
    print((_resident_kib("VmHWM") - before) * 1024)


def peak_rss(library, model, variant, quick):
    command = [sys.executable, __file__, "--peak-rss", library, model, variant]
    if quick:
        command.append("--quick")
    try:
        output = subprocess.run(
            command, capture_output=True, text=True, check=True, timeout=300
        )
        return int(output.stdout.split()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return None


# -- tracing growth and scanned stacks -------------------------------------------------


def tracing_rows(counts):
    rows = []
    for count in counts:
        module, variables, x = linen_wide(count)
        probe = bridge.probe(module, variables)

        def plain(params, x, module=module):
            return jax.value_and_grad(lambda p: module.apply({"params": p}, x).sum())(
                params
            )

        start = time.perf_counter()
        jax.jit(plain).trace(variables["params"], x)
        plain_s = time.perf_counter() - start
        probed = []
        DISCOVERIES.clear()
        for _ in ("cold", "warm"):
            start = time.perf_counter()
            jax.jit(lambda p, x: p.value_and_grad(lambda y: y.sum(), x)).trace(probe, x)
            probed.append(time.perf_counter() - start)
        rows.append((count, plain_s, *probed))
    return rows


def scanned_rows(library, depths, sizes):
    """Compile time of a scanned stack, probed and plain: flat in depth."""
    rows = []
    for depth in depths:
        probe, plain, params, x = SCANNED[library](depth, sizes)
        plain_s, _ = compile_seconds(plain, params, x)
        probed = []
        DISCOVERIES.clear()
        for _ in ("cold", "warm"):
            seconds, _ = compile_seconds(
                lambda p, x: p.value_and_grad(models.mse, x), probe, x
            )
            probed.append(seconds)
        rows.append((depth, plain_s, *probed))
    return rows


# -- the report ----------------------------------------------------------------------


def _versions():
    names = ["jax", "jaxlib", "flax", "equinox", "dm-haiku"]
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(found)


def _machine():
    cpu = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    return f"{cpu}, {cores} cores, {platform.system()}"


def _ratio(measured, a, b):
    """`median ratio (fastest ratio)` of variant `a` over variant `b`."""
    median, fastest = measured["median"], measured["fastest"]
    if a not in median or b not in median:
        return "—"
    return f"{median[a] / median[b]:.3f} ({fastest[a] / fastest[b]:.3f})"


def _mib(value):
    return "—" if value is None else f"{value / 2**20:.1f}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a smoke run for CI")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "RESULTS.md")
    parser.add_argument(
        "--libraries", nargs="+", choices=list(LIBRARIES), default=list(LIBRARIES)
    )
    parser.add_argument("--peak-rss", nargs=3, metavar=("LIBRARY", "MODEL", "VARIANT"))
    options = parser.parse_args()
    if options.peak_rss:
        peak_rss_child(*options.peak_rss, options.quick)
        return
    repeats = 2 if options.quick else options.repeats
    sizes = QUICK if options.quick else FULL
    started, cpu_started = time.perf_counter(), time.process_time()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")

    lines = [
        "# bridge benchmark",
        "",
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC · {_machine()} · "
        f"{jax.device_count()} {jax.devices()[0].platform} device(s) · "
        f"Python {platform.python_version()} · {_versions()}",
        "",
        "Generated by `python benchmarks/run.py`. Runtime: jitted training steps, "
        f"median of {repeats} interleaved runs (in parentheses: fastest run "
        "over fastest run), as ratios to plain "
        "`jax.value_and_grad` of the same loss (`hand` = the library's "
        "hand-written epsilon trick). Compile: lower + compile, all sites over "
        "plain, each the fastest of interleaved compilations of fresh functions "
        "(plain 4, cold 4, warm 3): cold with bridge's discovery cache cleared, "
        "warm with a discovery of the same structure kept (a second compilation "
        "of a step). Memory: XLA `memory_analysis` (temporaries + outputs), all "
        "sites over plain, and the same after subtracting the activations and "
        "activation gradients returned. FLOPs: XLA `cost_analysis`, all sites "
        "over plain.",
        "",
        "| library | model | sites (hand) | plain ms | all sites | one site | hand "
        "| all / hand | compile cold | compile warm | memory | memory − returned "
        "| FLOPs | `sites()` ms cold / warm (compiles) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    libraries = [
        lib
        for lib in options.libraries
        if importlib.util.find_spec(LIBRARIES[lib]) is not None
    ]
    rss_rows = []
    for library in libraries:
        builders = BUILDERS[library][:1] if options.quick else BUILDERS[library]
        for builder in builders:
            workload = builder(sizes)
            m = measure(workload, repeats)
            median = m["median"]
            ratio = functools.partial(_ratio, m)
            memory_plain = m["memory"]["plain"]
            row = (
                f"| {library} | {workload.model} | {len(m['sites'])} "
                f"({workload.hand_sites}) | {median['plain'] * 1e3:.2f} "
                f"| {ratio('all sites', 'plain')} | {ratio('one site', 'plain')} "
                f"| {ratio('hand trick', 'plain')} "
                f"| {ratio('all sites', 'hand trick')} "
                f"| {m['compile']['cold'] / m['compile']['plain']:.2f} "
                f"| {m['compile']['warm'] / m['compile']['plain']:.2f} "
                f"| {m['memory']['all sites'] / memory_plain:.2f} "
                f"| {(m['memory']['all sites'] - m['returned']) / memory_plain:.2f} "
                f"| {m['flops']['all sites'] / m['flops']['plain']:.3f} "
                f"| {m['sites_seconds'] * 1e3:.0f} / "
                f"{m['sites_again_seconds'] * 1e3:.1f} ({m['sites_compiles']}) |"
            )
            print(row, flush=True)
            lines.append(row)
            if workload.model == "mlp" and not options.quick:
                plain_rss = peak_rss(library, "mlp", "plain", options.quick)
                all_rss = peak_rss(library, "mlp", "all sites", options.quick)
                rss_rows.append((library, plain_rss, all_rss, m["returned"]))

    lines += [
        "",
        "Peak resident memory of one MLP step in a fresh process (MiB added "
        "over the process's resident memory before the step; Linux `VmHWM`):",
        "",
        "| library | plain | all sites | returned arrays | all − returned − plain |",
        "|---|---|---|---|---|",
    ]
    for library, plain_rss, all_rss, returned in rss_rows:
        excess = (
            None
            if plain_rss is None or all_rss is None
            else all_rss - returned - plain_rss
        )
        lines.append(
            f"| {library} | {_mib(plain_rss)} | {_mib(all_rss)} | {_mib(returned)} "
            f"| {_mib(excess)} |"
        )
        print(lines[-1], flush=True)

    lines += [
        "",
        "Tracing time of a jitted `value_and_grad` as sites grow (Linen, a chain "
        "of tiny Dense layers, every site probed); probed cold (discovery cache "
        "cleared) and warm (the same step traced again):",
        "",
        "| sites | plain trace s | probed trace s cold | warm "
        "| probed ms per site cold | warm |",
        "|---|---|---|---|---|---|",
    ]
    for count, plain_s, cold_s, warm_s in tracing_rows(
        [10] if options.quick else [10, 100, 1000]
    ):
        lines.append(
            f"| {count} | {plain_s:.2f} | {cold_s:.2f} | {warm_s:.2f} "
            f"| {cold_s / count * 1e3:.2f} | {warm_s / count * 1e3:.2f} |"
        )
        print(lines[-1], flush=True)

    lines += [
        "",
        "Compile time (lower + compile) of a scanned stack of identical blocks "
        "(LayerNorm, gelu, Dense, residual), every site probed: Linen `nn.scan`, "
        "NNX `nnx.scan` over `nnx.vmap`-built layers, Equinox `lax.scan` over "
        "`eqx.filter_vmap`-built layers, Haiku `hk.experimental.layer_stack`; "
        "probed cold (discovery cache cleared) and warm (compiled again):",
        "",
        "| library | layers | plain s | probed s cold | warm | ratio cold | warm |",
        "|---|---|---|---|---|---|---|",
    ]
    for library in libraries:
        depths = [2] if options.quick else [12, 48]
        if options.quick and library != "linen":
            continue
        for depth, plain_s, cold_s, warm_s in scanned_rows(library, depths, sizes):
            lines.append(
                f"| {library} | {depth} | {plain_s:.2f} | {cold_s:.2f} | {warm_s:.2f} "
                f"| {cold_s / plain_s:.2f} | {warm_s / plain_s:.2f} |"
            )
            print(lines[-1], flush=True)

    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    lines += [
        "",
        f"Benchmark wall time {wall:.0f} s, CPU time of this process {cpu:.0f} s "
        f"(subprocesses not counted); load average at start {load:.1f}.",
    ]
    print(lines[-1])
    if not options.quick:
        # Hand-written analysis below the marker survives a rerun.
        kept = ""
        if options.out.exists():
            previous = options.out.read_text()
            if ANALYSIS_MARKER in previous:
                kept = previous[previous.index(ANALYSIS_MARKER) :]
        options.out.write_text("\n".join(lines) + "\n\n" + kept)
        print(f"wrote {options.out}")


if __name__ == "__main__":
    main()
