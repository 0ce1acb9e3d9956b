"""The bounded map behind the tier's "first missing keys" counts (tiers/miss_reasons.py)."""

from __future__ import annotations

import pytest

from vllm_npu_offload.tiers.miss_reasons import Fate, MissReason, MissReasons


def test_a_key_older_than_the_map_counts_as_new_and_each_fate_gives_its_reason():
    m = MissReasons(limit=3)
    m.note([b"a"], Fate.WRITTEN)
    m.note([b"b", b"c"], Fate.HOST)
    m.note([b"d"], Fate.WRITE_FAILED)  # a is forgotten
    assert m.missed(b"b", queued=False) is MissReason.NOT_ADMITTED
    assert m.missed(b"c", queued=True) is MissReason.QUEUED
    assert m.missed(b"d", queued=False) is MissReason.WRITE_FAILED
    assert m.missed(b"d", queued=False) is None  # counted once until its next fate
    m.note([b"d"], Fate.DROPPED)
    assert m.missed(b"d", queued=False) is MissReason.DROPPED
    assert m.missed(b"a", queued=False) is MissReason.NEW
    m.note([b"c"], Fate.WRITTEN)
    assert m.missed(b"c", queued=False, refused=True) is MissReason.COST
    assert m.counts == {"new": 1, "queued": 1, "dropped": 1, "gone": 0, "not_admitted": 1, "write_failed": 1,
                        "cost": 1}


def test_limit_must_be_positive():
    with pytest.raises(ValueError, match="MissReasons limit=0"):
        MissReasons(limit=0)
