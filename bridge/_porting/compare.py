"""`compare`: where two models part, pair by pair.

Pairs are made as for `transfer` (`bridge._porting.transfer`): the parameterised
modules of both models in call order. Both models run once at the paired
sites; each pair's activations and activation gradients are brought to the
canonical layout (channel-last, batch-first) and compared, each tensor at its
own scale (`_differences`).

What a porter could mistake for a divergence is kept out of the pairs:
- a call whose output never reaches the loss (a model that calls a module
  twice and drops the first result) is *dead*: found from the computation's
  structure (`_unreached_in_jax`: which epsilons the loss's jaxpr uses; a
  PyTorch model's autograd graph), never from a gradient that happens to be
  zero; reported, never paired;
- an extra call of a module on one side pairs with the other side's call
  whose values it matches;
- float32 rounding, with `dtype="float64"`: both models run in float64, on
  copies, and what differences stay are the port's.

The report ends with the outputs compared as logits (`_logits_figures`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import BridgeTypeError, BridgeValueError
from .._session.sites import split_arrays
from .contract import porting_side
from .hyperparameters import differing_hyperparameters
from .report import ComparisonReport, LogitsComparison, PairComparison
from .transfer import (
    Layer,
    described_tie,
    inputs_for,
    label,
    pair_calls,
    parameterised_layers,
    second_inputs,
    untied,
    with_counterparts,
)

#: The default tolerances by the precision compared in: float32's rounding
#: after a different order of operations is near 1e-7 of a tensor's largest
#: element (1e-6 in a deep model), float64's near 1e-16.
_TOLERANCES = {None: (1e-5, 1e-6), "float64": (1e-10, 1e-12)}

_NAMES = ("probe_a", "probe_b")


def compare(
    probe_a: Any,
    probe_b: Any,
    loss_fn: Callable[[Any], Any] | tuple[Callable, Callable],
    *args: Any,
    rtol: float | None = None,
    atol: float | None = None,
    dtype: str | None = None,
    logits: Any = None,
    args_b: tuple | None = None,
    kwargs_b: dict | None = None,
    **kwargs: Any,
) -> ComparisonReport:
    """Run two models on the same inputs and find where they part.

    Pairs the calls of the models' parameterised modules in call order (as
    `bridge.transfer` pairs the modules), runs `value_and_grad` of both (under
    `jax.jit`), brings each pair's activations and activation gradients to a
    common layout (channel-last: Equinox and PyTorch convolutions are
    channel-first; attention head axes flattened; PyTorch's sequence-first
    attention batch-first), and measures their differences. A PyTorch model
    runs eagerly in PyTorch, the JAX model under `jax.jit`.

    A value that broadcasts to the other side's shape by NumPy's rules
    (PyTorch's position embedding `(1, seq, d)` or `(seq, d)` against Flax's
    `(batch, seq, d)`) is compared broadcast, the other side's gradient
    summed over the broadcast axes. Tied LM heads (`report.tied`) do not pair
    by their weights: where both sides have one, tied to paired modules, they
    are compared with each other. A call whose output never reaches the loss
    (`report.dead`: a module called twice, its first result dropped) is never
    paired. Where the counts differ only by repeated calls of a module on one
    side, the other side's call pairs with the repeated call whose
    activations match it best, and the others are left unpaired
    (`report.unpaired`) rather than refused.

    `report.first_divergence` is the first pair in call order whose
    activations differ beyond tolerance — a forward bug shows there, while
    gradients differ everywhere upstream of it. Where every activation agrees
    but gradients do not (a bug in a backward pass), it is the last pair
    whose gradients differ. `None` when everything agrees.

    Args:
      probe_a, probe_b: the two models' probes.
      loss_fn: `outputs -> scalar`, applied to each model's outputs; or a pair
        `(loss_fn_a, loss_fn_b)` where one function cannot serve both (a
        PyTorch model's loss takes torch tensors).
      *args, **kwargs: the call arguments both models accept (the first
        model's, when `args_b`/`kwargs_b` are given).
      rtol: the relative tolerance: a tensor agrees when
        `max|a - b| <= atol + rtol * max|b|`, its difference judged at the
        scale of the whole tensor (a float32 rounding error on an element
        near zero is no divergence). Default 1e-5 (1e-10 with
        `dtype="float64"`): float32 models whose operations run in another
        order differ near 1e-7 of their largest element; loosen it for deep
        models or bfloat16. A hyperparameter mismatch shows only as far as it
        changes numbers: LayerNorm epsilons of 1e-6 and 1e-5 differ visibly
        only where the normalised variance is small.
      atol: the absolute tolerance, for tensors near zero throughout. Default
        1e-6 (1e-12 with `dtype="float64"`).
      dtype: `None` (the default) runs the models as they are; `"float64"`
        runs both in float64, on copies (a JAX model's floating parameters,
        variables and inputs cast, and its modules' `dtype` fields, with x64
        enabled only for the call; a PyTorch model as `copy.deepcopy(model)
        .double()`), so that rounding vanishes and what differs is the port's.
        Code that casts to float32 itself stays float32 there.
      logits: which outputs to compare as logits at the end of the report
        (KL divergence and top-1 agreement): `None` (the default) finds them,
        the outputs' `logits` (a Hugging Face output), else the outputs
        themselves when they are one floating array whose last axis has two
        entries or more; a function `outputs -> logits`, or a pair of them,
        one per model; `False` for none.
      args_b, kwargs_b: the second model's inputs, where they differ from the
        first's: `args_b=(x_nhwc,)` for a JAX port of a PyTorch model that
        takes `x_nchw`. Values are compared in the common layout either way.

    Returns:
      A `ComparisonReport`: `str(report)` is a table; `report.rows` the data.

    Examples:
      >>> report = bridge.compare(linen_probe, eqx_probe, loss_fn, x)
      >>> print(report)
      >>> report.first_divergence
    """
    losses = _loss_pair(loss_fn)
    logits_fns = _logits_pair(logits)
    precision = _precision(dtype)
    default_rtol, default_atol = _TOLERANCES[precision]
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    porting_side(probe_a, "probe_a")
    porting_side(probe_b, "probe_b")
    args_b, kwargs_b = second_inputs(args, kwargs, args_b, kwargs_b)
    inputs = (
        inputs_for(probe_a, args, kwargs),
        inputs_for(probe_b, args_b, kwargs_b),
    )
    tolerances = (rtol, atol)
    if precision is None:
        return _compare((probe_a, probe_b), losses, inputs, logits_fns, tolerances)
    with _x64():
        probes = tuple(
            _in_float64(probe, name)
            for probe, name in zip((probe_a, probe_b), _NAMES, strict=True)
        )
        inputs = tuple(_inputs_in_float64(given) for given in inputs)
        report = _compare(probes, losses, inputs, logits_fns, tolerances, precision)
    return report


def _compare(probes, losses, inputs, logits_fns, tolerances, precision=None):
    rtol, atol = tolerances
    layers = [
        parameterised_layers(probe, name, *given)[1]
        for probe, name, given in zip(probes, _NAMES, inputs, strict=True)
    ]
    dead = _dead_layers(probes, losses, inputs, layers)
    gone = {id(layer) for _, layer in dead}
    own, tied = zip(
        *(untied([la for la in found if id(la) not in gone]) for found in layers),
        strict=True,
    )
    own_a, own_b = with_counterparts(*own)
    left_out = [
        described_tie(layer, name)
        for name, side in zip(_NAMES, tied, strict=True)
        for layer in side
    ] + [f"{_described(layer, name)}, dead" for name, layer in dead]
    paired, unpaired = pair_calls(own_a, own_b, _NAMES, left_out)
    _check_kinds(paired)
    pairs = [(a, b) for a, b in paired if a.site and b.site]
    tie_pairs, unpaired = _paired_ties(tied, paired, unpaired)
    sites = tuple(
        [pair[side].site for pair in (*pairs, *tie_pairs)]
        + [
            layer.site
            for name, layer in unpaired
            if layer.site and name == _NAMES[side]
        ]
        for side in (0, 1)
    )
    results = _run_both(probes, losses, sites, inputs, logits_fns)
    pairs, unpaired = _matched_by_value(pairs, unpaired, results)
    order = {id(layer): n for n, layer in enumerate(layers[0])}
    compared = sorted(
        [(a, b, a.kind) for a, b in pairs] + [(a, b, "tied") for a, b in tie_pairs],
        key=lambda pair: order[id(pair[0])],
    )
    dtype, lower_precision = _precision_of(compared, results, precision)
    return ComparisonReport(
        [_compare_pair(a, b, *results, rtol, atol, kind) for a, b, kind in compared],
        float(results[0].loss),
        float(results[1].loss),
        rtol,
        atol,
        tied=_tie_notes(tied, tie_pairs),
        unpaired=tuple(_described(layer, name) for name, layer in unpaired),
        dead=tuple(_described(layer, name) for name, layer in dead),
        dtype=dtype,
        lower_precision=lower_precision,
        logits=_logits_figures(results[0].aux, results[1].aux, logits_fns),
    )


def _dead_layers(probes, losses, inputs, layers) -> list[tuple[str, Layer]]:
    """`[(probe's name, layer)]` of the calls whose output never reaches the
    loss."""
    found = []
    for probe, name, loss_fn, given, side in zip(
        probes, _NAMES, losses, inputs, layers, strict=True
    ):
        sites = [layer.site for layer in side if layer.site]
        unreached = _unreached(probe, loss_fn, given, sites)
        found += [(name, layer) for layer in side if layer.site in unreached]
    return found


def _tie_notes(tied, tie_pairs) -> tuple[str, ...]:
    """Each tied layer described, with what it was compared with."""
    partners = {id(a): (b, "probe_b") for a, b in tie_pairs}
    partners |= {id(b): (a, "probe_a") for a, b in tie_pairs}
    notes = []
    for name, side in zip(_NAMES, tied, strict=True):
        for layer in side:
            note = described_tie(layer, name)
            if id(layer) in partners:
                other, other_name = partners[id(layer)]
                note += f"; compared with {label(other)} of {other_name}"
            notes.append(note)
    return tuple(notes)


def _precision_of(compared, results, precision) -> tuple[str, tuple[str, ...]]:
    """`(the precision the report names, the sites of a float64 run whose
    values were not float64)`: without `dtype=`, the dtypes of the compared
    activations (`"float32"`)."""
    found, lower = set(), []
    for pair in compared:
        for side, name in enumerate(_NAMES):
            layer = pair[side]
            dtypes = {
                np.asarray(leaf).dtype
                for leaf in _common(layer, results[side].activations[layer.site])
            }
            found |= {dtype.name for dtype in dtypes}
            if precision is not None and dtypes - {np.dtype(np.float64)}:
                lower.append(f"{label(layer)} of {name}")
    return precision or "/".join(sorted(found)) or "float32", tuple(lower)


def _described(layer: Layer, name: str) -> str:
    return f"{label(layer)} ({layer.described}) of {name}"


def _check_kinds(paired: list[tuple[Layer, Layer]]) -> None:
    for layer_a, layer_b in paired:
        if layer_a.kind != layer_b.kind:
            raise BridgeValueError(
                f"Cannot compare {label(layer_a)} ({layer_a.described}) of "
                f"probe_a with {label(layer_b)} ({layer_b.described}) of "
                f"probe_b: their kinds differ ({layer_a.kind} vs {layer_b.kind}). "
                "compare pairs parameterised modules in call order: check that "
                "both models call the same layers in the same order."
            )


def _paired_ties(tied, paired, unpaired) -> tuple[list, list]:
    """`(pairs, unpaired)`: each tied layer paired with what stands for it on
    the other side, compared with it (its weights move with its owner's):
    the other side's tied layer tied to the partner of its owner (PyTorch's
    `lm_head` holding `embed_tokens`' tensor against Flax's `attend` of the
    embedding), or else an extra call of that partner (BART's decoder
    embedding, tied in PyTorch, a second call of the shared embedding in
    Flax), which is then no longer unpaired."""
    partner: tuple[dict, dict] = ({}, {})
    for a, b in paired:
        partner[0].setdefault(a.path, b.path)
        partner[1].setdefault(b.path, a.path)
    found, taken, used = [], set(), set()

    def extra_call(side: int, path: str | None) -> Layer | None:
        for n, (name, layer) in enumerate(unpaired):
            if n not in used and name == _NAMES[side] and layer.site:
                if layer.path == path:
                    used.add(n)
                    return layer
        return None

    for a in (layer for layer in tied[0] if layer.site):
        want = partner[0].get(a.tied)
        b = next(
            (
                b
                for b in tied[1]
                if b.site and id(b) not in taken and b.tied == want is not None
            ),
            None,
        )
        b = b if b is not None else extra_call(1, want)
        if b is not None:
            found.append((a, b))
            taken.update((id(a), id(b)))
    for b in (layer for layer in tied[1] if layer.site and id(layer) not in taken):
        a = extra_call(0, partner[1].get(b.tied))
        if a is not None:
            found.append((a, b))
    return found, [pair for n, pair in enumerate(unpaired) if n not in used]


def _loss_pair(loss_fn: Any) -> tuple[Callable, Callable]:
    pair_ = tuple(loss_fn) if isinstance(loss_fn, tuple | list) else (loss_fn,) * 2
    if len(pair_) != 2 or not all(callable(f) for f in pair_):
        raise BridgeTypeError(
            "`loss_fn` must be a function `outputs -> scalar`, or a pair "
            "`(loss_fn_a, loss_fn_b)` of them when the models' outputs differ in "
            f"kind (torch tensors against JAX arrays); got {loss_fn!r}. The inputs "
            "come after it: bridge.compare(probe_a, probe_b, loss_fn, x)."
        )
    return pair_


# -- dead calls -----------------------------------------------------------------


def _unreached(probe, loss_fn, inputs, names) -> set[str]:
    """The sites among `names` whose output has no path to the loss, from
    the computation's structure (`PortableProbe.unreached_sites`: a JAX
    model's jaxpr, PyTorch's autograd graph)."""
    names = list(dict.fromkeys(names))
    if not names:
        return set()
    args, kwargs = inputs
    return set(probe.unreached_sites(loss_fn, names, *args, **kwargs))


def _matched_by_value(pairs, unpaired, results):
    """Where a module is called more often on one side, the other side's
    call pairs with the call whose activations are nearest its own (for
    equal distances, the first): `(pairs, unpaired)`."""
    pairs, unpaired = list(pairs), list(unpaired)
    for n, (name, extra) in enumerate(unpaired):
        if not extra.site:
            continue
        side = _NAMES.index(name)
        for k, pair in enumerate(pairs):
            mine, other = pair[side], pair[1 - side]
            if mine.path != extra.path:
                continue
            theirs = _values(other, results[1 - side])
            if _distance(_values(extra, results[side]), theirs) < _distance(
                _values(mine, results[side]), theirs
            ):
                pairs[k] = (extra, other) if side == 0 else (other, extra)
                unpaired[n] = (name, mine)
            break
    return pairs, unpaired


def _values(layer: Layer, result: Any) -> list[np.ndarray]:
    return _common(layer, result.activations[layer.site])


def _distance(values: list, theirs: list) -> float:
    """The largest relative difference of two sites' activations, `inf`
    where they cannot be compared."""
    if len(values) != len(theirs):
        return float("inf")
    values, theirs, _, _ = _broadcast(values, theirs, values, theirs)
    if [np.shape(v) for v in values] != [np.shape(v) for v in theirs]:
        return float("inf")
    relative = _differences(values, theirs, 0.0, 0.0)[1]
    return float("inf") if np.isnan(relative) else relative


# -- float64 --------------------------------------------------------------------


def _precision(dtype: Any) -> str | None:
    if dtype is None:
        return None
    name = None
    for given in (dtype, str(dtype).removeprefix("torch.")):  # torch.float64 too
        try:
            name = np.dtype(given).name
            break
        except TypeError:
            continue
    if name != "float64":
        raise BridgeValueError(
            '`dtype` must be None (the models as they are) or "float64" (both '
            f"models run in float64, on copies); got {dtype!r}."
        )
    return name


@contextlib.contextmanager
def _x64() -> Iterator[None]:
    """x64 enabled for the block only (this thread's; the global flag is left
    as it was)."""
    try:
        context = jax.enable_x64(True)
    except (AttributeError, TypeError):  # pragma: no cover - older JAX
        from jax.experimental import enable_x64

        context = enable_x64()
    with context:
        yield


def _in_float64(probe: Any, name: str) -> Any:
    """A probe of a float64 copy of the model: the library's own
    `in_float64` where its porting module has one (PyTorch's `.double()`,
    the Flax libraries' `dtype` fields), else the probe's floating leaves
    cast."""
    own = getattr(porting_side(probe, name), "in_float64", None)
    if own is not None:
        return own(probe)
    if getattr(probe, "runs_in_jax", False):
        return jax.tree.map(_float64, probe)
    raise BridgeTypeError(
        f"`{name}` is a {type(probe).__name__}, which compare cannot run in "
        'float64: its porting module has no `in_float64`. Leave dtype="float64" '
        "out, or cast the model yourself."
    )


def _float64(leaf: Any) -> Any:
    if type(leaf).__module__.split(".")[0] == "torch":
        return leaf.double() if leaf.is_floating_point() else leaf
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        return leaf
    if isinstance(leaf, np.ndarray | np.generic):
        return np.asarray(leaf, np.float64)
    return jnp.asarray(leaf, jnp.float64)


def _inputs_in_float64(inputs: tuple[tuple, dict]) -> tuple[tuple, dict]:
    return jax.tree.map(_float64, inputs)


# -- logits ---------------------------------------------------------------------


def _logits_pair(logits: Any) -> tuple[Any, Any] | None:
    """`None` (no logits), or a function per model (`_AUTO`: found)."""
    if logits is False:
        return None
    if logits is None:
        return (_AUTO, _AUTO)
    pair_ = tuple(logits) if isinstance(logits, tuple | list) else (logits,) * 2
    if len(pair_) != 2 or not all(callable(f) for f in pair_):
        raise BridgeTypeError(
            "`logits` must be None (found in the outputs), False (none), a "
            "function `outputs -> logits`, or a pair `(logits_a, logits_b)` of "
            f"them; got {logits!r}."
        )
    return pair_


def _AUTO(outputs: Any) -> Any:
    """The outputs' logits: a `logits` field or key (a Hugging Face output),
    else the outputs themselves when they are one floating array whose last
    axis has two entries or more; else `None`."""
    found = getattr(outputs, "logits", None)
    if found is None and isinstance(outputs, dict):
        found = outputs.get("logits")
    if found is None and _floating(outputs) and np.ndim(outputs) >= 1:
        found = outputs if outputs.shape[-1] >= 2 else None
    return found if _floating(found) else None


def _floating(value: Any) -> bool:
    if type(value).__module__.split(".")[0] == "torch":
        return hasattr(value, "is_floating_point") and value.is_floating_point()
    dtype = getattr(value, "dtype", None)
    return (
        dtype is not None
        and hasattr(value, "shape")
        and jnp.issubdtype(dtype, jnp.floating)
    )


def _with_logits(loss_fn: Callable, logits_fn: Any) -> Callable:
    """`loss_fn` returning the logits as its aux."""
    return lambda outputs: (loss_fn(outputs), logits_fn(outputs))


def _host(value: Any) -> np.ndarray:
    if type(value).__module__.split(".")[0] == "torch":
        return value.detach().cpu().double().numpy()
    return np.asarray(value, np.float64)


def _logits_figures(logits_a: Any, logits_b: Any, logits_fns) -> Any:
    """KL divergence and top-1 agreement of the two models' logits, over
    every position (each index of all axes but the last); `None` where
    there are none, or (found, not given) where their shapes differ."""
    if logits_fns is None or logits_a is None or logits_b is None:
        return None
    a, b = _host(logits_a), _host(logits_b)
    if a.shape != b.shape:
        if logits_fns[0] is _AUTO:
            return None
        raise BridgeValueError(
            f"The logits given by `logits` have shapes {a.shape} and {b.shape}: "
            "compare needs the same positions and classes on both sides."
        )
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    log_p, log_q = _log_softmax(a), _log_softmax(b)
    # Never below 0 but by rounding, which would read as a sign.
    kl = np.maximum(np.sum(np.exp(log_p) * (log_p - log_q), axis=-1), 0.0)
    top1 = np.argmax(a, axis=-1) == np.argmax(b, axis=-1)
    return LogitsComparison(float(np.mean(kl)), float(np.mean(top1)), len(a))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - np.max(x, axis=-1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


# -- running both models --------------------------------------------------------


def _run_both(probes, loss_fns, sites, inputs, logits_fns=None):
    """Both models' `value_and_grad` at their paired sites, the logits as
    aux: JAX models under one `jax.jit` (no parameter baked in), a PyTorch
    model eagerly in PyTorch."""
    if logits_fns is not None:
        loss_fns = tuple(
            _with_logits(loss_fn, logits_fn)
            for loss_fn, logits_fn in zip(loss_fns, logits_fns, strict=True)
        )
    has_aux = logits_fns is not None
    runs = list(zip(probes, loss_fns, sites, inputs, strict=True))
    in_jax = [getattr(probe, "runs_in_jax", False) for probe in probes]
    if all(in_jax):
        return _jitted(runs, has_aux)
    return tuple(
        _jitted([run], has_aux)[0] if jax_run else _value_and_grad(*run, has_aux)
        for run, jax_run in zip(runs, in_jax, strict=True)
    )


def _value_and_grad(probe, loss_fn, names, inputs, has_aux=False):
    args, kwargs = inputs
    return probe.value_and_grad(
        loss_fn, *args, at=_exactly(names), has_aux=has_aux, **kwargs
    )


def _jitted(runs: list, has_aux: bool = False) -> tuple:
    """`_value_and_grad` of each run, all under one `jax.jit`, the inputs'
    arrays traced."""

    probes = [probe for probe, *_ in runs]
    losses_and_sites = [(loss_fn, names) for _, loss_fn, names, _ in runs]
    dynamic, rebuild = split_arrays([inputs for *_, inputs in runs])

    @jax.jit
    def run(probes, dynamic):
        return tuple(
            _value_and_grad(probe, loss_fn, names, inputs, has_aux)
            for probe, (loss_fn, names), inputs in zip(
                probes, losses_and_sites, rebuild(dynamic), strict=True
            )
        )

    return run(probes, dynamic)


def _exactly(names: Sequence[str]) -> list[str] | Callable:
    """A selection of exactly these sites. Glob characters in a name would
    widen a pattern; such names are few and harmless (the extra sites are
    recorded, never compared)."""
    return list(dict.fromkeys(names))


# -- one pair -------------------------------------------------------------------


def _compare_pair(layer_a, layer_b, result_a, result_b, rtol, atol, kind):
    values_a = _common(layer_a, result_a.activations[layer_a.site])
    values_b = _common(layer_b, result_b.activations[layer_b.site])
    grads_a = _common(layer_a, result_a.activation_grads[layer_a.site])
    grads_b = _common(layer_b, result_b.activation_grads[layer_b.site])
    values_a, values_b, grads_a, grads_b = _broadcast(
        values_a, values_b, grads_a, grads_b
    )
    shapes_a = [np.shape(v) for v in values_a]
    shapes_b = [np.shape(v) for v in values_b]
    if shapes_a != shapes_b:
        raise BridgeValueError(
            f"Cannot compare site {layer_a.site!r} ({layer_a.described}) of probe_a "
            f"with site {layer_b.site!r} ({layer_b.described}) of probe_b: their "
            f"activations have shapes {shapes_a} and {shapes_b} in the common "
            "layout (channel-last, head axes flattened, batch first). Check that "
            "both models are given the same inputs, and vmap=True for an Equinox "
            "model that handles one example."
        )
    act_abs, act_rel, act_ok = _differences(values_a, values_b, rtol, atol)
    grad_abs, grad_rel, grad_ok = _differences(grads_a, grads_b, rtol, atol)
    hyperparameters = (
        {}
        if kind == "tied"  # a Linear against an embedding's `attend`
        else differing_hyperparameters(layer_a.hyperparameters, layer_b.hyperparameters)
    )
    return PairComparison(
        layer_a.site,
        layer_b.site,
        kind,
        tuple(shapes_a[0]) if shapes_a else (),
        act_abs,
        act_rel,
        act_ok,
        grad_abs,
        grad_rel,
        grad_ok,
        hyperparameters,
    )


def _broadcast(values_a, values_b, grads_a, grads_b):
    """Where one side's value broadcasts to the other's shape (PyTorch's
    position embedding `(1, seq, d)` against Flax's per-row `(batch, seq,
    d)`), the value broadcast and the other side's gradient summed over the
    broadcast axes: the gradient a broadcast value receives is that sum."""
    if len(values_a) != len(values_b) or len(grads_a) != len(values_a):
        return values_a, values_b, grads_a, grads_b
    values_a, values_b, grads_a, grads_b = map(
        list, (values_a, values_b, grads_a, grads_b)
    )
    for n, (a, b) in enumerate(zip(values_a, values_b, strict=True)):
        if a.shape == b.shape:
            continue
        if _broadcasts(a.shape, b.shape):
            values_a[n] = np.broadcast_to(a, b.shape)
            grads_b[n] = _summed_to(grads_b[n], a.shape)
        elif _broadcasts(b.shape, a.shape):
            values_b[n] = np.broadcast_to(b, a.shape)
            grads_a[n] = _summed_to(grads_a[n], b.shape)
    return values_a, values_b, grads_a, grads_b


def _broadcasts(small: tuple, large: tuple) -> bool:
    """`small` broadcasts to `large` by NumPy's rules: axes of 1 (a batch
    axis of 1), or leading axes missing (`(seq, d)` against `(batch, seq,
    d)`)."""
    extra = len(large) - len(small)
    return extra >= 0 and all(
        s in (1, big) for s, big in zip(small, large[extra:], strict=True)
    )


def _summed_to(grad: np.ndarray, shape: tuple) -> np.ndarray:
    """`grad` summed over the axes a value of `shape` was broadcast along."""
    grad = np.sum(grad, axis=tuple(range(grad.ndim - len(shape))))
    pairs = enumerate(zip(shape, grad.shape, strict=True))
    axes = tuple(n for n, (s, g) in pairs if s != g)
    return np.sum(grad, axis=axes, keepdims=True)


def _common(layer: Layer, value: Any) -> list[np.ndarray]:
    return [np.asarray(layer.to_common(leaf)) for leaf in layer.select(value)]


def _differences(
    values_a: list, values_b: list, rtol: float, atol: float
) -> tuple[float, float, bool]:
    """`(largest |a - b|, that over the largest |b|, agree)` over the leaves.

    A leaf agrees when `max|a - b| <= atol + rtol * max|b|`: its difference
    is judged at the scale of the whole tensor, not element by element. A
    float32 result summed in another order differs by a few units of
    rounding of its *largest* elements, and that difference lands on every
    element, those near zero too, where an elementwise `rtol * |b|` is no
    room at all (a false alarm that depends on the CPU's vector width). A
    port's bug moves elements by far more than that rounding.
    """
    largest_abs, largest_b, agree = 0.0, 0.0, True
    for a, b in zip(values_a, values_b, strict=True):
        if a.size == 0:
            continue
        a, b = a.astype(np.float64), b.astype(np.float64)
        difference = float(np.max(np.abs(a - b)))
        scale = float(np.max(np.abs(b)))
        largest_abs = max(largest_abs, difference)
        largest_b = max(largest_b, scale)
        # A NaN difference compares false: it disagrees.
        agree = agree and difference <= atol + rtol * scale
    relative = largest_abs / largest_b if largest_b > 0 else largest_abs
    return largest_abs, relative, agree
