"""The reliability part: injected faults under real serving, resources over a soak, kill -9 and restart.

One device command (``--budget-s``), one layout at the capacity load (serve.CAPACITY: the disk tier's case).
An ``off`` server (the reference tokens) and ``ours-disk`` with the fault hook on (``--faults`` is
its ``NPU_OFFLOAD_FAULTS``) start together; then, on ours-disk:

1. probe: a fixed prompt of PROBE_WORDS tokens (~63 offloaded blocks of 64), greedy, PROBE_TOKENS
   tokens, ``ignore_eos``: its text and token ids must equal off's;
2. soak: vLLM's multi-turn client, pass after pass with new texts, until SOAK_SHARE of the budget
   is used (the passes push the probe out of device and host KV), the server's process tree
   sampled every SAMPLE_EVERY_S (benchmarks/multiturn/resources.py: the CPU soak's sample and
   flatness rule, plus GPU memory): no failed or unanswered request, every resource flat after the
   warm-up, the disk tier within its budget; the server's log shows the hook's start-up warning and
   counts what it injected (copy jobs retried, the disk tier's failed reads, checksum failures and
   dropped stores);
3. the probe again: equal to off;
4. kill -9: a pass starts and KILL_AFTER_S later (sooner once the pass has written KILL_BUDGET_SHARE
   of the disk budget, read off the folder: ``wait_for_kill``) every process of the server's tree gets SIGKILL at once. Nothing may be left: no process, no /dev/shm entry of ours, no locked memory, no GPU memory.
   The same server starts again on the same disk folder (not emptied) with the fault hook off, so a
   record failing its checksum can only be one the kill tore; once its disk tier is up and has
   scanned: none of the temporary records the kill left (its own writes make new ones), the probe
   equal to off and served from disk (external hits on a server whose host KV is empty), no record
   failing its checks.

A failing check is a FAIL in the table and the JSON, never an exception; a check that cannot be
measured here (no nvidia-smi, too few samples) is n/a. The soak gives way to the kill -9 stage: a
pass starts only while the time left after it still holds that stage (``Schedule``). Results are
written after every stage (``reliability.json``/``.txt``), so a command cut off still returns them.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from benchmarks.multiturn.procs import listening_pid, tree_pids
from benchmarks.multiturn.resources import (alive, disk_within_budget, flat, records_since, sample, temporaries,
                                            written_since)
from benchmarks.multiturn.report import _table
from vllm_npu_offload.env import KNOBS, parse_faults
from vllm_npu_offload.tiers.channel import tier_sockets

from .serve import (DISK_BYTES, Budget, Load, ServerPlan, check_disk, complete, disk_need, hash_seed, pass_workload,
                    plan_servers, run_one, scrape, server_args, server_env, server_log_info, start_servers,
                    stop_servers)

DEFAULT_FAULTS = "load=0.01,store=0.01,disk_read=0.02,disk_corrupt=0.02,disk_write=0.02"
FAULTS_VAR = "NPU_OFFLOAD_FAULTS"
HASH_SEED = (("PYTHONHASHSEED", "0"),)
SERVERS = ("off", "ours-disk")
SOAK_SHARE = 0.55  # of the budget used when the last soak pass may start
SAMPLE_EVERY_S = 10.0
WARMUP_SAMPLES = 3
SLACK = 0.10
KILL_AFTER_S = 20.0  # of the pass running when the kill comes: requests computing, stores in flight
KILL_BUDGET_SHARE = 0.5  # the cut pass writes at most this share of the disk budget before the kill
KILL_LEAST_S = 2.0  # never sooner into the pass: its first stores are under way
POLL_S = 0.25  # how often the folder is read while waiting on it
QUIET_S = 2.0  # no record written for this long: the server's writes are done (before and after a probe)
PROBE_WORDS = 4040  # word-level tokenizer: one token each; 63 whole blocks of 64
PROBE_TOKENS = 32
FLAT_KEYS = ("rss_mib", "locked_mib", "threads", "open_files", "shm_entries", "gpu_mib")
SAMPLE_KEYS = FLAT_KEYS + ("disk_records", "disk_tmp", "disk_mib")
OURS_SHM = ("npu", "offload")  # in the name of a /dev/shm entry of ours (the CPU kill -9 test's rule)
LOCKED_SLACK_MIB = 256.0

HOOK_ON = f"{FAULTS_VAR} is set"  # faults.py's start-up warning
COPY_RETRIED = re.compile(r"KV offload job \d+ \(\w+\) failed \(injected fault")  # workers.Retries
COPY_FAILED = re.compile(r"KV offload job \d+ \(\w+\) failed: ")  # reported to vLLM: retries spent
TIER_UP = re.compile(r"disk tier: \S+, budget [\d.]+ GiB")  # DiskTier's line once every rank said hello
TIER_LINE = re.compile(
    r"disk tier: hits (\d+) \(.*?recomputed: (\d+) by cost, (\d+) no host chunk, (\d+) late, (\d+) failed "
    r"\((\d+) checksum\); stores (\d+) \(.*?\), dropped (\d+)(?: \(\d+ left host first\))?, evictions (\d+), on disk ([\d.]+) GB")
TIER_FIELDS = ("hits", "misses_cost", "misses_no_chunk", "timeouts", "read_failures", "checksum_failures",
               "stores", "dropped_stores", "evictions")
CORRUPT_WARNING = "failed its checks"  # DiskTier's warning when a record fails its checks


# ---------------------------------------------------------------------------- arguments and plans
def faults_arg(text: str) -> str:
    """``--faults``: NPU_OFFLOAD_FAULTS's syntax, normalised, or ``none`` (the hook off); argparse names
    the flag in front of the error."""
    if text.strip().lower() == "none":
        return ""
    probs = parse_faults(text.strip()) if text.strip() else None
    if probs is None:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected {KNOBS[FAULTS_VAR].allowed()}, or none (the fault hook off)")
    return ",".join(f"{k}={v:g}" for k, v in probs.items())


def plan(layout: str, load: Load, gpu_bytes: int, host_bytes: int, faults: str) -> list[ServerPlan]:
    """off and ours-disk (the fault hook on with ``faults``), sized as the serve part sizes them; both
    with ``PYTHONHASHSEED`` set: vLLM 0.22-0.28 seed block hashes per process otherwise, and the
    restarted server could never find its records (docs/disk_tier.md)."""
    off, ours = (replace(p, env=p.env + HASH_SEED) for p in plan_servers(layout, list(SERVERS), load, gpu_bytes,
                                                                          host_bytes))
    if faults:
        ours = replace(ours, env=ours.env + ((FAULTS_VAR, faults),))
    return [off, ours]


def without_faults(p: ServerPlan) -> ServerPlan:
    """The same server with the fault hook off (the restart after the kill)."""
    return replace(p, env=tuple((k, v) for k, v in p.env if k != FAULTS_VAR))


@dataclass
class Schedule:
    """When the soak stops: SOAK_SHARE of the budget used, or the next pass would leave the kill -9
    stage too little time (its pass before the kill, the kill, a restart, the scan and the probe)."""

    budget_s: float
    soak_share: float = SOAK_SHARE
    kill_after_s: float = KILL_AFTER_S

    def kill_reserve(self, restart_s: float) -> float:
        return self.kill_after_s + 30.0 + restart_s + 60.0

    def another_pass(self, elapsed_s: float, left_s: float, walls: list[float], restart_s: float) -> bool:
        est = 1.25 * max(walls) if walls else 90.0
        return elapsed_s < self.soak_share * self.budget_s and left_s - est >= self.kill_reserve(restart_s)


def restart_estimate(start_s: float, compile_s: float | None) -> float:
    """A restart's seconds: the first start less its compilation (the restart loads it from the cache)."""
    return max(60.0, start_s - (compile_s or 0.0))


