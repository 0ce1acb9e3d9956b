"""The disk tier's core without vLLM: rank workers over real host buffers, the scheduler-side tier over
their sockets, real files. Byte-exact round trips, every bad record a miss, the budget, sharing a
path, a full and a read-only filesystem, a read past its deadline."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from vllm_npu_offload.tiers.channel import socket_path
from vllm_npu_offload.tiers.contract import Failure, Op, RecordIdentity
from vllm_npu_offload.tiers.disk_index import DiskIndex
from vllm_npu_offload.tiers.disk_io import RecordFiles
from vllm_npu_offload.tiers.disk_janitor import DiskJanitor
from vllm_npu_offload.tiers.disk_tier import DiskTier, DiskTierConfig, ReadRate
from vllm_npu_offload.tiers.disk_worker import DiskTierServer
from vllm_npu_offload.tiers.record import HEADER_BYTES

CHUNK = 256 << 10
CHUNKS = 8


def identity(world: int = 1, dtype: str = "bfloat16", chunk: int = CHUNK) -> RecordIdentity:
    return RecordIdentity("tiny-llama", dtype, (chunk // 2, chunk // 2), (0, chunk // 2), chunk, 1, world)


class Rig:
    """``world`` rank workers (each its own host buffer) and one scheduler-side tier on ``root``."""

    def __init__(self, root: Path, world: int = 1, budget: int = 64 << 20, ident: RecordIdentity | None = None,
                 **cfg):
        self.engine = uuid.uuid4().hex
        self.ident = ident or identity(world)
        self.hosts = [np.zeros(CHUNKS * self.ident.chunk_bytes, dtype=np.uint8) for _ in range(world)]
        self.servers = [DiskTierServer(memoryview(h), self.ident, r, str(root), socket_path(self.engine, str(root), r),
                                       probe_bytes=1 << 20) for r, h in enumerate(self.hosts)]
        self.tier = DiskTier(DiskTierConfig(str(root), budget, world, self.engine, tokens_per_key=16, **cfg))
        end = time.monotonic() + 10
        while not self.tier.up:
            assert time.monotonic() < end, "the tier did not come up"
            self.tier.poll()
            time.sleep(0.005)

    def fill(self, chunk: int, seed: int) -> list[np.ndarray]:
        out = []
        for r, h in enumerate(self.hosts):
            data = np.random.default_rng(seed * 10 + r).integers(0, 256, self.ident.chunk_bytes, dtype=np.uint8)
            h[chunk * self.ident.chunk_bytes:(chunk + 1) * self.ident.chunk_bytes] = data
            out.append(data)
        return out

    def chunk(self, rank: int, chunk: int) -> np.ndarray:
        c = self.ident.chunk_bytes
        return self.hosts[rank][chunk * c:(chunk + 1) * c]

    def wait(self, timeout: float = 10.0):
        out = []
        end = time.monotonic() + timeout
        while self.tier.in_flight() and time.monotonic() < end:
            out += self.tier.poll()
            time.sleep(0.002)
        return out + self.tier.poll()

    def close(self):
        self.tier.close()
        for s in self.servers:
            s.shutdown()


@pytest.fixture
def root(tmp_path):
    return tmp_path / "kv"


def test_round_trip_byte_exact_on_every_rank(root):
    rig = Rig(root, world=2)
    try:
        want = rig.fill(1, seed=3)
        assert rig.tier.may_write() and rig.tier.needs_write(b"key-a")
        assert rig.tier.start_write(b"key-a", 1)
        (done,) = rig.wait()
        assert done.ok and done.op is Op.WRITE and rig.tier.has(b"key-a")
        assert not rig.tier.needs_write(b"key-a")  # content-addressed: never twice
        assert rig.tier.start_read(b"key-a", 5)
        (done,) = rig.wait()
        assert done.ok and done.chunk == 5
        for r in range(2):
            assert np.array_equal(rig.chunk(r, 5), want[r]), f"rank {r}'s chunk differs after the round trip"
        files = sorted(p.name for p in root.rglob("*.r*"))
        assert files == [f"{b'key-a'.hex()}.r0", f"{b'key-a'.hex()}.r1"]
        assert all((p.stat().st_mode & 0o777) == 0o600 for p in root.rglob("*.r*"))
        assert (root / rig.ident.fingerprint()).stat().st_mode & 0o777 == 0o700
        assert rig.tier.stats.hits == 1 and rig.tier.stats.read_bytes == 2 * (CHUNK + HEADER_BYTES)
    finally:
        rig.close()


def _written(rig: Rig, key: bytes, chunk: int = 0) -> None:
    rig.fill(chunk, seed=len(key))
    rig.tier.start_write(key, chunk)
    assert rig.wait()[0].ok


@pytest.mark.parametrize("damage", ["payload", "header", "truncated", "empty", "other_key", "other_rank"])
def test_bad_records_are_misses_and_removed(root, damage):
    rig = Rig(root, world=1)
    try:
        _written(rig, b"good")
        _written(rig, b"other", chunk=1)
        files = RecordFiles(root, rig.ident.fingerprint())
        path = files.path(b"good", 0)
        raw = bytearray(path.read_bytes())
        if damage == "payload":
            raw[HEADER_BYTES + 7] ^= 0x01
        elif damage == "header":
            raw[40] ^= 0x01
        elif damage == "truncated":
            raw = raw[: HEADER_BYTES + CHUNK // 2]
        elif damage == "empty":
            raw = bytearray()
        elif damage == "other_key":  # a whole, valid record of another key under this key's name
            raw = bytearray(files.path(b"other", 0).read_bytes())
        elif damage == "other_rank":
            raw[12:16] = (1).to_bytes(4, "little")
        path.write_bytes(bytes(raw))
        rig.tier.start_read(b"good", 4)
        (done,) = rig.wait()
        assert not done.ok
        assert not path.exists(), "a record that failed its checks must be removed"
        assert not rig.tier.has(b"good")
        assert rig.tier.stats.checksum_failures == 1 and rig.tier.stats.hits == 0
    finally:
        rig.close()


def test_foreign_identities_never_meet(root):
    a = Rig(root, world=1, ident=identity(dtype="bfloat16"))
    try:
        _written(a, b"shared-prefix")
    finally:
        a.close()
    for other in (identity(dtype="float16"), identity(world=1, chunk=CHUNK // 2), identity(world=2)):
        assert other.fingerprint() != a.ident.fingerprint()
        b = Rig(root, world=other.world_size, ident=other, rescan_s=0)
        try:
            assert not b.tier.has(b"shared-prefix")
        finally:
            b.close()
    # and a foreign record copied under this identity's name is refused by its header
    files_a = RecordFiles(root, a.ident.fingerprint())
    c = Rig(root, world=1, ident=identity(dtype="float8_e4m3fn"))
    try:
        dst = RecordFiles(root, c.ident.fingerprint()).path(b"shared-prefix", 0)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(files_a.path(b"shared-prefix", 0).read_bytes())
        order_done = c.servers[0].execute(_order(Op.READ, b"shared-prefix", 2))
        assert not order_done.ok and order_done.failure is Failure.FOREIGN and not dst.exists()
    finally:
        c.close()


def _order(op, key, chunk):
    from vllm_npu_offload.tiers.contract import Order

    return Order(1, op, key, chunk)


def test_restart_and_sharing_see_earlier_records(root):
    a = Rig(root, world=1, rescan_s=0.1)
    b = Rig(root, world=1, rescan_s=0.1)  # a second server on the same path, running at the same time
    try:
        want = a.fill(0, seed=9)[0]
        a.tier.start_write(b"conv-1", 0)
        assert a.wait()[0].ok
        end = time.monotonic() + 5
        while not b.tier.has(b"conv-1"):
            assert time.monotonic() < end, "the second server never saw the first one's record"
            b.tier.poll()
            time.sleep(0.02)
        b.tier.start_read(b"conv-1", 3)
        assert b.wait()[0].ok and np.array_equal(b.chunk(0, 3), want)
    finally:
        a.close()
        b.close()
    c = Rig(root, world=1)  # a restart: the start-up scan finds it
    try:
        end = time.monotonic() + 5
        while not c.tier.has(b"conv-1"):
            assert time.monotonic() < end
            c.tier.poll()
            time.sleep(0.01)
    finally:
        c.close()


def test_budget_holds_after_many_stores(root):
    key_bytes = CHUNK + HEADER_BYTES
    rig = Rig(root, world=1, budget=5 * key_bytes)
    try:
        for i in range(40):
            rig.fill(i % CHUNKS, seed=i)
            rig.tier.start_write(f"k{i}".encode(), i % CHUNKS)
            rig.wait()
        assert rig.tier.index.used_bytes <= 5 * key_bytes and len(rig.tier.index) == 5
        assert rig.tier.stats.evictions == 35
        end = time.monotonic() + 5
        while len(list(root.rglob("*.r0"))) > 5:
            assert time.monotonic() < end, "evicted records stayed on disk"
            time.sleep(0.02)
        kept = {p.name.split(".")[0] for p in root.rglob("*.r0")}
        assert kept == {f"k{i}".encode().hex() for i in range(35, 40)}  # least recently used went first
    finally:
        rig.close()


def test_budget_is_made_room_for_before_a_write_starts(root):
    """Writes under way count against the budget: a record's room is made before it is written, so
    the folder never holds more than the budget (the index learns of a finished write only when the
    scheduler next polls; on the GPU that overshot by 7% under load)."""
    key_bytes = CHUNK + HEADER_BYTES
    rig = Rig(root, world=1, budget=5 * key_bytes)
    try:
        for i in range(5):
            rig.fill(i, seed=i)
            rig.tier.start_write(f"k{i}".encode(), i)
        rig.wait()
        assert len(rig.tier.index) == 5 and rig.tier.stats.evictions == 0
        for i in range(5, 8):  # three more at once: three evicted before any of them is written
            rig.tier.start_write(f"k{i}".encode(), i)
        assert rig.tier.stats.evictions == 3
        assert rig.tier.index.used_bytes + rig.tier._write_backlog <= 5 * key_bytes
        rig.wait()
        end = time.monotonic() + 5
        while len(list(root.rglob("*.r0"))) > 5:
            assert time.monotonic() < end, "evicted records stayed on disk"
            time.sleep(0.02)
        assert len(rig.tier.index) == 5 and rig.tier.stats.evictions == 3
    finally:
        rig.close()


def test_a_starting_tier_defers_lookups_until_its_records_are_scanned(root, monkeypatch):
    """A restarted server's first lookups wait (``looking_up``) for the ranks' hello and the first scan
    instead of missing records that are on disk; a tier whose ranks never answer stops waiting."""
    from vllm_npu_offload.tiers import disk_tier

    rig = Rig(root)
    _written(rig, b"old")
    rig.close()
    again = Rig(root)  # up: every rank said hello; the first scan may not be in yet
    try:
        end = time.monotonic() + 5
        while not again.tier.has(b"old"):
            assert again.tier.looking_up(b"old"), "a lookup missed before the first scan was in"
            assert time.monotonic() < end, "the first scan never came in"
            again.tier.poll()
            time.sleep(0.005)
        assert not again.tier.looking_up(b"other")  # scanned: an absent key is a miss at once
    finally:
        again.close()
    monkeypatch.setattr(disk_tier, "STARTUP_WAIT_S", 0.3)
    lonely = DiskTier(DiskTierConfig(str(root), 1 << 30, 1, uuid.uuid4().hex, tokens_per_key=16))
    try:
        assert lonely.looking_up(b"old") and not lonely.has(b"old")  # no rank has answered yet
        time.sleep(0.35)
        assert not lonely.looking_up(b"old")  # nobody answered: lookups miss instead of waiting on
    finally:
        lonely.close()


def test_index_sizing_at_a_real_shape():
    """Llama-3-70B at TP 8, bf16: 80 layers, K and V of one 8-head... one KV head per rank, 16-token blocks."""
    page = 16 * 1 * 128 * 2  # tokens x kv heads per rank x head dim x bf16
    ident = RecordIdentity("meta-llama/Llama-3.3-70B-Instruct", "bfloat16", (page,) * 160,
                           tuple(i * page for i in range(160)), 160 * page, 4, 8)
    assert ident.chunk_bytes == 160 * page * 4 == 2_621_440
    index = DiskIndex(budget_bytes=1 << 40, key_bytes=(ident.chunk_bytes + HEADER_BYTES) * 8)
    assert index.key_bytes == 21_004_288
    assert (1 << 40) // index.key_bytes == 52_347  # keys (64 tokens each) a 1 TiB budget holds
    for i in range(52_347):
        index.add(i.to_bytes(8, "big"))
    assert index.over_budget() == []
    index.add(b"one more")
    assert index.over_budget() == [(0).to_bytes(8, "big")]


@contextlib.contextmanager
def tmpfs(path: Path, opts: str):
    """A tmpfs mounted at ``path`` for the test (root only; else the test skips)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a tmpfs")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_full_disk_drops_stores_and_keeps_serving(tmp_path):
    with tmpfs(tmp_path / "small", "size=1m,mode=0700") as mnt:
        rig = Rig(mnt, world=1)
        try:
            _written(rig, b"first")  # 260 KiB of the 1 MiB
            results = []
            for i in range(6):
                rig.fill(i % CHUNKS, seed=i)
                if rig.tier.may_write() and rig.tier.needs_write(f"x{i}".encode()):
                    rig.tier.start_write(f"x{i}".encode(), i % CHUNKS)
                    results += rig.wait()
            assert any(not r.ok for r in results), "a 1 MiB filesystem took every record"
            assert rig.tier.stats.dropped_stores >= 1 and rig.tier.stats.by_failure.get("no_space", 0) >= 1
            assert not rig.tier.may_write(), "stores go on at once after ENOSPC"
            assert not [p for p in mnt.rglob("*") if ".tmp." in p.name], "a failed write left its temporary file"
            rig.tier.start_read(b"first", 6)  # reads go on
            assert rig.wait()[0].ok
        finally:
            rig.close()


