"""Two probes of different libraries in two threads at once give the results
each gives alone: a probe's sites live in its own session (a `ContextVar`), never
in shared state.
"""

from __future__ import annotations

import threading

import jax
import pytest
from helpers import assert_tree_allclose
from reliability import Spec, build, loss_fn

for _library in ("flax.linen", "flax.nnx", "equinox", "haiku"):
    pytest.importorskip(_library)

ROUNDS = {"eager": 2, "jit": 3}


def _run(built, mode):
    def call(probe, x):
        return probe.value_and_grad(loss_fn, x)

    return (jax.jit(call) if mode == "jit" else call)(built.probe, built.x)


@pytest.mark.parametrize(
    ("mode", "libraries"),
    [("eager", ("nnx", "haiku")), ("jit", ("linen", "equinox"))],
    ids=["eager-nnx-haiku", "jit-linen-equinox"],
)
def test_two_probes_in_two_threads_equal_each_alone(mode, libraries):
    # Different architectures: a site of one leaking into the other would show
    # as a wrong name, shape or number.
    models = [
        build(libraries[0], Spec(layers=((4, "tanh"),), repeats=2)),
        build(libraries[1], Spec(in_dim=2, layers=((3, "sin"),), pair=True)),
    ]
    alone = [_run(built, mode) for built in models]
    results = [[] for _ in models]
    errors = []
    barrier = threading.Barrier(len(models))

    def work(index):
        try:
            barrier.wait()
            for _ in range(ROUNDS[mode]):
                results[index].append(_run(models[index], mode))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(models))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for built, expected, got in zip(models, alone, results, strict=True):
        assert len(got) == ROUNDS[mode]
        for res in got:
            assert sorted(res.activation_grads) == sorted(built.names)
            assert_tree_allclose(res, expected, rtol=1e-5, atol=1e-7)
