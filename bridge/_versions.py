"""The library versions bridge supports, and the error for one it does not.

The lower bounds are the versions CI installs in its minimum-versions
environment (`.ci/run`), the same as `pyproject.toml`'s: tested, not guessed.
Where an adapter relies on a library's private internals, its `internals`
module (`bridge.adapters.<library>.internals`, and
`bridge.adapters.shared.jax_internals` for JAX's) checks at import that they
exist and calls
`unsupported` where they do not, so an unsupported version fails at
`bridge.probe` with this error, never with a wrong number.
"""

from __future__ import annotations

import importlib.metadata

from ._errors import BridgeImportError

#: Distribution name -> oldest supported release (tested in CI).
MINIMUM = {
    "jax": "0.4.36",
    "flax": "0.10.1",
    "equinox": "0.11.5",
    "dm-haiku": "0.0.13",
    "torch": "2.13.0",
    "keras": "3.6.0",
}
#: Where one adapter needs more than the package's floor: NNX's module system
#: as bridge uses it (pytree modules, `nnx.List`) is flax 0.12's, which needs
#: jax 0.7.1. Tested in CI's second minimum-versions environment.
ADAPTER_MINIMUM = {("Flax NNX", "flax"): "0.12.0"}
#: The newest releases tested when this version of bridge was made.
NEWEST_TESTED = {
    "jax": "0.10.2",
    "flax": "0.12.8",
    "equinox": "0.13.8",
    "dm-haiku": "0.0.17",
    "torch": "2.13.0",
    "keras": "3.15.1",
}


def installed(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "an unknown version"


def unsupported(distribution: str, adapter: str, missing: list[str]) -> ImportError:
    """The error for a version of `distribution` that lacks what `adapter` uses.

    Args:
      distribution: the package, as pip names it (`jax`, `dm-haiku`).
      adapter: the adapter that needs it (`Equinox`).
      missing: what was looked for and not found, for the message.
    """
    oldest = ADAPTER_MINIMUM.get((adapter, distribution), MINIMUM[distribution])
    newest = NEWEST_TESTED[distribution]
    return BridgeImportError(
        f"bridge's {adapter} adapter relies on {distribution} internals that "
        f"{distribution} {installed(distribution)} lacks ({'; '.join(missing)}). "
        f"bridge supports {distribution} {oldest} to {newest} for {adapter} "
        f"models (both ends tested in CI): pip install "
        f"'{distribution}>={oldest},<={newest}'. If yours is a newer release, "
        "please report it: bridge must follow it."
    )
