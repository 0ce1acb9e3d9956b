"""The Mooncake Store tier: whole host records in a distributed memory pool that servers share.

Same split as the disk tier. Each rank's worker runs a ``MooncakeRankServer`` over its host buffer:
a Mooncake client that lends ``segment_bytes`` of its memory to the pool, registers the host buffer
once and moves records zero-copy between it and the pool (``batch_put_from_multi_buffers`` /
``batch_get_into_multi_buffers``, one call for all orders queued together). The scheduler's
``MooncakeTier`` decides what to read and write, with ``DiskTier``'s surface, and answers
``has`` at once from what it knows; a background thread asks the master about keys it does not know
(``batch_is_exist``), so no scheduler call ever waits on the network.

A record is one rank's share of one key: a 4 KiB header (``record.py``: identity, key, rank, size,
CRC-32C of the payload) and the host chunk, stored as one object named
``<tenant>/<identity fingerprint>/<key hex>/r<rank>``. A different model, dtype, layout, world
size or tenant never has the same name, and a record that fails its header or checksum is a miss
and is removed.

A master that stops answering (RPC failure, or a call past ``timeout_s``) takes the tier down for a
backoff that doubles up to ``max_backoff_s``: nothing is looked up or ordered meanwhile, and it
comes back by itself once the master answers again (its clients remount their segments; what the
pool held before a master restart is gone, so what the tier knew is forgotten).
"""

from __future__ import annotations

import hashlib
import logging
import re
import socket
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, fields
from typing import Any, Mapping

import numpy as np

from .channel import listen, serve, socket_path, unlisten
from .contract import Completion, Done, Failure, Hello, Op, Order, RecordIdentity, TierStats
from .disk_tier import ReadRate
from .rank_links import OrderedTier, PendingOrder
from .record import HEADER_BYTES, RecordError, check_header, checksum, pack_header

logger = logging.getLogger(__name__)

# Mooncake's error codes (mooncake-store/include/types.h) that change what the tier does.
NO_AVAILABLE_HANDLE = -200  # no space in the pool
INVALID_PARAMS = -600  # e.g. an object larger than the buffers given
OBJECT_NOT_FOUND = -704
TRANSFER_FAIL = -800  # e.g. an object smaller than the buffers given
RPC_FAIL_FIRST, RPC_FAIL_LAST = -999, -900  # -900 RPC failed, -901 timed out: the master is unreachable

PROTOCOLS = ("tcp", "rdma", "ascend")
MIN_SEGMENT_BYTES = 16 << 20  # Mooncake refuses a smaller segment (0 lends none)
DEFAULT_METADATA_PORT = 8080
INSTALL_HINT = "pip install .[mooncake] (mooncake-transfer-engine-non-cuda; -cuda13 / -npu wheels on GPU / Ascend)"
SYSTEM_LIBS = "libibverbs1 libnl-3-200 libnl-route-3-200 libnuma1 libcurl4"
MAX_BATCH = 32  # orders in one batched store call
MAX_KNOWN = 1 << 20  # keys remembered present (least recently used forgotten first)
MAX_QUEUED = 8192  # keys waiting for an existence check
CHECK_BATCH = 256  # keys per batch_is_exist
_TENANT = re.compile(r"[A-Za-z0-9._-]{1,64}")


class MooncakeMissing(ImportError):
    """The mooncake package (or a system library it needs) is not installed."""


class StoreError(Exception):
    """A Mooncake call answered an error code."""

    def __init__(self, code: int, what: str):
        super().__init__(f"{what}: mooncake error {code}")
        self.code = code


