"""Shared by the tests porting Hugging Face models between their PyTorch and
Flax twins (`test_hf_ports.py`, `test_hf_families.py`).

The references are independent of bridge: Hugging Face's own
`convert_pytorch_state_dict_to_flax` for the weights, the two models' own
outputs for the numbers.
"""

from __future__ import annotations

import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

import bridge

BATCH, SEQ, VOCAB = 2, 6, 50
# float32 on any CPU: the libraries sum in different orders.
RTOL, ATOL = 1e-4, 1e-5


def flax_probe(flax_model, params):
    """A probe of a Hugging Face Flax model's module with `params`."""
    return bridge.probe(flax_model.module, {"params": params})


def assert_flat_equal(got, want, keys=None):
    """Two nested dicts with the same keys (or `keys` of `want`), leaves
    exactly equal: weights moved and transposed, never computed."""
    got, want = flatten_dict(dict(got)), flatten_dict(dict(want))
    if keys is None:
        assert set(got) == set(want)
    for key in want if keys is None else keys:
        np.testing.assert_array_equal(
            np.asarray(got[key]), np.asarray(want[key]), err_msg=str(key)
        )


def first_divergence_with_a_bug(
    torch_model,
    flax_model,
    params,
    key,
    index,
    loss_fn,
    torch_inputs,
    flax_inputs,
    relative=None,
):
    """`(site_a, site_b)` of `compare`'s first divergence once
    `params[key][index]` of the Flax model is off by 0.5 (or by `relative`
    of itself: a bug planted in a correct port), which must be in the
    activations."""
    flat = flatten_dict(params)
    if relative is None:
        flat[key] = flat[key].at[index].add(0.5)
    else:
        flat[key] = flat[key].at[index].multiply(1 + relative)
    report = bridge.compare(
        bridge.probe(torch_model),
        flax_probe(flax_model, unflatten_dict(flat)),
        loss_fn,
        *torch_inputs,
        args_b=flax_inputs,
        rtol=RTOL,
        atol=ATOL,
    )
    first = report.first_divergence
    assert first is not None and not first.activations_agree
    return first.site_a, first.site_b


def weighted_sum(weights, torch):
    """A loss pair `(torch, Flax)`: `last_hidden_state` weighted by fixed
    random `weights`. The sum of squares of a LayerNorm's output is about
    constant, its gradients noise."""
    return (
        lambda outputs: (outputs.last_hidden_state * torch.tensor(weights)).sum(),
        lambda outputs: (outputs.last_hidden_state * weights).sum(),
    )