# ---------------------------------------------------------------------------- the probe
def probe_prompt() -> str:
    from .models import corpus_words

    rng = random.Random("reliability-probe")
    words = corpus_words()
    return " ".join(rng.choice(words) for _ in range(PROBE_WORDS))


@dataclass
class Probe:
    label: str
    text: str = ""
    token_ids: list[int] | None = None
    device_hit_tokens: float = 0.0  # vLLM's prefix cache hits during the probe
    external_hit_tokens: float = 0.0  # hits through the connector (host or disk)
    error: str | None = None

    def same_as(self, ref: "Probe") -> bool:
        if self.error or ref.error:
            return False
        if self.token_ids is not None and ref.token_ids is not None and self.token_ids != ref.token_ids:
            return False
        return self.text == ref.text


def run_probe(url: str, served: str, label: str, prompt: str, timeout: float = 120.0) -> Probe:
    before = scrape(url)
    try:
        choice = complete(url, served, prompt, PROBE_TOKENS, timeout=timeout, ignore_eos=True,
                          return_token_ids=True)["choices"][0]
        out = Probe(label, choice.get("text") or "", choice.get("token_ids"))
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        return Probe(label, error=f"{type(e).__name__}: {e}")
    time.sleep(0.5)  # the step's stats reach /metrics after the answer
    after = scrape(url)
    out.device_hit_tokens = after.get("prefix_hits", 0.0) - before.get("prefix_hits", 0.0)
    out.external_hit_tokens = after.get("external_hits", 0.0) - before.get("external_hits", 0.0)
    return out


@dataclass
class References:
    """off's answers to the probe computed from scratch and with the whole prefix reused from its
    device cache. In bf16 a prompt's tokens may differ with how much of it was reused (other kernels,
    other rounding), so a probe of ours is compared with off's for the same reuse: none (scratch) or
    the whole prefix (PROBE_WORDS + BOS - 1 tokens, a whole number of 64-token blocks); a partial
    reuse (a record the fault hook damaged or the LRU evicted midway) has no reference: n/a."""

    scratch: Probe
    reuse: Probe

    def compare(self, got: Probe) -> tuple[bool | None, str]:
        if got.error:
            return False, f"error: {got.error}"
        reused = got.device_hit_tokens + got.external_hit_tokens
        whole = self.reuse.device_hit_tokens
        if reused == 0:
            return got.same_as(self.scratch), "off from scratch"
        if whole and reused == whole:
            return got.same_as(self.reuse), f"off reusing {whole:.0f} tokens"
        return None, f"reused {reused:.0f} of {whole:.0f} tokens: no reference with that reuse"


# ---------------------------------------------------------------------------- logs and counters
def tier_counters(text: str) -> dict | None:
    """The disk tier's counters as last logged (TierStats.line), or None before its first line."""
    m = None
    for m in TIER_LINE.finditer(text):
        pass
    if m is None:
        return None
    out: dict = {k: int(v) for k, v in zip(TIER_FIELDS, m.groups()[:len(TIER_FIELDS)])}
    out["on_disk_gb"] = float(m.group(len(TIER_FIELDS) + 1))
    return out


