"""What one call costs where it crosses a boundary of CPython's data stack.

CPython 3.11 keeps its frames in 16 KB chunks it maps and unmaps as a stack
grows and shrinks: a call whose frame starts a chunk maps one, its return
unmaps it. A loop of calls at that depth pays a `mmap`/`munmap` pair and a
page fault per call, which a plain Linux host does in a few microseconds and
a sandboxed one (the TPU machine runs its commands under gVisor) in a
hundred or more. How often a trace crosses a boundary depends only on how
deep its hot calls sit, so two traces of one model can differ tenfold.

    python benchmarks/stack_chunks.py

prints the median cost of an empty call and the cost at the worst depth.
"""

from __future__ import annotations

import sys
import time

DEPTHS = 400
CALLS = 2000


def empty() -> None:
    pass


def cost_at(depth: int) -> float:
    """Seconds per call of `empty` made `depth` frames below this one."""
    if depth:
        return cost_at(depth - 1)
    start = time.perf_counter()
    for _ in range(CALLS):
        empty()
    return (time.perf_counter() - start) / CALLS


def main() -> None:
    costs = [min(cost_at(depth) for _ in range(3)) for depth in range(DEPTHS)]
    median = sorted(costs)[DEPTHS // 2]
    worst = max(costs)
    print(
        f"python {sys.version.split()[0]}: an empty call {median * 1e6:.3f} µs, "
        f"{worst * 1e6:.3f} µs at depth {costs.index(worst)} (a chunk's boundary)"
    )


if __name__ == "__main__":
    main()
