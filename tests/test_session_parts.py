"""Each part of a session (`bridge._session`) on its own, with JAX alone.

The parts a `Session` is a facade over (`Request`, `Naming`, the two
recorders, `Taps`) are each made from what they need and tested here
without a model library and, where they do not need one, without a
session: what each part answers, names and records is asserted value by
value. Then what the session adds over its parts (`active`, `tap`), and
that no part holds the session, so a session is freed
by reference counting alone.
"""

from __future__ import annotations

import dataclasses
import gc
import types
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bridge
from bridge._errors import BridgeRuntimeError, BridgeTypeError, BridgeValueError
from bridge._session import context
from bridge._session.naming import DISCARDED, Naming, renames_of, renumbered
from bridge._session.recorders import DiscoveryRecorder, RunRecorder
from bridge._session.taps import Taps
from bridge.adapter_api import (
    Call,
    Request,
    Session,
    Site,
    SiteOrigin,
    current_session,
)

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Lifted(SiteOrigin):
    """An adapter's origin: `hidden` marks a site only a fallback reaches."""

    hidden: bool = False
    tap: str | None = None


@dataclasses.dataclass(frozen=True)
class Scanned(SiteOrigin):
    """A call inside a scan of 4 steps whose carry holds bridge's values."""

    scan: tuple = (4, False)
    value: object = jax.ShapeDtypeStruct((2, 3), F32)
    inputs: object = (jax.ShapeDtypeStruct((2, 5), jnp.bfloat16),)


def a_site(name, shape=(2, 3), origin=None, method=None, index=0, **changes):
    struct = jax.ShapeDtypeStruct(shape, F32)
    return Site(name, name, method, index, None, struct, origin, **changes)


def a_call(name, method=None, index=0, module=None, origin=None):
    return Call(name, name, method, index, module, origin, -1)


def through(recorder, call, value, args=(), perturb=None, record=True, patch=None):
    """One call, entered and exited, through `recorder` alone."""
    recorder.entered(call, args, record)
    return recorder.exited(call, value, perturb, record, patch)


def close(actual, expected):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected))


# -- Request -----------------------------------------------------------------


def test_a_discovery_request_asks_for_nothing_but_inputs_even_if_given_something():
    site = a_site("a")
    request = Request(
        selected=None,
        epsilons={"a": jnp.ones((2, 3))},
        patches={"a": jnp.zeros((2, 3))},
        patched={"a": site},
        with_inputs=True,
        batch_axis="batch",
    )
    assert request.discovering
    assert dict(request.epsilons) == {}
    assert dict(request.patches) == {}
    assert dict(request.patched) == {}
    # A discovery for a run that records inputs marks every call's inputs.
    assert request.with_inputs is True
    assert request.batch_axis == "batch"  # how it runs, not what it asks
    # An empty selection is a run that records nothing, not a discovery.
    run = Request(
        selected={}, patches={"a": 0.0}, patched={"a": site}, with_inputs=True
    )
    assert not run.discovering
    assert dict(run.patches) == {"a": 0.0}
    assert run.patched["a"] is site
    assert run.with_inputs is True


def test_patch_values_keeps_the_values_not_the_functions():
    def double(v):
        return v * 2

    value = jnp.zeros((2, 3))
    request = Request(selected={}, patches={"v": value, "f": double, "s": 1.5})
    values = request.patch_values()
    assert set(values) == {"v", "s"}
    assert values["v"] is value
    assert values["s"] == 1.5


def test_varied_replaces_epsilons_and_patch_values_and_keeps_the_rest():
    def double(v):
        return v * 2

    selected = {"a": a_site("a")}
    patched = {"v": a_site("v"), "f": a_site("f")}
    renames = {"a": ("a", 0)}
    inside = object()
    request = Request(
        selected=selected,
        epsilons={"a": jnp.ones((2, 3))},
        patches={"v": jnp.zeros((2, 3)), "f": double, "gone": jnp.ones((2, 3))},
        patched=patched,
        with_inputs=True,
        batch_axis="batch",
        renames=renames,
        inside=inside,
    )
    epsilon, row = jnp.full((2, 3), 0.5), jnp.full((2, 3), 7.0)
    varied = request.varied({"a": epsilon}, {"v": row})
    assert varied.epsilons == {"a": epsilon}
    assert varied.patches == {"v": row, "f": double}  # old values all replaced
    assert varied.selected is selected
    assert varied.patched is patched
    assert varied.with_inputs is True
    assert varied.batch_axis == "batch"
    assert varied.renames is renames
    assert varied.inside is inside
    assert varied.arrays is request.arrays
    # The request itself is unchanged (frozen).
    assert set(request.patches) == {"v", "f", "gone"}
    assert request.epsilons["a"] is not epsilon
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.with_inputs = False