def test_read_only_path_serves_reads_and_drops_stores(tmp_path):
    with tmpfs(tmp_path / "ro", "size=4m,mode=0700") as mnt:
        rig = Rig(mnt, world=1)
        want = rig.fill(0, seed=1)[0]
        rig.tier.start_write(b"kept", 0)
        assert rig.wait()[0].ok
        rig.close()
        assert subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True).returncode == 0
        rig = Rig(mnt, world=1)
        try:
            assert all(not s.writable for s in rig.servers) and not rig.tier.writable
            assert not (rig.tier.may_write() and rig.tier.needs_write(b"new"))
            rig.tier.start_read(b"kept", 2)
            assert rig.wait()[0].ok and np.array_equal(rig.chunk(0, 2), want)
        finally:
            rig.close()


def test_a_read_past_its_deadline_is_a_miss_and_its_chunk_waits(root, monkeypatch):
    rig = Rig(root, world=1, read_timeout_s=0.2)
    try:
        _written(rig, b"slow")
        real = RecordFiles.read_into

        def slow(self, *a, **k):
            time.sleep(0.6)  # a hung network filesystem, for a while
            return real(self, *a, **k)

        monkeypatch.setattr(RecordFiles, "read_into", slow)
        rig.tier.start_read(b"slow", 3)
        time.sleep(0.3)
        assert rig.tier.poll() == [] and b"slow" in rig.tier.abandoned and rig.tier.stats.timeouts == 1
        assert rig.tier.reading(b"slow"), "the chunk is released before the read has ended"
        (done,) = rig.wait()
        assert done.ok and b"slow" not in rig.tier.abandoned
    finally:
        rig.close()


