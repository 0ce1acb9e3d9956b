"""The write queue on its own: store order, one entry a key, a lost key takes its batch's later keys."""

from __future__ import annotations

import pytest

from vllm_npu_offload.tiers.write_queue import WriteQueue


def drain(q, present=(), gone=()):
    out = []
    while (k := q.pop(lambda k: k in present, lambda k: k not in gone)) is not None:
        out.append(k)
    return out


def test_keys_come_out_in_store_order_once_each():
    q = WriteQueue()
    q.add([b"a", b"b"])
    q.add([b"b", b"c"])  # b keeps its first place
    assert len(q) == 3 and drain(q) == [b"a", b"b", b"c"] and q.take_dropped() == []


def test_keys_already_on_the_tier_are_passed_over_without_a_drop():
    q = WriteQueue()
    q.add([b"a", b"b", b"c"])
    assert drain(q, present={b"a"}) == [b"b", b"c"] and q.take_dropped() == []


def test_a_key_that_left_host_drops_the_later_keys_of_its_batch_only():
    q = WriteQueue()
    q.add([b"a1", b"a2", b"a3"])
    q.add([b"b1", b"b2"])
    assert drain(q, gone={b"a2"}) == [b"a1", b"b1", b"b2"]
    assert q.take_dropped() == [b"a2", b"a3"] and q.take_dropped() == []


def test_a_key_already_on_the_tier_keeps_the_batch_reachable():
    q = WriteQueue()
    q.add([b"p", b"x1", b"x2"])
    assert drain(q, present={b"p"}) == [b"x1", b"x2"]


def test_beyond_the_limit_the_oldest_are_dropped():
    q = WriteQueue(limit=3)
    q.add([b"a", b"b", b"c", b"d", b"e"])
    assert len(q) == 3 and q.take_dropped() == [b"a", b"b"] and drain(q) == [b"c", b"d", b"e"]
    assert q.clear() == 0


def test_a_limit_below_one_is_refused_naming_it():
    with pytest.raises(ValueError, match="limit=0"):
        WriteQueue(limit=0)
