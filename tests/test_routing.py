"""The call router (`bridge._session.routing.route`): one decision for every
library, from the rules of the transforms around a call. The adapters'
behaviour inside each transform is the conformance and fuzz suites'; this is
the table itself, and the sentence a refusal reads."""

import pytest

from bridge.adapter_api import (
    BRANCH,
    JAX_RULES,
    LOOP_AMONG,
    PLAIN,
    UNBOUNDED_LOOP,
    Carried,
    Mapped,
    Refused,
    Rule,
    ThroughControlFlow,
    Transform,
    route,
)

JIT, VMAP, COND, FORI = (JAX_RULES[n] for n in ("jit", "vmap", "cond", "fori_loop"))
WHILE, SCAN = JAX_RULES["while_body"], JAX_RULES["scan"]
STACK = Transform("nn.scan", Rule.CARRIES)
SOLE = Transform("jax.lax.scan", Rule.CARRIES, "scans nest", "unnest", nests=False)
CARRIED_COND = Transform("jax.lax.cond", Rule.FLOWS, BRANCH, "pick", nests=True)


@pytest.mark.parametrize(
    "enclosing, expected",
    [
        ((), PLAIN),
        ((JIT, JIT), PLAIN),
        ((VMAP,), Mapped(1)),
        ((VMAP, JIT, VMAP), Mapped(2)),
        ((COND,), ThroughControlFlow()),
        ((FORI, JIT, COND), ThroughControlFlow()),
        ((STACK,), Carried((STACK,), 0)),
        ((VMAP, VMAP, STACK), Carried((STACK,), 2)),
        ((STACK, STACK), Carried((STACK, STACK), 0)),
        ((CARRIED_COND, SOLE), Carried((SOLE,), 0)),
        ((STACK, SOLE, STACK), Carried((STACK, SOLE, STACK), 0)),
        ((VMAP, CARRIED_COND), Carried((CARRIED_COND,), 1)),
    ],
    ids=repr,
)
def test_routes(enclosing, expected):
    assert route("site", enclosing) == expected


@pytest.mark.parametrize(
    "enclosing, blocker",
    [
        ((WHILE,), WHILE),
        ((VMAP, WHILE, COND), WHILE),  # a transform that blocks, before all
        ((COND, VMAP), COND),  # a branch among other transforms
        ((VMAP, FORI), FORI),
        ((COND, STACK), COND),  # a branch the library does not carry
        ((STACK, VMAP), VMAP),  # the model's vmap around a carrier
        ((SOLE, STACK, SOLE), SOLE),  # two carriers that do not nest
        ((SCAN,), SCAN),
    ],
    ids=repr,
)
def test_refusals_name_the_transform_that_blocks(enclosing, blocker):
    found = route("a/b", enclosing)
    assert isinstance(found, Refused)
    assert found.transform == blocker


def test_the_sentence_names_transform_site_reason_way_out_and_where():
    found = route("a/b", (VMAP, WHILE, JIT))
    assert found.sentence == (
        "bridge cannot see through jax.lax.while_loop around site 'a/b': "
        f"{UNBOUNDED_LOOP} (it runs inside jax.vmap inside jax.lax.while_loop "
        "inside a jax.jit inside the model). Select other sites with `at=` "
        "(`at=None` leaves it out), or write the loop as a jax.lax.scan of "
        "fixed length."
    )
    alone = route("a", (FORI, VMAP)).sentence
    assert LOOP_AMONG in alone and "jax.lax.fori_loop around site 'a'" in alone
    assert "(it runs inside" not in route("a", (WHILE,)).sentence