def test_cost_rule_reads_while_the_queue_drains_in_time(root):
    """Reads start while the queued reads drain within ``read_queue_s`` at the measured rate (and,
    with a prefill rate, beat recomputing the key); the rest is recomputed and counted."""
    rig = Rig(root, world=1, read_queue_s=0.35)
    try:
        for i in range(4):
            _written(rig, f"k{i}".encode(), chunk=i)
        rig.tier.rate.value = rig.tier.index.key_bytes * 10.0  # 10 keys a second
        started = 0
        while rig.tier.worth_reading():
            assert rig.tier.start_read(f"k{started}".encode(), 4 + started)
            started += 1
        assert started == 3 and rig.tier.stats.misses_cost == 1  # a 4th would wait 0.4 s
        rig.wait()
        rig.tier.rate.value = rig.tier.index.key_bytes * 10.0
        assert rig.tier.worth_reading()  # the queue drained
        rig.tier.cfg = dataclasses.replace(rig.tier.cfg, prefill_tokens_per_s=16 / 0.05)  # 16 tokens in 50 ms
        assert not rig.tier.worth_reading() and rig.tier.stats.misses_cost == 2  # the disk needs 100 ms
        rig.tier.cfg = dataclasses.replace(rig.tier.cfg, prefill_tokens_per_s=16 / 0.2)
        assert rig.tier.worth_reading()
    finally:
        rig.close()


