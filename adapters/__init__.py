"""One adapter package per library, installed as `bridge.adapters`.

`linen`, `nnx`, `equinox`, `haiku`, `torch`: each imports its own library and
is imported only when a model of that library is probed. A file name means
the same thing in every package that has it:

- `probe`: the probe class (a `ProbeBase`, PyTorch's a `ProbeFront`) and
  its factory `probe` (what the registry imports), and the probe's call of
  the model;
- `run`: one run of the model, each module call reported plainly to the
  session from where it runs (Linen's and Haiku's interceptor, NNX's `Run`,
  Equinox's wrappers' calls): where it runs, and so how its epsilon crosses
  any transform, the core reads from the computation;
- `surgery`: the copy of the model whose modules report their calls (NNX's
  reporting subclasses, Equinox's wrappers);
- `variables` (NNX's): the path each module of the copy carries through
  NNX's transforms;
- `internals`: the library's private API, all of it and only there
  (version-checked at import in NNX, Haiku and PyTorch; JAX's is
  `shared.jax_internals`);
- `guest`: its modules called inside another library's model (found by name
  by `shared.guests`);
- `porting`: its side of `transfer`/`compare` (its `LayerKinds` table and
  `with_weights`).

Names one package alone needs: `linen.hub` (Hugging Face Flax model objects),
`torch.session` (the gradient caught at each call), `torch.arrays` (torch
tensors as the core's arrays), `torch.discovery` (discovery on fake
tensors). `shared` holds what several of them use, and imports no library
package.
"""
