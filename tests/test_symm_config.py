"""The exchange's typed settings (CPU): ExchangeConfig / Tile validation (errors name the field), the
factory's size rules against the rules they replaced, TOML tables and overrides, the dispatcher's
shorthands, and one config per buffer set."""

from __future__ import annotations

import dataclasses
import math
import os
import types

import pytest
import torch

from tlx_dist.comm import ExchangeConfig, SymmDispatcher, Tile, ep_buffers
from tlx_dist.comm.emulated import EmulatedWorld
from tlx_dist.comm.symm import policy
from tlx_dist.comm.symm.buffers import SymmBuffers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "configs", "debug_cpu.toml")


# --- validation ------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value,msg", [
    ("copy_engine", "yes", "copy_engine='yes' must be 'auto', 'on' or 'off'"),
    ("copy_engine", True, "copy_engine=True must be 'auto', 'on' or 'off'"),  # a bool is no mode
    ("recv_overlap", "1", "recv_overlap='1' must be"),
    ("comb_overlap", None, "comb_overlap=None must be"),
    ("route_block", 3, "route_block=3 must be 0 .automatic. or a power of two"),
    ("route_block", True, "route_block=True must be"),
    ("comb_sum_per_sm", 0, "comb_sum_per_sm=0 must be a positive integer"),
    ("comb_send_per_sm", 1.5, "comb_send_per_sm=1.5 must be a positive integer"),
    ("overlap_sms", -1, "overlap_sms=-1 must be a positive integer"),
    ("ce_chunk_rows", 0, "ce_chunk_rows=0 must be a positive integer"),
    ("ce_tail_rows", -32, "ce_tail_rows=-32 must be 0"),
    ("ce_sum_per_sm", 9, "ce_sum_per_sm=9 must be an integer from 1 to 8"),
    ("overlap", 1, "overlap=1 must be a bool"),
    ("route_agg_only", "no", "route_agg_only='no' must be a bool"),
    ("timeout_s", 0, "timeout_s=0 must be None or a number of seconds"),
    ("timeout_s", math.inf, "timeout_s=inf must be None"),
    ("send", (4, 1024), r"send=\(4, 1024\) must be a Tile"),
])
def test_a_bad_field_is_named(field, value, msg):
    err = TypeError if field == "send" else ValueError
    with pytest.raises(err, match=f"ExchangeConfig.{msg}"):
        ExchangeConfig(**{field: value})


@pytest.mark.parametrize("kw,msg", [(dict(cols=3), "cols=3 must be a power of two"),
                                    (dict(rows=6), "rows=6 must be None .sized per launch. or a power of two"),
                                    (dict(warps=64), "warps=64 must be a power of two from 1 to 32"),
                                    (dict(per_sm=0), "per_sm=0 must be an integer from 1 to 64")])
def test_a_bad_tile_field_is_named(kw, msg):
    with pytest.raises(ValueError, match=f"Tile.{msg}"):
        Tile(**kw)
    with pytest.raises(ValueError, match=f"parallel.exchange.reduce_send.{msg}"):
        ExchangeConfig.from_dict({"reduce_send": kw}, prefix="parallel.exchange")


def test_frozen_and_replaceable():
    cfg = ExchangeConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.copy_engine = "on"
    assert dataclasses.replace(cfg, copy_engine="off").copy_engine == "off" and cfg.copy_engine == "auto"
    with pytest.raises(ValueError, match="ExchangeConfig.ce_sum_per_sm=0"):
        dataclasses.replace(cfg, ce_sum_per_sm=0)  # replace validates too
    assert hash(cfg) == hash(ExchangeConfig()) and cfg == ExchangeConfig()
    assert cfg.differences(dataclasses.replace(cfg, overlap=True, route_block=8)) == [
        "route_block: 0 vs 8", "overlap: False vs True"]


# --- defaults and the factory ------------------------------------------------------------------------

