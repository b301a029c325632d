"""bridge's PyTorch benchmark: what probing a `torch.nn.Module` costs.

    python benchmarks/torch_bench.py            # prints the tables (~7 min)
    python benchmarks/torch_bench.py --write    # and puts them in RESULTS.md
    python benchmarks/torch_bench.py --quick    # a smoke run: tiny MLP, 3 repeats

`--write` replaces the tables between the markers of RESULTS.md's PyTorch
section (appending the section if it is missing); the analysis written below
the end marker stays. `--threads N` (default 1) sets `torch.set_num_threads`.

Three models, written the way PyTorch users write them: an MLP (8 x Linear
1024 with ReLU, batch 64), a small ResNet-style CNN (Conv2d + BatchNorm2d +
ReLU blocks with residual additions, train mode, batch 32 of 32x32 images)
and a 4-layer `nn.TransformerEncoder` (d_model 256, 4 heads, batch 16 of 64
tokens, train mode, dropout 0), each with a final `nn.Linear` head. One
training step, six ways, interleaved (each variant in turn, the order rotated
every repetition, so drift in the machine's load hits every variant alike):

- plain: `model.zero_grad(set_to_none=True)`, forward, `loss.backward()`;
- all sites: `probe.value_and_grad(loss, x)`;
- one site: `probe.value_and_grad(loss, x, at=<the head Linear>)`;
- all sites, new probe: `bridge.probe(model).value_and_grad(loss, x)`, so
  discovery runs every step (a probe reuses it for inputs of one signature);
- hand (retain_grad): what a PyTorch user writes: a `register_forward_hook`
  on every submodule keeping its output and calling `retain_grad()`, then
  `loss.backward()`, the hooks removed after;
- hand (backward hook): the other common way, `register_forward_hook` for the
  outputs and `register_full_backward_hook` capturing `grad_output`.

Before timing, the results are checked once: the probe's parameter gradients
equal plain `loss.backward()`'s, and both hand-written ways' activation
gradients equal the probe's.

Also measured: `probe.sites(x)` alone (discovery on fake tensors), the peak
resident memory of one step in a fresh subprocess (Linux `VmHWM`), and a
breakdown of the probed step's overhead by ablation (see `breakdown_steps`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import bridge

HERE = pathlib.Path(__file__).parent


# -- the models ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sizes:
    batch_mlp: int = 64
    width_mlp: int = 1024
    depth_mlp: int = 8
    batch_cnn: int = 32
    image: int = 32
    channels: int = 16
    blocks_cnn: int = 2
    batch_tf: int = 16
    tokens: int = 64
    width_tf: int = 256
    heads: int = 4
    depth_tf: int = 4


FULL = Sizes()
QUICK = Sizes(4, 32, 2, 2, 8, 4, 1, 2, 8, 16, 2, 1)


@dataclasses.dataclass
class Workload:
    name: str
    model: nn.Module
    x: torch.Tensor
    one_site: str  # the last Linear: the head


def loss_fn(y: torch.Tensor) -> torch.Tensor:
    return y.square().mean()


def mlp(s: Sizes) -> Workload:
    layers: list[nn.Module] = []
    for _ in range(s.depth_mlp):
        layers += [nn.Linear(s.width_mlp, s.width_mlp), nn.ReLU()]
    layers.append(nn.Linear(s.width_mlp, 10))
    model = nn.Sequential(*layers)
    x = torch.randn(s.batch_mlp, s.width_mlp)
    return Workload("mlp", model, x, str(len(layers) - 1))


class Block(nn.Module):
    """A ResNet basic block: conv-BN-ReLU, conv-BN, plus the input, ReLU."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu2 = nn.ReLU()

    def forward(self, x):
        h = self.relu1(self.bn1(self.conv1(x)))
        return self.relu2(x + self.bn2(self.conv2(h)))


class CNN(nn.Module):
    def __init__(self, s: Sizes):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, s.channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(s.channels),
            nn.ReLU(),
        )
        self.blocks = nn.Sequential(*[Block(s.channels) for _ in range(s.blocks_cnn)])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(s.channels, 10)

    def forward(self, x):
        return self.head(self.pool(self.blocks(self.stem(x))).flatten(1))