def test_a_requests_inside_is_the_one_in_the_context_when_it_was_made():
    assert Request().inside is None
    inside, other = object(), object()
    token = context.INSIDE.set(inside)
    try:
        made_inside = Request(selected={})
        assert made_inside.inside is inside
        assert Request(inside=other).inside is other
    finally:
        context.INSIDE.reset(token)
    assert Request().inside is None
    # Read when made, not when used: a varied request keeps it too.
    assert made_inside.inside is inside
    assert made_inside.varied({}, {}).inside is inside
    assert Session(made_inside).inside is inside


# -- Naming ------------------------------------------------------------------


def test_naming_names_each_call_in_entry_order():
    naming = Naming()
    module, origin = object(), Lifted()
    first = naming.enter("encoder", None, module, origin)
    assert dataclasses.astuple(first)[:4] == ("encoder", "encoder", None, 0)
    assert first.module is module
    assert first.origin is origin
    assert first.slot == -1
    method = naming.enter("encoder/dense", "encode", None, None)
    naming.exit()
    again = naming.enter("encoder/dense", None, None, None)
    naming.exit()
    third = naming.enter("encoder/dense", None, None, None)
    naming.exit()
    naming.exit()
    other_method = naming.enter("encoder/dense", "encode", None, None)
    naming.exit()
    names = [c.name for c in (first, method, again, third, other_method)]
    assert names == [
        "encoder",
        "encoder/dense.encode",
        "encoder/dense",
        "encoder/dense#1",
        "encoder/dense.encode#1",
    ]
    assert [c.index for c in (method, again, third, other_method)] == [0, 0, 1, 1]


def test_naming_knows_the_calls_running_now():
    naming = Naming()
    assert naming.enclosing == ()
    assert naming.under_enclosing("h") == "h"
    naming.enter("a", None, None, None)
    naming.enter("a/b", "f", None, None)
    assert naming.enclosing == ("a", "a/b")
    assert naming.under_enclosing("h") == "a/b/h"
    naming.exit()
    assert naming.enclosing == ("a",)
    assert naming.under_enclosing("h") == "a/h"
    naming.exit()
    assert naming.enclosing == ()


def test_renames_map_the_names_counted_while_tracing_to_public_ones():
    # Discovery saw `cell` twice, and JAX kept only the second trace.
    found = [a_site("cell"), a_site("cell#1", index=1), a_site("head")]
    found = [dataclasses.replace(s, path=s.name.split("#")[0]) for s in found]
    assert renames_of(found) is None  # nothing discarded: counted as they come
    kept = renumbered(found, lambda site: site.name != "cell")
    assert [(s.name, s.index, s.traced_as) for s in kept] == [
        ("cell", 0, "cell#1"),
        ("head", 0, None),
    ]
    renames = renames_of(kept)
    assert renames == {"cell#1": ("cell", 0), "head": ("head", 0)}
    naming = Naming(renames)
    traced = [naming.enter(path, None, None, None) for path in ("cell", "cell")]
    traced.append(naming.enter("head", None, None, None))
    traced.append(naming.enter("unknown", None, None, None))
    assert [(c.name, c.index) for c in traced] == [
        ("cell" + DISCARDED, 0),
        ("cell", 0),
        ("head", 0),
        ("unknown" + DISCARDED, 0),
    ]


# -- DiscoveryRecorder ---------------------------------------------------------


def test_discovery_lists_each_call_as_a_site_in_entry_order_and_changes_nothing():
    recorder = DiscoveryRecorder()
    module, origin = object(), Lifted()
    outer = a_call("outer", module=module, origin=origin)
    inner = a_call("outer/inner", method="f", index=2)
    recorder.entered(outer, (jnp.ones(3),), True)
    x = jnp.arange(6.0, dtype=F32).reshape(2, 3)
    value = (x, jnp.arange(4, dtype=jnp.int32), "label")
    inner_value = through(recorder, inner, value)
    outer_value = recorder.exited(outer, jnp.ones((5,), jnp.bfloat16), None, True, None)
    close(inner_value[0], x)
    close(inner_value[1], np.arange(4))
    assert inner_value[1].dtype == jnp.int32
    assert inner_value[2] == "label"
    close(outer_value, np.ones(5))
    sites = recorder.discovered()
    assert [s.name for s in sites] == ["outer", "outer/inner"]  # entry order
    first, second = sites
    assert first.struct == jax.ShapeDtypeStruct((5,), jnp.bfloat16)
    assert (first.module, first.origin, first.stacked) == (module, origin, 0)
    assert second.struct == (
        jax.ShapeDtypeStruct((2, 3), F32),
        jax.ShapeDtypeStruct((4,), jnp.int32),
        None,
    )
    assert (second.path, second.method, second.index) == ("outer/inner", "f", 2)
    assert recorder.activations == {}
    assert recorder.inputs == {}