def test_defaults_are_the_measured_launch_shapes():
    """The kernels' launch shapes, programs and copy sizes: what the exchange launched before it
    had a config (starting tile width and programs per SM per kernel, 4 warps; the one-launch
    combine's 4 x 2 programs an SM; the copy-engine combine's 4096-row copies cut down to 512, 4
    summing programs an SM; 32 SMs for the overlapped send; every mode automatic, overlap off)."""
    cfg = ExchangeConfig()
    assert {k: (getattr(cfg, k).cols, getattr(cfg, k).per_sm) for k in ("send", "expand", "reduce_send",
                                                                       "reduce_recv")} == {
        "send": (1024, 4), "expand": (512, 4), "reduce_send": (512, 16), "reduce_recv": (512, 16)}
    assert all(getattr(cfg, k).rows is None and getattr(cfg, k).warps == 4
               for k in ("send", "expand", "reduce_send", "reduce_recv"))
    assert (cfg.route_block, cfg.comb_sum_per_sm, cfg.comb_send_per_sm) == (0, 4, 2)
    assert (cfg.ce_chunk_rows, cfg.ce_tail_rows, cfg.ce_sum_per_sm, cfg.overlap_sms) == (4096, 512, 4, 32)
    assert (cfg.copy_engine, cfg.recv_overlap, cfg.comb_overlap, cfg.overlap, cfg.timeout_s) == (
        "auto", "auto", "auto", False, None)


def _old_copy_engine_rule(T, W, E, K):
    """The rule ``"auto"`` applied before the config existed, restated: on from 4096 tokens a rank
    where a uniformly routed token reaches each peer with probability >= 0.95."""
    e = E // W
    return T >= 4096 and 1.0 - math.comb(E - e, K) / math.comb(E, K) >= 0.95


@pytest.mark.parametrize("T", [128, 4095, 4096, 8191, 8192, 16384])
@pytest.mark.parametrize("W,E,K", [(2, 64, 8), (4, 64, 8), (8, 256, 8), (2, 8, 2), (2, 16, 1), (1, 64, 8)])
def test_factory_is_the_old_auto_rules(T, W, E, K):
    cfg = ExchangeConfig.auto(max_tokens=T, world_size=W, num_experts=E, top_k=K)
    assert cfg.copy_engine == ("on" if _old_copy_engine_rule(T, W, E, K) else "off")
    assert cfg.recv_overlap == ("on" if T >= 8192 else "off")
    assert cfg.comb_overlap == "on"
    assert dataclasses.replace(cfg, copy_engine="auto", recv_overlap="auto", comb_overlap="auto") == ExchangeConfig()
    # on real ranks over peer pointers the policy resolves "auto" exactly as the factory spells it out
    if W > 1:
        def real(c):
            return types.SimpleNamespace(use_nvshmem=False, hier=None, backend="cuda", world_size=W,
                                         device=torch.device("cuda"),
                                         config=c, modes={}, layout=types.SimpleNamespace(
                                             max_tokens=T, world_size=W, num_experts=E, top_k=K, row_regions=1))
        import tlx_dist.comm.copy_engine as drv
        avail, hip = drv.available, torch.version.hip
        drv.available, torch.version.hip = (lambda device: True), None
        try:
            for name in ("recv", "comb", "copy_engine"):
                assert policy._RESOLVE[name](real(ExchangeConfig()), ExchangeConfig()) == \
                    policy._RESOLVE[name](real(cfg), cfg), name
        finally:
            drv.available, torch.version.hip = avail, hip


def test_factory_overrides_and_checks():
    cfg = ExchangeConfig.auto(4096, 2, 64, 8, copy_engine="off", overlap_sms=16)
    assert (cfg.copy_engine, cfg.overlap_sms) == ("off", 16)
    for bad, msg in (((0, 2, 64, 8), "max_tokens=0"), ((16, 3, 64, 8), "num_experts=64 must be divisible"),
                     ((16, 2, 4, 8), "at least top_k=8"), ((16, True, 64, 8), "world_size=True")):
        with pytest.raises(ValueError, match=msg):
            ExchangeConfig.auto(*bad)


# --- tables: from_dict / to_dict, TOML, overrides --------------------------------------------------------

def _toml_table(name: str, d: dict) -> str:
    """A (flat) TOML table of ``d``'s scalars, then one sub-table per nested dict."""
    def v(x):
        return str(x).lower() if isinstance(x, bool) else repr(x).replace("'", '"')
    out = [f"[{name}]"] + [f"{k} = {v(x)}" for k, x in d.items() if not isinstance(x, dict)]
    for k, x in d.items():
        if isinstance(x, dict):
            out += ["", f"[{name}.{k}]"] + [f"{kk} = {v(xx)}" for kk, xx in x.items()]
    return "\n".join(out) + "\n"


