"""bridge against the PyTorch tools people pick instead, on one model.

    python benchmarks/peers_bench.py            # prints the table
    python benchmarks/peers_bench.py --quick    # 2 layers, 3 repeats

The model is TransformerLens's own `HookedTransformer` (4 layers, d_model
256, 8 heads, d_mlp 1024, vocabulary 1000, random init), batch 8 x 64
tokens, one thread; the loss is the mean next-token cross-entropy. One
training step's forward and backward, each way in turn, the order rotated
every repetition (drift hits every variant alike), medians of the process's
CPU time (on one thread, the work done: what other tenants of a shared
machine do moves wall time by up to 15 % between runs) as ratios to plain:

- plain: forward, `loss.backward()`;
- TransformerLens `run_with_cache(incl_bwd=True)` (its cache of every
  HookPoint's activation and gradient; it runs `backward` itself);
- TransformerLens hooks: `hooks(fwd_hooks=..., bwd_hooks=...)` storing every
  HookPoint's activation and gradient, then `loss.backward()`;
- nnsight: a `model.trace` saving every HookPoint's output and its `.grad`;
- by hand: every HookPoint's gradient from one `torch.autograd.grad` of
  views of their outputs, with nothing else (the floor of keeping every
  gradient);
- bridge, `at=HookPoint`: `probe.value_and_grad(loss, tokens, at=HookPoint)`;
- bridge, all sites: every module call's activation and gradient.

The peers are installed by the `bench` extra (`pip install -e ".[bench]"`).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import bridge


def build(layers: int):
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.hook_points import HookPoint

    config = HookedTransformerConfig(
        n_layers=layers,
        d_model=256,
        n_heads=8,
        d_head=32,
        d_mlp=1024,
        d_vocab=1000,
        n_ctx=64,
        act_fn="gelu",
        normalization_type="LN",
        seed=0,
        device="cpu",
    )
    return HookedTransformer(config).eval(), HookPoint


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    quick = parser.parse_args().quick
    torch.set_num_threads(1)
    model, hook_point = build(2 if quick else 4)
    tokens = torch.randint(0, 1000, (8, 64), generator=torch.Generator().manual_seed(0))

    def loss_of(logits):
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
        )

    probe = bridge.probe(model)
    # nnsight asks for values in the order the model computes them: the
    # HookPoints in call order (bridge's sites are).
    hook_points = {n for n, m in model.named_modules() if isinstance(m, hook_point)}
    names = [name for name in probe.sites(tokens) if name in hook_points]

    def plain():
        model.zero_grad(set_to_none=True)
        loss_of(model(tokens)).backward()

    def lens_cache():
        model.zero_grad(set_to_none=True)
        _, cache = model.run_with_cache(tokens, incl_bwd=True, return_type="loss")
        return cache

    def lens_hooks():
        model.zero_grad(set_to_none=True)
        stored = {}

        def forward(tensor, hook):
            stored[hook.name] = tensor.detach()

        def backward(tensor, hook):
            stored[hook.name + "_grad"] = tensor.detach()

        with model.hooks(
            fwd_hooks=[(n, forward) for n in names],
            bwd_hooks=[(n, backward) for n in names],
        ):
            loss_of(model(tokens)).backward()
        return stored

    import nnsight

    # nnsight patches the modules it wraps: a model of its own, so that the
    # other variants run the model as it was.
    nnsight_model = copy.deepcopy(model)
    wrapped = nnsight.NNsight(nnsight_model)

    def nnsight_trace():
        nnsight_model.zero_grad(set_to_none=True)
        with wrapped.trace(tokens):
            outputs = [wrapped.get(n).output for n in names]
            saved = nnsight.save(list(outputs))
            loss = loss_of(wrapped.output)
            with loss.backward():  # gradients arrive last layer first
                grads = nnsight.save([output.grad for output in reversed(outputs)])
        return saved, grads

    parameters = list(model.parameters())

    def by_hand():
        # The floor of what every tool here returns: every HookPoint's
        # activation and gradient, the gradient taken at a view of the
        # output (a node of autograd's own) in one `torch.autograd.grad`,
        # with no naming and no checks. What it costs over plain is keeping
        # the gradients.
        views = []

        def keep(module, args, output):
            if isinstance(output, torch.Tensor) and output.requires_grad:
                views.append(output.view_as(output))
                return views[-1]
            return None

        handles = [
            model.get_submodule(name).register_forward_hook(keep) for name in names
        ]
        try:
            loss = loss_of(model(tokens))
        finally:
            for handle in handles:
                handle.remove()
        return torch.autograd.grad(loss, parameters + views)

    def bridge_hook_points():
        model.zero_grad(set_to_none=True)
        return probe.value_and_grad(lambda out: loss_of(out), tokens, at=hook_point)

    def bridge_all():
        model.zero_grad(set_to_none=True)
        return probe.value_and_grad(lambda out: loss_of(out), tokens)

    variants = {
        "plain backward": plain,
        "TransformerLens run_with_cache(incl_bwd=True)": lens_cache,
        "TransformerLens hooks": lens_hooks,
        "nnsight trace, .save() and .grad": nnsight_trace,
        "by hand: views at every HookPoint": by_hand,
        "bridge at=HookPoint": bridge_hook_points,
        "bridge all sites": bridge_all,
    }
    # Checked once before timing: bridge's gradients are plain backward's.
    result = bridge_all()
    plain()
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(result.grads[name], parameter.grad)
    assert len(result.activation_grads) == len(probe.sites(tokens))

    repeats = 3 if quick else 21
    times = {name: [] for name in variants}
    for function in variants.values():  # warm up: discovery, allocator
        function()
    order = list(variants)
    for repeat in range(repeats):
        rotated = order[repeat % len(order) :] + order[: repeat % len(order)]
        for name in rotated:
            start = time.process_time()
            variants[name]()
            times[name].append(time.process_time() - start)
    base = statistics.median(times["plain backward"])
    sites = len(probe.sites(tokens))
    print(
        f"HookedTransformer {len(model.blocks)} x 256, batch 8 x 64, one thread; "
        f"{len(names)} HookPoints, {sites} bridge sites; {repeats} repeats"
    )
    print(f"{'variant':50s} {'median':>9s} {'ratio':>7s}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:50s} {median * 1e3:7.1f}ms {median / base:7.3f}")


if __name__ == "__main__":
    main()
