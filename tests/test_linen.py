"""Flax Linen specifics beyond the conformance suite."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.linen import DropoutNet, SharedMLP, perturbed_apply
from helpers import (
    assert_tree_allclose,
    random_like,
    tree_vdot,
    unrolled_linen_steps,
    value_and_grad_in,
)

# JAX's own scan, bound before any probe runs (`from jax.lax import scan`, a
# spelling of its own): the same `scan` in the computation as `jax.lax.scan`.
from jax.lax import scan as uncounted_scan

import bridge


def mse(y):
    return jnp.mean(jnp.square(y - 0.5))


@pytest.fixture(scope="module")
def mlp():
    model = SharedMLP()
    x = jax.random.normal(jax.random.key(1), (4, 8))
    return model, model.init(jax.random.key(0), x), x


def test_any_batch_size_without_a_new_init(mlp):
    model, variables, _ = mlp
    probe = bridge.probe(model, variables)
    step = jax.jit(lambda probe, x: probe.value_and_grad(mse, x))
    for batch in (1, 3, 16):
        x = jnp.ones((batch, 8))
        assert probe.sites(x)["Dense_2"].shape == (batch, 3)
        assert step(probe, x).activation_grads["Dense_0"].shape == (batch, 8)


def test_dropout_numbers_are_those_of_plain_apply_with_the_same_key():
    model = DropoutNet()
    x = jnp.ones((4, 6))
    variables = model.init({"params": jax.random.key(0)}, x)
    probe = bridge.probe(model, variables)
    for seed in (3, 4):
        rngs = {"dropout": jax.random.key(seed)}
        res = probe.value_and_grad(mse, x, rngs=rngs)
        np.testing.assert_allclose(res.loss, mse(model.apply(variables, x, rngs=rngs)))
    first = probe.value_and_grad(mse, x, rngs={"dropout": jax.random.key(3)})
    second = probe.value_and_grad(mse, x, rngs={"dropout": jax.random.key(4)})
    assert not np.allclose(
        first.activations["Dropout_0"], second.activations["Dropout_0"]
    )


def test_mutable_true_returns_every_collection_but_the_probe_own():
    class Counter(nn.Module):
        @nn.compact
        def __call__(self, x):
            count = self.variable("counter", "n", lambda: jnp.zeros((), jnp.int32))
            count.value += 1
            return nn.Dense(2)(x)

    model = Counter()
    x = jnp.ones((2, 3))
    variables = model.init(jax.random.key(0), x)
    res = bridge.probe(model, variables).value_and_grad(mse, x, mutable=True)
    assert set(res.state) == {"params", "counter"}
    assert res.state["counter"]["n"] == 2
    assert variables["counter"]["n"] == 1


def test_a_model_that_calls_perturb_itself_keeps_working():
    class SelfPerturbing(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = self.perturb("h", nn.Dense(4)(x))
            return nn.Dense(1)(h)

    model = SelfPerturbing()
    x = jnp.ones((2, 3))
    variables = model.init(jax.random.key(0), x)
    assert "perturbations" in variables
    res = bridge.probe(model, variables).value_and_grad(mse, x)
    own = jax.grad(lambda v: mse(model.apply(v, x)))(variables)
    np.testing.assert_allclose(
        res.activation_grads["Dense_0"], own["perturbations"]["h"], rtol=1e-5
    )


def test_vmap_true_maps_a_single_example_model():
    wrapper_model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(3)])
    x = jax.random.normal(jax.random.key(2), (6, 5))
    variables = wrapper_model.init(jax.random.key(0), x[0])
    batched = bridge.probe(wrapper_model, variables, vmap=True)
    plain = bridge.probe(wrapper_model, variables)
    res, ref = batched.value_and_grad(mse, x), plain.value_and_grad(mse, x)
    assert batched.sites(x)["layers_0"].shape == (6, 4)
    assert_tree_allclose(res.activation_grads, ref.activation_grads)
    assert_tree_allclose(res.grads, ref.grads, rtol=1e-5, atol=1e-6)


def test_jax_vmap_over_value_and_grad_gives_per_example_gradients(mlp):
    model, variables, x = mlp
    probe = bridge.probe(model, variables)
    per_example = jax.vmap(lambda xi: probe.value_and_grad(mse, xi[None]), 0)(x)
    for i in range(x.shape[0]):
        single = probe.value_and_grad(mse, x[i : i + 1])
        assert_tree_allclose(
            jax.tree.map(lambda a, i=i: a[i], per_example.activation_grads),
            single.activation_grads,
        )


def test_jax_grad_through_the_probe_equals_plain_grad(mlp):
    model, variables, x = mlp
    probe = bridge.probe(model, variables)
    through = jax.grad(lambda x: probe.value_and_grad(mse, x, at="Dense_2").loss)(x)
    plain = jax.grad(lambda x: mse(model.apply(variables, x)))(x)
    np.testing.assert_allclose(through, plain, rtol=1e-5, atol=1e-7)


def test_a_user_jit_step_takes_the_probe_as_an_argument(mlp):
    model, variables, x = mlp

    traces = []

    @jax.jit
    def step(probe, x):
        traces.append(None)
        res = probe.value_and_grad(mse, x)
        return res.loss, {
            k: jnp.linalg.norm(g) for k, g in res.activation_grads.items()
        }

    loss, norms = step(bridge.probe(model, variables), x)
    scaled = jax.tree.map(lambda p: 2 * p, variables)
    loss2, _ = step(bridge.probe(model, scaled), x)
    # New parameters: no new trace. (Counted by the trace itself: the size of
    # JAX's cache also depends on what other tests left in the process.)
    assert len(traces) == 1
    assert loss != loss2 and set(norms) == set(bridge.probe(model, variables).sites(x))


def test_the_reference_hook_really_perturbs(mlp):
    """Guard the conformance reference: it must move the loss."""
    model, variables, x = mlp
    probe = bridge.probe(model, variables)
    res = probe.value_and_grad(mse, x)
    delta = random_like(probe.sites(x)["Dense_0#1"])
    moved = mse(perturbed_apply(model, variables, "Dense_0#1", delta, (x,), {}))
    assert not np.isclose(moved, res.loss)
    assert not np.isclose(tree_vdot(res.activation_grads["Dense_0#1"], delta), 0.0)


# -- errors ------------------------------------------------------------------------


def test_a_module_without_variables_is_refused():
    with pytest.raises(TypeError, match=r"needs its variables: bridge.probe\(module"):
        bridge.probe(nn.Dense(3))


def test_variables_of_the_wrong_kind_are_refused():
    with pytest.raises(TypeError, match="`variables` must be the dict returned"):
        bridge.probe(nn.Dense(3), [1, 2])
    params = nn.Dense(3).init(jax.random.key(0), jnp.ones((1, 2)))["params"]
    with pytest.raises(
        ValueError, match=r"no 'params' collection .* \{'params': params\}"
    ):
        bridge.probe(nn.Dense(3), params)


def test_mutable_of_the_wrong_kind_is_refused(mlp):
    model, variables, x = mlp
    with pytest.raises(TypeError, match="`mutable` goes to Module.apply"):
        bridge.probe(model, variables).value_and_grad(mse, x, mutable=3)


def test_selecting_an_integer_site_explicitly_is_refused():
    class Argmax(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jnp.argmax(x, axis=-1)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(x) * Argmax()(x)[:, None].astype(x.dtype)

    x = jnp.ones((2, 3))
    probe = bridge.probe(Model(), Model().init(jax.random.key(0), x))
    assert list(probe.sites(x)) == ["Dense_0"]
    with pytest.raises(ValueError, match="selects only sites with integer values"):
        probe.value_and_grad(lambda y: y.sum(), x, at="Argmax_0")


# -- lifted transforms -------------------------------------------------------------


class ScannedBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.Dense(4)(x)
        return nn.tanh(nn.LayerNorm()(h)) + x, h


class ScannedStack(nn.Module):
    """A scanned stack as users write it: nothing names a perturbation."""

    @nn.compact
    def __call__(self, x):
        scan = nn.scan(
            ScannedBlock,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=3,
        )
        x, hs = scan()(nn.Dense(4)(x), None)
        return nn.Dense(2)(x) + hs.mean()


class UnrolledStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        x, hs = nn.Dense(4)(x), []
        for _ in range(3):
            x, h = ScannedBlock()(x, None)
            hs.append(h)
        return nn.Dense(2)(x) + jnp.stack(hs).mean()


def unrolled_variables(scanned):
    params = dict(scanned["params"])
    stacked = params.pop("ScanScannedBlock_0")
    for i in range(3):
        params[f"ScannedBlock_{i}"] = jax.tree.map(lambda a, i=i: a[i], stacked)
    return {"params": params}


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_scanned_site_stacks_iterations_and_equals_the_unrolled_model(mode):
    x = jax.random.normal(jax.random.key(0), (5, 4))
    variables = ScannedStack().init(jax.random.key(1), x)
    scanned = bridge.probe(ScannedStack(), variables)
    unrolled = bridge.probe(UnrolledStack(), unrolled_variables(variables))
    assert list(scanned.sites(x)) == [
        "Dense_0",
        "ScanScannedBlock_0",
        "ScanScannedBlock_0/Dense_0",
        "ScanScannedBlock_0/LayerNorm_0",
        "Dense_1",
    ]
    assert scanned.sites(x)["ScanScannedBlock_0/Dense_0"].shape == (3, 5, 4)

    def run(probe, x):
        return probe.value_and_grad(mse, x)

    if mode == "jit":
        run = jax.jit(run)
    res, ref = run(scanned, x), run(unrolled, x)
    np.testing.assert_allclose(res.loss, ref.loss, rtol=1e-5)
    for layer in ("Dense_0", "LayerNorm_0"):
        for i in range(3):
            for field in ("activations", "activation_grads"):
                np.testing.assert_allclose(
                    getattr(res, field)[f"ScanScannedBlock_0/{layer}"][i],
                    getattr(ref, field)[f"ScannedBlock_{i}/{layer}"],
                    rtol=1e-5,
                    atol=1e-6,
                )
    plain = jax.grad(lambda p: mse(ScannedStack().apply({"params": p}, x)))(
        variables["params"]
    )
    assert_tree_allclose(res.grads, plain, rtol=1e-5, atol=1e-6)


def test_with_vmap_a_scanned_site_has_the_batch_axis_after_the_iterations():
    x = jax.random.normal(jax.random.key(0), (5, 4))
    variables = ScannedStack().init(jax.random.key(1), x[0])
    scanned = bridge.probe(ScannedStack(), variables, vmap=True)
    unrolled = bridge.probe(UnrolledStack(), unrolled_variables(variables), vmap=True)
    site = "ScanScannedBlock_0/Dense_0"
    assert scanned.sites(x)[site].shape == (3, 5, 4)
    run = jax.jit(lambda probe, x: probe.value_and_grad(mse, x, at="*Dense_0"))
    res, ref = run(scanned, x), run(unrolled, x)
    for i in range(3):
        for field in ("activations", "activation_grads"):
            np.testing.assert_allclose(
                getattr(res, field)[site][i],
                getattr(ref, field)[f"ScannedBlock_{i}/Dense_0"],
                rtol=1e-5,
                atol=1e-6,
            )


def unrolled_rnn(cell, params, xs, edits):
    """`nn.RNN(cell)` over `xs` (batch, steps, features) unrolled in Python,
    without bridge (`unrolled_linen_steps`)."""
    carry = cell.initialize_carry(jax.random.key(0), xs[:, 0].shape)
    return unrolled_linen_steps(
        lambda carry, x: cell.apply({"params": params}, carry, x), carry, xs, edits
    )


def keep(step, out):
    return out


def added(offsets, per_step=True):
    """An edit adding `offsets`: row `step` at each step (`per_step`), else the
    one offset at every step."""
    return lambda step, out: jax.tree.map(
        lambda o, d: o + (d[step] if per_step else d), out, offsets
    )


def test_a_scan_that_broadcasts_params_is_a_site_per_step_as_in_the_unrolled_cell():
    xs = jax.random.normal(jax.random.key(3), (2, 3, 4))
    model = nn.RNN(nn.LSTMCell(5))
    variables = model.init(jax.random.key(0), xs)
    params = variables["params"]["cell"]
    probe = bridge.probe(model, variables)
    # Every step's call, stacked: (steps, batch, features); carry, then output.
    sites = probe.sites(xs)
    assert jax.tree.map(jnp.shape, sites["cell"]) == (((3, 2, 5), (3, 2, 5)), (3, 2, 5))
    assert sites["cell/hi"].shape == (3, 2, 5)

    def hand_loss(edits):
        return mse(unrolled_rnn(model.cell, params, xs, edits)[0])

    _, values = unrolled_rnn(model.cell, params, xs, {"": keep, "hi": keep})
    zeros = jax.tree.map(jnp.zeros_like, values)
    by_step = {
        name: jax.grad(lambda d, name=name: hand_loss({name: added(d)}))(zeros[name])
        for name in values
    }
    one_offset = {
        name: jax.grad(lambda d, name=name: hand_loss({name: added(d, False)}))(
            jax.tree.map(lambda z: z[0], zeros[name])
        )
        for name in values
    }
    loss, grads = jax.value_and_grad(lambda p: mse(model.apply({"params": p}, xs)))(
        variables["params"]
    )

    def run(probe, xs):
        return probe.value_and_grad(mse, xs, at=["cell", "cell/hi"])

    for res in (run(probe, xs), jax.jit(run)(probe, xs)):
        assert set(res.activations) == {"cell", "cell/hi"}
        np.testing.assert_allclose(res.loss, loss, rtol=1e-6)
        assert_tree_allclose(res.grads, grads)
        for site, name in (("cell", ""), ("cell/hi", "hi")):
            assert_tree_allclose(res.activations[site], values[name])
            assert_tree_allclose(res.activation_grads[site], by_step[name])
            summed = jax.tree.map(lambda g: g.sum(0), res.activation_grads[site])
            assert_tree_allclose(summed, one_offset[name])
        # The bias identity: `hi`'s bias gradient sums its output's over steps
        # and the batch.
        np.testing.assert_allclose(
            res.activation_grads["cell/hi"].sum((0, 1)),
            grads["cell"]["hi"]["bias"],
            rtol=1e-5,
            atol=1e-6,
        )

    # Patches per step: a stacked value at the cell replaces each step's
    # carry and output (the next step's `hi` reads the patched carry); a
    # stacked value or a function at `hi`, each step's own.
    cell_value = random_like(sites["cell"], seed=4)
    hi_value = random_like(sites["cell/hi"], seed=5)

    def row(value):
        return lambda step, out: jax.tree.map(lambda v: v[step], value)

    cases = [
        ({"cell": cell_value}, {"": row(cell_value), "hi": keep}),
        ({"cell/hi": hi_value}, {"": keep, "hi": row(hi_value)}),
        ({"cell/hi": lambda h: 2 * h + 1}, {"": keep, "hi": lambda t, h: 2 * h + 1}),
    ]
    for patch, edits in cases:
        outputs, values = unrolled_rnn(model.cell, params, xs, edits)

        def patched(probe, xs, patch=patch):
            return probe.apply(xs, at=["cell", "cell/hi"], patch=patch)

        for res in (patched(probe, xs), jax.jit(patched)(probe, xs)):
            assert_tree_allclose(res.outputs, outputs)
            assert_tree_allclose(res.activations["cell"], values[""])
            assert_tree_allclose(res.activations["cell/hi"], values["hi"])


def test_layer_inputs_inside_remat_leave_through_the_collection():
    from cases.linen import Rematerialised

    x = jax.random.normal(jax.random.key(0), (3, 4))
    model = Rematerialised()
    probe = bridge.probe(model, model.init(jax.random.key(1), x))

    def run(probe, x):
        return probe.value_and_grad(mse, x, with_inputs=True)

    for res in (run(probe, x), jax.jit(run)(probe, x)):
        (first,) = res.inputs["CheckpointBlock_0/Dense_0"]
        (second,) = res.inputs["CheckpointBlock_0/Dense_0#1"]
        np.testing.assert_allclose(first, res.activations["Dense_0"], rtol=1e-5)
        np.testing.assert_allclose(
            second, res.activations["CheckpointBlock_0"], rtol=1e-5
        )


# -- taps --------------------------------------------------------------------------


class Tapped(nn.Module):
    """Taps at the root, in a submodule and in a plain function it calls.

    `offsets` is the reference's hand-inserted perturbation: `{tap: delta}`.
    """

    offsets: Any = None

    @nn.compact
    def __call__(self, x):
        h = bridge.tap("pre", offset(self.offsets, "pre", nn.Dense(6)(x)))
        h = TappedBlock(offsets=self.offsets)(jnp.tanh(h))
        return nn.Dense(2)(bridge.tap("pre", offset(self.offsets, "pre#1", h)))


def offset(offsets, site, value):
    delta = (offsets or {}).get(site)
    return value if delta is None else value + delta


class TappedBlock(nn.Module):
    offsets: Any = None

    @nn.compact
    def __call__(self, x):
        def gate(v):  # a plain function called from the module's code
            return bridge.tap("gate", offset(self.offsets, "TappedBlock_0/gate", v))

        return gate(jax.nn.sigmoid(nn.Dense(6)(x))) * x


def test_taps_are_sites_with_gradients_equal_to_jvp_of_a_hand_inserted_offset():
    x = jax.random.normal(jax.random.key(0), (3, 4))
    variables = Tapped().init(jax.random.key(1), x)
    probe = bridge.probe(Tapped(), variables)
    assert list(probe.sites(x)) == [
        "Dense_0",
        "pre",
        "TappedBlock_0",
        "TappedBlock_0/Dense_0",
        "TappedBlock_0/gate",
        "pre#1",
        "Dense_1",
    ]

    def run(probe, x):
        return probe.value_and_grad(mse, x)

    for res in (run(probe, x), jax.jit(run)(probe, x)):
        for seed, name in enumerate(("pre", "TappedBlock_0/gate", "pre#1")):
            delta = random_like(probe.sites(x)[name], seed)

            def loss_along(t, name=name, delta=delta):
                model = Tapped(offsets={name: t * delta})
                return mse(model.apply(variables, x))

            _, expected = jax.jvp(loss_along, (0.0,), (1.0,))
            np.testing.assert_allclose(
                tree_vdot(res.activation_grads[name], delta), expected, rtol=1e-4
            )


def test_a_tap_can_be_selected_and_patched():
    x = jax.random.normal(jax.random.key(0), (3, 4))
    probe = bridge.probe(Tapped(), Tapped().init(jax.random.key(1), x))
    res = probe.value_and_grad(mse, x, at="*gate", patch={"pre": jnp.zeros_like})
    assert list(res.activations) == ["TappedBlock_0/gate"]
    # With `pre` zeroed, the block sees tanh(0) = 0: its gate input is the bias.
    fwd = probe.apply(x, at="TappedBlock_0/Dense_0", patch={"pre": jnp.zeros_like})
    bias = probe.variables["params"]["TappedBlock_0"]["Dense_0"]["bias"]
    np.testing.assert_allclose(
        fwd.activations["TappedBlock_0/Dense_0"], jnp.broadcast_to(bias, (3, 6))
    )


class Ensemble(nn.Module):
    """`nn.vmap` over independent parameter sets: sites stack the members."""

    broadcast: bool = False

    @nn.compact
    def __call__(self, x):
        axes = {"params": None} if self.broadcast else {"params": 0}
        members = nn.vmap(
            lambda module, x: module(x),
            variable_axes=axes,
            split_rngs={"params": not self.broadcast},
            in_axes=0,
        )
        return members(ScannedBlockBody(), x)


class ScannedBlockBody(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.tanh(nn.Dense(4)(x))


def test_nn_vmap_over_parameter_sets_stacks_members_and_equals_each_member():
    x = jax.random.normal(jax.random.key(0), (3, 2, 4))
    variables = Ensemble().init(jax.random.key(1), x)
    res = bridge.probe(Ensemble(), variables).value_and_grad(mse_zero, x)
    site = "ScannedBlockBody_0/Dense_0"
    assert res.activation_grads[site].shape == (3, 2, 4)
    members = variables["params"]["ScannedBlockBody_0"]["Dense_0"]
    for i in range(3):
        expected = x[i] @ members["kernel"][i] + members["bias"][i][None]
        np.testing.assert_allclose(res.activations[site][i], expected, rtol=1e-5)
    # The output is tanh of the site: d mean(tanh(h)^2) / dh, member by member.
    h = res.activations[site]
    expected_grad = 2 * jnp.tanh(h) * (1 - jnp.tanh(h) ** 2) / h.size
    np.testing.assert_allclose(res.activation_grads[site], expected_grad, rtol=1e-5)


def mse_zero(y):
    return jnp.mean(jnp.square(y))


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_nn_vmap_that_broadcasts_params_is_a_site_per_member(mode):
    """`variable_axes={'params': None}`: every member reads the same
    parameters, and each member's call is its own (per-member gradients),
    against the members written by hand with an offset at each site."""
    x = jax.random.normal(jax.random.key(0), (3, 2, 4))
    model = Ensemble(True)
    variables = model.init(jax.random.key(1), x)
    probe = bridge.probe(model, variables)
    sites = probe.sites(x)
    assert list(sites) == ["ScannedBlockBody_0", "ScannedBlockBody_0/Dense_0"]
    assert sites["ScannedBlockBody_0"].shape == (3, 2, 4)  # the members first
    dense = variables["params"]["ScannedBlockBody_0"]["Dense_0"]

    def by_hand(offsets, dense):
        pre = x @ dense["kernel"] + dense["bias"][None, None]
        pre = pre + offsets["ScannedBlockBody_0/Dense_0"]
        return mse(jnp.tanh(pre) + offsets["ScannedBlockBody_0"])

    zeros = {name: jnp.zeros((3, 2, 4)) for name in sites}
    loss, (site_grads, dense_grads) = jax.value_and_grad(by_hand, (0, 1))(zeros, dense)
    res = value_and_grad_in(mode, probe, mse, (x,))
    np.testing.assert_allclose(res.loss, loss, rtol=1e-6)
    assert_tree_allclose(res.activation_grads, site_grads)
    assert_tree_allclose(res.grads["ScannedBlockBody_0"]["Dense_0"], dense_grads)
    pre = x @ dense["kernel"] + dense["bias"][None, None]
    assert_tree_allclose(res.activations["ScannedBlockBody_0/Dense_0"], pre)
    assert_tree_allclose(res.activations["ScannedBlockBody_0"], jnp.tanh(pre))


# -- an `apply` the model makes itself (a tied LM head) -------------------------


class _Head(nn.Module):
    @nn.compact
    def __call__(self, h):
        return nn.Dense(6, name="proj")(nn.LayerNorm(name="norm")(h))


class _TiedLM(nn.Module):
    """Hugging Face's tied GPT-2 head in miniature: a submodule applied with
    variables the model hands it, `self.head.apply({"params": ...}, h)`."""

    def setup(self):
        self.embed = nn.Embed(6, 4)
        self.head = _Head()

    def __call__(self, ids):
        h = self.embed(ids)
        if self.is_initializing():
            return self.head(h)
        head_params = dict(self.variables["params"]["head"])
        head_params["proj"] = {
            "kernel": self.variables["params"]["embed"]["embedding"].T,
            "bias": head_params["proj"]["bias"],
        }
        return self.head.apply({"params": head_params}, h)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_an_apply_the_model_makes_itself_is_a_site_under_its_name(mode):
    model, ids = _TiedLM(), jnp.array([[0, 3, 5], [2, 2, 1]])
    variables = model.init(jax.random.key(0), ids)
    probe = bridge.probe(model, variables)
    assert list(probe.sites(ids)) == ["embed", "head", "head/norm", "head/proj"]

    def loss(y):
        return jnp.sum(jnp.sin(y) ** 2)

    res = value_and_grad_in(mode, probe, loss, (ids,))
    params = variables["params"]
    plain_loss, plain_grads = jax.value_and_grad(
        lambda p: loss(model.apply({"params": p}, ids))
    )(params)
    np.testing.assert_allclose(res.loss, plain_loss, rtol=1e-5)
    assert_tree_allclose(res.grads, plain_grads, rtol=1e-5, atol=1e-6)
    # Values: the head's LayerNorm of the embedding, computed on its own.
    embedded = params["embed"]["embedding"][ids]
    normed = nn.LayerNorm().apply({"params": params["head"]["norm"]}, embedded)
    np.testing.assert_allclose(res.activations["head/norm"], normed, atol=1e-6)
    # The bias identity at the projection; the head's gradient at the output.
    np.testing.assert_allclose(
        res.activation_grads["head/proj"].sum((0, 1)),
        plain_grads["head"]["proj"]["bias"],
        rtol=1e-5,
    )
    output = model.apply(variables, ids)
    np.testing.assert_allclose(
        res.activation_grads["head"], jax.grad(loss)(output), rtol=1e-5
    )
    # And the jvp of an offset the test adds at the LayerNorm inside the apply.
    delta = random_like(jax.ShapeDtypeStruct(normed.shape, normed.dtype), seed=3)

    def loss_along(t):
        def add(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            if context.module.name == "norm":
                out = out + t * delta
            return out

        with nn.intercept_methods(add):
            return loss(model.apply(variables, ids))

    _, directional = jax.jvp(loss_along, (0.0,), (1.0,))
    assert abs(directional) > 1e-3  # the offset moves the loss
    np.testing.assert_allclose(
        tree_vdot(res.activation_grads["head/norm"], delta), directional, rtol=1e-4
    )


# -- taps inside lifted transforms ------------------------------------------------


class _TappedCell(nn.Module):
    @nn.compact
    def __call__(self, carry, _):
        hidden = bridge.tap("pre", jnp.tanh(nn.Dense(4, name="dense")(carry)))
        return hidden * 0.5 + carry, hidden


class _TappedStack(nn.Module):
    remat: bool = False

    @nn.compact
    def __call__(self, x):
        cell = nn.remat(_TappedCell) if self.remat else _TappedCell
        stack = nn.scan(
            cell, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
        )
        carry, hidden = stack(name="cells")(x, None)
        return jnp.sum(hidden, axis=0) + carry


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_tap_inside_nn_scan_and_nn_remat_is_stacked_like_the_modules_there(
    mode, remat
):
    model = _TappedStack(remat=remat)
    x = jax.random.normal(jax.random.key(1), (2, 4))
    variables = model.init(jax.random.key(0), x)
    probe = bridge.probe(model, variables)
    sites = probe.sites(x)
    # One site per call in the body, however often Flax traces it (twice for
    # nn.scan, and again for the nn.remat inside it).
    assert set(sites) == {"cells", "cells/dense", "cells/pre"}
    assert sites["cells/pre"].shape == (3, 2, 4)
    res = value_and_grad_in(mode, probe, mse, (x,))
    # The reference: the scan unrolled by hand, with an offset at the tap.
    dense = variables["params"]["cells"]["dense"]
    delta = random_like(jax.ShapeDtypeStruct((3, 2, 4), jnp.float32), seed=5)

    def unrolled(t):
        carry, hidden = x, []
        for i in range(3):
            pre = jnp.tanh(carry @ dense["kernel"][i] + dense["bias"][i][None])
            pre = pre + t * delta[i]
            hidden.append(pre)
            carry = pre * 0.5 + carry
        return jnp.stack(hidden), mse(sum(hidden) + carry)

    (taps, loss), (_, directional) = jax.jvp(unrolled, (0.0,), (1.0,))
    np.testing.assert_allclose(res.loss, loss, rtol=1e-5)
    np.testing.assert_allclose(res.activations["cells/pre"], taps, atol=1e-6)
    assert abs(directional) > 1e-3  # the offset moves the loss
    np.testing.assert_allclose(
        tree_vdot(res.activation_grads["cells/pre"], delta), directional, rtol=1e-4
    )
    # The module there keeps its own epsilon beside the tap's: the bias
    # identity per iteration.
    np.testing.assert_allclose(
        res.activation_grads["cells/dense"].sum(1),
        res.grads["cells"]["dense"]["bias"],
        rtol=1e-5,
        atol=1e-7,
    )


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("patched", ["cells/dense", "cells/pre"])
def test_a_stacked_patch_value_inside_nn_scan_gives_each_iteration_its_row(
    patched, mode, remat
):
    model = _TappedStack(remat=remat)
    x = jax.random.normal(jax.random.key(1), (2, 4))
    variables = model.init(jax.random.key(0), x)
    patch = random_like(jax.ShapeDtypeStruct((3, 2, 4), jnp.float32), seed=9)
    dense = variables["params"]["cells"]["dense"]
    delta = random_like(jax.ShapeDtypeStruct((3, 2, 4), jnp.float32), seed=5)

    def unrolled(t):
        carry, hidden = x, []
        for i in range(3):
            out = carry @ dense["kernel"][i] + dense["bias"][i][None]
            if patched == "cells/dense":
                out = patch[i]
            pre = patch[i] if patched == "cells/pre" else jnp.tanh(out)
            pre = pre + t * delta[i]
            hidden.append(pre)
            carry = pre * 0.5 + carry
        return jnp.stack(hidden), mse(sum(hidden) + carry)

    (taps, loss), (_, directional) = jax.jvp(unrolled, (0.0,), (1.0,))
    probe = bridge.probe(model, variables)
    # Selected or not, the patched site takes its row in each iteration.
    for at in (None, "cells/pre"):
        res = value_and_grad_in(
            mode, probe, mse, (x,), {"at": at, "patch": {patched: patch}}
        )
        np.testing.assert_allclose(res.loss, loss, rtol=1e-5)
        np.testing.assert_allclose(res.activations["cells/pre"], taps, atol=1e-6)
        np.testing.assert_allclose(
            tree_vdot(res.activation_grads["cells/pre"], delta),
            directional,
            rtol=1e-4,
        )


class _Trainer:
    """A wrapper of the kind users hand over by mistake: the model and its
    parameters in attributes, a `__call__` of its own."""

    def __init__(self, net: nn.Module, params: Any):
        self.net = net
        self.params = params

    def __call__(self, x):
        return self.net.apply({"params": self.params}, x)


def test_a_wrapper_holding_a_model_names_the_attribute_to_pass():
    net = nn.Dense(2)
    params = net.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
    with pytest.raises(
        TypeError,
        match=r"_Trainer that holds the model in its attribute 'net': pass that, "
        r"bridge\.probe\(model\.net, \{'params': model\.params\}\)",
    ) as info:
        bridge.probe(_Trainer(net, params))
    assert isinstance(info.value, bridge.BridgeError)


# -- sites inside JAX transforms of the model's own code --------------------------


SCAN_STEPS = 3


class InJaxTransforms(nn.Module):
    """`inner` applied by the model's own `jax.vmap` over two scalings of the
    input, then a tap inside `jax.checkpoint` and one inside a `lax.scan` over
    the iterations' indices, whose carry starts as a Python `0` (its body is
    traced twice). `offsets` shift the sites' values (`step`'s row `i` at the
    iteration over `i`); the scan's `ys`, each iteration's `step` value, are
    sown in `intermediates`."""

    offsets: Any = None
    #: Whether the scan is `jax.lax.scan` looked up as the model runs or
    #: `uncounted_scan`, bound at import (the same scan to the computation).
    counted: bool = True

    def setup(self):
        self.inner = nn.Dense(3)
        self.head = nn.Dense(2)

    def __call__(self, x):
        pair = jnp.stack([x, 0.5 * x])
        ys = jax.vmap(self.inner)(pair)
        ys = offset(self.offsets, "inner", ys)  # the mapped value, axis first
        h = jnp.tanh(ys[0] - ys[1])
        h = jax.checkpoint(
            lambda h: offset(self.offsets, "remat", bridge.tap("remat", jnp.sin(h)))
        )(h)
        step_offsets = (self.offsets or {}).get("step")

        def step(carry, i):
            h, total = carry
            h = bridge.tap("step", jnp.tanh(h))
            h = h if step_offsets is None else h + step_offsets[i]
            return (h, total + jnp.mean(h)), h

        scan = jax.lax.scan if self.counted else uncounted_scan
        (h, total), steps = scan(step, (h, 0), jnp.arange(SCAN_STEPS))
        self.sow("intermediates", "step", steps)
        return offset(self.offsets, "head", self.head(h + total))


def test_a_module_in_the_models_own_vmap_holds_the_mapped_value():
    x = jax.random.normal(jax.random.key(0), (4, 5))
    model = InJaxTransforms()
    variables = model.init(jax.random.key(1), x)
    probe = bridge.probe(model, variables)
    sites = probe.sites(x)
    assert list(sites) == ["inner", "remat", "step", "head"]
    assert sites["inner"].shape == (2, 4, 3)  # the vmap's axis first
    assert sites["remat"].shape == (4, 3)
    assert sites["step"].shape == (3, 4, 3)  # the scan's iterations first
    inner = nn.Dense(3).bind({"params": variables["params"]["inner"]})
    expected = jax.vmap(inner)(jnp.stack([x, 0.5 * x]))
    delta = random_like(sites["inner"], 3)

    def loss_along(t):
        return mse(InJaxTransforms({"inner": t * delta}).apply(variables, x))

    _, directional = jax.jvp(loss_along, (0.0,), (1.0,))
    run = jax.jit(lambda probe, x: probe.value_and_grad(mse, x, at="inner"))
    for res in (probe.value_and_grad(mse, x, at="inner"), run(probe, x)):
        np.testing.assert_allclose(res.activations["inner"], expected, rtol=1e-5)
        np.testing.assert_allclose(
            tree_vdot(res.activation_grads["inner"], delta), directional, rtol=1e-4
        )
        np.testing.assert_allclose(res.loss, loss_along(0.0), rtol=1e-6)


@pytest.mark.parametrize("counted", [True, False], ids=["lax.scan", "bound_at_import"])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_tap_in_the_models_own_lax_scan_is_a_site_of_every_iteration(mode, counted):
    """The model's own `jax.lax.scan`, looked up as it runs or bound at import, is the
    same `scan` in the computation: its body's tap (traced twice) is one site of
    every iteration, `(iterations, batch, width)`. Its values are the scan's own
    `ys`; its gradients, those of offsets the model adds by hand (plain `jax.grad`),
    row `i` at the iteration over `i`, and summed over the iterations, that of one
    offset shared by all; the tap inside `jax.checkpoint`, the sites around it and
    the parameters' gradients are plain Linen's."""
    x = jax.random.normal(jax.random.key(0), (4, 5))
    variables = InJaxTransforms().init(jax.random.key(1), x)
    probe = bridge.probe(InJaxTransforms(counted=counted), variables)
    sites = probe.sites(x)
    assert list(sites) == ["inner", "remat", "step", "head"]
    assert sites["step"].shape == (SCAN_STEPS, 4, 3)
    at = ["inner", "remat", "step", "head"]

    def reference(params, offsets):
        y, sown = InJaxTransforms(offsets, counted).apply(
            {"params": params}, x, mutable="intermediates"
        )
        return mse(y), {"step": sown["intermediates"]["step"][0], "head": y}

    zeros = {name: jnp.zeros(sites[name].shape) for name in at}
    (loss, values), (grads, offset_grads) = jax.value_and_grad(
        reference, argnums=(0, 1), has_aux=True
    )(variables["params"], zeros)
    shared = jax.grad(
        lambda one: reference(
            variables["params"],
            {**zeros, "step": jnp.broadcast_to(one, sites["step"].shape)},
        )[0]
    )(jnp.zeros(sites["step"].shape[1:]))
    # Every iteration's gradient is its own: the test tells them apart.
    assert not np.allclose(offset_grads["step"][0], offset_grads["step"][-1])

    def step(probe, x):
        return probe.value_and_grad(mse, x, at=at)

    res = (jax.jit(step) if mode == "jit" else step)(probe, x)
    np.testing.assert_allclose(res.loss, loss, rtol=1e-6)
    assert_tree_allclose(res.grads, grads, rtol=1e-5)
    for name in ("step", "head"):
        np.testing.assert_allclose(
            res.activations[name], values[name], rtol=1e-5, atol=1e-6
        )
    for name in at:
        np.testing.assert_allclose(
            res.activation_grads[name], offset_grads[name], rtol=1e-5, atol=1e-7
        )
    np.testing.assert_allclose(
        res.activation_grads["step"].sum(0), shared, rtol=1e-5, atol=1e-7
    )


class RematThenVmap(nn.Module):
    """An `nn.remat` and an `nn.vmap` that broadcasts `params`, both of
    functions of the model itself (their modules are clones of the model)."""

    def setup(self):
        self.first = nn.Dense(3)
        self.second = nn.Dense(3)

    def __call__(self, x):
        h = nn.remat(lambda mdl, h: mdl.first(h))(self, x)
        mapped = nn.vmap(
            lambda mdl, h: mdl.second(h),
            variable_axes={"params": None},
            split_rngs={"params": False},
        )
        return jnp.sum(mapped(self, jnp.stack([h, 0.5 * h])), axis=0)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_an_nn_remat_then_an_nn_vmap_broadcasting_params_are_sites(mode):
    """Functional `nn.remat` and `nn.vmap` of the model itself: `second` is
    a site per member of the broadcasting `nn.vmap`, against the model
    written by hand with an offset at each site."""
    x = jax.random.normal(jax.random.key(0), (4, 5))
    model = RematThenVmap()
    variables = model.init(jax.random.key(1), x)
    probe = bridge.probe(model, variables)
    sites = probe.sites(x)
    assert list(sites) == ["first", "second"]
    assert sites["second"].shape == (2, 4, 3)
    params = variables["params"]

    def by_hand(offsets, params):
        first, second = (
            nn.Dense(3).bind({"params": params[name]}) for name in ("first", "second")
        )
        h = first(x) + offsets["first"]
        members = second(jnp.stack([h, 0.5 * h])) + offsets["second"]
        return jnp.sum(jnp.sin(jnp.sum(members, axis=0)))

    zeros = {name: jnp.zeros(site.shape) for name, site in sites.items()}
    loss, (site_grads, param_grads) = jax.value_and_grad(by_hand, (0, 1))(zeros, params)
    res = value_and_grad_in(mode, probe, lambda y: jnp.sum(jnp.sin(y)), (x,))
    np.testing.assert_allclose(res.loss, loss, rtol=1e-6)
    assert_tree_allclose(res.activation_grads, site_grads)
    assert_tree_allclose(res.grads, param_grads)


class RetracedScan(nn.Module):
    """A functional `nn.scan` whose carry starts as a Python `0`: Flax traces
    its body three times."""

    def setup(self):
        self.cell = nn.Dense(4)

    def __call__(self, x):
        def body(mdl, carry, _):
            h, total = carry
            h = jnp.tanh(mdl.cell(h))
            return (h, total + jnp.mean(h)), None

        scanned = nn.scan(
            body,
            variable_broadcast="params",
            split_rngs={"params": False},
            length=2,
        )
        (h, total), _ = scanned(self, (x, 0), None)
        return h + total


def test_a_functional_nn_scan_traced_three_times_lists_its_site_once():
    x = jax.random.normal(jax.random.key(0), (3, 4))
    model = RetracedScan()
    variables = model.init(jax.random.key(1), x)
    sites = bridge.probe(model, variables).sites(x)
    assert list(sites) == ["cell"]
    assert sites["cell"].shape == (2, 3, 4)
