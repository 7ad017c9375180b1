"""Bad input gets a clear error naming the argument; the NaN/inf policy is what the docs say."""

from __future__ import annotations

import pytest
import torch

from _util import make_cfg
from tlx_dist import LocalDispatcher, MoEConfig, MoELayer


@pytest.mark.parametrize("kw,match", [
    (dict(top_k=9), r"moe.top_k=9 exceeds num_experts=8"),
    (dict(top_k=0), r"moe.top_k=0 must be a positive integer"),
    (dict(dim=-4), r"moe.dim=-4 must be a positive integer"),
    (dict(score_func="relu"), r"moe.score_func='relu' must be 'softmax' or 'sigmoid'"),
    (dict(dtype="int8"), r"moe.dtype='int8' must be one of"),
    (dict(aux_loss_coef=-1.0), r"moe.aux_loss_coef=-1.0 must be a non-negative number"),
    (dict(route_scale=0), r"moe.route_scale=0 must be a positive number"),
    (dict(num_shared_experts=-1), r"moe.num_shared_experts=-1 must be a non-negative integer"),
    (dict(route_norm="False"), r"moe.route_norm='False' must be a bool"),
    (dict(load_balance_bias=1), r"moe.load_balance_bias=1 must be a bool"),
    (dict(init_std="x"), r"moe.init_std='x' must be a positive number"),
    (dict(z_loss_coef=True), r"moe.z_loss_coef=True must be a non-negative number"),
])
def test_config_errors_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        make_cfg(**kw)


def test_experts_not_divisible_by_ep():
    with pytest.raises(ValueError, match=r"moe.num_experts=12 is not divisible by expert_parallel=8"):
        make_cfg(num_experts=12).validate(expert_parallel=8)


def test_config_from_dict_unknown_and_missing_fields():
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['experts'\]"):
        MoEConfig.from_dict(dict(dim=4, moe_inter_dim=4, num_experts=2, top_k=1, experts=3))
    with pytest.raises(ValueError, match=r"missing field\(s\) \['top_k'\]"):
        MoEConfig.from_dict(dict(dim=4, moe_inter_dim=4, num_experts=2))
    assert MoEConfig.from_dict(dict(dim=4, moe_inter_dim=4, num_experts=2, top_k=1)).top_k == 1