def test_read_rate_follows_what_the_disk_delivers_while_busy():
    """The cost rule's rate starts at the probe, then moves towards what queued reads really got
    (a disk shared with writes or other servers); idle time between bursts never counts."""
    mib = 1 << 20
    rate = ReadRate(1e9)
    rate.started(0, now=10.0)
    rate.ended(128 * mib, backlog_after=8 * mib, now=10.5)
    assert rate.value == 1e9  # a window is 256 MiB
    rate.ended(128 * mib, backlog_after=0, now=11.0)  # 256 MiB in 1 s
    assert rate.value == pytest.approx(0.75e9 + 0.25 * 256 * mib)
    before = rate.value
    rate.ended(300 * mib, backlog_after=0, now=50.0)  # no read was queued since: not a sample
    rate.started(0, now=60.0)
    rate.ended(16 * mib, backlog_after=0, now=61.0)  # a burst under 1/8 window: too small to say
    assert rate.value == before
    rate.started(0, now=70.0)
    rate.ended(64 * mib, backlog_after=0, now=70.1)  # 640 MiB/s
    assert rate.value == pytest.approx(0.75 * before + 0.25 * 640 * mib)


def test_read_rate_of_completions_that_arrive_together():
    """A batch of reads that finish in one poll after 1 s in flight is 1 s of work however the windows
    fall: every sample counts from the start of the busy period, so the rate stays near 512 MiB/s (the
    first window, half the bytes by the same time, errs low) instead of a window over microseconds."""
    mib = 1 << 20
    rate = ReadRate(0)
    rate.started(0, now=0.0)
    for i in range(64):
        rate.started(8 * mib * (i + 1), now=0.0)  # 64 reads of 8 MiB queued at once
    for i in range(64):
        rate.ended(8 * mib, backlog_after=8 * mib * (63 - i), now=1.0 + i * 1e-6)
    first = 0.75 * 256 * mib + 0.25 * 512 * mib  # windows of 256 then 512 MiB, both over ~1 s
    assert rate.value == pytest.approx(first, rel=1e-3)
    rate.started(0, now=5.0)  # a new busy period starts its own clock
    rate.ended(64 * mib, backlog_after=0, now=5.5)
    assert rate.value == pytest.approx(0.75 * first + 0.25 * 128 * mib, rel=1e-3)


