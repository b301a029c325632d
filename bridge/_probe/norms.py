"""`SiteNorms`: every site reduced to its norms, as one array.

A gradient-flow monitor keeps two numbers per site. Returned from a jitted
step as one scalar each, they are hundreds of output buffers, and the host
pays for each buffer it hands back (about 5 µs on a TPU: a 133-site step
returning 266 scalars costs 1.13–1.38× plain where its device time is
plain's). `ProbeResult.norms()` stacks them inside the step into one
`(sites, 2)` float32 array, with the sites' names static beside it.

The norms of JAX values are taken here; a framework whose values are not JAX
arrays (PyTorch) gives its own with `register_norms`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._errors import BridgeTypeError, BridgeValueError

#: The columns of a `ProbeResult`'s norms, and of a `ForwardResult`'s.
GRADIENT_COLUMNS = ("activation", "gradient")
FORWARD_COLUMNS = ("activation",)


@jax.tree_util.register_pytree_with_keys_class
class SiteNorms:
    """The L2 norm of every selected site, as one float32 array.

    What `ProbeResult.norms()` and `ForwardResult.norms()` return: a pytree
    with one array leaf, `values`, and the site names as static data, so a
    jitted step returns it as one buffer and the names survive `jax.jit`.

    Attributes:
      values: float32 array `(sites, 2)`: column 0 the norm of each site's
        activation, column 1 that of its activation gradient (`(sites, 1)`,
        activations only, for a `ForwardResult`). A norm is taken over all
        of the site's elements, every floating leaf of a pytree site
        together. A PyTorch probe's is a torch tensor.
      names: the sites, in the order of the rows: call order, as in
        `res.activations`.
      columns: what each column holds: `("activation", "gradient")`, or
        `("activation",)` for a forward pass.

    Example:
      >>> step = jax.jit(lambda probe, x: probe.value_and_grad(loss_fn, x).norms())
      >>> norms = step(probe, x)  # one buffer
      >>> norms.gradient  # (sites,): |d loss / d activation| per site
      >>> norms["Dense_0"]  # (2,): that site's row
      >>> norms.as_dict()  # on the host: {site: {"activation": .., "gradient": ..}}
    """

    __slots__ = ("columns", "names", "values")

    def __init__(
        self,
        values: Any,
        names: Sequence[str],
        columns: Sequence[str] = GRADIENT_COLUMNS,
    ):
        self.values = values
        self.names = tuple(names)
        self.columns = tuple(columns)

    def tree_flatten_with_keys(self) -> tuple[tuple[Any, ...], tuple]:
        return ((jax.tree_util.GetAttrKey("values"), self.values),), (
            self.names,
            self.columns,
        )

    @classmethod
    def tree_unflatten(cls, static: tuple, children: tuple) -> SiteNorms:
        names, columns = static
        return cls(children[0], names, columns)

    @property
    def activation(self) -> Any:
        """The norm of each site's activation: `values[..., 0]`, `(sites,)`."""
        return self.column("activation")

    @property
    def gradient(self) -> Any:
        """The norm of each site's activation gradient: `values[..., 1]`."""
        return self.column("gradient")

    def column(self, column: str) -> Any:
        """One column of `values`, by its name in `columns`."""
        if column not in self.columns:
            raise BridgeValueError(
                f"These norms have no {column!r} column: they hold {self.columns}"
                + (
                    " (a forward pass has no gradients; take the norms of "
                    "probe.value_and_grad(...) for them)."
                    if column == "gradient"
                    else "."
                )
            )
        return self.values[..., self.columns.index(column)]

    def __getitem__(self, name: str) -> Any:
        """The row of the site `name`: its norms, in the order of `columns`."""
        if name not in self.names:
            raise BridgeValueError(
                f"No site {name!r} among these norms; they hold {list(self.names)}."
            )
        return self.values[..., self.names.index(name), :]

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def as_dict(self) -> dict[str, dict[str, float]]:
        """`{site: {column: norm}}` as Python floats, read from the device in
        one transfer: for logging, on the host, after the step."""
        if isinstance(self.values, jax.core.Tracer):
            raise BridgeTypeError(
                "SiteNorms.as_dict() reads the norms on the host: call it on "
                "what the jitted step returns, not inside the step."
            )
        if self.values.ndim != 2:
            raise BridgeValueError(
                "SiteNorms.as_dict() takes norms of shape (sites, columns); "
                f"these are {tuple(self.values.shape)} (mapped over by "
                "jax.vmap?): index the mapped axis first."
            )
        rows = self.values.tolist()  # one transfer, jax or torch alike
        return {
            name: dict(zip(self.columns, row, strict=True))
            for name, row in zip(self.names, rows, strict=True)
        }

    def __repr__(self) -> str:
        return (
            f"SiteNorms({len(self.names)} sites, columns={self.columns}, "
            f"values={self.values!r})"
        )