def test_discovery_answers_for_every_site():
    recorder = DiscoveryRecorder()
    assert recorder.learns_sites()
    assert recorder.needs_value("anything")
    assert recorder.keeps("anything")
    assert recorder.keeps_any(lambda site: False)  # no site is known yet
    value = {"a": jnp.ones(2), "n": jnp.arange(2)}
    assert recorder.kept_part(value) is value
    recorder.check_reached()  # discovery learns which sites there are
    assert recorder.discovered() == []


def test_a_run_adds_the_epsilon_of_a_selected_site_and_records_it():
    request = Request(
        selected={"s": a_site("s"), "plain": a_site("plain")},
        epsilons={"s": jnp.full((2, 3), 0.5)},
    )
    recorder = RunRecorder(request)
    x = jnp.ones((2, 3))
    close(through(recorder, a_call("s"), x), np.full((2, 3), 1.5))
    close(through(recorder, a_call("plain"), x), np.ones((2, 3)))
    close(through(recorder, a_call("other"), x * 3), np.full((2, 3), 3.0))
    assert set(recorder.activations) == {"s", "plain"}
    close(recorder.activations["s"], np.full((2, 3), 1.5))
    close(recorder.activations["plain"], np.ones((2, 3)))
    assert recorder.inputs == {}
    assert recorder.discovered() == []
    assert not recorder.learns_sites()


def test_a_run_perturbs_with_the_adapters_perturb_where_given():
    request = Request(
        selected={"s": a_site("s"), "t": a_site("t")},
        epsilons={"s": jnp.full((2, 3), 0.5)},
    )
    recorder = RunRecorder(request)
    seen = []

    def perturb(value):
        seen.append(value)
        return value * 10

    x = jnp.ones((2, 3))
    close(through(recorder, a_call("s"), x, perturb=perturb), np.full((2, 3), 10.0))
    assert len(seen) == 1 and seen[0] is x
    close(recorder.activations["s"], np.full((2, 3), 10.0))
    # No epsilon: nothing to add, so `perturb` is not called.
    close(through(recorder, a_call("t"), x, perturb=perturb), np.ones((2, 3)))
    assert len(seen) == 1


def test_a_run_adds_epsilons_and_records_only_floating_leaves():
    request = Request(
        selected={"s": a_site("s")},
        epsilons={"s": (jnp.full((2,), 0.25), None)},
    )
    recorder = RunRecorder(request)
    value = (jnp.ones((2,)), jnp.arange(2, dtype=jnp.int32))
    out = through(recorder, a_call("s"), value)
    close(out[0], [1.25, 1.25])
    close(out[1], [0, 1])
    assert out[1].dtype == jnp.int32
    recorded = recorder.activations["s"]
    close(recorded[0], [1.25, 1.25])
    assert recorded[1] is None


def test_a_run_records_the_inputs_of_selected_calls_with_inputs():
    selected = {"s": a_site("s")}
    recorder = RunRecorder(Request(selected=selected, with_inputs=True))
    x, n = jnp.ones((2, 3)), jnp.arange(3)
    through(recorder, a_call("s"), x, args=(x, 3, "mode", n))
    through(recorder, a_call("other"), x, args=(x,))
    assert set(recorder.inputs) == {"s"}
    recorded = recorder.inputs["s"]
    assert recorded[0] is x and recorded[3] is n
    assert recorded[1:3] == (None, None)
    # Without `with_inputs`, or where the adapter records them: none.
    without = RunRecorder(Request(selected=selected))
    through(without, a_call("s"), x, args=(x,))
    assert without.inputs == {}
    adapter_records = RunRecorder(Request(selected=selected, with_inputs=True))
    through(adapter_records, a_call("s"), x, args=(x,), record=False)
    assert adapter_records.inputs == {}
    assert adapter_records.activations == {}


