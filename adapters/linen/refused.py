"""Linen calls bridge cannot express: inside `nn.while_loop`, `nn.cond` or
`nn.switch`, or an `nn.scan`/`nn.vmap` that broadcasts `params` (`nn.RNN`).
They are listed and refused only where selected or patched (see
`bridge.adapters.shared.unexpressible`); this is how the Linen adapter tells
them and says why.

A transform that broadcasts `params` is found by discovery: recording a call
inside it among the parameters, Flax refuses a broadcast variable that
depends on the loop (`broadcasting` reads which transform from its error),
and discovery runs again with that transform's calls refused (`Broadcasts`).
"""

from __future__ import annotations

from ..shared import jax_internals


class Broadcasts(Exception):
    """Discovery, recording in `params`, met a lifted transform that
    broadcasts them (`nn.RNN`'s `nn.scan`, an `nn.vmap` with
    `variable_axes={'params': None}`): Flax refuses a broadcast variable that
    depends on the loop. Discovery runs again with the calls inside it listed
    as refused sites, and the others as before."""

    def __init__(self, key: tuple, transform: str):
        super().__init__(key, transform)
        self.key = key
        self.transform = transform


#: Flax's errors where a transform broadcasts `params` that a recording made
#: inside depends on, and the transform each names.
_BROADCAST_ERRORS = {
    "broadcasted variable has a data dependency": "nn.scan",
    "got axis spec None but output was batched": "nn.vmap",
}


def broadcasting(error: ValueError) -> str | None:
    message = str(error)
    for text, transform in _BROADCAST_ERRORS.items():
        if text in message:
            return transform
    return None


#: Why a site inside each transform cannot be expressed, and what to do.
REFUSALS = {
    "nn.scan": (
        "it broadcasts `params` (variable_broadcast='params', as nn.RNN "
        "does), so one epsilon would serve every iteration and their "
        "gradients would be summed",
        "scan over stacked layers (variable_axes={'params': 0}), or unroll the loop",
    ),
    "nn.vmap": (
        "it broadcasts `params` (variable_axes={'params': None}), so one "
        "epsilon would serve every mapped example and their gradients would "
        "be summed",
        "probe the unmapped model with bridge.probe(..., vmap=True)",
    ),
    "nn.while_loop": (
        "how many iterations run is known only when the model runs, so no "
        "epsilon or recording can be shaped for them",
        "write the loop as an nn.scan of fixed length",
    ),
    "nn.cond": (
        "which branch runs is known only when the model runs, so a call in a "
        "branch may not run at all",
        "compute both branches and pick with jnp.where",
    ),
    "nn.switch": (
        "which branch runs is known only when the model runs, so a call in a "
        "branch may not run at all",
        "compute every branch and pick with jnp.where",
    ),
}

#: JAX's names of the loops and branches (`unexpressible.LOOPS_AND_BRANCHES`)
#: as Linen's lifted transforms.
LINEN_NAMES = {"while_loop": "nn.while_loop", "cond": "nn.cond", "switch": "nn.switch"}


#: JAX's names of its transforms (a trace's `traced_for`), as the model's
#: code calls them.
JAX_NAMES = jax_internals.TRANSFORM_NAMES

#: Why a value inside a JAX transform of the model's own code (not a Flax
#: lifted transform) cannot be a site bridge probes, and what to do, where it
#: is neither the model's root trace nor only its own `jax.vmap`s around it.
RAW_REFUSALS = {
    "cond": REFUSALS["nn.cond"],
    "switch": REFUSALS["nn.switch"],
    "while_body": REFUSALS["nn.while_loop"],
    "while_cond": REFUSALS["nn.while_loop"],
}
RAW_REFUSAL = (
    "a value there belongs to the transform's own trace, which hands out only "
    "what the model's code returns from it, so bridge can neither record it "
    "nor give it an epsilon",
    "move it out of the transform, or use Flax's own lifted transform "
    "(nn.remat, nn.scan with variable_axes={'params': 0}, nn.vmap), which "
    "bridge sees through",
)


def raw_transform(names: list[str]) -> str:
    """The transform that holds a value seen inside the model's own JAX
    transforms (`names`, JAX's, innermost first): the innermost that is
    neither a `jax.vmap` (whose value bridge hands out) nor a `jax.jit`
    (traced through)."""
    for name in names:
        if name not in ("vmap", "jit", "pjit"):
            return name
    return names[0] if names else "a JAX transform"
