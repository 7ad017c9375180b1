"""bench/exchange_tiles.py's ``--configs`` parser on CPU (the bench itself needs two GPUs): every spec
kind becomes the ExchangeConfig field it names (a shape's left-out warps / programs per SM keep the
kernel's default), and a bad spec names itself."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from exchange_tiles import GRID, parse  # noqa: E402

from tlx_dist.comm import ExchangeConfig, Tile  # noqa: E402


def test_copy_engine_specs():
    assert parse("default") == ExchangeConfig()
    assert parse("ce:on") == ExchangeConfig(copy_engine="on")
    assert parse("ce:off,ce_chunk:4096,ce_tail:512,ce_sum:8") == ExchangeConfig(
        copy_engine="off", ce_chunk_rows=4096, ce_tail_rows=512, ce_sum_per_sm=8)
    assert parse("reduce_recv:16x512w4") == ExchangeConfig(reduce_recv=Tile(rows=16, cols=512, warps=4, per_sm=16))


def test_shape_route_and_combine_specs():
    d = ExchangeConfig()
    cfg = parse("8x512w8p2")  # the same tile for the send and both reductions
    assert cfg.send == cfg.reduce_send == cfg.reduce_recv == Tile(rows=8, cols=512, warps=8, per_sm=2)
    assert cfg.expand == d.expand
    cfg = parse("send:4x1024,route:32,comb:after,comb_recv:4x2")
    assert cfg.send == Tile(rows=4, cols=1024, warps=4, per_sm=d.send.per_sm)
    assert cfg.reduce_send == d.reduce_send and cfg.route_block == 32
    assert (cfg.comb_overlap, cfg.comb_sum_per_sm, cfg.comb_send_per_sm) == ("off", 4, 2)
    assert parse("comb:overlap").comb_overlap == "on"
    assert [parse(s) for s in GRID][0] == d and len({parse(s) for s in GRID}) == len(GRID)


@pytest.mark.parametrize("spec,msg", [("ce:yes", "ce:'yes' must be on or off"),
                                      ("ce_tail:100", "ce_tail:'100' must be a multiple of 32"),
                                      ("ce_chunk:16", "ce_chunk:'16' must be a multiple of 32"),
                                      ("ce_sum:9", "ce_sum:'9' must be 1 to 8"),
                                      ("send:3x512", "rows and columns must be powers of two"),
                                      ("send:4x1024L", "bad shape '4x1024L'"),
                                      ("send:8x512w3", r"--configs.send.warps=3 must be a power of two"),
                                      ("route:3", "route:'3' must be a power of two")])
def test_bad_specs_name_themselves(spec, msg):
    with pytest.raises(ValueError, match=msg):
        parse(spec)