def test_a_run_records_nothing_where_the_adapter_records_but_still_perturbs():
    request = Request(selected={"s": a_site("s")}, epsilons={"s": jnp.ones((2, 3))})
    recorder = RunRecorder(request)
    out = through(recorder, a_call("s"), jnp.ones((2, 3)), record=False)
    close(out, np.full((2, 3), 2.0))
    assert recorder.activations == {}
    recorder.check_reached()  # reached, if recorded elsewhere
    recorder.record("s", out * 2, inputs=(out,))
    close(recorder.activations["s"], np.full((2, 3), 4.0))
    assert recorder.inputs == {}  # not asked for


def test_a_run_applies_a_patch_value_and_a_patch_function():
    value = jnp.full((2, 3), 9.0)
    request = Request(
        selected={"f": a_site("f")},
        patches={"v": value, "f": lambda v: v * 0 + 2, "given": jnp.zeros((2, 3))},
        epsilons={"f": jnp.full((2, 3), 0.5)},
    )
    recorder = RunRecorder(request)
    x = jnp.ones((2, 3))
    assert through(recorder, a_call("v"), x) is value
    # Patched first, then perturbed and recorded.
    close(through(recorder, a_call("f"), x), np.full((2, 3), 2.5))
    close(recorder.activations["f"], np.full((2, 3), 2.5))
    assert set(recorder.activations) == {"f"}
    # The adapter's row of a patch value it carried wins over the session's.
    row = jnp.full((2, 3), 4.0)
    assert through(recorder, a_call("given"), x, patch=row) is row
    assert through(recorder, a_call("free"), x, patch=row) is row


@pytest.mark.parametrize(
    "patch, wording",
    [
        (jnp.zeros((3, 2)), "the patch has"),
        (jnp.zeros((2, 3), jnp.int32), "the patch has"),
        (lambda v: v[0], "the patch function returns"),
    ],
    ids=["shape", "dtype", "function"],
)
def test_a_patch_that_does_not_fit_raises_naming_the_site(patch, wording):
    recorder = RunRecorder(Request(selected={}, patches={"enc/dense#1": patch}))
    with pytest.raises(BridgeValueError, match=wording) as raised:
        through(recorder, a_call("enc/dense#1"), jnp.ones((2, 3)))
    assert "'enc/dense#1'" in str(raised.value)
    assert "(2, 3)" in str(raised.value)


def test_a_patch_function_may_keep_a_non_array_leaf_of_the_value():
    def zeroed(value):
        return value[0] * 0, value[1]

    recorder = RunRecorder(Request(selected={}, patches={"s": zeroed}))
    out = through(recorder, a_call("s"), (jnp.ones(2), 3))
    close(out[0], [0.0, 0.0])
    assert out[1] == 3


def test_a_misfit_patch_with_a_string_leaf_raises_the_error_naming_the_site():
    def shortened(value):
        return value[0][:1], value[1]

    recorder = RunRecorder(Request(selected={}, patches={"s": shortened}))
    with pytest.raises(BridgeValueError, match="'s'"):
        through(recorder, a_call("s"), (jnp.ones(2), "label"))


def test_a_patch_that_turns_a_non_array_leaf_into_an_array_does_not_fit():
    def arrayed(value):
        return value[0], jnp.asarray(value[1])

    recorder = RunRecorder(Request(selected={}, patches={"s": arrayed}))
    with pytest.raises(BridgeValueError, match=r"'s'.*'int'\).*\(\(\), dtype"):
        through(recorder, a_call("s"), (jnp.ones(2), 3))


def test_a_misfit_names_a_non_array_leaf_by_its_type():
    recorder = RunRecorder(Request(selected={}, patches={"s": lambda v: v[0][:1]}))
    with pytest.raises(BridgeValueError, match="'str'"):
        through(recorder, a_call("s"), (jnp.ones(2), "label"))


def test_a_patch_function_sees_the_whole_batch_under_the_probes_vmap():
    def centred(v):
        return v - v.mean(0, keepdims=True)

    request = Request(selected={}, patches={"s": centred}, batch_axis="batch")

    def one_example(x):
        return through(RunRecorder(request), a_call("s"), x)

    x = jnp.arange(6.0).reshape(3, 2) ** 2
    out = jax.vmap(one_example, axis_name="batch")(x)
    close(out, x - x.mean(0, keepdims=True))


