"""What several library adapters use: JAX's private trace stack
(`jax_internals`) and the framework of guests, modules of one library called
inside another's model (`guests`; each library's side is its package's
`guest`, found by name). Nothing here imports a library package."""
