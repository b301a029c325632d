"""The programs bridge traces, saved and compared: a change meant to leave
them alone (a refactor of the routing, a file split) shows no difference.

    python benchmarks/programs.py save DIR      # before the change
    python benchmarks/programs.py compare DIR   # after: lists what differs
    python benchmarks/programs.py compare DIR --library nnx   # one library

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


def _programs(probe, x, loss) -> str:
    texts = []
    for name, step in (
        ("value_and_grad", lambda x: probe.value_and_grad(loss, x)),
        ("apply", lambda x: probe.apply(x)),
    ):
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            try:
                texts.append(f"== {name}\n{jax.make_jaxpr(jax.jit(step))(x)}")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["save", "compare"])
    parser.add_argument("directory", type=pathlib.Path)
    parser.add_argument("--library", choices=LIBRARIES, action="append")
    arguments = parser.parse_args()
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