def test_check_reached_names_a_selected_or_patched_site_never_reached():
    request = Request(
        selected={"a": a_site("a"), "b": a_site("b")},
        patches={"p": jnp.zeros((2, 3))},
    )
    recorder = RunRecorder(request)
    through(recorder, a_call("a"), jnp.ones((2, 3)))
    with pytest.raises(BridgeRuntimeError, match=r"Site 'b' .*\(nor \['p'\]\)"):
        recorder.check_reached()
    through(recorder, a_call("b"), jnp.ones((2, 3)))
    with pytest.raises(BridgeRuntimeError, match="Site 'p' ") as raised:
        recorder.check_reached()
    assert "nor" not in str(raised.value)
    through(recorder, a_call("p"), jnp.ones((2, 3)))
    recorder.check_reached()
    # Reached through the adapter's own recording or carried patch row too.
    other = RunRecorder(Request(selected={"c": a_site("c")}, patches={"q": 0.0}))
    other.record("c", jnp.ones(2))
    through(other, a_call("q"), jnp.ones(()), patch=jnp.zeros(()))
    other.check_reached()


def test_a_run_needs_and_keeps_only_its_selected_and_patched_sites():
    selected = {"a": a_site("a", shape=(4,)), "b": a_site("b")}
    recorder = RunRecorder(Request(selected=selected, patches={"p": 0.0}))
    assert [recorder.needs_value(n) for n in ("a", "b", "p", "x")] == [
        True,
        True,
        True,
        False,
    ]
    assert [recorder.keeps(n) for n in ("a", "b", "p", "x")] == [
        True,
        True,
        False,
        False,
    ]
    assert recorder.keeps_any(lambda site: site.struct.shape == (4,))
    assert not recorder.keeps_any(lambda site: site.name == "p")
    empty = RunRecorder(Request(selected={}))
    assert not empty.keeps_any(lambda site: True)
    value = (jnp.ones(2), jnp.arange(2))
    kept = recorder.kept_part(value)
    assert kept[0] is value[0] and kept[1] is None


def test_tapping_installs_a_route_only_within_its_block():
    taps = Taps()
    assert taps.route is None

    def first(name, value):
        return value

    def second(name, value):
        return value

    with taps.tapping(first):
        assert taps.route is first
        with taps.tapping(second):
            assert taps.route is second
        assert taps.route is first
        with pytest.raises(KeyError), taps.tapping(second):
            raise KeyError("left early")
        assert taps.route is first
    assert taps.route is None


def test_a_tap_goes_through_the_route_where_one_is_installed():
    session = Session()
    routed = []

    def route(name, value):
        routed.append((name, value))
        return value * 2

    outer = session.enter("block", None, None)
    with session.taps.tapping(route):
        close(session.tap("h", jnp.ones(2)), [2.0, 2.0])
    assert [name for name, _ in routed] == ["h"]
    assert session.discovered() == []  # `block` is listed when it returns
    # No route: `tap_here`, named under the call running now.
    close(session.tap("h", jnp.ones(2)), [1.0, 1.0])
    close(session.tap_here("h", jnp.ones(3)), np.ones(3))
    session.exit(outer, jnp.ones(1))
    session.tap_here("top", jnp.ones(4))
    sites = session.discovered()
    assert [s.name for s in sites] == ["block", "block/h", "block/h#1", "top"]
    assert [s.path for s in sites] == ["block", "block/h", "block/h", "top"]
    assert all(s.module is None for s in sites[1:])
    assert sites[2].struct == jax.ShapeDtypeStruct((3,), F32)
    assert session.enclosing == ()


def test_a_tap_in_a_run_is_perturbed_and_recorded():
    tapped = a_site("block/h")
    session = Session(
        Request(selected={"block/h": tapped}, epsilons={"block/h": jnp.ones(2)})
    )
    outer = session.enter("block", None, None)
    close(session.tap("h", jnp.full((2,), 3.0)), [4.0, 4.0])
    session.exit(outer, jnp.ones(1))
    close(session.activations["block/h"], [4.0, 4.0])
    session.check_reached()


def test_bridge_tap_outside_a_session_is_the_value_itself():
    value = jnp.ones(2)
    assert current_session() is None
    assert bridge.tap("h", value) is value
    assert bridge.tap(3, value) is value  # no session: not even checked
    session = Session()
    with session.active():
        with pytest.raises(BridgeTypeError, match="non-empty string"):
            bridge.tap("", value)
        close(bridge.tap("h", value), np.ones(2))
    assert [s.name for s in session.discovered()] == ["h"]


# -- Session -------------------------------------------------------------------


