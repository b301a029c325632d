"""`bridge.compare` lists the hyperparameters `transfer` does not move, and
draws itself.

Each pair of models carries the same weights (moved by `bridge.transfer`);
what differs is planted in the modules' own options: a LayerNorm epsilon too
small to show in float32 numbers, a convolution's padding and dilation, a
BatchNorm momentum given in PyTorch's convention (the batch's weight) against
Flax's (the running average's weight).
"""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from porting_models import filled

import bridge
from bridge._porting.hyperparameters import AsGiven, conv_padding


def jax_loss(outputs):
    return jnp.sum(outputs**2)


def torch_loss(outputs):
    return (outputs**2).sum()


def _images() -> tuple[np.ndarray, np.ndarray]:
    """The same images as NCHW (PyTorch, Equinox) and NHWC (Linen, Haiku)."""
    nchw = np.random.default_rng(7).standard_normal((2, 3, 6, 6)).astype(np.float32)
    return nchw, np.ascontiguousarray(np.moveaxis(nchw, 1, -1))


def _linen(module, x):
    variables = filled(jax.eval_shape(module.init, jax.random.key(0), x), 5)
    return bridge.probe(module, variables)


def _haiku(function, x):
    transformed = hk.transform_with_state(function)
    params, state = jax.eval_shape(transformed.init, jax.random.key(0), x)
    return bridge.probe(transformed, filled(params, 5), filled(state, 6))


def _torch_vs_linen(torch_module, linen_module, x_torch, x_jax):
    torch_probe = bridge.probe(torch_module)
    ported = bridge.transfer(
        torch_probe, _linen(linen_module, x_jax), x_torch, args_b=(x_jax,)
    )
    return bridge.compare(
        ported, torch_probe, (jax_loss, torch_loss), x_jax, args_b=(x_torch,)
    )


def test_a_layer_norm_epsilon_below_float32_tolerance_is_still_named():
    """Linen's LayerNorm epsilon 1e-6 against PyTorch's 1e-5: the numbers agree
    within tolerance, the report names the epsilon at that pair."""
    torch.manual_seed(0)
    torch_module = torch.nn.Sequential(
        torch.nn.Linear(3, 8), torch.nn.LayerNorm(8, eps=1e-5)
    ).eval()
    linen_module = nn.Sequential([nn.Dense(8), nn.LayerNorm(epsilon=1e-6)])
    x = 10 * np.random.default_rng(1).standard_normal((2, 3)).astype(np.float32)
    report = _torch_vs_linen(torch_module, linen_module, x, x)
    assert report.agree and report.first_divergence is None
    assert [row.hyperparameters for row in report.rows] == [
        {},
        {"epsilon": (1e-6, 1e-5)},
    ]
    assert report.hyperparameter_differences == [
        ("layers_1 / 1", "epsilon", 1e-6, 1e-5)
    ]
    table = str(report).splitlines()
    assert "all pairs agree; hyperparameters differ at 1 pair" in table[0]
    row = next(n for n, line in enumerate(table) if line.startswith("1  layers_1"))
    assert table[row].rstrip().endswith("ok")
    assert table[row + 1].split() == [
        *"^ hyperparameters differ: epsilon 1e-06 (A) vs 1e-05 (B)".split()
    ]


def test_matching_hyperparameters_are_not_reported_across_spellings():
    """Linen's `padding="SAME"` and PyTorch's `padding=1` (a 3x3 window at
    stride 1), a float32 and a Python epsilon, a momentum of 0.9 in Flax's
    convention and 0.1 in PyTorch's: the same, nothing reported."""
    torch.manual_seed(0)
    torch_module = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1),
        torch.nn.BatchNorm2d(4, eps=float(np.float32(1e-5)), momentum=0.1),
    ).eval()
    linen_module = nn.Sequential(
        [
            nn.Conv(4, (3, 3), padding="SAME"),
            nn.BatchNorm(use_running_average=True, momentum=0.9, epsilon=1e-5),
        ]
    )
    x_torch, x_jax = _images()
    report = _torch_vs_linen(torch_module, linen_module, x_torch, x_jax)
    assert report.agree
    assert report.hyperparameter_differences == []
    assert "hyperparameters differ" not in str(report)


def test_a_batch_norm_momentum_is_compared_in_one_convention():
    """PyTorch's momentum 0.1 keeps 0.9 of the running average; Flax's 0.99
    keeps 0.99: reported as 0.99 (A) against 0.9 (B), though inference numbers
    agree."""
    torch.manual_seed(0)
    torch_module = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4, momentum=0.1)
    ).eval()
    linen_module = nn.Sequential(
        [
            nn.Conv(4, (3, 3), padding="SAME"),
            nn.BatchNorm(use_running_average=True, momentum=0.99),
        ]
    )
    x_torch, x_jax = _images()
    report = _torch_vs_linen(torch_module, linen_module, x_torch, x_jax)
    assert report.agree
    [difference] = report.hyperparameter_differences
    assert difference.pair == "layers_1 / 1"
    assert difference.name == "momentum"
    np.testing.assert_allclose((difference.a, difference.b), (0.99, 0.9))


