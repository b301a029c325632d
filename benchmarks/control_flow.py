"""What a probe inside control flow costs: sites in `lax.cond` branches, in
a `lax.fori_loop` of static bounds and in a `lax.scan` whose body closes over
a layer, against plain `jax.value_and_grad`.

    python benchmarks/control_flow.py            # width 512, batch 64
    python benchmarks/control_flow.py --quick    # width 64, batch 8

Two Equinox models, one example each, probed with `vmap=True` (so a branch
is taken per example, as a mixture-of-experts router does):

- `cond`: an encoder, then one of two experts (an MLP each) chosen per
  example by `lax.cond`, then a head; the sites are both experts' layers.
- `loop`: an encoder, then `STEPS` iterations of a recurrent refinement
  (`h = tanh(cell(h) + h)`) in `lax.fori_loop`, then a head; the site is
  the cell, one entry per iteration.
- `scan`: the same refinement written as a `lax.scan` closing over the cell
  (bridge counts its iterations in the scan's carry while it probes).
- `GRU over time`: an `eqx.nn.GRUCell` applied by a `lax.scan` over a
  sequence of `STEPS` inputs (an RNN); the site is the cell, per step.

For each: XLA's FLOPs and bytes accessed (`cost_analysis`), its temporaries
(`memory_analysis`) and the runtime of the compiled step, as ratios against
plain `jax.value_and_grad` of the same loss (interleaved repeats, medians).
The floor is what the perturbation and the returned values must cost: one
add per site element, and the site's values and gradients written out.
"""

from __future__ import annotations

import argparse
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp

import bridge

STEPS = 8


class Expert(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, width, key):
        keys = jax.random.split(key)
        self.up = eqx.nn.Linear(width, 4 * width, key=keys[0])
        self.down = eqx.nn.Linear(4 * width, width, key=keys[1])

    def __call__(self, h):
        return self.down(jax.nn.gelu(self.up(h)))


class Routed(eqx.Module):
    encoder: eqx.nn.Linear
    left: Expert
    right: Expert
    head: eqx.nn.Linear

    def __init__(self, width, key):
        keys = jax.random.split(key, 4)
        self.encoder = eqx.nn.Linear(width, width, key=keys[0])
        self.left = Expert(width, keys[1])
        self.right = Expert(width, keys[2])
        self.head = eqx.nn.Linear(width, 8, key=keys[3])

    def __call__(self, x):
        h = self.encoder(x)
        h = jax.lax.cond(h[0] > 0, lambda h: self.left(h), lambda h: self.right(h), h)
        return self.head(h)


class Refined(eqx.Module):
    encoder: eqx.nn.Linear
    cell: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, width, key):
        keys = jax.random.split(key, 3)
        self.encoder = eqx.nn.Linear(width, width, key=keys[0])
        self.cell = eqx.nn.Linear(width, width, key=keys[1])
        self.head = eqx.nn.Linear(width, 8, key=keys[2])

    def __call__(self, x):
        h = self.encoder(x)
        h = jax.lax.fori_loop(0, STEPS, lambda i, h: jnp.tanh(self.cell(h) + h), h)
        return self.head(h)


class RefinedByScan(Refined):
    def __call__(self, x):
        h = self.encoder(x)
        step = lambda h, _: (jnp.tanh(self.cell(h) + h), None)  # noqa: E731
        h = jax.lax.scan(step, h, None, length=STEPS)[0]
        return self.head(h)


class GRUOverTime(eqx.Module):
    cell: eqx.nn.GRUCell
    head: eqx.nn.Linear

    def __init__(self, width, key):
        keys = jax.random.split(key)
        self.cell = eqx.nn.GRUCell(width, width, key=keys[0])
        self.head = eqx.nn.Linear(width, 8, key=keys[1])

    def __call__(self, x):
        xs = jnp.stack([jnp.roll(x, step) for step in range(STEPS)])  # a sequence

        def step(h, x_t):
            h = self.cell(x_t, h)
            return h, h

        return self.head(jax.lax.scan(step, jnp.zeros_like(x), xs)[0])


def loss_fn(outputs):
    return jnp.mean(outputs**2)


def _analysis(compiled) -> tuple[float, float, float]:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    memory = compiled.memory_analysis()
    temporaries = getattr(memory, "temp_size_in_bytes", float("nan"))
    return cost.get("flops", float("nan")), cost.get("bytes accessed", 0.0), temporaries


def _seconds(function, arguments) -> float:
    start = time.perf_counter()
    jax.block_until_ready(function(*arguments))
    return time.perf_counter() - start


def measure(name, model, at, x, repeats) -> dict:
    probe = bridge.probe(model, vmap=True)

    def plain(model, x):
        return eqx.filter_value_and_grad(lambda m: loss_fn(jax.vmap(m)(x)))(model)

    def probed(probe, x):
        return probe.value_and_grad(loss_fn, x, at=at)

    steps = {
        "plain": (jax.jit(plain), (model, x)),
        "probe": (jax.jit(probed), (probe, x)),
    }
    analysis = {}
    for key, (step, arguments) in steps.items():
        analysis[key] = _analysis(step.lower(*arguments).compile())
        jax.block_until_ready(step(*arguments))  # compiled outside the timing
    times = {key: [] for key in steps}
    for _ in range(repeats):  # interleaved
        for key, (step, arguments) in steps.items():
            times[key].append(_seconds(step, arguments))
    result = probe.value_and_grad(loss_fn, x, at=at)
    returned = sum(
        leaf.size * leaf.dtype.itemsize
        for leaf in jax.tree.leaves((result.activations, result.activation_grads))
    )
    elements = sum(leaf.size for leaf in jax.tree.leaves(result.activations))
    (plain_flops, plain_bytes, plain_temp) = analysis["plain"]
    (flops, bytes_accessed, temp) = analysis["probe"]
    return {
        "model": name,
        "sites": len(result.activations),
        "flops": flops / plain_flops,
        "flops floor": (plain_flops + elements) / plain_flops,
        "bytes": bytes_accessed / plain_bytes,
        # In MB, not as a ratio: on a TPU plain's step may need none.
        "temporaries MB (plain / probe)": f"{plain_temp / 1e6:.2f} / {temp / 1e6:.2f}",
        "returned MB": returned / 1e6,
        "time": statistics.median(times["probe"]) / statistics.median(times["plain"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=15)
    arguments = parser.parse_args()
    width, batch = (64, 8) if arguments.quick else (512, 64)
    x = jax.random.normal(jax.random.key(1), (batch, width))
    key = jax.random.key(0)
    rows = [
        measure(
            "cond (2 experts)",
            Routed(width, key),
            ["left/up", "left/down", "right/up", "right/down"],
            x,
            arguments.repeats,
        ),
        measure("fori_loop", Refined(width, key), ["cell"], x, arguments.repeats),
        measure("scan", RefinedByScan(width, key), ["cell"], x, arguments.repeats),
        measure(
            "GRU over time", GRUOverTime(width, key), ["cell"], x, arguments.repeats
        ),
    ]
    print(
        f"jax {jax.__version__}, {jax.devices()[0].device_kind}, width {width}, "
        f"batch {batch}, {STEPS} iterations"
    )
    columns = list(rows[0])
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print(
            "| "
            + " | ".join(
                f"{value:.3f}" if isinstance(value, float) else str(value)
                for value in row.values()
            )
            + " |"
        )


if __name__ == "__main__":
    main()