def fault_log(text: str) -> dict:
    """What a server's log says of the fault hook: its start-up warning, copy jobs whose injected
    failure was retried, jobs reported failed to vLLM, the disk tier's warning of a record failing
    its checks, and the tier's counters (failed reads, checksum failures, dropped stores)."""
    hook = next((ln.strip() for ln in text.splitlines() if HOOK_ON in ln), "")
    return {"hook_on": bool(hook), "hook_line": hook[-300:],
            "copy_injected_retried": len(COPY_RETRIED.findall(text)), "copy_failed": len(COPY_FAILED.findall(text)),
            "corrupt_warning": CORRUPT_WARNING in text, "disk_tier": tier_counters(text)}


def injected_counted(seen: dict) -> bool:
    """The log counts failures the hook caused: copy jobs retried, or the disk tier's failed reads or
    dropped stores."""
    d = seen.get("disk_tier") or {}
    return seen.get("copy_injected_retried", 0) + d.get("read_failures", 0) + d.get("dropped_stores", 0) > 0


def client_counts(log_text: str, ok: int, planned: int, clients: int, finished: float | None = None) -> dict:
    """A pass's requests from vLLM's client: ``ok`` (its stats rows), failed (its clients'
    ``num_failures=`` as each ends), unanswered (successes it counted that neither a stats row nor the
    server's ``finished`` count, vLLM's ``request_success`` during the pass, accounts for), and how
    many of ``clients`` ended (one that died says nothing of its requests). ``planned`` is an upper
    bound only: a client whose queue runs dry abandons its open conversations (docs/gpu_e2e.md, serve).
    The client can lose a stats row of a request that was answered: its main process drains the
    results with ``multiprocessing.Queue.empty()``, which may say empty while the last client's last
    result is still in its pipe (seen once: 160 successes, 159 rows, 160 answered by the server)."""
    done = re.findall(r"is done \(num_successes=(\d+), num_failures=(\d+)\)", log_text)
    successes = sum(int(x) for x, _ in done)
    answered = max(ok, int(finished)) if finished is not None else ok
    return {"planned": planned, "ok": ok, "failed": sum(int(y) for _, y in done),
            "unanswered": max(0, successes - answered), "rows_lost": max(0, min(successes, answered) - ok),
            "clients": clients, "clients_done": len(done)}


# ---------------------------------------------------------------------------- resources
def gpu_mib(pids: list[int]) -> float | None:
    """GPU memory of ``pids`` (nvidia-smi's compute apps); None without nvidia-smi."""
    try:
        q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if q.returncode != 0:
        return None
    return gpu_mib_of(q.stdout, pids)


def gpu_used_mib() -> float | None:
    """Memory used on the GPU(s), every process (nvidia-smi); None without nvidia-smi."""
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20)
        return sum(float(x) for x in q.stdout.split()) if q.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None


def gpu_mib_of(table: str, pids: list[int]) -> float:
    want, total = set(pids), 0.0
    for line in table.splitlines():
        parts = [x.strip() for x in line.split(",")]
        try:
            if len(parts) >= 2 and int(parts[0]) in want:
                total += float(parts[1])
        except ValueError:
            continue
    return total