def store_class():
    """``MooncakeDistributedStore``, imported on first use so the package works without it."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        missing = "system library" if "lib" in str(e) and ".so" in str(e) else "package"
        raise MooncakeMissing(f"the Mooncake tier needs the mooncake {missing} ({e}): {INSTALL_HINT}; "
                              f"on Debian/Ubuntu also apt-get install {SYSTEM_LIBS}") from e
    return MooncakeDistributedStore


def unreachable(code: int) -> bool:
    return RPC_FAIL_FIRST <= code <= RPC_FAIL_LAST


def failure_of(code: int) -> Failure:
    if code == NO_AVAILABLE_HANDLE:
        return Failure.NO_SPACE
    if code == OBJECT_NOT_FOUND:
        return Failure.MISSING
    return Failure.IO_ERROR


# -- configuration -----------------------------------------------------------------------
def _bad(key: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{key}={value!r}: expected {allowed}")


def _host_port(key: str, value: str) -> tuple[str, int]:
    host, _, port = str(value).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise _bad(key, value, "host:port")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class MooncakeConfig:
    """Where the pool is and what each rank lends it (``kv_connector_extra_config`` keys ``mooncake_*``)."""

    master: str  # host:port of mooncake_master's RPC
    metadata_server: str = ""  # "": http://<master host>:8080/metadata (the master's own HTTP server)
    protocol: str = "tcp"
    device: str = ""  # RDMA / Ascend device names ("": the transfer engine picks)
    segment_bytes: int = 4 << 30  # memory each rank lends to the pool (0: none, it only uses others')
    buffer_bytes: int = 16 << 20  # the client's own transfer buffer (records go zero-copy, not through it)
    tenant: str = "default"  # servers of one tenant share records; others never see them
    local_hostname: str = ""  # the address other clients reach this one at ("": the one that routes to the master)
    timeout_s: float = 5.0  # a store call longer than this takes the tier down
    backoff_s: float = 5.0  # first down period; doubles while the master stays unreachable
    max_backoff_s: float = 60.0

    def __post_init__(self) -> None:
        _host_port("mooncake_master", self.master)
        md = self.metadata_server
        if md and not (md == "P2PHANDSHAKE" or re.match(r"^(https?|etcd)://\S+$", md)):
            raise _bad("mooncake_metadata_server", md, "http://host:port/metadata, etcd://host:port or P2PHANDSHAKE")
        if self.protocol not in PROTOCOLS:
            raise _bad("mooncake_protocol", self.protocol, " | ".join(PROTOCOLS))
        if self.segment_bytes != 0 and self.segment_bytes < MIN_SEGMENT_BYTES:
            raise _bad("mooncake_segment_bytes", self.segment_bytes, f"0 or at least {MIN_SEGMENT_BYTES} (16 MiB)")
        if self.buffer_bytes < 0:
            raise _bad("mooncake_buffer_bytes", self.buffer_bytes, "a byte count >= 0")
        if not _TENANT.fullmatch(self.tenant):
            raise _bad("mooncake_tenant", self.tenant, "1-64 characters of A-Z a-z 0-9 . _ -")
        for name in ("timeout_s", "backoff_s", "max_backoff_s"):
            if not getattr(self, name) > 0:
                raise _bad(f"mooncake_{name}", getattr(self, name), "a number of seconds > 0")

    @property
    def metadata_url(self) -> str:
        host, _ = _host_port("mooncake_master", self.master)
        return self.metadata_server or f"http://{host}:{DEFAULT_METADATA_PORT}/metadata"

    def hostname(self) -> str:
        """This client's address: the configured one, else the local address that routes to the master."""
        if self.local_hostname:
            return self.local_hostname
        host, port = _host_port("mooncake_master", self.master)
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((host, port))  # UDP: no packet is sent
                return s.getsockname()[0]
        except OSError:
            return socket.gethostname()

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> "MooncakeConfig | None":
        """The tier's config from ``mooncake_*`` keys; None when ``mooncake_master`` is not set."""
        names = {f"mooncake_{f.name}": f for f in fields(cls)}
        given = {k: v for k, v in extra.items() if k.startswith("mooncake_")}
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(unknown)}; the Mooncake tier takes {', '.join(sorted(names))}")
        if given.get("mooncake_master") in (None, ""):
            if given:
                raise ValueError(f"{', '.join(sorted(given))} given without mooncake_master (host:port)")
            return None
        return cls(**{names[k].name: _coerce(k, v, names[k].type) for k, v in given.items()})


def _coerce(key: str, value: Any, kind: Any) -> Any:
    """A config value as its field's type; a wrong one raises ValueError naming the key."""
    kind = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().isdigit():
            raise _bad(key, value, "a whole number of bytes")
        return int(value)
    if kind == "float":
        try:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        except (TypeError, ValueError):
            raise _bad(key, value, "a number of seconds") from None
    if not isinstance(value, str):
        raise _bad(key, value, "a string")
    return value


