"""bench/exchange_tiles.py's ``--configs`` parser on CPU (the bench itself needs two GPUs): every spec
kind lands where ``tuning.LAUNCH_OVERRIDES`` / the buffers read it, and a bad spec names itself."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from exchange_tiles import parse  # noqa: E402


def test_copy_engine_specs():
    assert parse("default") == {}
    assert parse("ce:on") == {"ce_mode": True}
    assert parse("ce:off,ce_chunk:4096,ce_tail:512,ce_sum:8") == {
        "ce_mode": False, "ce": {"chunk_rows": 4096, "tail_rows": 512, "sum_per_sm": 8}}
    assert parse("reduce_recv:16x512w4") == {"reduce_recv": dict(BLOCK_ROWS=16, BLOCK_D=512, num_warps=4)}


@pytest.mark.parametrize("spec,msg", [("ce:yes", "ce:'yes' must be on or off"),
                                      ("ce_tail:100", "ce_tail:'100' must be a multiple of 32"),
                                      ("ce_chunk:16", "ce_chunk:'16' must be a multiple of 32"),
                                      ("ce_sum:9", "ce_sum:'9' must be 1 to 8"),
                                      ("send:3x512", "rows and columns must be powers of two")])
def test_bad_specs_name_themselves(spec, msg):
    with pytest.raises(ValueError, match=msg):
        parse(spec)