def test_reads_go_before_queued_writes(root, monkeypatch):
    """A burst of stores never makes a waiting request's read queue behind it; writes hold at most
    half the I/O threads."""
    rig = Rig(root, world=1)
    try:
        _written(rig, b"wanted")
        real = RecordFiles.write_from
        writing, most = [0], [0]

        def slow(self, *a, **k):
            writing[0] += 1
            most[0] = max(most[0], writing[0])
            time.sleep(0.05)
            writing[0] -= 1
            return real(self, *a, **k)

        monkeypatch.setattr(RecordFiles, "write_from", slow)
        for i in range(12):
            assert rig.tier.start_write(f"w{i}".encode(), 1 + i % (CHUNKS - 1))
        time.sleep(0.01)  # the writes are queued on the rank first
        assert rig.tier.start_read(b"wanted", 0)
        done = rig.wait()
        assert [c.op for c in done].count(Op.WRITE) == 12 and all(c.ok for c in done)
        assert [c.op for c in done].index(Op.READ) < 3, f"the read waited for the writes: {[c.op for c in done]}"
        assert most[0] == 2, f"{most[0]} writes ran at once on 4 I/O threads"
    finally:
        rig.close()


def test_out_of_range_chunk_is_refused(root):
    rig = Rig(root, world=1)
    try:
        d = rig.servers[0].execute(_order(Op.WRITE, b"k", CHUNKS))
        assert not d.ok and "out of range" in d.detail
    finally:
        rig.close()