def test_toml_round_trip(tmp_path):
    from train.config import load_config, read_toml

    cfg = ExchangeConfig(send=Tile(rows=4, cols=1024, warps=8, per_sm=2), reduce_recv=Tile(cols=256, per_sm=8),
                         route_block=32, copy_engine="on", ce_chunk_rows=2048, ce_tail_rows=0, overlap=True,
                         overlap_sms=16, recv_overlap="off", comb_overlap="off", timeout_s=12.5)
    assert ExchangeConfig.from_dict(cfg.to_dict()) == cfg
    assert "timeout_s" not in ExchangeConfig().to_dict()  # None has no TOML form: left out, the default again
    text = open(RECIPE).read().replace("[parallel]\nep = 1\n", "[parallel]\nep = 1\nep_row_regions = true\n"
                                       "capacity_factor = 2.0\n\n" + _toml_table("parallel.exchange", cfg.to_dict()))
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    assert read_toml(path)["parallel"]["exchange"]["send"] == {"cols": 1024, "rows": 4, "warps": 8, "per_sm": 2}
    assert load_config(path).parallel.exchange == cfg
    assert load_config(RECIPE).parallel.exchange == ExchangeConfig()
    # an int where a float goes is fine (as everywhere in the recipes); a tile's left-out fields are its defaults
    d = ExchangeConfig.from_dict({"timeout_s": 5, "expand": {"per_sm": 8}})
    assert d.timeout_s == 5.0 and d.expand == Tile(cols=512, per_sm=8)


def test_overrides_and_errors_name_the_key():
    from train.config import load_config

    cfg = load_config(RECIPE, ["parallel.exchange.copy_engine=on", "parallel.exchange.send.rows=8",
                               "parallel.exchange.send.cols=512", "parallel.exchange.timeout_s=60"])
    assert cfg.parallel.exchange == ExchangeConfig(copy_engine="on", send=Tile(rows=8, cols=512), timeout_s=60.0)
    for over, msg in ((["parallel.exchange.copy_engine=maybe"], "parallel.exchange.copy_engine='maybe' must be"),
                      (["parallel.exchange.send.rows=3"], "parallel.exchange.send.rows=3 must be None"),
                      (["parallel.exchange.send.depth=3"], r"parallel.exchange.send: unknown field\(s\) \['depth'\]"),
                      (["parallel.exchange.bulk=6"], r"parallel.exchange: unknown field\(s\) \['bulk'\]"),
                      (["parallel.exchange=on"], "parallel.exchange must be a table"),
                      (["parallel.exchange_copy_engine=off"],
                       "parallel.exchange_copy_engine was replaced by parallel.exchange.copy_engine"),
                      (["parallel.exchange_bulk=6"], "parallel.exchange_bulk was removed")):
        with pytest.raises(ValueError, match=msg):
            load_config(RECIPE, over)


def test_training_builds_its_dispatcher_from_the_table():
    """``[parallel.exchange]`` reaches the SymmDispatcher the training builds, with the run's
    collective timeout where the table sets none."""
    from train.config import load_config
    from train.parallelize import make_train_dispatcher

    pd = types.SimpleNamespace(ep=1, ep_group=None)
    cuda = types.SimpleNamespace(type="cuda")  # (nothing here touches a device: the buffers come at the first op)
    cfg = load_config(RECIPE, ["parallel.dispatcher=symm", "parallel.exchange.copy_engine=off",
                               "parallel.exchange.route_block=64"])
    d = make_train_dispatcher(cfg, pd, cuda)
    assert d.config == ExchangeConfig(copy_engine="off", route_block=64, timeout_s=cfg.train.comm_timeout_s)
    cfg = load_config(RECIPE, ["parallel.dispatcher=symm", "parallel.exchange.timeout_s=7"])
    assert make_train_dispatcher(cfg, pd, cuda).config.timeout_s == 7.0


# --- the dispatcher's shorthands and the buffer set's one config ---------------------------------------

def test_shorthands_fold_into_a_config():
    assert SymmDispatcher(8).config == ExchangeConfig()
    assert SymmDispatcher(8, copy_engine=True, overlap=True, timeout_s=5).config == ExchangeConfig(
        copy_engine="on", overlap=True, timeout_s=5.0)
    assert SymmDispatcher(8, copy_engine=False).config.copy_engine == "off"
    assert SymmDispatcher(8, copy_engine="auto").config == ExchangeConfig()
    cfg = ExchangeConfig(route_block=16)
    assert SymmDispatcher(8, config=cfg).config is cfg
    with pytest.raises(TypeError, match=r"give copy_engine, overlap inside config="):
        SymmDispatcher(8, config=cfg, overlap=True, copy_engine=True)
    with pytest.raises(TypeError, match="overlap='yes' must be a bool"):
        SymmDispatcher(8, overlap="yes")
    with pytest.raises(ValueError, match="timeout_s=-1 must be None or a number of seconds"):
        SymmDispatcher(8, timeout_s=-1)
    with pytest.raises(TypeError, match="config must be an ExchangeConfig, got dict"):
        SymmDispatcher(8, config={"copy_engine": "on"})


