"""The programs bridge traces, saved and compared: a change meant to leave
them alone (a refactor of the routing, a file split) shows no difference.

    python benchmarks/programs.py save DIR      # before the change
    python benchmarks/programs.py compare DIR   # after: lists what differs
    python benchmarks/programs.py compare DIR --library nnx   # one library
    python benchmarks/programs.py save DIR --compiled --no-replay
    python benchmarks/programs.py compare DIR --compiled
    python benchmarks/programs.py summary DIR OTHER   # two saved sets

`--compiled` compares what XLA compiles instead of the jaxpr: each
instruction of the optimised HLO with its operands' and result's shapes,
names and metadata left out, as a sorted list (the computations' own order
and names follow the jaxpr's), and the compiled step's FLOPs. A run that
evaluates discovery's trace binds the model as one nested call, so its
jaxprs differ from the model's run while XLA may compile the same program:
`--no-replay` saves the programs of runs that trace the model's Python
again, to compare the two.

For each library, each transform a layer can run in (the trace-pattern
fuzzer's wraps, JAX's and the library's own: `tests/fuzz_models.py`), with a
module call and a `bridge.tap`, and for the benchmark's models
(`benchmarks/models.py`, quick sizes): the jaxpr of `value_and_grad` under
`jax.jit` with every site, and of `apply`. Addresses (`0x...`) are blanked.
Where probing raises, the error's class and first line are saved instead,
and the warnings it gives beside, so a refusal that moves is a difference
too.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import sys
import warnings

import jax
import jax.numpy as jnp

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]

import fuzz_models  # noqa: E402
import models  # noqa: E402

LIBRARIES = ("linen", "nnx", "equinox", "haiku")


def _loss(outputs):
    return jnp.sum(jnp.square(outputs))


#: Set by `--compiled`: compare optimised HLO rather than jaxprs.
COMPILED = [False]


def _compiled(step, x) -> str:
    """The optimised HLO of `step` as a sorted list of its instructions, names
    and metadata blanked, and its FLOPs."""
    compiled = jax.jit(step).lower(x).compile()
    lines = []
    for line in compiled.as_text().splitlines():
        line = re.sub(r", metadata=\{[^}]*\}", "", line.strip())
        line = re.sub(r"%[\w.\-]+", "%", line)
        if " = " in line:
            lines.append(line)
    flops = (compiled.cost_analysis() or {}).get("flops", 0.0)
    if isinstance(flops, list):  # older jaxlib: one dict per device
        flops = flops[0].get("flops", 0.0)
    return f"flops {flops:.0f}\n" + "\n".join(sorted(lines))


def _programs(probe, x, loss) -> str:
    texts = []
    for name, step in (
        ("value_and_grad", lambda x: probe.value_and_grad(loss, x)),
        ("apply", lambda x: probe.apply(x)),
    ):
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            try:
                program = (
                    _compiled(step, x)
                    if COMPILED[0]
                    else jax.make_jaxpr(jax.jit(step))(x)
                )
                texts.append(f"== {name}\n{program}")
            except Exception as error:  # the refusal is the program
                first = str(error).splitlines()[0] if str(error) else ""
                texts.append(f"== {name}\n{type(error).__name__}: {first}")
        texts.extend(f"warns: {w.message}" for w in warned)
    return re.sub(r"0x[0-9a-f]+", "0x", "\n".join(texts))


def _fuzzed(libraries):
    for library in libraries:
        for wrap in fuzz_models.wraps_of(library):
            for native in (False, True):
                for module, tap in ((True, False), (False, True), (True, True)):
                    layer = fuzz_models.Layer(
                        module=module, tap=tap, wrap=wrap, native=native
                    )
                    spec = fuzz_models.Spec(layers=(layer, fuzz_models.Layer()))
                    name = f"{library}-{wrap}-{'native' if native else 'jax'}"
                    name += f"-{'module' if module else ''}{'tap' if tap else ''}"
                    yield name, lambda s=spec, lib=library: fuzz_models.build(lib, s)


def _benchmarked(libraries):
    for library in libraries:
        for model in ("mlp", "cnn", "transformer"):
            builder = getattr(models, f"{library}_{model}")
            yield f"{library}-{model}", lambda b=builder: b(models.QUICK)
        builder = getattr(models, f"{library}_scanned")
        yield f"{library}-scanned", lambda b=builder: _scanned(b)


def _scanned(builder):
    probe, _, _, x = builder(3, models.QUICK)
    return models.Workload("", "", probe, x, models.mse, *[None] * 6)


def programs(libraries=LIBRARIES) -> dict[str, str]:
    found = {}
    for name, build in _fuzzed(libraries):
        try:
            built = build()
        except Exception as error:
            found[name] = f"build: {type(error).__name__}"
            continue
        found[name] = _programs(built.probe, built.x, _loss)
    for name, build in _benchmarked(libraries):
        workload = build()
        found[name] = _programs(workload.probe, workload.x, workload.loss)
    return found


def _sections(text: str) -> dict[str, str]:
    return {
        name: body
        for name, _, body in (chunk.partition("\n") for chunk in text.split("== ")[1:])
    }


def _opcodes(lines: collections.Counter) -> dict[str, int]:
    found = collections.Counter(
        match.group(1) if (match := re.search(r" ([a-z\-]+)\(", line)) else line
        for line in lines.elements()
    )
    return dict(found.most_common(4))


def summary(first: pathlib.Path, second: pathlib.Path) -> None:
    """What differs between two sets saved with `--compiled`."""
    names = sorted(path.stem for path in first.glob("*.txt"))
    differ = []
    for name in names:
        one = (first / f"{name}.txt").read_text()
        other = second / f"{name}.txt"
        if other.exists() and other.read_text() == one:
            continue
        theirs = _sections(other.read_text()) if other.exists() else {}
        for step, body in _sections(one).items():
            if theirs.get(step) == body:
                continue
            flops, a, b = [], collections.Counter(), collections.Counter()
            for text, counter in ((body, a), (theirs.get(step, ""), b)):
                head, _, rest = text.partition("\n")
                flops.append(head)  # `flops N`, or the refusal
                counter.update(rest.splitlines())
            differ.append(
                f"{name} {step}: {flops[0]} -> {flops[1]}; "
                f"-{_opcodes(a - b)} +{_opcodes(b - a)}"
            )
    print(
        f"{len(names) - len({d.split()[0] for d in differ})} of {len(names)} "
        "programs identical"
    )
    print("\n".join(differ))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["save", "compare", "summary"])
    parser.add_argument("directory", type=pathlib.Path)
    parser.add_argument("other", type=pathlib.Path, nargs="?")
    parser.add_argument("--library", choices=LIBRARIES, action="append")
    parser.add_argument("--compiled", action="store_true", help="optimised HLO")
    parser.add_argument(
        "--no-replay",
        action="store_true",
        help="runs trace the model's Python again (not discovery's trace)",
    )
    arguments = parser.parse_args()
    if arguments.action == "summary":
        return summary(arguments.directory, arguments.other)
    COMPILED[0] = arguments.compiled
    if arguments.no_replay:
        from bridge._probe import jax_backend

        jax_backend._replays = lambda plan, with_inputs: False
    found = programs(arguments.library or LIBRARIES)
    if arguments.action == "save":
        arguments.directory.mkdir(parents=True, exist_ok=True)
        for name, text in found.items():
            (arguments.directory / f"{name}.txt").write_text(text)
        print(f"saved {len(found)} programs in {arguments.directory}")
        return
    differ = [
        name
        for name, text in found.items()
        if not (arguments.directory / f"{name}.txt").exists()
        or (arguments.directory / f"{name}.txt").read_text() != text
    ]
    print(f"{len(found) - len(differ)} of {len(found)} programs unchanged")
    for name in differ:
        print(f"  differs: {name}")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