def test_a_session_is_a_facade_over_its_request():
    def double(v):
        return v * 2

    selected = {"a": a_site("a")}
    request = Request(
        selected=selected,
        epsilons={"a": 1.0},
        patches={"f": double},
        patched={"f": a_site("f")},
        with_inputs=True,
        batch_axis="batch",
    )
    session = Session(request)
    assert session.request is request
    assert session.selected is selected
    assert session.epsilons == {"a": 1.0}
    assert session.patches == {"f": double}
    assert set(session.patched) == {"f"}
    assert (session.with_inputs, session.batch_axis) == (True, "batch")
    assert session.arrays is request.arrays
    assert isinstance(session.recorder, RunRecorder)
    discovery = Session()
    assert isinstance(discovery.recorder, DiscoveryRecorder)
    assert dict(discovery.selected) == {}
    assert discovery.request.discovering


def test_active_makes_the_session_current_only_inside():
    session, inner = Session(), Session()
    assert current_session() is None
    with session.active() as yielded:
        assert yielded is session
        assert current_session() is session
        call = session.enter("a", None, None)
        with inner.active():
            assert current_session() is inner
            bridge.tap("h", jnp.ones(2))
        assert current_session() is session
        bridge.tap("h", jnp.ones(2))
        session.exit(call, jnp.ones(2))
    assert current_session() is None
    assert [s.name for s in session.discovered()] == ["a", "a/h"]
    assert [s.name for s in inner.discovered()] == ["h"]
    with pytest.raises(KeyError), session.active():
        raise KeyError("left early")
    assert current_session() is None


# -- No part holds the session ---------------------------------------------------


def _reaches(roots, target, limit=200_000):
    """Whether `target` is reachable from `roots` through the objects they
    refer to: not through classes, modules or a function's globals (shared
    by everything), but through a function's closure and defaults."""
    seen, stack = {}, list(roots)
    while stack:
        obj = stack.pop()
        if obj is target:
            return True
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType)):
            continue
        seen[id(obj)] = obj
        assert len(seen) < limit, "too much to walk: the test is inconclusive"
        if isinstance(obj, types.FunctionType):
            for cell in obj.__closure__ or ():
                try:
                    stack.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    pass
            stack.extend(obj.__defaults__ or ())
            stack.extend((obj.__kwdefaults__ or {}).values())
            continue
        stack.extend(gc.get_referents(obj))
    return False


def _use(session):
    """A session at work on everything that might keep a reference to it."""

    def route(name, value):
        return session.tap_here(name, value)

    with session.active():
        outer = session.enter("block", "f", object(), (jnp.ones(2), 3), Lifted())
        with session.taps.tapping(route):
            bridge.tap("h", jnp.ones(2))
        session.exit(outer, jnp.ones((2, 3)))
    session.check_reached()


def _requests():
    selected = {"block.f": a_site("block.f", origin=Lifted())}
    return {
        "discovery": Request(),
        "run": Request(
            selected=selected,
            epsilons={"block.f": jnp.ones((2, 3))},
            patches={"block/h": lambda v: v + 1},
            patched={"block/h": a_site("block/h", shape=(2,))},
            with_inputs=True,
        ),
    }


@pytest.mark.parametrize("kind", ["discovery", "run"])
def test_no_part_refers_to_the_session(kind):
    session = Session(_requests()[kind])
    _use(session)
    assert session.discovered() or session.activations  # it did work
    parts = {
        "request": session.request,
        "naming": session.naming,
        "recorder": session.recorder,
        "taps": session.taps,
    }
    for name, part in parts.items():
        assert not any(r is session for r in gc.get_referents(part)), name
        assert not _reaches([part], session), name
    # The check can fail: a part holding the session is found.
    session.taps.route = session.tap
    assert _reaches([session.taps], session)


@pytest.mark.parametrize("kind", ["discovery", "run"])
def test_a_session_is_freed_without_the_garbage_collector(kind):
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        session = Session(_requests()[kind])
        _use(session)
        parts = [session.naming, session.recorder, session.taps]
        ref = weakref.ref(session)
        del session
        assert ref() is None
        # A cycle through the session would keep it: the check can fail.
        cyclic = Session(_requests()[kind])
        cyclic.taps.route = cyclic.tap
        cyclic_ref = weakref.ref(cyclic)
        del cyclic
        assert cyclic_ref() is not None
    finally:
        if was_enabled:
            gc.enable()
    gc.collect()
    assert cyclic_ref() is None
    assert parts  # the parts outlive the session without reviving it
