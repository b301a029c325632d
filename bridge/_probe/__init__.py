"""The probe: what every adapter's `ActivationProbe` shares.

`front` (the checks before any work, discovery and its cache, selection,
patch resolution, the result in call order) over two backends: `jax_backend`
(a model that runs in JAX, differentiated by `jax.value_and_grad`) and the
PyTorch one in `bridge.adapters.torch`. Beside them: the protocol, the
registry of adapters, and the front's helpers (selection, checks, batching,
discovery cache, results).
"""