@dataclass(frozen=True)
class MooncakeTierConfig:
    """The scheduler side's settings (the same decisions as ``DiskTierConfig``)."""

    store: MooncakeConfig
    world_size: int
    engine_id: str
    tokens_per_key: int
    read_timeout_s: float = 5.0
    read_queue_s: float = 1.0  # reads start while the queue of reads drains within this
    prefill_tokens_per_s: float = 0.0  # > 0: reads must also beat recomputing at this rate
    admit: str = "all"  # as the disk tier's
    max_write_backlog_bytes: int = 1 << 30
    read_bytes_per_s: float = 1e9  # the cost rule's rate until reads have measured it
    recheck_s: float = 2.0  # a key found absent is asked again after this (another server may write it)
    no_space_pause_s: float = 2.0  # stores pause this long after the pool was full


# -- names ---------------------------------------------------------------------------------
def record_name(tenant: str, fingerprint: str, key: bytes, rank: int) -> str:
    return f"{tenant}/{fingerprint}/{key.hex()}/r{rank}"


def header_fingerprint(tenant: str, fingerprint: str) -> str:
    """What a record's header carries: the identity and the tenant, so a record copied across tenants fails."""
    return hashlib.sha256(f"{tenant}\0{fingerprint}".encode()).hexdigest()[:32]


def tier_address(cfg: MooncakeConfig, engine_id: str, rank: int) -> str:
    """The Unix socket of ``rank``'s Mooncake tier worker."""
    return socket_path(engine_id, f"/mooncake/{cfg.tenant}@{cfg.master}", rank)


def open_store(cfg: MooncakeConfig, segment_bytes: int, buffer_bytes: int):
    """A set-up Mooncake client; StoreError if the master or metadata server refuses it."""
    store = store_class()()
    rc = store.setup(cfg.hostname(), cfg.metadata_url, segment_bytes, buffer_bytes, cfg.protocol, cfg.device,
                     cfg.master)
    if rc != 0:
        raise StoreError(rc, f"setup with master {cfg.master}, metadata {cfg.metadata_url}")
    return store


def _close_later(store, after: list[threading.Thread]) -> None:
    """Close a client once the threads that call it have ended (closing under a call crashes the
    process), on a thread of its own: against a hung master a call, and ``close``, can block."""
    if store is not None:
        threading.Thread(target=_close_after, args=(store, after), name="npu-kv-mooncake-close", daemon=True).start()


def _close_after(store, after: list[threading.Thread]) -> None:
    for t in after:
        if t is not threading.current_thread():
            t.join()
    if store is None:
        return
    try:
        store.close()
    except Exception:
        pass


# -- the rank's side -------------------------------------------------------------------------
def _share(t0: float, n: int) -> float:
    """Each record's share of one batch call's seconds: the counters' seconds sum to the time the
    calls took, and bytes over seconds is the rate the pool delivered."""
    return (time.perf_counter() - t0) / max(1, n)


