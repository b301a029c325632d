"""What several library adapters use: JAX's private trace stack
(`jax_internals`) and the guests of one library inside another's model
(`guests`)."""