def test_a_convolution_padding_and_dilation_differ_between_haiku_and_equinox():
    """Haiku's 3x3 convolution at rate 2, SAME (pads of 2), against Equinox's
    at dilation 1 with `padding=1`: the same output shape, other numbers, and
    both differences named."""
    x_nchw, x_nhwc = _images()

    def haiku_model(x):
        x = hk.Conv2D(4, 3, rate=2, padding="SAME")(x)
        return hk.LayerNorm(-1, create_scale=True, create_offset=True)(x)

    class EqxModel(eqx.Module):
        conv: eqx.nn.Conv2d
        norm: eqx.nn.LayerNorm

        def __init__(self, key):
            self.conv = eqx.nn.Conv2d(3, 4, 3, padding=1, key=key)
            self.norm = eqx.nn.LayerNorm(4, eps=1e-5)

        def __call__(self, x):
            return jax.vmap(jax.vmap(self.norm, 1, 1), 2, 2)(self.conv(x))

    source = _haiku(haiku_model, x_nhwc)
    ported = bridge.transfer(
        source,
        bridge.probe(EqxModel(jax.random.key(0)), vmap=True),
        x_nhwc,
        args_b=(x_nchw,),
    )
    report = bridge.compare(source, ported, jax_loss, x_nhwc, args_b=(x_nchw,))
    assert not report.rows[0].activations_agree
    assert report.rows[0].hyperparameters == {
        "padding": (((2, 2), (2, 2)), ((1, 1), (1, 1))),
        "dilation": ((2, 2), (1, 1)),
    }
    assert [d.name for d in report.hyperparameter_differences] == [
        "padding",
        "dilation",
    ]
    assert "padding ((2, 2), (2, 2)) (A) vs ((1, 1), (1, 1)) (B)" in str(report)


def test_same_padding_at_a_stride_is_reported_as_given():
    """SAME at stride 2 pads by the input's size (here 0 before, 1 after),
    which the sites do not keep: NNX's "SAME" is reported as given, with the
    reason, against Linen's explicit pads; a stride difference is named."""
    x = _images()[1]
    linen_module = nn.Sequential(
        [nn.Conv(4, (3, 3), strides=2, padding=((1, 1), (1, 1))), nn.Dense(2)]
    )

    class NnxModel(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(3, 4, (3, 3), strides=2, padding="SAME", rngs=rngs)
            self.out = nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            return self.out(self.conv(x))

    source = _linen(linen_module, x)
    ported = bridge.transfer(source, bridge.probe(NnxModel(nnx.Rngs(0))), x)
    report = bridge.compare(source, ported, jax_loss, x)
    explicit, given = report.rows[0].hyperparameters["padding"]
    assert explicit == ((1, 1), (1, 1))
    assert given == AsGiven("SAME", "SAME padding at stride (2, 2) depends on the "
                            "input's size")  # fmt: skip
    assert "'SAME' (as given: SAME padding at stride (2, 2)" in str(report)


@pytest.mark.parametrize(
    "padding, window, strides, dilation, pads",
    [
        ("VALID", (3, 3), (2, 2), (1, 1), ((0, 0), (0, 0))),
        ("SAME", (3, 2), (1, 1), (1, 1), ((1, 1), (0, 1))),
        ("same", (3,), (1,), (2,), ((2, 2),)),  # PyTorch's spelling
        ("SAME_LOWER", (2,), (1,), (1,), ((1, 0),)),
        ("CIRCULAR", (4,), (3,), (1,), ((1, 2),)),
        ("CAUSAL", (3,), (1,), (2,), ((4, 0),)),
        (2, (3, 3), (1, 1), (1, 1), ((2, 2), (2, 2))),
        ((1, 0), (3, 3), (1, 1), (1, 1), ((1, 1), (0, 0))),
        ([(0, 1), (2, 3)], (3, 3), (1, 1), (1, 1), ((0, 1), (2, 3))),
    ],
)
def test_convolution_paddings_are_normalised_to_explicit_pads(
    padding, window, strides, dilation, pads
):
    assert conv_padding(padding, window, strides, dilation) == pads


def test_the_report_draws_itself(tmp_path):
    from matplotlib.figure import Figure

    torch.manual_seed(0)
    torch_module = torch.nn.Sequential(
        torch.nn.Linear(3, 8), torch.nn.LayerNorm(8, eps=1e-2)
    ).eval()
    linen_module = nn.Sequential([nn.Dense(8), nn.LayerNorm(epsilon=1e-6)])
    x = np.random.default_rng(1).standard_normal((2, 3)).astype(np.float32)
    report = _torch_vs_linen(torch_module, linen_module, x, x)
    assert report.first_divergence is report.rows[1]
    path = tmp_path / "compare.png"
    figure = report.plot(path)
    assert isinstance(figure, Figure)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    [axes] = figure.axes
    labels = [text.get_text() for text in axes.get_legend().get_texts()]
    assert "first divergence" in labels and "hyperparameters differ" in labels


def test_plot_names_the_install_when_matplotlib_is_missing(monkeypatch):
    import sys

    report = bridge.ComparisonReport([], 0.0, 0.0, 1e-5, 1e-6)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        report.plot("unused.png")