class MooncakeRankServer:
    """Serves one scheduler connection at a time on ``address`` for one rank's host buffer.

    One thread runs reads and one runs writes, so a read never waits behind a burst of stores; each
    takes every order queued for it (up to ``max_batch``) into one store call.
    """

    def __init__(self, host: memoryview, identity: RecordIdentity, rank: int, cfg: MooncakeConfig, address: str,
                 max_batch: int = MAX_BATCH, store=None):
        store_class()  # fail now, naming the install, rather than on the first order
        self.identity = identity
        self.rank = rank
        self.cfg = cfg
        self.address = address
        self.chunk_bytes = identity.chunk_bytes
        self._host = np.frombuffer(host, dtype=np.uint8)
        self.num_chunks = self._host.nbytes // self.chunk_bytes
        self._fingerprint = identity.fingerprint()
        self._header_fp = header_fingerprint(cfg.tenant, self._fingerprint)
        self.max_batch = max_batch
        self._pages = np.zeros(2 * max_batch * HEADER_BYTES, dtype=np.uint8)  # read pages, then write pages
        self._op_locks = {Op.READ: threading.Lock(), Op.WRITE: threading.Lock()}
        self._store = store
        self._registered = False
        self._store_lock = threading.Lock()
        self._down_until = 0.0
        self._cv = threading.Condition()
        self._queues: dict[Op, deque] = {Op.READ: deque(), Op.WRITE: deque()}
        self._send_lock = threading.Lock()
        self._closed = False
        self._listener = listen(address)
        self._threads = [threading.Thread(target=self._serve, name=f"npu-kv-mooncake-accept-r{rank}", daemon=True)]
        self._threads += [threading.Thread(target=self._io_loop, args=(op,), name=f"npu-kv-mooncake-{op.value}-r{rank}",
                                           daemon=True) for op in (Op.READ, Op.WRITE)]
        for t in self._threads:
            t.start()
        logger.info("mooncake tier (rank %d): master %s, %s, segment %.1f GiB, record %d bytes, tenant %s", rank,
                    cfg.master, cfg.protocol, cfg.segment_bytes / 2**30, self.chunk_bytes, cfg.tenant)

    def hello(self) -> Hello:
        return Hello(self.rank, self.identity, True, False, 0.0, 0.0)

    def name(self, key: bytes) -> str:
        return record_name(self.cfg.tenant, self._fingerprint, key, self.rank)

    # -- serving ---------------------------------------------------------------------------
    def _serve(self) -> None:
        serve(self._listener, self.hello, self._enqueue, lambda: self._closed)

    def _enqueue(self, conn, order: Order) -> None:
        with self._cv:
            self._queues[order.op].append((conn, order))
            self._cv.notify_all()

    def _take(self, op: Op) -> list:
        """Every order queued for ``op`` (at most ``max_batch``), waiting for one; [] when closed."""
        q = self._queues[op]
        with self._cv:
            while not q and not self._closed:
                self._cv.wait()
            return [q.popleft() for _ in range(min(len(q), self.max_batch))] if not self._closed else []

    def _io_loop(self, op: Op) -> None:
        if op is Op.READ:
            self._connected()  # set up now, so the first order does not wait for it
        while batch := self._take(op):
            dones = self.execute_batch([order for _, order in batch])
            for (conn, _), done in zip(batch, dones):
                try:
                    with self._send_lock:
                        conn.send(done)
                except OSError:
                    pass

    # -- the store -------------------------------------------------------------------------
    def _connected(self):
        """The set-up client with the host buffer registered, or None while the pool is unreachable."""
        with self._store_lock:
            if time.monotonic() < self._down_until:
                return None
            try:
                if self._store is None:
                    store = open_store(self.cfg, self.cfg.segment_bytes, self.cfg.buffer_bytes)
                    if self._closed:
                        _close_after(store, [])
                        return None
                    self._store = store
                if not self._registered:
                    for arr in (self._host, self._pages):
                        rc = self._store.register_buffer(arr.ctypes.data, arr.nbytes)
                        if rc != 0:
                            raise StoreError(rc, f"register_buffer of {arr.nbytes} bytes")
                    self._registered = True
            except Exception as e:
                logger.warning("mooncake tier (rank %d): %s; orders fail for %.1f s", self.rank, e, self.cfg.backoff_s)
                self._down_until = time.monotonic() + self.cfg.backoff_s
                return None
            return self._store

    def _went_down(self, why: str) -> None:
        """Orders fail at once for a while: queued ones must not each wait on a dead master."""
        self._down_until = time.monotonic() + self.cfg.backoff_s
        logger.warning("mooncake tier (rank %d): %s; orders fail for %.1f s", self.rank, why, self.cfg.backoff_s)

    # -- orders ----------------------------------------------------------------------------
    def execute(self, order: Order) -> Done:
        """Carry out one order now (on the calling thread); never raises."""
        return self.execute_batch([order])[0]

    def execute_batch(self, orders: list[Order]) -> list[Done]:
        """Carry out orders of one kind in one store call; one Done each, in order; never raises."""
        out: dict[int, Done] = {}
        todo = []
        for i, o in enumerate(orders):
            if 0 <= o.chunk < self.num_chunks:
                todo.append(i)
            else:
                out[i] = self._failed(o, Failure.IO_ERROR, f"host chunk {o.chunk} out of range [0, {self.num_chunks})")
        for start in range(0, len(todo), self.max_batch):
            part = todo[start:start + self.max_batch]
            for i, done in zip(part, self._run([orders[i] for i in part])):
                out[i] = done
        return [out[i] for i in range(len(orders))]

    def _run(self, orders: list[Order]) -> list[Done]:
        op = orders[0].op
        if any(o.op is not op for o in orders):
            return [self._failed(o, Failure.IO_ERROR, "a batch mixes reads and writes") for o in orders]
        store = self._connected()
        if store is None:
            return [self._failed(o, Failure.IO_ERROR, "store unreachable") for o in orders]
        t0 = time.perf_counter()
        with self._op_locks[op]:
            try:
                dones = (self._read if op is Op.READ else self._write)(store, orders, t0)
            except Exception as e:  # a tier never takes the worker down: the orders fail, the keys are misses
                self._went_down(f"{op.value} raised {e!r}")
                return [self._failed(o, Failure.IO_ERROR, repr(e)) for o in orders]
        took = time.perf_counter() - t0
        if took > self.cfg.timeout_s and self._down_until < time.monotonic():
            self._went_down(f"a {op.value} of {len(orders)} records took {took:.1f} s")
        return dones

    def _failed(self, o: Order, failure: Failure, detail: str) -> Done:
        return Done(o.seq, self.rank, o.op, False, failure=failure, detail=detail)

    def _chunk(self, chunk: int) -> np.ndarray:
        return self._host[chunk * self.chunk_bytes:(chunk + 1) * self.chunk_bytes]

    def _page(self, op: Op, i: int) -> np.ndarray:
        base = (0 if op is Op.READ else self.max_batch) + i
        return self._pages[base * HEADER_BYTES:(base + 1) * HEADER_BYTES]

    def _buffers(self, orders: list[Order]) -> tuple[list[str], list[list[int]], list[list[int]]]:
        names = [self.name(o.key) for o in orders]
        ptrs = [[self._page(o.op, i).ctypes.data, self._chunk(o.chunk).ctypes.data] for i, o in enumerate(orders)]
        return names, ptrs, [[HEADER_BYTES, self.chunk_bytes] for _ in orders]

    def _write(self, store, orders: list[Order], t0: float) -> list[Done]:
        world = self.identity.world_size
        for i, o in enumerate(orders):
            crc = checksum(self._chunk(o.chunk))
            header = pack_header(self._header_fp, o.key, self.rank, world, self.chunk_bytes, crc)
            self._page(Op.WRITE, i)[:] = np.frombuffer(header, dtype=np.uint8)
        names, ptrs, sizes = self._buffers(orders)
        codes = store.batch_put_from_multi_buffers(names, ptrs, sizes)
        seconds = _share(t0, len(orders))
        out = []
        for o, code in zip(orders, codes):
            if code == 0:
                out.append(Done(o.seq, self.rank, o.op, True, HEADER_BYTES + self.chunk_bytes, seconds))
            else:
                out.append(self._failed(o, failure_of(code), f"put: mooncake error {code}"))
        if any(unreachable(c) for c in codes):
            self._went_down(f"put: master unreachable ({min(codes)})")
        return out

    def _read(self, store, orders: list[Order], t0: float) -> list[Done]:
        names, ptrs, sizes = self._buffers(orders)
        codes = store.batch_get_into_multi_buffers(names, ptrs, sizes)
        seconds = _share(t0, len(orders))
        if any(unreachable(c) for c in codes):
            self._went_down(f"get: master unreachable ({min(codes)})")
        return [self._verify(store, i, o, name, code, seconds) for i, (o, name, code) in
                enumerate(zip(orders, names, codes))]

    def _verify(self, store, i: int, o: Order, name: str, code: int, seconds: float) -> Done:
        """One read's outcome: a whole, checked record; else a miss (a bad record is removed)."""
        want = HEADER_BYTES + self.chunk_bytes
        try:
            if code == want:
                crc = check_header(self._page(Op.READ, i), self._header_fp, o.key, self.rank,
                                   self.identity.world_size, self.chunk_bytes)
                if checksum(self._chunk(o.chunk)) != crc:
                    raise RecordError(Failure.CORRUPT, f"{name}: payload checksum mismatch")
                return Done(o.seq, self.rank, o.op, True, want, seconds)
            if code >= 0 or code in (INVALID_PARAMS, TRANSFER_FAIL):
                size = code if code >= 0 else store.get_size(name)
                if size >= 0 and size != want:
                    raise RecordError(Failure.CORRUPT, f"{name}: {size} bytes, a record of this identity has {want}")
            return self._failed(o, failure_of(code), f"get: mooncake error {code}")
        except RecordError as e:
            store.remove(name, True)  # never to be read again (force: even under a fresh lease)
            return self._failed(o, e.failure, str(e))

    def shutdown(self) -> None:
        self._closed = True
        unlisten(self._listener, self.address)
        with self._cv:
            self._cv.notify_all()
        for t in self._threads[1:]:
            t.join(timeout=self.cfg.timeout_s)
        if self._store_lock.acquire(timeout=self.cfg.timeout_s):  # a setup against a dead master takes ~90 s
            store, self._store = self._store, None
            self._store_lock.release()
            if not any(t.is_alive() for t in self._threads[1:]):
                _close_after(store, [])
                return
        else:
            store = None  # still being set up: it is not closed, and dies with the process
        _close_later(store, self._threads[1:])  # a call is stuck on a hung master