WRITER = r"""
import sys, time, uuid, numpy as np
sys.path.insert(0, sys.argv[2])
from test_disk_tier import Rig
from pathlib import Path
rig = Rig(Path(sys.argv[1]), world=1)
for i in range(10_000):
    rig.fill(i % 8, seed=i)
    rig.tier.start_write(f"w{i}".encode(), i % 8)
    rig.tier.poll()
    if i == 20:
        print("writing", flush=True)
    time.sleep(0.001)
"""


def test_kill_9_mid_write_leaves_only_whole_records(root, tmp_path):
    """A server killed (SIGKILL) with writes in flight: the next one on the path removes the temporary
    files, and every record it finds reads back whole and verified."""
    import signal
    import sys

    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(script), str(root), str(Path(__file__).parent)], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    rig = Rig(root, world=1)  # start-up: stale temporaries removed, whole records indexed
    try:
        assert not [p for p in root.rglob("*") if ".tmp." in p.name]
        end = time.monotonic() + 5
        while not len(rig.tier.index):
            assert time.monotonic() < end, "no record survived the kill"
            rig.tier.poll()
            time.sleep(0.01)
        keys = list(rig.tier.index._lru)
        for i, key in enumerate(keys[:CHUNKS]):
            rig.tier.start_read(key, i)
        done = rig.wait()
        assert done and all(d.ok for d in done), [d for d in done if not d.ok]
        assert rig.tier.stats.checksum_failures == 0
    finally:
        rig.close()


def test_sockets_left_by_a_killed_server_are_removed_at_the_next_start(tmp_path):
    """A rank server killed with SIGKILL leaves its socket file (named after an engine id no later
    server uses); the next one to listen in that folder removes every socket of ours nobody holds,
    and keeps a live one."""
    import socket

    from vllm_npu_offload.tiers import channel

    if channel.bound_sockets() is None:
        pytest.skip("no /proc/net/unix here")
    stale = tmp_path / "npu-kv-dead-r0.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()  # the file stays, as after SIGKILL
    other = tmp_path / "someone-else.sock"
    other.write_text("")
    live = channel.listen(str(tmp_path / "npu-kv-live-r0.sock"))
    try:
        assert not stale.exists() and other.exists()
        second = channel.listen(str(tmp_path / "npu-kv-second-r0.sock"))
        assert (tmp_path / "npu-kv-live-r0.sock").exists()  # bound by a live listener: kept
        second.close()
    finally:
        live.close()