#: `(array type, norms)` of each framework whose values are not JAX arrays.
_FRAMEWORKS: list[tuple[type | tuple[type, ...], Callable[..., Any]]] = []


def register_norms(
    array_type: type | tuple[type, ...],
    norms: Callable[[Sequence[Sequence[Any]]], Any],
) -> None:
    """Teach `ProbeResult.norms()` a framework whose values are not JAX arrays.

    Args:
      array_type: the framework's array class (`torch.Tensor`), or a tuple.
      norms: `norms(columns) -> array`: `columns[k][i]` is site `i`'s value
        in column `k` (a pytree of the framework's arrays); the result is one
        float32 array of shape `(sites, len(columns))` holding the L2 norm of
        each, over all of its floating leaves together, in the framework's
        own array type.
    """
    _FRAMEWORKS.insert(0, (array_type, norms))


def site_norms(
    columns: Sequence[dict[str, Any]], names: Sequence[str], labels: Sequence[str]
) -> SiteNorms:
    """The `SiteNorms` of the sites `names`, one column per dict of `columns`."""
    values = [[column[name] for name in names] for column in columns]
    leaves = jax.tree.leaves(values)
    for array_type, norms in _FRAMEWORKS:
        if any(isinstance(leaf, array_type) for leaf in leaves):
            return SiteNorms(norms(values), names, labels)
    return SiteNorms(jax_norms(values), names, labels)


@jax.jit
def jax_norms(columns: Sequence[Sequence[Any]]) -> jax.Array:
    """`(sites, len(columns))` float32: the L2 norm of each site's value in
    each column, over all of its floating leaves together (`l2_norm`).
    Jitted: called eagerly, it compiles once per structure."""
    sites = len(columns[0]) if columns else 0
    if sites == 0:
        return jnp.zeros((0, len(columns)), jnp.float32)
    norms = [l2_norm(column[i]) for i in range(sites) for column in columns]
    return jnp.stack(norms).reshape(sites, len(columns))


def l2_norm(tree: Any) -> jax.Array:
    """The L2 norm of the floating leaves of `tree`, all together, as float32:
    bfloat16 and float16 are upcast before squaring (float64 stays float64
    until the norm is taken)."""
    leaves = [
        jnp.abs(leaf) if jnp.iscomplexobj(leaf) else leaf
        for leaf in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)
    ]
    if not leaves:
        return jnp.zeros((), jnp.float32)
    dtype = jnp.promote_types(jnp.result_type(*leaves), jnp.float32)
    # One plain sum of squares per leaf, a reduction XLA fuses into the
    # leaf's producer or reads the leaf once for. A scale-safe norm (the
    # largest magnitude first, or sums of rescaled squares beside it) reads
    # every value again: 3-20x the reduction's time on a CPU. So, as
    # `jnp.linalg.norm`: a norm above 1.8e19 reads `inf`, and elements under
    # about 1e-19 (squares below float32's normal range) add nothing.
    total = jnp.zeros((), dtype)
    for leaf in leaves:
        total = total + jnp.sum(jnp.square(jnp.asarray(leaf).astype(dtype)))
    return jnp.sqrt(total).astype(jnp.float32)
