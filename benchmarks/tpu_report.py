"""`benchmarks/RESULTS_tpu.md` from the chip's rows in `benchmarks/tpu_runs/`.

    python benchmarks/tpu_report.py [--runs benchmarks/tpu_runs] [--out FILE]
                                    [--plot docs/performance_tpu.png]
                                    [--only keras]
    python benchmarks/tpu_report.py --cpu benchmarks/cpu_runs

`benchmarks/tpu.py` measures on the chip and appends rows (one per model, size
and dtype); this turns every row kept into tables, here, without the chip. A
variant measured in several runs is taken from the latest, and always as a
ratio to the plain step of the same run (interleaved with it).
"""

from __future__ import annotations

import argparse
import json
import pathlib

#: The chip's HBM bandwidth (TPU v5e), for the floor of a step that returns
#: `bytes` more than plain: plain's time + bytes / bandwidth.
HBM_BYTES_PER_S = 819e9

HERE = pathlib.Path(__file__).parent


def load(runs: pathlib.Path) -> list[dict]:
    records = []
    for path in sorted(runs.glob("*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines()]
    return records


def latest_timings(records: list[dict]) -> dict:
    """`{(model, size, dtype): {variant: (row, plain's row, record)}}`, each
    variant from the latest run that measured it."""
    table: dict = {}
    for record in sorted(records, key=lambda r: r["date"]):
        rows = record["rows"]
        if "step_s" not in rows.get("plain", {}):
            continue
        key = (
            record["model"],
            f"{record['batch']}x{record['tokens']}",
            record["dtype"],
        )
        entry = table.setdefault(key, {"record": record})
        for variant, row in rows.items():
            entry[variant] = (row, rows["plain"], record)
    return table


def ratio(entry: dict, variant: str, key: str) -> float | None:
    if variant not in entry:
        return None
    row, plain, _ = entry[variant]
    return row[key] / plain[key]


def floor(entry: dict, variant: str) -> float | None:
    """Plain's step plus writing the extra bytes the variant returns, over plain."""
    if variant not in entry:
        return None
    row, plain, _ = entry[variant]
    extra = max(row["output"] - plain["output"], 0)
    return (plain["device_s"] + extra / HBM_BYTES_PER_S) / plain["device_s"]


def cell(entry: dict, variant: str) -> str:
    step, device = ratio(entry, variant, "step_s"), ratio(entry, variant, "device_s")
    if step is None:
        return "–"
    # Rows measured before the hand tricks returned their activations too.
    older = variant == "hand" and "hand_returns" not in entry["hand"][2]
    return f"{step:.3f} / {device:.3f}" + (" †" if older else "")


def number(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def memory_cell(entry: dict, variant: str) -> str:
    if variant not in entry:
        return "–"
    row, plain, _ = entry[variant]
    least = plain["memory"] + max(row["output"] - plain["output"], 0)
    return f"{row['memory'] / plain['memory']:.2f} ({least / plain['memory']:.2f})"


def timing_table(table: dict, size: str, dtype: str) -> list[str]:
    lines = [
        "| model | sites | plain ms (step / device) | one site | norms | hand norms "
        "| all sites | all floor | hand | hand floor | all / hand (device) "
        "| memory all (floor) | memory hand (floor) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (model, row_size, row_dtype), entry in sorted(table.items()):
        if (row_size, row_dtype) != (size, dtype):
            continue
        plain = entry["plain"][0]
        all_over_hand = None
        if "all" in entry and "hand" in entry:
            all_over_hand = entry["all"][0]["device_s"] / entry["hand"][0]["device_s"]
        lines.append(
            f"| {model} | {entry['record']['sites']} "
            f"| {plain['step_s'] * 1e3:.2f} / {plain['device_s'] * 1e3:.2f} "
            f"| {cell(entry, 'one')} | {cell(entry, 'norms')} "
            f"| {cell(entry, 'hand_norms')} | {cell(entry, 'all')} "
            f"| {number(floor(entry, 'all'))} | {cell(entry, 'hand')} "
            f"| {number(floor(entry, 'hand'))} | {number(all_over_hand)} "
            f"| {memory_cell(entry, 'all')} | {memory_cell(entry, 'hand')} |"
        )
    return lines


def compile_table(records: list[dict]) -> list[str]:
    sequential = {}
    for record in sorted(records, key=lambda r: r["date"]):
        plain = record["rows"].get("plain", {})
        if "compile_s" in plain and not plain.get("compiled_concurrently", True):
            key = (record["model"], f"{record['batch']}x{record['tokens']}")
            sequential[key] = record
    lines = [
        "| model | size | discovery s | plain s | one site | all sites | norms "
        "| lowering s (plain / one / all / norms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (model, size), record in sorted(sequential.items()):
        rows = record["rows"]
        plain = rows["plain"]["compile_s"]

        def over_plain(variant, rows=rows, plain=plain):
            return (
                number(rows[variant]["compile_s"] / plain) if variant in rows else "–"
            )

        lowering = " / ".join(
            f"{rows[v]['lower_s']:.1f}"
            for v in ("plain", "one", "all", "norms")
            if v in rows
        )
        lines.append(
            f"| {model} | {size} | {record['build_and_discovery_s']:.1f} | {plain:.1f} "
            f"| {over_plain('one')} | {over_plain('all')} | {over_plain('norms')} "
            f"| {lowering} |"
        )
    return lines


def layout_table(table: dict) -> list[str]:
    """The rows measured with `tpu.py --auto-layouts`: the same steps, their
    outputs left in the layouts XLA picks instead of row-major."""
    lines = [
        "| model | size | dtype | all sites | all, XLA's layouts | all floor "
        "| hand | hand, XLA's layouts |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (model, size, dtype), entry in sorted(table.items()):
        if "all_auto" not in entry:
            continue
        lines.append(
            f"| {model} | {size} | {dtype} | {cell(entry, 'all')} "
            f"| {cell(entry, 'all_auto')} | {number(floor(entry, 'all'))} "
            f"| {cell(entry, 'hand')} | {cell(entry, 'hand_auto')} |"
        )
    return lines


def memory_table(runs: pathlib.Path) -> list[str]:
    """`benchmarks/tpu_memory.py`'s rows: the small CNN's memory and the
    scanned stack's cold compile."""
    records = []
    for path in sorted((runs / "memory").glob("*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines()]
    if not records:
        return []
    mib = 2**20
    lines = [
        "| library | step | temporaries MiB | outputs MiB (logical) "
        "| outputs, XLA's layouts MiB | scanned stack of 12, cold compile |",
        "|---|---|---|---|---|---|",
    ]
    latest = {record["library"]: record for record in records}
    for record in latest.values():
        (depth, plain_s, cold_s, _), *_ = record["scanned"]
        for variant in ("plain", "one site", "all sites", "hand trick"):
            rows = record["cnn"]
            row, auto = rows[f"{variant} / row-major"], rows[f"{variant} / auto"]
            compile_cell = (
                f"{cold_s / plain_s:.2f}× ({plain_s:.2f} s plain)"
                if variant == "plain"
                else ""
            )
            lines.append(
                f"| {record['library']} | {variant} | {row['temp'] / mib:.2f} "
                f"| {row['output'] / mib:.2f} ({row['output_logical'] / mib:.2f}) "
                f"| {auto['output'] / mib:.2f} | {compile_cell} |"
            )
    phases = [r for r in latest.values() if "scanned_phases" in r]
    if phases:
        lines += [
            "",
            "The scanned stack's compile phase by phase (seconds; `tpu_memory.py`'s "
            "`scanned_phases`: cold is the first probed compile, discovery "
            "included; XLA's while loops and HLO instructions of the compiled "
            "program):",
            "",
            "| library | step | trace | lower | compile | discovery "
            "| while loops | HLO instructions |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for record in phases:
            for step in ("plain", "cold", "warm"):
                row = record["scanned_phases"][step]
                discovery = row.get("discovery")
                lines.append(
                    f"| {record['library']} | {step} | {row['trace']:.2f} "
                    f"| {row['lower']:.2f} | {row['compile']:.2f} "
                    f"| {'–' if discovery is None else f'{discovery:.2f}'} "
                    f"| {row['while_loops']} | {row['hlo_instructions']} |"
                )
    return lines


def lowering_table(folder: pathlib.Path) -> list[str]:
    """`benchmarks/lowering.py`'s rows, the latest per model and backend."""
    latest: dict = {}
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            latest[(row["backend"], row["model"])] = row
    if not latest:
        return []
    lines = [
        "| backend | model | date | plain (s) | one site | every site "
        "| cold plain (s) | cold one site | cold every site |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (backend, model), row in sorted(latest.items()):
        seconds, ratio = row["lower_s"], row["ratio"]
        cold = (
            f"{seconds['plain_cold']:.2f} | {ratio['one_cold']:.2f}× | "
            f"{ratio['all_cold']:.2f}×"
            if "plain_cold" in seconds
            else "– | – | –"
        )
        lines.append(
            f"| {backend} | {model} | {row['date'][:10]} | {seconds['plain']:.2f} | "
            f"{ratio['one']:.2f}× | {ratio['all']:.2f}× | {cold} |"
        )
    return lines


def failures(records: list[dict]) -> list[str]:
    lines = []
    for record in records:
        if "error" in record["rows"]:
            error = record["rows"]["error"].split("\n")[0][:240]
            lines.append(
                f"- {record['model']} at {record['batch']} × {record['tokens']} "
                f"({record['dtype']}, {record['date']}): `{error}`"
            )
    return lines


def report(records: list[dict], runs: pathlib.Path) -> str:
    table = latest_timings(records)
    first = records[0]
    dates = sorted({r["date"][:10] for r in records})
    out = [
        "# bridge on a TPU",
        "",
        f"{first['device']} · jax {first['jax']}, jaxlib {first['jaxlib']}, "
        f"libtpu {first['libtpu']} · runs of {', '.join(dates)} · GPT-2 small's "
        f"width and depth ({first['width']} × {first['depth']}).",
        "",
        "Generated by `python benchmarks/tpu_report.py` from the rows that "
        "`python benchmarks/tpu.py` wrote on the chip (`benchmarks/tpu_runs/`). "
        "Models: the pre-norm transformer of `benchmarks/models.py` in each "
        "library, Hugging Face's Flax GPT-2 (`hf`), and KerasHub's GPT-2 "
        "backbone on Keras 3 (`keras`: plain is `jax.value_and_grad` through "
        "`backbone.stateless_call`; no hand trick). Each cell is "
        "**step / device**, a ratio to plain `jax.value_and_grad` of the same "
        "loss measured in the same run, interleaved: *step* is the time per "
        "call of 10 calls dispatched back to back (what a training loop sees; "
        "median of 7–9 repeats), *device* the time the chip spends in XLA ops "
        "per call (profiler). *one site*: `at=` one MLP output; *norms*: every "
        "site, reduced to two norms inside the step; *all sites*: every "
        "activation and activation gradient returned; *hand*: the library's "
        "hand-written epsilon trick, returning the activations it perturbs and "
        "their gradients (it perturbs the sites its library reaches: fewer than "
        "bridge's in Equinox, Haiku and NNX). *floor*: plain's device time plus "
        "writing the bytes the step returns beyond plain at "
        f"{HBM_BYTES_PER_S / 1e9:.0f} GB/s, over plain. *memory*: XLA "
        "temporaries + outputs over plain; in "
        "parentheses, plain's plus the bytes returned beyond plain. †: a hand "
        "row measured before the hand tricks returned their activations (it "
        "returns only the activation gradients).",
    ]
    sizes = sorted({(k[1], k[2]) for k in table}, key=lambda s: (s[1] != "float32", s))
    for size, dtype in sizes:
        batch, tokens = size.split("x")
        out += ["", f"## {dtype}, {batch} × {tokens} tokens", ""]
        out += timing_table(table, size, dtype)
    out += [
        "",
        "## Compile time",
        "",
        "Lower + compile of each jitted step, compiled one after another in one "
        "process (discovery, which `probe.sites` runs once per model, apart), "
        "as ratios to plain's.",
        "",
    ]
    out += compile_table(records)
    layouts = layout_table(table)
    if len(layouts) > 2:
        out += [
            "",
            "## Returned arrays in XLA's own layouts",
            "",
            "`tpu.py --auto-layouts`: `hand` and `all` jitted again with "
            "`out_shardings=Format(Layout.AUTO)`, so that XLA leaves each "
            "returned array in the tiled layout it computed it in instead of "
            "copying it to row-major. What is left over plain is the writing "
            "of the returned bytes.",
            "",
        ] + layouts
    memory = memory_table(runs)
    if memory:
        out += [
            "",
            "## A small CNN's memory, and a scanned stack's compile",
            "",
            "`python benchmarks/tpu_memory.py` (compile only): `models.py`'s "
            "CNN (8 × 32 × 32 images, 16 channels) and scanned stack of 12 "
            "layers, float32. A TPU stores an array in tiles of its last two "
            "dimensions, so a 16-channel activation takes 4× its logical "
            "bytes: the CNN's steps need no temporaries at all, and their "
            "memory is their outputs, the hand trick's as bridge's.",
            "",
        ] + memory
    # `control_flow.py` prints its table; the summary written from it is kept
    # beside the rows and placed here as it is.
    control_flow = runs / "control_flow_section.md"
    if control_flow.exists():
        out += ["", control_flow.read_text().rstrip()]
    lowering = lowering_table(runs / "lowering")
    if lowering:
        out += [
            "",
            "## Lowering alone",
            "",
            "`python benchmarks/lowering.py` on the chip's host (13 quiet "
            "cores): `jax.jit(step).lower(...)`, Python tracing before XLA's "
            "compile, of fresh functions, three rounds interleaved, the fastest "
            "of each; plain in seconds, the probed steps as ratios to it. "
            "The first three columns lower a step again (discovery cached, "
            "JAX's caches warm: what a training loop, a new `jax.jit` of "
            "the same step or a restarted notebook cell costs); *cold*: "
            "JAX's caches and bridge's discovery cache cleared before each "
            "lowering (what the first lowering of a new shape costs), over "
            "plain's cold lowering. The rows shown "
            "are the run of 2026-12-08, where the run binds each layer of a "
            "stack as one shared function (`docs/architecture.md`).",
            "",
        ] + lowering
        notes = runs / "lowering" / "notes.md"
        if notes.exists():
            out += ["", notes.read_text().rstrip()]
    failed = failures(records)
    if failed:
        out += ["", "## Did not run", ""] + failed
    return "\n".join(out) + "\n"


def plot(records: list[dict], path: str) -> None:
    """Device time over plain per model, float32, one panel per size: one site,
    norms and all sites, with the all-sites floor drawn over its bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = latest_timings(records)
    sizes = ["2x128", "4x512"]
    variants = [("one", "one site"), ("norms", "norms"), ("all", "all sites")]
    figure, axes = plt.subplots(1, len(sizes), figsize=(10, 3.6), sharey=True)
    for axis, size in zip(axes, sizes, strict=True):
        models = sorted(m for m, s, d in table if (s, d) == (size, "float32"))
        for offset, (variant, label) in enumerate(variants):
            xs, heights = [], []
            for i, model in enumerate(models):
                value = ratio(table[(model, size, "float32")], variant, "device_s")
                if value is not None:
                    xs.append(i + (offset - 1) * 0.27)
                    heights.append(value)
            axis.bar(xs, heights, width=0.25, label=label)
        for i, model in enumerate(models):
            least = floor(table[(model, size, "float32")], "all")
            if least is not None:
                axis.hlines(least, i + 0.15, i + 0.39, colors="black")
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_xticks(range(len(models)), models)
        batch, tokens = size.split("x")
        axis.set_title(f"GPT-2 small's shape, {batch} × {tokens} tokens, float32")
    axes[0].set_ylabel("device time / plain")
    axes[0].legend(loc="upper left", fontsize=8)
    figure.text(
        0.5,
        0.01,
        "black line: plain + writing the returned bytes at HBM bandwidth "
        "(TPU v5e, jax 0.10.2)",
        ha="center",
        fontsize=8,
    )
    figure.tight_layout(rect=(0, 0.04, 1, 1))
    figure.savefig(path, dpi=110)


CPU_START = "<!-- tpu_report.py --cpu: tables start (rewritten) -->"
CPU_END = "<!-- tpu_report.py --cpu: tables end -->"


def cpu_tables(folder: pathlib.Path) -> list[str]:
    """`tpu.py`'s and `lowering.py`'s rows measured on a CPU (`--cpu`): every
    run, one line each, as ratios to plain's of the same run."""
    records = []
    for path in sorted(folder.glob("**/rows.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines()]
    lowering = []
    for path in sorted(folder.glob("**/lowering.jsonl")):
        lowering += [json.loads(line) for line in path.read_text().splitlines()]
    lines = [
        "| date | load | model | size | layers × width | sites | plain step ms "
        "| one site | norms | all sites | clock | compile: plain s | one site "
        "| all sites | norms | lowering: plain s | one site | all sites | norms "
        "| XLA memory, all sites | FLOPs, all sites |",
        "|" + "---|" * 21,
    ]
    for record in sorted(records, key=lambda r: r["date"]):
        rows = record["rows"]
        plain = rows["plain"]

        def over(variant, key, rows=rows, plain=plain):
            if variant not in rows or key not in rows[variant]:
                return "–"
            return f"{rows[variant][key] / plain[key]:.3f}"

        load = record.get("load_average")
        lines.append(
            f"| {record['date']} | {'–' if load is None else f'{load:.1f}'} "
            f"| {record['model']} | {record['batch']} × {record['tokens']} "
            f"| {record['depth']} × {record['width']} | {record['sites']} "
            f"| {plain['step_s'] * 1e3:.1f} | {over('one', 'step_s')} "
            f"| {over('norms', 'step_s')} | {over('all', 'step_s')} "
            f"| {plain.get('compile_clock', 'wall')} "
            f"| {plain['compile_s']:.2f} | {over('one', 'compile_s')} "
            f"| {over('all', 'compile_s')} | {over('norms', 'compile_s')} "
            f"| {plain['lower_s']:.2f} | {over('one', 'lower_s')} "
            f"| {over('all', 'lower_s')} | {over('norms', 'lower_s')} "
            f"| {over('all', 'memory')} | {over('all', 'flops')} |"
        )
    if lowering:
        lines += [
            "",
            "`python benchmarks/lowering.py` (the fastest of three interleaved "
            "lowerings of fresh functions, discovery warm; *cold*: JAX's caches "
            "and the discovery cache cleared before each, what the first "
            "lowering of a new program costs, over plain's cold lowering; – "
            "where the row predates it):",
            "",
            "| date | load | model | size | layers × width | clock | plain s "
            "| one site | every site | one site, cold | every site, cold |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]

        def ratio(row: dict, variant: str) -> str:
            value = row["ratio"].get(variant)
            return "–" if value is None else f"{value:.2f}×"

        for row in lowering:
            load = row.get("load_average")
            lines.append(
                f"| {row.get('date', '–')} | {'–' if load is None else f'{load:.1f}'} "
                f"| {row['model']} | {row['size'].replace('x', ' × ')} "
                f"| {row.get('depth', '–')} × {row.get('width', '–')} "
                f"| {row.get('clock', 'wall')} "
                f"| {row['lower_s']['plain']:.2f} | {ratio(row, 'one')} "
                f"| {ratio(row, 'all')} | {ratio(row, 'one_cold')} "
                f"| {ratio(row, 'all_cold')} |"
            )
    return lines


def write_cpu(folder: pathlib.Path, results: pathlib.Path) -> None:
    """Put `cpu_tables` between RESULTS.md's markers (kept when `run.py`
    rewrites its own tables above its analysis marker)."""
    records = []
    for path in sorted(folder.glob("**/rows.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines()]
    # The latest row names the host (earlier rows may not).
    first = max(records, key=lambda r: r["date"])
    versions = ", ".join(
        f"{name} {first[key]}"
        for name, key in (
            ("jax", "jax"),
            ("keras", "keras"),
            ("keras-hub", "keras_hub"),
        )
        if first.get(key)
    )
    digest = first.get("keras_adapter_sha256")
    body = [
        CPU_START,
        "",
        f"{first.get('host', 'host not recorded')}, shared with other work "
        f"(load average in each row) · {versions}"
        + (f" · `adapters/keras/` sha256 {digest}" if digest else "")
        + f" · rows in `{folder.relative_to(HERE.parent)}/`",
        "",
        "Generated by `python benchmarks/tpu_report.py --cpu "
        f"{folder.relative_to(HERE.parent)}` from the rows that "
        "`python benchmarks/tpu.py` and `benchmarks/lowering.py` wrote on this "
        "CPU. Step: the median of interleaved runs (10 calls dispatched back to "
        "back, per call), as ratios to plain's in the same run. Compile: lower "
        "+ compile, the fastest of `--compile-rounds` interleaved compilations "
        "of fresh functions, discovery warm, timed by the wall clock or by the "
        "process's CPU time (*clock*: `--compile-clock process`, less disturbed "
        "by other work on the host); lowering: that compilation's lowering "
        "alone. Memory: XLA temporaries + outputs; FLOPs: XLA's cost analysis.",
        "",
        *cpu_tables(folder),
        "",
        CPU_END,
    ]
    text = results.read_text()
    if CPU_START in text:
        start = text.index(CPU_START)
        end = text.index(CPU_END) + len(CPU_END)
        text = text[:start] + "\n".join(body) + text[end:]
    else:
        heading = "\n\n## Keras 3 on the CPU\n\n"
        text = text.rstrip("\n") + heading + "\n".join(body) + "\n"
    results.write_text(text)


def _row_key(line: str) -> tuple[str, ...]:
    return tuple(cell.strip() for cell in line.strip().strip("|").split("|")[:2])


def merge(old: str, new: str, models: set[str]) -> str:
    """`old` with the table rows of `models` (a row whose first or second
    cell names one) taken from `new`, table by table (a table is known by
    the section it is in and its header); every other line of `old` stays
    as it is, and the paragraph that says how the file is generated is
    `new`'s."""

    def tables(text: str) -> dict:
        found: dict = {}
        section, header = "", None
        for line in text.splitlines():
            if line.startswith("#"):
                section, header = line, None
            elif line.startswith("|") and header is None:
                header = line
            elif line.startswith("|") and not line.startswith("|---"):
                if models & set(_row_key(line)):
                    found.setdefault((section, header), []).append(line)
            elif not line.startswith("|"):
                header = None
        return found

    wanted = tables(new)
    out: list[str] = []
    section, header, pending = "", None, []

    def flush_pending(before: tuple | None) -> None:
        while pending and (before is None or _row_key(pending[0]) < before):
            out.append(pending.pop(0))

    for line in old.splitlines():
        if line.startswith("Generated by `python benchmarks/tpu_report.py`"):
            line = next(n for n in new.splitlines() if n.startswith(line[:40]))
        if line.startswith("|") and header is not None and not line.startswith("|---"):
            if models & set(_row_key(line)):
                continue
            flush_pending(_row_key(line))
        elif not line.startswith("|"):
            flush_pending(None)
            header = None
            if line.startswith("#"):
                section = line
        elif header is None:
            header = line
            pending = list(wanted.pop((section, header), []))
        out.append(line)
    flush_pending(None)
    for (section, _), rows in wanted.items():
        print(f"not in the old file, left out: {section}: {len(rows)} rows")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", default=str(HERE / "tpu_runs"))
    parser.add_argument("--out", default=str(HERE / "RESULTS_tpu.md"))
    parser.add_argument("--plot", help="also draw the float32 device ratios here")
    parser.add_argument(
        "--only",
        help="comma-separated models: put only their rows into the existing "
        "--out, every other line of it as it stands (a run of new models, "
        "without rewriting the others' rows from every run kept)",
    )
    parser.add_argument(
        "--cpu",
        help="instead: put the tables of tpu.py's and lowering.py's rows measured "
        "on a CPU under this folder into RESULTS.md, between its markers",
    )
    options = parser.parse_args()
    if options.cpu:
        write_cpu(pathlib.Path(options.cpu).resolve(), HERE / "RESULTS.md")
        print(f"wrote {HERE / 'RESULTS.md'}'s CPU tables from {options.cpu}")
        return
    records = load(pathlib.Path(options.runs))
    text = report(records, pathlib.Path(options.runs))
    out = pathlib.Path(options.out)
    if options.only:
        text = merge(out.read_text(), text, set(options.only.split(",")))
    out.write_text(text)
    if options.plot:
        plot(records, options.plot)
    print(f"wrote {options.out} from {len(records)} rows")


if __name__ == "__main__":
    main()