def test_start_up_removes_only_temporaries_of_writers_that_are_gone(tmp_path):
    """A server starting on a shared path leaves another server's write under way alone (it once
    removed a rank's rate probe mid-write, and that rank served reads only); a dead writer's
    temporaries on this host go, and any older than STALE_TMP_S (another host's writer)."""
    import subprocess
    import sys

    from vllm_npu_offload.tiers import disk_io

    sub = tmp_path / "fp" / "00"
    sub.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = disk_io._HOST
    names = {"live": f"aa.r0.tmp.{host}.{os.getpid()}.1", "dead": f"bb.r0.tmp.{host}.{dead.pid}.2",
             "other-host": "cc.r0.tmp.elsewhere.1.3", "old": "dd.r0.tmp.elsewhere.1.4", "legacy-dead": f"ee.r0.tmp.{dead.pid}.5"}
    for name in names.values():
        (sub / name).write_bytes(b"x")
    old = time.time() - disk_io.STALE_TMP_S - 5
    os.utime(sub / names["old"], (old, old))
    assert disk_io.remove_stale_temporaries(tmp_path / "fp") == 3
    left = {p.name for p in sub.iterdir()}
    assert left == {names["live"], names["other-host"]}


def test_a_scan_that_raced_an_eviction_never_puts_the_evicted_key_back(root, monkeypatch):
    """The janitor lists the records while the scheduler evicts one whose files are not yet deleted:
    the scan's answer must not bring the key back into the index (a phantom: its read would find
    nothing, and it would count against the budget)."""
    import threading

    scanning, go, calls = threading.Event(), threading.Event(), []
    real_scan = DiskJanitor.scan

    def scan_in_step(self):
        calls.append(1)
        if len(calls) == 2:  # the first rescan after the record is on disk
            scanning.set()
            assert go.wait(10)
        return real_scan(self)

    monkeypatch.setattr(DiskJanitor, "scan", scan_in_step)
    rig = Rig(root, rescan_s=0.2)
    try:
        rig.fill(0, seed=1)
        assert rig.tier.start_write(b"old", 0)
        rig.wait()
        assert rig.tier.has(b"old")
        assert scanning.wait(10)
        # evicted while the janitor is inside its scan: the record is still on disk
        rig.tier.index.remove(b"old")
        rig.tier._delete(b"old")
        go.set()
        end = time.monotonic() + 10
        while rig.tier._deleted_upto < 1:
            assert time.monotonic() < end, "the janitor never reported the deletion"
            rig.tier.poll()
            time.sleep(0.01)
        assert not rig.tier.has(b"old"), "the scan that raced the eviction put the key back"
        assert not list(root.rglob("*.r0"))
        assert rig.tier._tombstones == {}
        # written again later, the key is on disk again
        rig.fill(1, seed=2)
        assert rig.tier.start_write(b"old", 1)
        rig.wait()
        assert rig.tier.has(b"old")
    finally:
        go.set()
        rig.close()


def _count_records(root: Path, stop, peak: list) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], len(list(root.rglob("*.r0"))))
        time.sleep(0.002)


def test_a_janitor_that_falls_behind_holds_writes_back_within_the_budget(root, monkeypatch):
    """Evicted records stay on disk until the janitor deletes them; on a server whose engine thread
    holds the GIL, it fell behind by hundreds of records and the folder went 7% over its budget
    (GPU, faults on). Writes now wait while the records still to be deleted would not fit: the
    folder never holds more than the budget, and every key is written once the janitor catches up."""
    import threading

    real_remove = RecordFiles.remove

    def slow_remove(self, key, rank):
        time.sleep(0.03)
        return real_remove(self, key, rank)

    monkeypatch.setattr(RecordFiles, "remove", slow_remove)
    key_bytes = CHUNK + HEADER_BYTES
    rig = Rig(root, world=1, budget=8 * key_bytes)
    stop, peak = threading.Event(), [0]
    counter = threading.Thread(target=_count_records, args=(root, stop, peak))
    counter.start()
    try:
        t = rig.tier
        waiting = [f"k{i}".encode() for i in range(40)]
        end = time.monotonic() + 30
        while waiting:  # as the manager does (tiered_manager._start_writes)
            assert time.monotonic() < end, f"{len(waiting)} writes never started"
            t.poll()
            while waiting and t.may_write():
                assert t.start_write(waiting.pop(0), 0)
            time.sleep(0.002)
        rig.wait()
        assert t.stats.stores == 40 and t.stats.evictions >= 32
        end = time.monotonic() + 10
        while t.deleting_bytes:
            assert time.monotonic() < end, "the janitor never caught up"
            t.poll()
            time.sleep(0.01)
    finally:
        stop.set()
        counter.join()
        rig.close()
    assert 0 < peak[0] <= 8, f"{peak[0]} records on disk against a budget of 8"
    assert len(list(root.rglob("*.r0"))) <= 8


