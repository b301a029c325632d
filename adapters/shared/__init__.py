"""What several library adapters use. Nothing here imports a library package.

`jax_internals` (JAX's private trace stack, checked by each adapter that uses
it with `require`), `lifting` (a value seen inside the model's own `jax.vmap`
handed out whole), `unexpressible` (sites listed but refused where selected
or patched), `scan_bodies` (a `lax.scan` body JAX traces twice lists its
sites once), `guests` (the framework of guests, modules of one library called
inside another's model, with `guest_calls` and `guest_libraries`; each
library's side is its package's `guest`, found by name), `equinox_loops`
(Equinox's while loops and the solves built on them, read off the call
stack).
"""
