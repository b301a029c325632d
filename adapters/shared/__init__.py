"""What several library adapters use. Nothing here imports a library package.

`jax_internals` (JAX's private trace stack, checked by each adapter that uses
it with `require`) and `guests` (the framework of guests, modules of one
library called inside another's model, with `guest_calls` and
`guest_libraries`; each library's side is its package's `guest`, found by
name).
"""