def shm_of(pids: list[int]) -> set[str]:
    """/dev/shm entries the processes hold open or mapped (not those already unlinked)."""
    out: set[str] = set()
    for p in pids:
        try:
            for fd in os.listdir(f"/proc/{p}/fd"):
                try:
                    link = os.readlink(f"/proc/{p}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("/dev/shm/") and not link.endswith("(deleted)"):
                    out.add(link[len("/dev/shm/"):])
            with open(f"/proc/{p}/maps") as f:
                for line in f:
                    path = line.split(maxsplit=5)[5].strip() if len(line.split(maxsplit=5)) == 6 else ""
                    if path.startswith("/dev/shm/") and not path.endswith("(deleted)"):
                        out.add(path[len("/dev/shm/"):])
        except OSError:
            continue
    return out


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def mlocked_mib() -> float | None:
    """The machine's locked memory (/proc/meminfo Mlocked)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("Mlocked:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def tree_sample(root: int, disk: Path | None) -> dict:
    """One sample of a server's tree (re-read each time: the tree may change), GPU memory included."""
    pids = tree_pids(root)
    return {**sample(pids, disk), "gpu_mib": gpu_mib(pids), "pids": len(pids)}


class Sampler:
    """Samples a server's tree every ``every_s`` on a thread, from ``start`` until ``stop``."""

    def __init__(self, root: int, disk: Path | None, every_s: float = SAMPLE_EVERY_S):
        self.root, self.disk, self.every_s = root, disk, every_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reliability-sampler", daemon=True)
        self._t0 = time.monotonic()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append({"t_s": round(time.monotonic() - self._t0, 1), **tree_sample(self.root, self.disk)})
            except Exception as e:  # noqa: BLE001 - a sample lost, not the part
                self.samples.append({"t_s": round(time.monotonic() - self._t0, 1), "error": repr(e)})
            self._stop.wait(self.every_s)

    def start(self) -> "Sampler":
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(timeout=60)
        return [s for s in self.samples if "error" not in s]


# ---------------------------------------------------------------------------- checks
def soak_checks(samples: list[dict], passes: list[dict], disk_budget: int, warm: int = WARMUP_SAMPLES,
                slack: float = SLACK) -> dict[str, bool | None]:
    """The soak's checks (None: not measurable): requests, resources flat after ``warm`` samples,
    the disk tier within its budget."""
    out: dict[str, bool | None] = {
        "soak: no failed requests": sum(p["failed"] for p in passes) == 0 if passes else None,
        "soak: no unanswered requests": sum(p["unanswered"] for p in passes) == 0 if passes else None,
        "soak: every client ran to its end": (all(p["clients_done"] == p["clients"] and not p.get("error")
                                                  for p in passes) if passes else None),
    }
    enough = len(samples) >= warm + 3
    for k in FLAT_KEYS:
        series = [s.get(k) for s in samples]
        ok = enough and all(v is not None for v in series) and not (k == "gpu_mib" and not any(series))
        out[f"soak: {k} flat"] = flat(series, warm, slack) if ok else None
    out["soak: disk tier within its budget"] = disk_within_budget(samples, disk_budget) if samples else None
    return out


@dataclass
class KillReport:
    """What the kill left: processes, /dev/shm entries, temporaries, locked and GPU memory."""

    pids: list[int]
    alive_after: list[int] = field(default_factory=list)
    shm_of_tree: list[str] = field(default_factory=list)  # held by the tree before the kill
    shm_left: list[str] = field(default_factory=list)  # of those, or new since before the start, still there
    temporaries_after_kill: list[str] = field(default_factory=list)  # a record being written when it died
    sockets_left: list[str] = field(default_factory=list)  # tier workers' sockets (info: a restart makes new ones)
    tree_locked_mib: float = 0.0  # VmLck of the tree before the kill
    others_locked_mib: float = 0.0  # VmLck of the servers still up (off)
    mlocked_start_mib: float | None = None  # the machine's Mlocked before the servers started
    mlocked_after_mib: float | None = None
    gpu_before_mib: float | None = None  # the tree's (nvidia-smi's compute apps)
    gpu_after_mib: float | None = None
    gpu_used_before_mib: float | None = None  # the GPU's, all processes (where the tree's pids are not visible)
    gpu_used_after_mib: float | None = None
    planned_gpu_mib: float = 0.0  # what the plan gave the killed server
    wait_s: float = 0.0
    after_s: float = KILL_AFTER_S  # into its pass
    written_mib: float | None = None  # records the cut pass had written when the kill came
    probe_records: int | None = None  # records written from the probe's start to the cut pass's (63 its own)
    probe_records_left: int | None = None  # of those, still on disk after the kill

    def checks(self) -> dict[str, bool | None]:
        ours = [n for n in self.shm_left if any(w in n.lower() for w in OURS_SHM)]
        locked = None
        if self.mlocked_start_mib is not None and self.mlocked_after_mib is not None:
            locked = self.mlocked_after_mib <= self.mlocked_start_mib + self.others_locked_mib + LOCKED_SLACK_MIB
        gpu = None
        if self.gpu_before_mib and self.gpu_after_mib is not None:
            gpu = self.gpu_after_mib == 0
        elif self.planned_gpu_mib and self.gpu_used_before_mib is not None and self.gpu_used_after_mib is not None:
            gpu = self.gpu_used_before_mib - self.gpu_used_after_mib >= 0.5 * self.planned_gpu_mib
        return {"kill: no process of the tree left": not self.alive_after,
                "kill: no /dev/shm entry of ours left": not ours,
                "kill: locked memory released": locked,
                "kill: GPU memory released": gpu}


def leftovers(pids: list[int], shm_tree: set[str], shm_before_start: set[str], shm_now: set[str]) -> tuple[list[int], list[str]]:
    """Processes of ``pids`` still running, and /dev/shm entries left: the tree's that are still
    there, and any entry of ours (OURS_SHM) new since before the servers started."""
    live = [p for p in pids if alive(p)]
    new_ours = {n for n in shm_now - shm_before_start if any(w in n.lower() for w in OURS_SHM)}
    return live, sorted((shm_tree & shm_now) | new_ours)


def kill_tree(pids: list[int]) -> None:
    """SIGKILL every process of the tree at once (one already gone is skipped)."""
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue


# ---------------------------------------------------------------------------- table
def _mark(v: bool | None) -> str:
    return "n/a" if v is None else "PASS" if v else "FAIL"


def _num(x) -> str:
    return "-" if x is None else f"{x:.0f}" if isinstance(x, (int, float)) else str(x)


def _faults_line(f: dict | None) -> str:
    if not f:
        return ""
    d = f.get("disk_tier") or {}
    return (f"faults seen in the log: hook warning {'yes' if f.get('hook_on') else 'NO'}; copy jobs failed by the hook "
            f"and retried {f.get('copy_injected_retried', 0)}, reported failed to vLLM {f.get('copy_failed', 0)}; "
            f"disk tier: failed reads {d.get('read_failures', '-')} (checksum {d.get('checksum_failures', '-')}), "
            f"dropped stores {d.get('dropped_stores', '-')}, hits {d.get('hits', '-')}, stores {d.get('stores', '-')}")


def _kill_line(k: dict | None, kp: dict | None) -> str:
    if not k:
        return ""
    kp = kp or {}
    written = f" ({k['written_mib']:,.0f} MiB of records written in it)" if k.get("written_mib") is not None else ""
    if k.get("probe_records") is not None:
        written += (f"; records written from the probe's start to the pass's {k['probe_records']}, "
                    f"{k.get('probe_records_left')} of them left after the kill")
    return (f"kill -9 {k.get('after_s', KILL_AFTER_S):.1f}s into a pass{written}: {len(k.get('pids', []))} processes, "
            f"gone after "
            f"{k.get('wait_s', 0):.1f}s; temporaries left by "
            f"the kill {len(k.get('temporaries_after_kill', []))}; /dev/shm entries of the tree "
            f"{len(k.get('shm_of_tree', []))}, left {k.get('shm_left', [])}; the pass it cut: {kp.get('ok', '-')} ok, "
            f"{kp.get('failed', '-')} failed of {kp.get('planned', '-')}; tier sockets left {k.get('sockets_left', [])}")


def _restart_line(r: dict | None) -> str:
    if not r:
        return ""
    return (f"restart: up in {_num(r.get('start_s'))}s, disk tier up after {_num(r.get('tier_up_s'))}s, probe "
            f"external hit tokens {_num((r.get('probe') or {}).get('external_hit_tokens'))}, tier counters "
            f"{r.get('disk_tier')}{', error ' + r['error'][-300:] if r.get('error') else ''}")


def table(res: dict) -> str:
    """Checks (PASS/FAIL/n/a), the soak's samples and passes, the faults counted, the kill -9 stage."""
    meta = res.get("meta") or {}
    out = [f"reliability: {res.get('layout', '?')} at {res.get('load', {}).get('clients', '?')} clients, faults "
           f"{res.get('faults') or 'none'}; {meta.get('device', '')}, vLLM {meta.get('vllm', '?')}, "
           f"{res.get('mode', '')}"]
    checks = res.get("checks", {})
    out.append(_table(["check", "result"], [[k, _mark(v)] for k, v in checks.items()]))
    probes = {**res.get("probes", {}), **({"restarted": res["restart"]["probe"]}
                                          if (res.get("restart") or {}).get("probe") else {})}
    if probes:
        out.append("probes (device / external hit tokens: where the probe's prefix came from; the checks above "
                   "compare each with off's answer for the same reuse):")
        out.append(_table(["probe", "compared with", "device hit tok", "external hit tok", "error"],
                          [[k, p.get("compared_with", "-"), _num(p.get("device_hit_tokens")),
                            _num(p.get("external_hit_tokens")), (p.get("error") or "")[:60]] for k, p in probes.items()]))
    samples = res.get("samples", [])
    if samples:
        keys = [k for k in SAMPLE_KEYS if any(k in s for s in samples)]
        out.append("soak samples (the ours-disk server's process tree):")
        out.append(_table(["t_s"] + keys, [[_num(s.get("t_s"))] + [_num(s.get(k)) for k in keys] for s in samples]))
    if res.get("passes"):
        out.append("passes (vLLM's multi-turn client against ours-disk):")
        out.append(_table(["pass", "at most", "ok", "failed", "unanswered", "rows lost", "clients ended", "wall s",
                           "external hit tok", "error"],
                          [[p.get("pass"), p.get("planned"), p.get("ok"), p.get("failed"), p.get("unanswered"),
                            p.get("rows_lost", "-"), f"{p.get('clients_done')}/{p.get('clients')}", _num(p.get("wall_s")), _num(p.get("metrics", {}).get("external_hits")),
                            (p.get("error") or "")[:60]] for p in res["passes"]]))
    out += [line for line in (_faults_line(res.get("faults_seen")), _kill_line(res.get("kill"), res.get("kill_pass")),
                              _restart_line(res.get("restart"))) if line]
    for c in res.get("cut", []):
        out.append(f"cut: {c}")
    for e in res.get("errors", []):
        out.append(f"error: {e}")
    return "\n".join(out)


# ---------------------------------------------------------------------------- the part (device only)
def run_reliability(layout: str, load: Load, a, work: Path, out: Path, budget: Budget, gpu_bytes: int,
                    host_bytes: int, meta: dict | None = None) -> dict:
    """Run the part (module docstring); always stops its servers; writes after every stage."""
    from benchmarks.multiturn.launcher import PLAIN_CHAT_TEMPLATE, vllm_server

    from .kv_layouts import LAYOUTS
    from .models import SERVE_VOCAB, build_shape_model
    from .tables import write_part
    from .engine import CACHE_ENV, ENV

    lay = LAYOUTS[layout]
    backend = lay.backend(a.attention_backend)
    faults = a.faults
    res: dict = {"layout": layout, "load": asdict(load), "faults": faults, "mode": "eager" if a.eager else "default",
                 "attention_backend": backend, "budget_s": budget.seconds, "checks": {}, "samples": [],
                 "passes": [], "probes": {}, "errors": [], "cut": [], "meta": meta or {}}

    def save() -> None:
        res["ok"] = all(v is not False for v in res["checks"].values()) and not res["errors"]
        write_part(out, "reliability", res)

    try:
        plans = plan(layout, load, gpu_bytes, host_bytes, faults)
        disk = plans[1].disk_dir
        shutil.rmtree(disk, ignore_errors=True)  # a fresh tier at the start; never emptied again (the restart reads it)
        disk.mkdir(parents=True, exist_ok=True)
        check_disk(disk_need(plans, load, lay.model.kv_bytes_per_token()), shutil.disk_usage(disk).free)
    except (ValueError, OSError) as e:
        res["errors"].append(f"plan: {type(e).__name__}: {e}")
        res["ok"] = False
        return res
    off_plan, ours_plan = plans
    res["servers"] = [asdict(p) for p in plans]
    work.mkdir(parents=True, exist_ok=True)
    model = build_shape_model(work / f"{lay.shape}-serve", lay.shape, SERVE_VOCAB)
    tmpl = work / "plain_chat_template.jinja"
    tmpl.write_text(PLAIN_CHAT_TEMPLATE)
    served = lay.shape
    env = {**ENV, **CACHE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    logs = work / "reliability_logs"
    log_of = {off_plan.label: logs / "off.log", ours_plan.label: logs / "ours-disk.log",
              "restart": logs / "ours-disk-restart.log"}

    def make_cm(p: ServerPlan, timeout_s: float, log: Path | None = None):
        return vllm_server(model, server_args(p, load, eager=a.eager, attention_backend=backend,
                                              chat_template=str(tmpl), served_name=served),
                           env=server_env(p, env), startup_timeout_s=timeout_s,
                           log_path=log or log_of[p.label], label=p.label)

    def log_text(key: str) -> str:
        try:
            return log_of[key].read_text(errors="replace")
        except OSError:
            return ""

    prompt = probe_prompt()
    schedule = Schedule(budget.seconds, SOAK_SHARE, KILL_AFTER_S)
    before = {"shm": shm_entries(), "sockets": tier_sockets(), "mlocked_mib": mlocked_mib()}
    cms: dict = {}
    started: list[str] = []
    try:
        t0 = time.perf_counter()
        deadline = time.monotonic() + max(60.0, min(420.0, budget.left() - 200))
        urls, errors = start_servers(make_cm, plans, getattr(a, "start_waves", True), deadline, cms)
        started = list(urls)
        res["start_s"] = time.perf_counter() - t0
        res["errors"] += [f"start {k}: {v}" for k, v in errors.items()]
        res["server_logs"] = {k: server_log_info(log_text(k)) for k in (off_plan.label, ours_plan.label)}
        if off_plan.label not in urls or ours_plan.label not in urls:
            res["checks"]["servers started"] = False
            return res
        off_url, url = urls[off_plan.label], urls[ours_plan.label]
        restart_s = restart_estimate(res["start_s"], res["server_logs"][ours_plan.label].get("compile_s"))
        res["restart_estimate_s"] = restart_s
        print(f"[reliability] servers up in {res['start_s']:.0f}s; restart estimated {restart_s:.0f}s", flush=True)

        refs = References(run_probe(off_url, served, "off", prompt), run_probe(off_url, served, "off reusing", prompt))
        st = _State(ref=refs)
        res["probes"]["off"], res["probes"]["off_reusing"] = asdict(refs.scratch), asdict(refs.reuse)
        res["checks"]["probe: off answered"] = refs.scratch.error is None and refs.reuse.error is None
        # information: whether bf16 gives other tokens when off reuses the prefix
        res["off_scratch_equals_reuse"] = refs.reuse.same_as(refs.scratch)

        def one_pass(timeout: float) -> dict:
            st.passes += 1
            return _pass(st.passes - 1, url, model, served, load, a, work, layout, timeout)

        def probe_stage(name: str, check: str) -> None:
            _quiet_folder(disk, time.time())  # the soak's last writes first (the drain writes them while idle)
            st.probe_t = time.time()
            got = run_probe(url, served, "ours-disk", prompt)
            res["probes"][name] = asdict(got)
            res["checks"][check], res["probes"][name]["compared_with"] = st.ref.compare(got)

        def soak_stage() -> None:
            sampler = Sampler(listening_pid(url), disk, SAMPLE_EVERY_S).start()
            try:
                while schedule.another_pass(budget.seconds - budget.left(), budget.left(),
                                            [p["wall_s"] for p in res["passes"]], restart_s):
                    p = one_pass(max(30.0, budget.left() - schedule.kill_reserve(restart_s)))
                    p["disk_tier"] = tier_counters(log_text(ours_plan.label))
                    res["passes"].append(p)
                    print(f"[reliability] pass {p['pass']}: {p['ok']}/{p['planned']} ok, {p['failed']} failed, "
                          f"{p['unanswered']} unanswered, {p['wall_s']:.0f}s", flush=True)
                    res["samples"] = [x for x in sampler.samples if "error" not in x]
                    save()
            finally:
                res["samples"] = sampler.stop()
            if not res["passes"]:
                res["cut"].append({"stage": "soak", "left_s": budget.left(), "why": "the kill -9 stage needs the time"})

        def kill_stage() -> None:
            probe_records = _quiet_folder(disk, st.probe_t)  # the probe's records (and any other write since)
            kill, client = _kill_during_pass(listening_pid(url), disk, before, [listening_pid(off_url)],
                                             ours_plan.gpu_bytes / 2**20, one_pass, DISK_BYTES)
            kill.probe_records = len(probe_records)
            kill.probe_records_left = sum((disk / n).exists() for n in probe_records)
            res["kill"], res["kill_pass"] = asdict(kill), client
            res["server_logs"][ours_plan.label] = server_log_info(log_text(ours_plan.label))  # to its end
            res["checks"].update(kill.checks())
            cms.pop(ours_plan.label).__exit__(None, None, None)  # reaps the killed API server
            started.remove(ours_plan.label)
            save()
            left = budget.left() - 45
            if left < 60:
                res["cut"].append({"stage": "restart", "left_s": budget.left()})
                res["checks"]["restart: server up"] = None
                return
            res["restart"] = _restart(without_faults(ours_plan), make_cm, log_of["restart"], cms, started, served,
                                      prompt, st.ref, disk, budget, left, kill.temporaries_after_kill)
            res["checks"].update(res["restart"].pop("checks"))

        # 1. the probe (off's tokens are the reference); 2. the soak; 3. the probe again; 4. kill -9 and restart:
        # a stage that raises is an error in the result, and the next stages still run
        _stage(res, "probe", lambda: probe_stage("first", "probe before the soak = off"))
        save()
        _stage(res, "soak", soak_stage)
        res["checks"].update(soak_checks(res["samples"], res["passes"], DISK_BYTES))
        res["faults_seen"] = fault_log(log_text(ours_plan.label))
        if faults:
            res["checks"]["faults: the hook's warning in the log"] = res["faults_seen"]["hook_on"]
            res["checks"]["faults: injected failures counted"] = injected_counted(res["faults_seen"])
        res["checks"]["faults: no copy job reported failed to vLLM"] = res["faults_seen"]["copy_failed"] == 0
        _stage(res, "probe after the soak", lambda: probe_stage("after_soak", "probe after the soak = off"))
        save()
        _stage(res, "kill -9", kill_stage)
        res["faults_seen"] = fault_log(log_text(ours_plan.label))  # the killed server's log, to its end
        save()
    except Exception as e:  # noqa: BLE001 - recorded as a failed part, the servers still stop
        import traceback

        res["errors"].append(f"{type(e).__name__}: {e}")
        res["traceback"] = traceback.format_exc()[-4000:]
    finally:
        t2 = time.perf_counter()
        stop_servers(cms, [k for k in started if k in cms])
        res["stop_s"] = time.perf_counter() - t2
        res["ok"] = all(v is not False for v in res["checks"].values()) and not res["errors"]
    return res


@dataclass
class _State:
    ref: References
    passes: int = 0
    probe_t: float = 0.0  # when the last probe began (wall clock: the records written since are its)


def _stage(res: dict, name: str, fn) -> bool:
    """Run one stage; an exception is recorded (error and traceback), not raised."""
    import traceback

    try:
        fn()
        return True
    except Exception as e:  # noqa: BLE001 - the next stages and the servers' stop still run
        res["errors"].append(f"{name}: {type(e).__name__}: {e}")
        res.setdefault("tracebacks", {})[name] = traceback.format_exc()[-4000:]
        print(res["tracebacks"][name], flush=True)
        return False


def part(work: Path, a, out: Path, budget: Budget, meta: dict) -> dict:
    """The part in device.py: the first layout of ``--layouts`` at the capacity load."""
    from .serve import CAPACITY

    res = run_reliability(a.layouts[0], CAPACITY, a, work, out, budget, meta.get("gpu_bytes", 0),
                          meta.get("host_bytes", 0), meta)
    if len(a.layouts) > 1:
        res["errors"].append(f"one layout per command: ran {a.layouts[0]}, not {a.layouts[1:]}")
    return res


def _pass(r: int, url: str, model: str, served: str, load: Load, a, work: Path, layout: str, timeout: float) -> dict:
    """One pass of vLLM's client against ours-disk (new texts), as the serve part runs it."""
    wl = pass_workload(work, f"reliability-pass{r}", load, hash_seed(f"reliability-{layout}", load.clients, r, a.seed))
    run_dir = work / "client" / f"reliability-{r}"
    shutil.rmtree(run_dir, ignore_errors=True)
    t1 = time.perf_counter()
    run = run_one("ours-disk", url, model, served, wl, load, a, run_dir, seed=r, timeout=timeout)
    try:
        log = (run_dir / "client.log").read_text(errors="replace")
    except OSError:
        log = ""
    counts = client_counts(log, run.get("summary", {}).get("requests", 0), load.conversations * load.user_turns,
                           load.clients, run.get("metrics", {}).get("requests_finished"))
    run.pop("rows", None)  # per-request rows: the serve part's business, not this table's
    return {"pass": r, **counts, "wall_s": time.perf_counter() - t1, **run}


def wait_for_kill(disk: Path, since: float, budget_bytes: int) -> tuple[float, int]:
    """Wait in the pass begun at ``since`` (wall clock) until it has written ``KILL_BUDGET_SHARE`` of the
    disk budget (its records' mtimes, so also while evictions hold the folder at its budget), at least
    KILL_LEAST_S and at most KILL_AFTER_S seconds; (seconds waited, bytes written). The restart must find
    the probe's records, written right before the pass; a pass that rewrote the budget would evict
    them, and the folder's size, sampled every 10 s, stops growing once evictions hold it at its
    budget."""
    t0 = time.monotonic()
    while True:
        waited = time.monotonic() - t0
        written = written_since(disk, since)
        if waited >= KILL_AFTER_S or (waited >= KILL_LEAST_S and written >= KILL_BUDGET_SHARE * budget_bytes):
            return waited, written
        time.sleep(POLL_S)


def _quiet_folder(disk: Path, since: float, timeout_s: float = 20.0) -> dict[str, int]:
    """Wait until no record has been written for QUIET_S (at most ``timeout_s``); the records written
    since ``since`` (``records_since``). A record count alone cannot tell: at its budget the folder keeps
    its count while writes evict."""
    end, seen, quiet_since = time.monotonic() + timeout_s, None, time.monotonic()
    while True:
        now = records_since(disk, since)
        if now != seen:
            seen, quiet_since = now, time.monotonic()
        if time.monotonic() - quiet_since >= QUIET_S or time.monotonic() >= end:
            return now
        time.sleep(POLL_S)


def _kill_during_pass(root: int, disk: Path, before: dict, others: list[int], planned_gpu_mib: float,
                      one_pass, budget_bytes: int) -> tuple[KillReport, dict]:
    """A pass (``one_pass(timeout)``) starts; when ``wait_for_kill`` says, the whole tree gets SIGKILL;
    what it left.
    ``before``: /dev/shm entries, tier sockets and Mlocked before the servers started; ``others``: the
    roots of the servers still up (their locked memory stays)."""
    box: dict = {}

    def killed_pass() -> None:
        try:
            box.update(one_pass(KILL_AFTER_S + 120))
        except Exception as e:  # noqa: BLE001 - the client's failure is part of the report, not a crash
            box["error"] = f"{type(e).__name__}: {e}"[-3000:]

    th = threading.Thread(target=killed_pass, name="reliability-kill-pass", daemon=True)
    since = time.time()
    th.start()
    after_s, written = wait_for_kill(disk, since, budget_bytes)
    pids = tree_pids(root)
    rep = KillReport(pids=pids, shm_of_tree=sorted(shm_of(pids)), tree_locked_mib=sample(pids, None)["locked_mib"],
                     others_locked_mib=sum(sample(tree_pids(o), None)["locked_mib"] for o in others),
                     mlocked_start_mib=before["mlocked_mib"], gpu_before_mib=gpu_mib(pids),
                     gpu_used_before_mib=gpu_used_mib(), planned_gpu_mib=planned_gpu_mib)
    t0 = time.monotonic()
    kill_tree(pids)
    while any(alive(p) for p in pids) and time.monotonic() - t0 < 30:
        time.sleep(0.2)
    rep.wait_s = time.monotonic() - t0
    rep.after_s, rep.written_mib = after_s, written / 2**20
    th.join(timeout=60)
    time.sleep(2.0)  # the driver frees the GPU memory of a dead process shortly after
    rep.alive_after, rep.shm_left = leftovers(pids, set(rep.shm_of_tree), before["shm"], shm_entries())
    rep.temporaries_after_kill = temporaries(disk)
    rep.sockets_left = sorted(tier_sockets() - before["sockets"])
    rep.mlocked_after_mib = mlocked_mib()
    rep.gpu_after_mib = gpu_mib(pids)
    rep.gpu_used_after_mib = gpu_used_mib()
    client = {k: v for k, v in box.items() if k in ("planned", "ok", "failed", "unanswered", "clients_done", "wall_s",
                                                    "error")}
    return rep, client


def _restart(p: ServerPlan, make_cm, log: Path, cms: dict, started: list[str], served: str, prompt: str,
             ref: References, disk: Path, budget: Budget, timeout_s: float, killed_tmp: list[str]) -> dict:
    """Start ``p`` again on its folder; wait for its disk tier to come up and scan; probe; its checks.
    ``killed_tmp``: the temporary records the kill left, which the start-up must have removed (the
    restarted server's own writes make temporaries of their own meanwhile: those are not counted)."""
    out: dict = {"checks": {}}
    c = out["checks"]
    t0 = time.perf_counter()
    key = "ours-disk-restart"
    cms[key] = make_cm(p, timeout_s, log)
    try:
        url = cms[key].__enter__()
    except Exception as e:  # noqa: BLE001 - a FAIL, not a crash
        cms.pop(key)
        out["error"] = f"{type(e).__name__}: {e}"[-3000:]
        c["restart: server up"] = False
        return out
    started.append(key)
    out["start_s"] = time.perf_counter() - t0
    c["restart: server up"] = True

    def text() -> str:
        try:
            return log.read_text(errors="replace")
        except OSError:
            return ""

    # the scheduler takes in its tier's state on its own calls: requests bring the tier up and its first
    # scan of the records in (tests/tiers/test_kill9_server.py)
    t1, up = time.monotonic(), False
    while time.monotonic() - t1 < 90 and budget.left() > 30:
        if TIER_UP.search(text()):
            up = True
            break
        _nudge(url, served)
        time.sleep(0.5)
    out["tier_up_s"] = time.monotonic() - t1 if up else None
    c["restart: disk tier up"] = up
    time.sleep(1.0)
    _nudge(url, served)
    now = temporaries(disk)
    c["restart: the kill's temporary records removed"] = not set(killed_tmp) & set(now)
    out["temporaries"] = now[:20]
    probe = run_probe(url, served, "ours-disk restarted", prompt)
    out["probe"] = asdict(probe)
    c["restart: probe = off"], out["probe"]["compared_with"] = ref.compare(probe)
    # the tier's counters reach the log every 30 s, on a lookup: nudge until they do while time allows
    t2 = time.monotonic()
    while tier_counters(text()) is None and time.monotonic() - t2 < 40 and budget.left() > 25:
        _nudge(url, served)
        time.sleep(2.0)
    counters = tier_counters(text())
    out["disk_tier"] = counters
    out["log"] = server_log_info(text())
    hits = probe.external_hit_tokens > 0 or bool(counters and counters["hits"] > 0)
    c["restart: probe served from disk"] = hits  # host KV is empty after a restart: an external hit is the disk's
    c["restart: no record failed its checks"] = (CORRUPT_WARNING not in text()
                                                  and not (counters and counters["checksum_failures"]))
    return out


def _nudge(url: str, served: str) -> None:
    """A request long enough to be looked up in the tiers (one whole offloaded block and more): on
    vLLM 0.23 the scheduler takes in its tiers' state only in a lookup."""
    rng = random.Random()
    try:
        complete(url, served, " ".join(f"w{rng.randrange(700)}" for _ in range(160)), 1, timeout=30)
    except (OSError, ValueError):
        pass


__all__ = ["DEFAULT_FAULTS", "KillReport", "Probe", "References", "Sampler", "Schedule", "client_counts", "fault_log", "faults_arg",
           "injected_counted", "leftovers", "part", "plan", "run_reliability", "soak_checks", "table",
           "tier_counters", "without_faults"]