# -- the scheduler's side ----------------------------------------------------------------------
class MooncakeTier(OrderedTier):
    """The scheduler side, a ``LowerTier`` (contract.py) over the pool; every call returns at once."""

    name = "mooncake"

    def __init__(self, cfg: MooncakeTierConfig, store=None):
        if store is None:
            store_class()  # fail now, naming the install
        self.cfg = cfg
        self.admit = cfg.admit
        self.stats = TierStats(where="in the pool")
        self.rate = ReadRate(cfg.read_bytes_per_s)
        self.writable = True
        self.identity: RecordIdentity | None = None
        self.key_bytes = 0
        self._names: list[tuple[str, str]] = []  # per rank: (prefix, suffix) of a record's name
        self._init_orders([tier_address(cfg.store, cfg.engine_id, r) for r in range(cfg.world_size)])
        self._stores_paused_until = 0.0
        # what the checker thread and the scheduler share, under _lock
        self._lock = threading.Lock()
        self._present: OrderedDict[bytes, None] = OrderedDict()
        self._absent: dict[bytes, float] = {}  # key -> when the master said so
        self._queued: OrderedDict[bytes, None] = OrderedDict()
        self._checking: set[bytes] = set()
        self._removals: list[bytes] = []
        self._probe = False
        self._epoch = 0  # bumps when the tier goes down: answers of an older epoch are dropped
        self._client = store
        self._connected = store is not None
        self._is_down = False  # until a probe of the master succeeds again
        self._down_until = 0.0  # the next probe
        self._backoff = cfg.store.backoff_s
        self._call_started: float | None = None
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._threads = [threading.Thread(target=self._check_loop, name="npu-kv-mooncake-check", daemon=True)]
        for t in self._threads:
            t.start()

    # -- state -----------------------------------------------------------------------------
    @property
    def down(self) -> bool:
        """The master is unreachable (or a call to it is stuck): nothing is looked up or ordered."""
        started = self._call_started
        stuck = started is not None and time.monotonic() - started > self.cfg.store.timeout_s
        if stuck and "stuck" not in self._warned:
            self._warn_once("stuck", "mooncake tier: a call to master %s has run over %.1f s; the tier is down",
                            self.cfg.store.master, self.cfg.store.timeout_s)
        return stuck or not self._connected or self._is_down

    @property
    def up(self) -> bool:
        return self.identity is not None and self._links.all_up and not self.down

    def names(self, key: bytes) -> list[str]:
        """Every rank's record name of ``key``."""
        h = key.hex()
        return [f"{pre}{h}{suf}" for pre, suf in self._names]

    def _go_down(self, why: str) -> None:
        """Called on the checker thread: forget what the pool held, wait, then ask again."""
        with self._lock:
            self._epoch += 1
            self._present.clear()
            self._absent.clear()
            self._queued.clear()
            self._checking.clear()
            self._removals.clear()
            self._is_down = True
            self._down_until = time.monotonic() + self._backoff
            wait, self._backoff = self._backoff, min(2 * self._backoff, self.cfg.store.max_backoff_s)
        self._warned.discard("up")
        self._warn_once("down", "mooncake tier: master %s unreachable (%s); down for %.1f s (backoff doubles to "
                        "%.0f s), requests recompute meanwhile", self.cfg.store.master, why, wait,
                        self.cfg.store.max_backoff_s)

    def _came_up(self) -> None:
        with self._lock:
            self._backoff = self.cfg.store.backoff_s
            self._is_down = False
        self._warned.discard("stuck")
        if "down" in self._warned:
            self._warned.discard("down")
            self._warn_once("up", "mooncake tier: master %s answers again", self.cfg.store.master)

    # -- the checker thread ----------------------------------------------------------------
    def _call(self, fn, *args):
        """A store call timed for the watchdog (``down`` sees a call stuck past ``timeout_s``)."""
        self._call_started = time.monotonic()
        try:
            return fn(*args)
        finally:
            took = time.monotonic() - self._call_started
            self._call_started = None
            if took > self.cfg.store.timeout_s:
                raise StoreError(RPC_FAIL_LAST, f"a call took {took:.1f} s")

    def _check_loop(self) -> None:
        while not self._closed.is_set():
            try:
                self._check_once()
            except Exception as e:  # StoreError, or the client itself failing
                if not self._closed.is_set():
                    self._go_down(str(e))
        _close_after(self._client, [])  # only this thread calls the client

    def _check_once(self) -> None:
        if self._closed.is_set():
            return
        if not self._connected:
            if time.monotonic() < self._down_until:
                self._closed.wait(min(0.1, self._down_until - time.monotonic()))
                return
            self._client = open_store(self.cfg.store, 0, 0)  # looks up and removes; lends no memory
            self._connected = True
            self._came_up()
            return
        if self._is_down:
            if time.monotonic() < self._down_until:
                self._closed.wait(min(0.1, self._down_until - time.monotonic()))
            else:
                self._probe_master()
            return
        if not self._names:
            self._closed.wait(0.05)
            return
        self._wake.wait(0.5)
        self._wake.clear()
        with self._lock:
            removals, self._removals = self._removals, []
            keys = [self._queued.popitem(last=False)[0] for _ in range(min(CHECK_BATCH, len(self._queued)))]
            self._checking.update(keys)
            probe, self._probe = self._probe, False
            epoch = self._epoch
        if removals:
            self._call(self._client.batch_remove, [n for k in removals for n in self.names(k)], True)
        if keys:
            self._check(keys, epoch)
        elif probe:
            self._probe_master()

    def _probe_master(self) -> None:
        (code,) = self._call(self._client.batch_is_exist, [f"{self.cfg.store.tenant}/probe"])
        if code < 0:
            raise StoreError(code, "existence probe")
        self._came_up()

    def _check(self, keys: list[bytes], epoch: int) -> None:
        """Ask the master which of ``keys`` have every rank's record."""
        world = self.cfg.world_size
        try:
            codes = self._call(self._client.batch_is_exist, [n for k in keys for n in self.names(k)])
        finally:
            with self._lock:
                self._checking.difference_update(keys)
        if any(unreachable(c) for c in codes):
            raise StoreError(min(codes), "batch_is_exist")
        now = time.monotonic()
        with self._lock:
            if epoch != self._epoch:
                return
            for i, key in enumerate(keys):
                mine = codes[i * world:(i + 1) * world]
                if all(c == 1 for c in mine):
                    self._remember(key)
                elif all(c >= 0 for c in mine) and key not in self._present:
                    self._absent[key] = now
                # another error: unknown, asked again on the next lookup

    def _remember(self, key: bytes) -> None:
        """Under _lock: ``key`` is present (bounded: the least recently used is forgotten)."""
        self._absent.pop(key, None)
        self._present[key] = None
        self._present.move_to_end(key)
        if len(self._present) > MAX_KNOWN:
            self._present.popitem(last=False)

    # -- ranks -----------------------------------------------------------------------------
    def _on_hello(self, h: Hello) -> None:
        ident = self._identity_of(h, ready=self.identity is not None)
        if ident is None:
            return
        fp = ident.fingerprint()
        self._names = [(f"{self.cfg.store.tenant}/{fp}/", f"/r{r}") for r in range(self.cfg.world_size)]
        self.key_bytes = (ident.chunk_bytes + HEADER_BYTES) * self.cfg.world_size
        self.identity = ident
        logger.info("mooncake tier: master %s, tenant %s, %d ranks, %d bytes a key, reads at most %.1f s",
                    self.cfg.store.master, self.cfg.store.tenant, self.cfg.world_size, self.key_bytes,
                    self.cfg.read_timeout_s)

    # -- completions -----------------------------------------------------------------------
    def poll(self) -> list[Completion]:
        """Take in everything the ranks said; returns the orders that ended on every rank."""
        out = self._take_events()
        self.stats.keys_now = len(self._present)
        self.stats.used_bytes_now = self.stats.keys_now * self.key_bytes
        return out

    def _forget(self, key: bytes, remove: bool) -> None:
        """``key`` is not (wholly) in the pool: ask again later; ``remove``: delete every rank's record."""
        with self._lock:
            self._present.pop(key, None)
            if remove:
                self._removals.append(key)
        if remove:
            self._wake.set()

    def _suspect(self) -> None:
        """An order failed without a reason from the pool: have the checker probe the master now."""
        with self._lock:
            self._probe = True
        self._wake.set()

    def _finish_read(self, p: PendingOrder) -> None:
        s = self.stats
        if p.ok:
            s.count_done(Op.READ, p.nbytes, p.seconds)
            with self._lock:
                if p.key in self._present:
                    self._present.move_to_end(p.key)
            return
        s.read_failures += 1
        bad = [f for f in p.failures if f in (Failure.CORRUPT, Failure.FOREIGN)]
        for f in p.failures:
            s.count_failure(f)
        if bad:
            s.checksum_failures += 1
            self._warn_once("corrupt", "mooncake tier: a record failed its checks and was removed; recomputing")
        partial = bool(bad) or len(p.failures) < self.cfg.world_size
        self._forget(p.key, remove=partial)  # a half-present key is of no use: remove what is left
        if Failure.IO_ERROR in p.failures:
            self._suspect()

    def _finish_write(self, p: PendingOrder) -> None:
        s = self.stats
        if p.ok:
            s.count_done(Op.WRITE, p.nbytes, p.seconds)
            with self._lock:
                self._remember(p.key)
            return
        s.dropped_stores += 1
        for f in p.failures:
            s.count_failure(f)
        if Failure.NO_SPACE in p.failures:
            self._stores_paused_until = time.monotonic() + self.cfg.no_space_pause_s
            self._warn_once("nospace", "mooncake tier: the pool is full; stores pause %.0f s at a time, reads go on",
                            self.cfg.no_space_pause_s)
        elif Failure.IO_ERROR in p.failures:
            self._suspect()
        self._forget(p.key, remove=len(p.failures) < self.cfg.world_size)  # no rank's record may stay alone

    # -- decisions -------------------------------------------------------------------------
    def has(self, key: bytes) -> bool:
        """Whether ``key`` is known to be in the pool, now; an unknown key is queued for the checker."""
        if not self.up:
            return False
        with self._lock:
            if key in self._present:
                self._present.move_to_end(key)
                return True
            at = self._absent.get(key)
            if at is not None and time.monotonic() - at < self.cfg.recheck_s:
                return False
            if key not in self._queued and key not in self._checking:
                self._queued[key] = None
                if len(self._queued) > MAX_QUEUED:
                    self._queued.popitem(last=False)
        self._wake.set()
        return False

    def checking(self, key: bytes) -> bool:
        """Whether the master has been asked about ``key`` and not answered yet (the lookup may wait)."""
        with self._lock:
            return key in self._queued or key in self._checking

    def looking_up(self, key: bytes) -> bool:
        return self.checking(key)

    def describe_rate(self) -> str:
        return super().describe_rate() + (", master down" if self.down else "")

    def _readable(self) -> bool:
        return self.up

    def needs_write(self, key: bytes) -> bool:
        """Whether ``key`` is neither known present nor moving (a write may wait for room)."""
        if key in self._writes or key in self._reads:
            return False
        with self._lock:
            return key not in self._present

    def _send(self, op: Op, key: bytes, chunk: int) -> bool:
        return self.up and super()._send(op, key, chunk)

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        self._links.close()
        self._connected = False
        self._threads[0].join(timeout=self.cfg.store.timeout_s)  # it closes its client as it ends


__all__ = ["MooncakeConfig", "MooncakeMissing", "MooncakeRankServer", "MooncakeTier", "MooncakeTierConfig",
           "StoreError", "header_fingerprint", "record_name", "store_class", "tier_address"]