def test_layer_input_errors():
    layer = MoELayer(make_cfg())
    with pytest.raises(TypeError, match=r"x.dtype=torch.float64 differs from the layer's dtype torch.float32"):
        layer(torch.randn(4, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x must be \[T, 16\] or \[B, S, 16\], got shape \(4, 15\)"):
        layer(torch.randn(4, 15))
    with pytest.raises(ValueError, match=r"got shape \(16,\)"):
        layer(torch.randn(16))
    with pytest.raises(ValueError, match=r"x is on meta but the layer's parameters are on cpu"):
        layer(torch.randn(4, 16, device="meta"))
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor"):
        layer([[0.0] * 16])
    with pytest.raises(TypeError, match=r"cfg must be a MoEConfig"):
        MoELayer(dict(dim=4))
    with pytest.raises(ValueError, match=r"dispatcher='bogus'"):
        MoELayer(make_cfg(), dispatcher="bogus")


def test_dispatcher_input_errors():
    d = LocalDispatcher(4)
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"idx_TK holds expert ids in \[0, 7\], outside \[0, 4\)"):
        d.dispatch(x, torch.tensor([[0], [7], [1]]))
    with pytest.raises(ValueError, match=r"idx_TK holds expert ids in \[-1, 1\]"):
        d.dispatch(x, torch.tensor([[0], [-1], [1]]))
    with pytest.raises(TypeError, match=r"idx_TK must be int32 or int64"):
        d.dispatch(x, torch.zeros(3, 1))
    with pytest.raises(ValueError, match=r"idx_TK must be \[T=3, K\]"):
        d.dispatch(x, torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"x_TD must be 2-D"):
        d.dispatch(x[0], torch.zeros(3, 1, dtype=torch.long))
    recv, h = d.dispatch(x, torch.tensor([[0], [3], [1]]))
    with pytest.raises(ValueError, match=r"y_ND has 2 rows but the dispatch received N=3"):
        d.combine(recv[:2], h)
    with pytest.raises(ValueError, match=r"num_experts=0"):
        LocalDispatcher(0)


def test_nan_policy_check_finite_raises():
    layer = MoELayer(make_cfg(check_finite=True))
    x = torch.randn(4, 16)
    x[2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"x contains NaN or inf \(cfg.check_finite=True\)"):
        layer(x)
    x[2, 3] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        layer(x)


def test_nan_policy_default_confines_to_row():
    """Default (no host sync): a non-finite token poisons only its own output row in the forward."""
    torch.manual_seed(0)
    layer = MoELayer(make_cfg(num_shared_experts=1))
    x = torch.randn(6, 16)
    clean = layer(x)
    x[2, 5] = float("nan")
    dirty = layer(x)
    assert torch.isnan(dirty[2]).all()
    keep = torch.tensor([0, 1, 3, 4, 5])
    # Other tokens keep their routing and values (up to fp32 rounding: the NaN token's move to
    # other experts changes how the GEMMs group rows).
    assert torch.isfinite(dirty[keep]).all()
    torch.testing.assert_close(dirty[keep], clean[keep], rtol=1e-5, atol=1e-6)


# --- grouped GEMM edge cases (tlx_dist.grouped_gemm) ---------------------------------------------

ALL_GEMM_BACKENDS = ["tlx", "triton", "torch", "reference"]


@pytest.mark.parametrize("backend", ALL_GEMM_BACKENDS + [None])
def test_grouped_mm_zero_experts_is_a_value_error(backend):
    # E=0 used to be an IndexError on 'torch' and zeros on 'reference': one clear error everywhere,
    # whether the backend is pinned, automatic, or reached through the custom op.
    from tlx_dist.grouped_gemm import grouped_mm, grouped_mm_wgrad

    x, w0, off0 = torch.randn(6, 8), torch.randn(0, 8, 4), torch.zeros(0, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"w_EDF of shape \(0, 8, 4\) has E=0 experts"):
        grouped_mm(x, w0, off0, backend=backend)
    with pytest.raises(ValueError, match=r"offsets_E of shape \(0,\) has E=0 experts"):
        grouped_mm_wgrad(x, torch.randn(6, 4), off0, backend=backend)


def test_grouped_mm_zero_experts_through_the_ops_and_backends():
    from tlx_dist.grouped_gemm.backends import available_backends, get_backend

    x, w0, off0 = torch.randn(6, 8), torch.randn(0, 8, 4), torch.zeros(0, dtype=torch.int32)
    for name in available_backends():
        with pytest.raises(ValueError, match="E=0 experts"):
            torch.ops.tlx_dist.grouped_mm(x, w0, off0, name)
        with pytest.raises(ValueError, match="E=0 experts"):
            torch.ops.tlx_dist.grouped_mm_wgrad(x, torch.randn(6, 4), off0, name)
    for name in ("torch", "reference"):  # the backends themselves (the kernel ones need a GPU/interpreter)
        with pytest.raises(ValueError, match="E=0 experts"):
            get_backend(name).mm(x, w0, off0)
        with pytest.raises(ValueError, match="E=0 experts"):
            get_backend(name).wgrad(x, torch.randn(6, 4), off0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_pinning_tlx_without_a_gpu_says_why():
    from tlx_dist.grouped_gemm import grouped_mm

    x, w, off = torch.randn(6, 8), torch.randn(2, 8, 8), torch.tensor([2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"backend='tlx' cannot run on this machine: .*(sm_90|fbtriton)"):
        grouped_mm(x, w, off, backend="tlx")
    with pytest.raises(ValueError, match=r"backend='bogus' is not one of"):
        grouped_mm(x, w, off, backend="bogus")


def test_grouped_mm_wgrad_2d_offsets_names_argument_and_shape():
    from tlx_dist.grouped_gemm import grouped_mm, grouped_mm_wgrad

    x, dy = torch.randn(6, 8), torch.randn(6, 4)
    off2 = torch.tensor([[2, 6]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"offsets_E must be 1-D \[E\] .*got shape \(1, 2\)"):
        grouped_mm_wgrad(x, dy, off2)
    with pytest.raises(ValueError, match=r"offsets_E must be 1-D \[E\] .*got shape \(1, 2\)"):
        grouped_mm(x, torch.randn(2, 8, 4), off2)
    with pytest.raises(ValueError, match=r"offsets_E has 3 entries but w_EDF has E=2 experts"):
        grouped_mm(x, torch.randn(2, 8, 4), torch.tensor([1, 2, 6], dtype=torch.int32))