def test_removed_arguments_say_so():
    with pytest.raises(TypeError, match=r"bulk_send=...\) was removed"):
        SymmDispatcher(8, bulk_send=4)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['pipe'\]"):
        SymmDispatcher(8, pipe=True)


def test_one_config_per_buffer_set():
    """A set built with a config keeps it (a dispatcher asking another raises, naming the fields);
    one on its default takes the first dispatcher's; a dispatcher that asks nothing runs the set's;
    ``reconfigure`` replaces it between ops and resolves the modes again."""
    world = EmulatedWorld(2, 8, 4, 2, 4, torch.float32, device="cpu", row_regions=1,
                          config=ExchangeConfig(copy_engine="on"))
    b = world.buffers[0]
    assert b.config == ExchangeConfig(copy_engine="on", timeout_s=30.0) and b.timeout_s == 30.0
    assert SymmDispatcher(4, buffers=b).config is b.config  # asks nothing: the set's
    SymmDispatcher(4, buffers=b, copy_engine=True)
    with pytest.raises(ValueError, match=r"its copy_engine: 'on' vs 'off'"):
        SymmDispatcher(4, buffers=b, copy_engine=False)
    assert policy.ce_mode(b) is True and b.modes == {"copy_engine": True}
    b.reconfigure(ExchangeConfig(copy_engine="off"))
    assert b.modes == {} and policy.ce_mode(b) is False and b.config.timeout_s == 30.0
    with pytest.raises(ValueError, match="config.timeout_s=1: this buffer set waits 30 s"):
        b.reconfigure(ExchangeConfig(timeout_s=1))
    plain = EmulatedWorld(2, 8, 4, 2, 4, torch.float32, device="cpu").buffers[0]
    SymmDispatcher(4, buffers=plain, overlap=True)  # a default set takes the first config asked for ...
    assert plain.config.overlap
    with pytest.raises(ValueError, match="overlap: True vs False"):  # ... and keeps it
        SymmDispatcher(4, buffers=plain, config=ExchangeConfig())
    with pytest.raises(TypeError, match="give copy_engine inside config="):
        EmulatedWorld(2, 8, 4, 2, 4, torch.float32, device="cpu", copy_engine=True, config=ExchangeConfig())


def test_ep_buffers_hand_one_set_to_every_layer_with_its_config():
    kw = dict(device="cpu")
    a = ep_buffers(None, 8, 4, 2, 4, torch.float32, config=ExchangeConfig(route_block=8), **kw)
    try:
        assert ep_buffers(None, 8, 4, 2, 4, torch.float32, **kw) is a  # asks nothing: the same set
        assert ep_buffers(None, 8, 4, 2, 4, torch.float32, config=ExchangeConfig(route_block=8), **kw) is a
        with pytest.raises(ValueError, match="route_block: 8 vs 16"):
            ep_buffers(None, 8, 4, 2, 4, torch.float32, config=ExchangeConfig(route_block=16), **kw)
        # the timeout is part of the key (as it was): another timeout, another set
        other = ep_buffers(None, 8, 4, 2, 4, torch.float32, config=ExchangeConfig(timeout_s=3), **kw)
        assert other is not a and other.timeout_s == 3.0
        other.close()
        with pytest.raises(ValueError, match="timeout_s=2 differs from config.timeout_s=3"):
            ep_buffers(None, 8, 4, 2, 4, torch.float32, timeout_s=2, config=ExchangeConfig(timeout_s=3), **kw)
    finally:
        a.close()


def test_the_timeout_debug_variable(monkeypatch):
    """``TLX_DIST_EXCHANGE_TIMEOUT_S`` (debug) is the waits' timeout where no config or argument sets
    one; a bad value names the variable."""
    monkeypatch.setenv("TLX_DIST_EXCHANGE_TIMEOUT_S", "4")
    assert SymmBuffers(8, 4, 2, 4, torch.float32, device="cpu").timeout_s == 4.0
    assert SymmBuffers(8, 4, 2, 4, torch.float32, device="cpu", config=ExchangeConfig(timeout_s=9)).timeout_s == 9.0
    monkeypatch.setenv("TLX_DIST_EXCHANGE_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="TLX_DIST_EXCHANGE_TIMEOUT_S='soon' must be a number of seconds"):
        SymmBuffers(8, 4, 2, 4, torch.float32, device="cpu")
