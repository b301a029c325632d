"""Selecting sites with `at=`: globs, classes, predicates, or a list of them."""

from __future__ import annotations

import difflib
import fnmatch
import functools
import inspect
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .._errors import BridgeTypeError, BridgeValueError, BridgeWarning
from .._session.sites import Site, strip_call_index

Selector = str | type | tuple | Callable[[str, Any], bool]

_AT_HELP = (
    "`at` must be None (every site), a glob string such as 'Dense_*', a module "
    "class or tuple of classes, a predicate `(path, module) -> bool`, or a list of "
    "these"
)


def check_selection(at: Any) -> None:
    """Raise `TypeError` for an `at` of the wrong kind, before any work."""
    for part in _parts(at):
        if isinstance(part, str | type):
            continue
        if isinstance(part, tuple) and part and all(isinstance(c, type) for c in part):
            continue
        if callable(part):
            continue
        if isinstance(part, tuple) and any(isinstance(c, str) for c in part):
            # A tuple is for module classes, as in `isinstance`.
            raise BridgeTypeError(
                f"{_AT_HELP}; got the tuple {part!r}. A tuple selects module "
                f"classes; for several paths or globs pass a list: at={list(part)!r}."
            )
        raise BridgeTypeError(
            f"{_AT_HELP}; got {part!r} of type {type(part).__name__}."
        )


def _parts(at: Any) -> list:
    if at is None:
        return []
    if isinstance(at, list):
        if not at:
            raise BridgeValueError(
                f"{_AT_HELP}; got an empty list, which selects nothing."
            )
        return at
    return [at]


def matches_pattern(pattern: str, name: str) -> bool:
    """A glob matches a site's name with or without its `#k` call suffix."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(
        strip_call_index(name), pattern
    )


def _matches(part: Any, site: Site) -> bool:
    if isinstance(part, str):
        return matches_pattern(part, site.name)
    if isinstance(part, type | tuple):
        return isinstance(site.module, part)
    return bool(part(site.name, site.module))


def select(at: Any, sites: Sequence[Site]) -> list[Site]:
    """The sites `at` selects, in call order.

    `at=None` selects every differentiable site bridge can express: a site
    inside a transform it cannot see through (`Site.refused`) is listed by
    `sites()` only, and left out with a `BridgeWarning` naming it and why;
    where that leaves nothing, it raises (a result is never silently
    empty). A selector (or an element of a list of them) that
    matches such a site raises with its reason; one that matches only
    integer-valued sites raises, since they have no gradient; one that
    matches nothing raises naming the closest available paths: a typo in one
    element of a list is not silently dropped.
    """
    if at is None:
        return _default_selection(sites)
    parts = _parts(at)
    matched = [[site for site in sites if _matches(part, site)] for part in parts]
    for part, chosen in zip(parts, matched, strict=True):
        described = f"`at={at!r}`" if len(parts) == 1 else f"`at` element {part!r}"
        if not chosen:
            raise BridgeValueError(_no_match_message(described, part, sites))
        if not any(site.differentiable for site in chosen):
            names = ", ".join(repr(site.name) for site in chosen)
            raise BridgeValueError(
                f"{described} selects only sites with integer values ({names}): "
                "they have no gradient. Select a site with floating-point values, "
                "or leave this one out of `at`."
            )
    for part, chosen in zip(parts, matched, strict=True):
        refused = [site for site in chosen if site.differentiable and site.refused]
        if refused:
            described = f"`at={at!r}`" if len(parts) == 1 else f"`at` element {part!r}"
            raise BridgeValueError(
                f"{described} selects {refused[0].name!r}, a site bridge lists "
                f"but cannot probe: {refused[0].refused}"
            )
    selected = {id(site) for chosen in matched for site in chosen}
    return [site for site in sites if id(site) in selected and site.differentiable]


def _default_selection(sites: Sequence[Site]) -> list[Site]:
    chosen = [site for site in sites if site.differentiable and not site.refused]
    left_out = [site for site in sites if site.differentiable and site.refused]
    if not left_out:
        return chosen
    names = _listed([site.name for site in left_out])
    first = left_out[0].refused
    if not chosen:
        raise BridgeValueError(
            "`at=None` leaves nothing to probe: every site of this call is one "
            f"bridge lists but cannot probe ({names}). The first: {first}"
        )
    warnings.warn(
        BridgeWarning(
            f"`at=None` leaves out {len(left_out)} site(s) bridge lists but "
            f"cannot probe ({names}) and probes the other {len(chosen)}. The "
            f"first: {first} Name the sites you want with `at=` to silence this."
        ),
        stacklevel=4,
    )
    return chosen


def _listed(names: list[str], most: int = 4) -> str:
    shown = ", ".join(repr(name) for name in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _no_match_message(described: str, part: Any, sites: Sequence[Site]) -> str:
    names = [site.name for site in sites if site.differentiable]
    if not names:
        return (
            f"{described} matches no site: this model calls no submodule with "
            "floating-point outputs on these inputs."
        )
    classes = {
        type(site.module).__name__: type(site.module)
        for site in sites
        if _is_module(site.module)
    }
    hint = ""
    closest: list[str] = []
    if isinstance(part, str):
        # A class name where a path was meant (`at="Dense"`): Linen and Haiku
        # number their modules (`Dense_0`), Equinox names them by field.
        numbered = f"{part}_*"
        if any(matches_pattern(numbered, name) for name in names):
            closest.append(numbered)
        if part in classes:
            cls = classes[part]
            hint = (
                f" {part!r} is a module class: to select its calls pass the class "
                f"itself, at={_public_name(cls)}, not its name."
            )
        candidates = sorted({strip_call_index(n) for n in names} | set(names))
        closest += difflib.get_close_matches(part, candidates, n=3, cutoff=0.0)
    closest = list(dict.fromkeys(closest)) or names[:5]
    listed = ", ".join(repr(name) for name in closest)
    called = f" Module classes called: {', '.join(sorted(classes))}." if classes else ""
    return (
        f"{described} matches no site.{hint} Closest paths: {listed}.{called} "
        "Call `probe.sites(*args)` to list every site."
    )


def _public_name(cls: type) -> str:
    """`flax.linen.Dense` rather than `flax.linen.linear.Dense`: the shortest
    already-imported package that exports the class (or, for an adapter's
    reporting subclass of it, its namesake base) under its own name."""
    for candidate in cls.__mro__:
        if candidate.__name__ != cls.__name__:
            continue
        parts = candidate.__module__.split(".")
        for end in range(1, len(parts) + 1):
            package = ".".join(parts[:end])
            if (
                getattr(sys.modules.get(package), candidate.__qualname__, 0)
                is candidate
            ):
                return f"{package}.{candidate.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_module(module: Any) -> bool:
    """A module object, not a tap (`None`) or a function called as a layer (an
    Equinox activation such as `jax.nn.relu`, a `custom_jvp`)."""
    if module is None or inspect.isroutine(module):
        return False
    return not isinstance(module, functools.partial | jax.custom_jvp | jax.custom_vjp)