def cnn(s: Sizes) -> Workload:
    model = CNN(s).train()
    x = torch.randn(s.batch_cnn, 3, s.image, s.image)
    return Workload("cnn", model, x, "head")


class Transformer(nn.Module):
    def __init__(self, s: Sizes):
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            s.width_tf,
            s.heads,
            dim_feedforward=4 * s.width_tf,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(
            layer, s.depth_tf, enable_nested_tensor=False
        )
        self.head = nn.Linear(s.width_tf, 10)

    def forward(self, x):
        return self.head(self.encoder(x).mean(dim=1))


def transformer(s: Sizes) -> Workload:
    model = Transformer(s).train()
    x = torch.randn(s.batch_tf, s.tokens, s.width_tf)
    return Workload("transformer", model, x, "head")


BUILDERS = {"mlp": mlp, "cnn": cnn, "transformer": transformer}


# -- the steps -------------------------------------------------------------------------


def plain_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(x))
    loss.backward()
    return loss.detach()


def _tensors(value: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a module's output (a tensor or a tuple)."""
    values = value if isinstance(value, tuple | list) else (value,)
    return [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]


def _named(path: str, counts: dict[str, int]) -> str:
    """`path`, then `path#k` for call k > 0: bridge's site names."""
    index = counts.get(path, 0)
    counts[path] = index + 1
    return path if index == 0 else f"{path}#{index}"


def hand_retain_grad(model: nn.Module, x: torch.Tensor):
    """Forward hooks keep every submodule's output and `retain_grad()` it."""
    model.zero_grad(set_to_none=True)
    outputs: dict[str, list[torch.Tensor]] = {}
    counts: dict[str, int] = {}

    def keep(path):
        def hook(module, args, output):
            kept = [t for t in _tensors(output) if t.requires_grad]
            for t in kept:
                t.retain_grad()
            outputs[_named(path, counts)] = kept

        return hook

    handles = [
        module.register_forward_hook(keep(path))
        for path, module in model.named_modules()
        if path
    ]
    try:
        loss = loss_fn(model(x))
        loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    activations = {name: [t.detach() for t in ts] for name, ts in outputs.items()}
    activation_grads = {name: [t.grad for t in ts] for name, ts in outputs.items()}
    return loss.detach(), activations, activation_grads


def hand_backward_hook(model: nn.Module, x: torch.Tensor):
    """Forward hooks keep the outputs; full backward hooks keep `grad_output`."""
    model.zero_grad(set_to_none=True)
    activations: dict[str, list[torch.Tensor]] = {}
    activation_grads: dict[str, list[torch.Tensor]] = {}
    forward_counts: dict[str, int] = {}
    backward_calls: dict[str, list[str]] = {}

    def keep_output(path):
        def hook(module, args, output):
            name = _named(path, forward_counts)
            activations[name] = [t.detach() for t in _tensors(output)]
            backward_calls.setdefault(path, []).append(name)

        return hook

    def keep_grad(path):
        def hook(module, grad_input, grad_output):
            # Backward runs the calls of one module last to first.
            name = backward_calls[path].pop()
            activation_grads[name] = [g for g in grad_output if g is not None]

        return hook

    handles = []
    for path, module in model.named_modules():
        if path:
            handles.append(module.register_forward_hook(keep_output(path)))
            handles.append(module.register_full_backward_hook(keep_grad(path)))
    try:
        loss = loss_fn(model(x))
        loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    return loss.detach(), activations, activation_grads


def variants(workload: Workload) -> dict[str, Callable[[], Any]]:
    model, x = workload.model, workload.x
    probe = bridge.probe(model)
    return {
        "plain": lambda: plain_step(model, x),
        "all sites": lambda: probe.value_and_grad(loss_fn, x),
        "one site": lambda: probe.value_and_grad(loss_fn, x, at=workload.one_site),
        # A new probe per step: discovery afresh every time (the adapter keeps
        # what a probe discovered for later calls with the same signature).
        "all sites, new probe": lambda: bridge.probe(model).value_and_grad(loss_fn, x),
        "hand retain_grad": lambda: hand_retain_grad(model, x),
        "hand backward hook": lambda: hand_backward_hook(model, x),
    }


# -- correctness -----------------------------------------------------------------------


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def check(workload: Workload) -> int:
    """The probe against plain backward and the hand-written hooks; the site count."""
    model, x = workload.model, workload.x
    probe = bridge.probe(model)
    loss = plain_step(model, x)
    plain_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    res = probe.value_and_grad(loss_fn, x)
    _close(res.loss, loss, f"{workload.name} loss")
    assert res.grads.keys() == plain_grads.keys(), (res.grads.keys(), plain_grads)
    for name, grad in plain_grads.items():
        _close(res.grads[name], grad, f"{workload.name} grad of {name}")
    one = probe.value_and_grad(loss_fn, x, at=workload.one_site)
    assert list(one.activation_grads) == [workload.one_site], list(one.activations)
    for name, grad in plain_grads.items():
        _close(one.grads[name], grad, f"{workload.name} grad of {name} (one site)")
    _close(
        one.activation_grads[workload.one_site],
        res.activation_grads[workload.one_site],
        f"{workload.name} one site",
    )
    for hand in (hand_retain_grad, hand_backward_hook):
        hand_loss, activations, activation_grads = hand(model, x)
        _close(hand_loss, loss, f"{workload.name} {hand.__name__} loss")
        assert activation_grads.keys() == res.activation_grads.keys(), (
            hand.__name__,
            set(activation_grads) ^ set(res.activation_grads),
        )
        for name, grads in activation_grads.items():
            ours = _tensors(res.activation_grads[name])
            assert len(ours) == len(grads), (hand.__name__, name)
            for theirs, mine in zip(grads, ours, strict=True):
                _close(theirs, mine, f"{workload.name} {hand.__name__} {name}")
            for theirs, mine in zip(
                activations[name], _tensors(res.activations[name]), strict=True
            ):
                _close(theirs, mine, f"{workload.name} {hand.__name__} value {name}")
        for n, p in model.named_parameters():
            _close(p.grad, plain_grads[n], f"{workload.name} {hand.__name__} {n}")
    return len(res.activation_grads)


# -- timing ----------------------------------------------------------------------------


def interleaved(steps: dict[str, Callable[[], Any]], repeats: int) -> dict:
    """Seconds per call of each step: every step in turn, the order rotated."""
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in names:  # warm up
        steps[name]()
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            gc.collect()
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    return times


def median(times: list[float]) -> float:
    return statistics.median(times)


# -- where the probed step's time goes -------------------------------------------------


def _adapter(probe: Any) -> Any:
    return sys.modules[type(probe).__module__]


def functional_step(model: nn.Module, x: torch.Tensor):
    """The probe's route without hooks: `functional_call` on detached aliases of
    the parameters and clones of the buffers, then one `torch.autograd.grad`."""
    params = {
        n: p.detach().requires_grad_(p.requires_grad)
        for n, p in model.named_parameters()
    }
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    loss = loss_fn(torch.func.functional_call(model, (params, buffers), (x,)))
    return loss.detach(), torch.autograd.grad(loss, list(params.values()))


def breakdown_steps(workload: Workload) -> dict[str, Callable[[], Any]]:
    """The probed step (all sites) built up one part at a time.

    Each step adds one part to the one before, by switching parts of the
    adapter off with `unittest.mock` (the adapter's code is not edited):
    discovery replaced by its result computed once, the gradient catching
    (`TorchSession.perturb`: epsilons, or hooked views) by the identity, the
    recorded copies by aliases, the per-call shell (a structural copy of the
    module, where the adapter makes one) by one made once.
    """
    from unittest import mock

    from bridge.adapters.torch import arrays, internals, session

    model, x = workload.model, workload.x
    probe = bridge.probe(model)
    found = probe._discover((x,), {}, loss_fn)
    shell = internals.shell(model)

    def probed(*off: str):
        with contextlib.ExitStack() as stack:
            if "discovery" in off:
                stack.enter_context(
                    mock.patch.object(probe, "_discover", lambda *a, **k: found)
                )
            if "epsilons" in off:
                stack.enter_context(
                    mock.patch.object(
                        session.TorchSession,
                        "perturb",
                        lambda self, *args, **kwargs: _same,
                    )
                )
            if "clones" in off:
                stack.enter_context(
                    mock.patch.object(arrays.TORCH_ARRAYS, "recorded", _same)
                )
            if "shell" in off:
                stack.enter_context(
                    mock.patch.object(internals, "shell", lambda *a, **k: shell)
                )
            return probe.value_and_grad(loss_fn, x)

    steps = {
        "plain": lambda: plain_step(model, x),
        "functional_call": lambda: functional_step(model, x),
        "+ hooks": lambda: probed("discovery", "epsilons", "clones", "shell"),
        "+ epsilons": lambda: probed("discovery", "clones", "shell"),
        "+ clones": lambda: probed("discovery", "shell"),
        "+ shell": lambda: probed("discovery"),
        "+ discovery": lambda: probed(),
        "discovery afresh": lambda: bridge.probe(model).sites(x),
    }
    return steps


def _same(value: Any) -> Any:
    return value


BREAKDOWN_PARTS = {
    "functional_call": "`functional_call` on parameter aliases + `autograd.grad` "
    "(vs `model(x)` + `backward()`)",
    "+ hooks": "forward hooks on every submodule, session naming (no epsilon, "
    "no copy, discovery cached)",
    "+ epsilons": "catching each site's gradient (`TorchSession.perturb`, by "
    "whatever means the adapter uses: zero epsilons, hooks, `_Catch`)",
    "+ clones": "recording: a `clone()` of every site's value",
    "+ shell": "the shell: the module's structure copied for each call "
    "(`internals.shell`)",
    "+ discovery": "discovery as a repeated call does it (the adapter's cache "
    "lookup, the loss checked on fake outputs)",
}


# -- peak memory, one step in a fresh process ------------------------------------------


def _resident_kib(field: str) -> int:
    status = pathlib.Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", status).group(1))


def peak_rss_child(model_name: str, variant: str, quick: bool, threads: int) -> None:
    """In a subprocess: the resident memory one step adds at its peak, in bytes."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    workload = BUILDERS[model_name](QUICK if quick else FULL)
    step = variants(workload)[variant]
    for _ in range(2):  # lazy initialisation, imports, fake-tensor caches
        step()
    # Every variant starts from no `.grad` (they all zero with set_to_none).
    workload.model.zero_grad(set_to_none=True)
    gc.collect()
    pathlib.Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM
    before = _resident_kib("VmRSS")
    result = step()
    peak = _resident_kib("VmHWM") - before
    del result
    print(peak * 1024)


def peak_rss(model_name: str, variant: str, quick: bool, threads: int) -> int | None:
    command = [
        sys.executable,
        __file__,
        "--peak-rss",
        model_name,
        variant,
        "--threads",
        str(threads),
    ]
    if quick:
        command.append("--quick")
    # Blocks of 64 KiB and more are mapped and unmapped by glibc on every
    # allocation (no dynamic threshold, no trimming delay): the warm-up steps
    # leave no freed heap behind to hide the measured step's peak.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    try:
        output = subprocess.run(
            command, capture_output=True, text=True, check=True, timeout=300, env=env
        )
        return int(output.stdout.split()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return None


def returned_bytes(workload: Workload) -> int:
    """Bytes of the activations and activation gradients the probe returns."""
    res = bridge.probe(workload.model).value_and_grad(loss_fn, workload.x)
    tensors = [
        t
        for tree in (res.activations, res.activation_grads)
        for value in tree.values()
        for t in _tensors(value)
    ]
    return sum(t.numel() * t.element_size() for t in tensors)


# -- the report ------------------------------------------------------------------------

START = "<!-- torch_bench.py: tables start (rewritten by --write) -->"
END = "<!-- torch_bench.py: tables end -->"
VARIANTS = [
    "plain",
    "all sites",
    "one site",
    "all sites, new probe",
    "hand retain_grad",
    "hand backward hook",
]


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    return f"{cpu}, {cores} cores, {platform.system()}"


def _adapter_hash() -> str:
    """Which version of the adapter was measured (it changes between runs)."""
    import hashlib

    package = pathlib.Path(_adapter(bridge.probe(nn.Linear(1, 1))).__file__).parent
    digest = hashlib.sha256()
    for source in sorted(package.glob("*.py")):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:12]


def _ratio(times: dict, a: str, b: str) -> str:
    """`median ratio (fastest ratio)` of step `a` over step `b`."""
    med = median(times[a]) / median(times[b])
    return f"{med:.2f} ({min(times[a]) / min(times[b]):.2f})"


def _mib(value: int | None) -> str:
    return "—" if value is None else f"{value / 2**20:.1f}"


def _ms(times: dict, name: str, base: str = "plain") -> str:
    """`ms (/ base)`: the median of step `name`, and over the median of `base`."""
    value = median(times[name])
    return f"{value * 1e3:.1f} ({value / median(times[base]):.2f})"


def report(results: dict, options, load: tuple, wall: float) -> list[str]:
    repeats = options.repeats
    lines = [
        START,
        "",
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC · {_machine()} · "
        f"Python {platform.python_version()} · torch {torch.__version__} · "
        f"`torch.set_num_threads({options.threads})` · load average "
        f"{load[0]:.1f} at start, {load[1]:.1f} at the end · {wall:.0f} s wall · "
        f"`adapters/torch/` sha256 {options.adapter_hash}",
        "",
        "Generated by `python benchmarks/torch_bench.py --write`. One training "
        f"step on CPU, median of {repeats} interleaved runs (each variant in "
        "turn, order rotated), as ratios to plain `loss.backward()` (in "
        "parentheses: fastest run over fastest run). `new probe`: "
        "`bridge.probe(model)` made anew each step, so discovery runs every "
        "step (a probe reuses what it discovered for inputs of the same "
        "signature). `hand retain_grad`: forward hooks on every submodule "
        "calling `retain_grad()` on its output; `hand backward hook`: forward "
        "hooks plus `register_full_backward_hook` capturing `grad_output`. "
        "`sites()`: ms (/ plain step), on a new probe (discovery on fake "
        "tensors) and on the same probe again. Checked before timing: the "
        "probe's parameter gradients equal plain `backward()`'s, and both "
        "hand-written ways' activations and activation gradients equal the "
        "probe's.",
        "",
        "| model | sites | plain ms | all sites | one site | all sites, new probe "
        "| hand retain_grad | hand backward hook | all / hand retain_grad "
        "| `sites()` new probe | `sites()` again |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        t = r["times"]
        lines.append(
            f"| {name} | {r['sites']} | {median(t['plain']) * 1e3:.1f} "
            + " ".join(f"| {_ratio(t, v, 'plain')}" for v in VARIANTS[1:])
            + f" | {_ratio(t, 'all sites', 'hand retain_grad')} "
            f"| {_ms(t, 'sites(), new probe')} | {_ms(t, 'sites()')} |"
        )
    lines += [
        "",
        "Where the probed step's time goes (all sites, the same probe every "
        "step): the step built up one part at a time, parts switched off with "
        "`unittest.mock` (discovery replaced by its result, the gradient "
        "catching by the identity, recorded copies by aliases, the shell by "
        "one made once); ms each part adds, the difference of consecutive "
        "medians (negative: below this machine's noise), and in parentheses "
        "over the plain step:",
        "",
        "| part | " + " | ".join(results) + " |",
        "|---|" + "---|" * len(results),
    ]
    first = next(iter(results.values()))["breakdown"]
    parts = [part for part in BREAKDOWN_PARTS if part in first]
    previous = ["plain", *parts[:-1]]
    for part, before in zip(parts, previous, strict=True):
        cells = []
        for r in results.values():
            b = r["breakdown"]
            added = median(b[part]) - median(b[before])
            cells.append(f"{added * 1e3:+.1f} ({added / median(b['plain']):+.2f})")
        lines.append(f"| {BREAKDOWN_PARTS[part]} | " + " | ".join(cells) + " |")
    for label, step in [
        ("= the probed step, ms (/ plain)", "+ discovery"),
        (
            "discovery afresh (`sites()` on a new probe), ms (/ plain)",
            "discovery afresh",
        ),
    ]:
        cells = [_ms(r["breakdown"], step) for r in results.values()]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if any(r.get("memory") for r in results.values()):
        lines += [
            "",
            "Peak resident memory one step adds, in a fresh process (MiB; Linux "
            "`VmHWM` reset after two warm-up steps, glibc told to unmap every "
            "freed block of 64 KiB or more). `returned`: the activations and "
            "activation gradients the all-sites probe returns.",
            "",
            "| model | "
            + " | ".join(VARIANTS)
            + " | returned | all − returned − plain |",
            "|---|" + "---|" * (len(VARIANTS) + 2),
        ]
        for name, r in results.items():
            memory = r.get("memory")
            if not memory:
                continue
            plain, every = memory["plain"], memory["all sites"]
            excess = (
                None
                if plain is None or every is None
                else every - r["returned"] - plain
            )
            lines.append(
                f"| {name} | "
                + " | ".join(_mib(memory[v]) for v in VARIANTS)
                + f" | {_mib(r['returned'])} | {_mib(excess)} |"
            )
    lines += ["", END]
    return lines


def write(lines: list[str], path: pathlib.Path) -> None:
    """Replace the tables between the markers, or append a PyTorch section."""
    text = path.read_text() if path.exists() else ""
    block = "\n".join(lines)
    if START in text and END in text:
        head, rest = text.split(START, 1)
        tail = rest.split(END, 1)[1]
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n## PyTorch\n\n" + block + "\n"
    path.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", nargs="+", choices=list(BUILDERS), default=None)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument(
        "--write", action="store_true", help="put the tables into --out"
    )
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "RESULTS.md")
    parser.add_argument("--peak-rss", nargs=2, metavar=("MODEL", "VARIANT"))
    options = parser.parse_args()
    warnings.filterwarnings("ignore", "Full backward hook is firing")
    if options.peak_rss:
        peak_rss_child(*options.peak_rss, options.quick, options.threads)
        return
    if options.quick:
        options.repeats = min(options.repeats, 3)
    torch.set_num_threads(options.threads)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    # The adapter as imported now is the one measured (the file may change
    # during the run).
    options.adapter_hash = _adapter_hash()
    sizes = QUICK if options.quick else FULL
    models = options.models or (["mlp"] if options.quick else list(BUILDERS))
    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    results = {}
    for name in models:
        torch.manual_seed(0)
        workload = BUILDERS[name](sizes)
        sites = check(workload)
        probe = bridge.probe(workload.model)
        steps = variants(workload)
        steps["sites(), new probe"] = lambda w=workload: bridge.probe(w.model).sites(
            w.x
        )
        steps["sites()"] = lambda probe=probe, x=workload.x: probe.sites(x)
        times = interleaved(steps, options.repeats)
        breakdown = interleaved(breakdown_steps(workload), options.repeats)
        results[name] = dict(
            sites=sites,
            times=times,
            breakdown=breakdown,
            returned=returned_bytes(workload),
        )
        print(
            f"{name}: {sites} sites, plain {median(times['plain']) * 1e3:.1f} ms, "
            + ", ".join(
                f"{v} {median(times[v]) / median(times['plain']):.2f}"
                for v in VARIANTS[1:]
            ),
            flush=True,
        )
        memory_variants = [] if options.no_memory or options.quick else VARIANTS
        if memory_variants:
            results[name]["memory"] = {
                v: peak_rss(name, v, options.quick, options.threads)
                for v in memory_variants
            } | {v: None for v in VARIANTS if v not in memory_variants}
    load = (load_start, os.getloadavg()[0])
    lines = report(results, options, load, time.perf_counter() - started)
    print("\n".join(lines))
    if options.write:
        write(lines, options.out)
        print(f"wrote {options.out}")


if __name__ == "__main__":
    main()