def test_records_a_scan_finds_beyond_the_budget_are_evicted_at_once(root):
    """Records the index did not know (another server's on a shared path, or a write that raced its
    key's eviction) join it at a rescan as the least recently used; if that puts the index over its
    budget, the oldest go at once rather than at this server's next write."""
    key_bytes = CHUNK + HEADER_BYTES
    a = Rig(root, world=1, budget=5 * key_bytes, rescan_s=0.1)
    b = Rig(root, world=1, budget=5 * key_bytes, rescan_s=0)  # another server, which never rescans
    try:
        for i in range(5):
            _written(a, f"a{i}".encode(), i)
        for i in range(3):
            _written(b, f"b{i}".encode(), i)
        end = time.monotonic() + 5
        while a.tier.stats.evictions < 3:
            assert time.monotonic() < end, "a's index took in b's records and stayed over its budget"
            a.tier.poll()
            time.sleep(0.01)
        assert len(a.tier.index) == 5 and a.tier.stats.evictions == 3
        end = time.monotonic() + 5
        while len(list(root.rglob("*.r0"))) > 5:
            assert time.monotonic() < end, "the evicted records stayed on disk"
            time.sleep(0.02)
    finally:
        a.close()
        b.close()


def test_a_janitor_whose_scan_fails_goes_on_deleting(root, monkeypatch):
    """Writes wait for the janitor's deletions (the budget counts them), so the janitor must outlive a
    scan that raises: it warns once and goes on."""
    import logging

    class Records(logging.Handler):  # on the module's own logger: the package may route to vLLM's
        def __init__(self):
            super().__init__(logging.WARNING)
            self.records = []

        def emit(self, record):
            self.records.append(record)

    seen = Records()
    janitor_log = logging.getLogger("vllm_npu_offload.tiers.disk_janitor")
    janitor_log.addHandler(seen)

    real_scan, calls = DiskJanitor.scan, []

    def failing_once(self):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected scan failure")
        return real_scan(self)

    monkeypatch.setattr(DiskJanitor, "scan", failing_once)
    key_bytes = CHUNK + HEADER_BYTES
    rig = Rig(root, world=1, budget=2 * key_bytes, rescan_s=0.05)
    try:
        end = time.monotonic() + 5
        while len(calls) < 3:  # past the failing scan
            assert time.monotonic() < end, "the janitor stopped after a failing scan"
            time.sleep(0.01)
        assert any("janitor" in r.getMessage() and "injected scan failure" in r.getMessage() for r in seen.records)
        for i in range(6):
            rig.fill(i % CHUNKS, seed=i)
            end = time.monotonic() + 5
            while not rig.tier.may_write():
                assert time.monotonic() < end, "writes never got room: the janitor stopped deleting"
                rig.tier.poll()
                time.sleep(0.005)
            assert rig.tier.start_write(f"k{i}".encode(), i % CHUNKS)
            rig.wait()
        assert rig.tier.stats.stores == 6 and len(rig.tier.index) <= 2
    finally:
        janitor_log.removeHandler(seen)
        rig.close()
