"""Prompts, statistics and tables of the GPU end-to-end runs (no vLLM, no GPU: unit-tested on CPU)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.multiturn.report import _fmt, _table

from .engine import layerwise_extra
from .pair import pair_table
from .reliability import table as reliability_table
from .timeline import HOST_COLUMNS

PARTS = ("smoke", "smoke-serve", "correctness", "ttft", "miss", "serve", "pair", "reliability", "multiturn")
ALL = ("correctness", "ttft", "miss", "serve")  # "all": what the issue's tables need (not the smoke, not the
# project's own multi-turn client)


def parse_parts(names: list[str]) -> list[str]:
    """``all`` (ALL) or a subset of PARTS, in PARTS order; unknown names raise ValueError."""
    if not names or names == ["all"]:
        return list(ALL)
    bad = [n for n in names if n not in PARTS]
    if bad:
        raise ValueError(f"unknown part(s) {bad}: choose from {list(PARTS)} or 'all'")
    return [p for p in PARTS if p in names]


def unique_prompts(n: int, length: int, seed: int, vocab: int = 1000, first: int = 4) -> list[list[int]]:
    """``n`` token-id prompts of exactly ``length`` ids in [first, vocab). The first 4 ids encode
    (seed, index), so no two prompts of different (seed, index) share even the first block."""
    import random

    if length < 4:
        raise ValueError(f"prompt length {length} < 4")
    span = vocab - first
    out = []
    for i in range(n):
        rng = random.Random(seed * 1_000_003 + i)
        head = [first + (seed // span) % span, first + seed % span, first + (i // span) % span, first + i % span]
        out.append(head + [first + rng.randrange(span) for _ in range(length - 4)])
    return out


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return layers * 2 * kv_heads * head_dim * dtype_bytes


def spread(xs: list[float]) -> dict[str, float]:
    """median, min, max and n of a sample."""
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def outside_spread(a: list[float], b: list[float]) -> bool:
    """True when the two samples' ranges do not overlap (the difference exceeds the run-to-run spread)."""
    return bool(a and b) and (min(a) > max(b) or min(b) > max(a))


def paired_ratios(xs: list[float], base: list[float]) -> list[float]:
    """Per-round relative changes x_i / base_i - 1 of interleaved runs (round i of both ran under
    the same conditions, so slow drifts of the machine cancel)."""
    return [x / b - 1.0 for x, b in zip(xs, base)]


def paired_change(xs: list[float], base: list[float]) -> dict[str, float]:
    """``paired_ratios``' median, min, max and n."""
    return spread(paired_ratios(xs, base))


def median_ci(xs: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """Distribution-free confidence interval of the median: the order statistics (j, k) with
    P(X_(j) <= median <= X_(k)) >= ``level`` for n draws (binomial(n, 1/2) ranks). None when n is
    too small for any interval to reach ``level``."""
    from math import comb

    n = len(xs)
    srt = sorted(xs)
    cdf, tail = 0.0, (1.0 - level) / 2
    j = -1  # largest rank (0-based) whose lower tail P(B <= j) stays <= tail
    for i in range(n):
        cdf += comb(n, i) / 2**n
        if cdf > tail:
            break
        j = i
    if j < 0:
        return None
    return srt[j], srt[n - 1 - j]


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:,.1f}"


def table(header: list[str], rows: list[list[Any]]) -> str:
    return _table(header, [[c if isinstance(c, str) else _fmt(c) for c in r] for r in rows])


def meta_line(meta: dict | None, layout: dict | None = None) -> str:
    """The header of every table: device, date, vLLM, execution mode, and the layout that ran."""
    if not meta:
        return ""
    parts = [f"device: {meta.get('device', '?')}", f"date: {meta.get('date', '?')}", f"vLLM {meta.get('vllm', '?')}",
             f"mode: {meta.get('mode', '?')}"]
    if layout:
        parts.append(f"layout: {layout.get('name', '?')} ({layout.get('blocks', '')})")
        if layout.get("model"):
            parts.append(f"model: {layout['model']}")
        if layout.get("attention_backend"):
            parts.append(f"attention: {layout['attention_backend']}")
    return "; ".join(parts)


def engine_report(kv: dict[str, dict]) -> str:
    """One line from engines' ``kv_info``: the CUDA-graph mode and the KV layout vLLM allocated."""
    if not kv:
        return ""
    bits = []
    modes = {v.get("cudagraph_mode") for v in kv.values() if v.get("cudagraph_mode")}
    if modes:
        bits.append("cudagraph_mode " + "/".join(sorted(str(m) for m in modes)))
    cl = {k: v.get("cross_layer_blocks") for k, v in kv.items() if "cross_layer_blocks" in v}
    if cl:
        bits.append("cross-layer blocks: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in cl.items()))
    groups = next((v["kv_cache_groups"] for v in kv.values() if v.get("kv_cache_groups")), None)
    if groups:
        bits.append(f"{len(groups)} KV-cache group(s): " + ", ".join(
            f"{g['layers']} x {g['spec']}" + (f" (window {g['sliding_window']})" if g.get("sliding_window") else "")
            for g in groups))
    return "engines report: " + "; ".join(bits) if bits else ""


def per_layout(fmt):
    """A part's formatter for results of several layouts ({"meta", "layouts": {name: res}}): each
    layout's table under its header line. Results of one layout (the older format) pass through."""

    def render(res: dict) -> str:
        if "layouts" not in res:
            return fmt(res)
        out = []
        for name, r in res["layouts"].items():
            head = meta_line(res.get("meta"), {"name": name, **(r.get("layout") or {})})
            rep = engine_report(r.get("kv_info") or {})
            try:
                body = fmt(r) if not r.get("error") else f"(not run: {r['error']})"
            except Exception as e:  # noqa: BLE001 - one layout's table must not hide the others
                body = f"(no table: {type(e).__name__}: {e})"
            out.append("\n".join(x for x in (f"### {name}", head, rep, body) if x))
        return "\n\n".join(out)

    render.__name__ = fmt.__name__
    render.__doc__ = fmt.__doc__
    return render


def correctness_table(res: dict) -> str:
    rows = []
    for c in res["checks"]:
        rows.append([c["dtype"], c["engine"], c["against"], c.get("host_tokens", "-"),
                     {True: "yes", False: "no (negative control)", None: "recorded"}[c["expect_equal"]],
                     "n/a" if c.get("not_run") else ("yes" if c["equal"] else "no"),
                     "PASS" if c["pass"] else ("NOT RUN" if c.get("not_run") else "FAIL")])
    out = table(["dtype", "engine", "compared with", "tokens from host", "must equal", "equal", "result"], rows)
    notes = [f"{c['engine']}: {c['error'].splitlines()[0][:300]}" for c in res["checks"] if c.get("error")]
    out += ("\n" + "\n".join(notes) if notes else "")
    if res.get("ranks"):
        out += f"\n\nper rank (tensor_parallel_size {res.get('tp', 1)}): host KV bytes against the rank's share " \
               "(within 1%), NUMA node of sampled host pages (move_pages) against the GPU's (info)\n"
        out += table(["engine", "rank", "host bytes", "share", "GPU node", "host pages by node", "start-up log",
                      "result"],
                     [[r["engine"], r["rank"], f"{r['host_bytes']:,}", f"{r['share']:,}",
                       "-" if r["gpu_node"] is None else r["gpu_node"],
                       ", ".join(f"{k}: {v}" for k, v in sorted(r["host_page_nodes"].items())) or "-",
                       r["numa"][:60], "PASS" if r["pass"] else "FAIL"] for r in res["ranks"]])
    return out


def ttft_table(res: dict) -> str:
    rows = []
    for r in res["rows"]:
        rows.append([r["prompt_tokens"], ms(r["cold_s"]["median"]), ms(r["device_hit_s"]["median"]),
                     ms(r["native_s"].get("median")), ms(r["ours_s"].get("median")),
                     ms(r.get("ours_load_s")), ms(r.get("ours_load_seen_s")), ms(r.get("ideal_s")),
                     r.get("host_tokens", "-"),
                     f"{r['ours_s']['median'] / r['ideal_s']:.2f}x" if r.get("ideal_s") and r["ours_s"].get("median")
                     else "-",
                     f"{r['ours_s']['median'] / r['native_s']['median']:.2f}x"
                     if r["ours_s"].get("median") and r["native_s"].get("median") else "-"])
    head = ["prompt tok", "cold ms", "device hit ms", "reload native ms", "reload ours ms", "ours transfer ms",
            "ours load seen ms", "ideal ms", "from host tok", "ours/ideal", "ours/native"]
    bw = res.get("bandwidth", {})
    sfx = max((r.get("suffix_tokens") or 0 for r in res["rows"]), default=0)
    if sfx:  # a later turn: the stored prompt comes from host, the new tokens are computed
        head[0] = f"prompt tok (+{sfx} new)"
    hit_where = "; cold and device hit on ours' engine, --no-off" if res.get("hit_engine") == "ours" else ""
    tp = res.get("tp", 1)
    per_rank = (f"; tensor_parallel_size {tp}: bytes are all ranks', each rank moves its share over its own GPU's "
                f"link at the same time (ideal divides by {tp}), transfer and load seen are the ranks' mean"
                if tp > 1 else "")
    text = (table(head, rows) + f"\nmedian of {res['reps']} after a warm-up; contiguous pinned copy in the same run: "
            f"H2D {bw.get('h2d_gbps', 0):.1f} GB/s, D2H {bw.get('d2h_gbps', 0):.1f} GB/s; ideal = bytes loaded / H2D "
            f"+ device-hit TTFT of the same prompt (one decode-like step over the cached prefix{hit_where}); ours "
            f"transfer = device time of the loads, load seen = from their submit until a poll saw them done{per_rank}")
    lw, lmc, steps, floor, prof = (layerwise_ttft_table(res), lmcache_ttft_table(res), ttft_steps_table(res),
                                   ttft_floor_table(res), forward_profile_table(res))
    return text + "".join("\n\n" + t for t in (lw, lmc, steps, floor, prof) if t)


def lmcache_ttft_table(res: dict) -> str:
    """Reload TTFT of LMCache (``--lmcache``) beside ours and native (same reps, in turns); a length at
    which a reload got no LMCache hit (degraded mode, nothing stored: it recomputed) is FAILED, no number."""
    rows = []
    for r in res["rows"]:
        if "lmcache_s" not in r and "lmcache_failed" not in r:
            continue
        ours, native = r["ours_s"].get("median"), r["native_s"].get("median")
        lmc = (r.get("lmcache_s") or {}).get("median")
        host = r.get("lmcache_host_tokens") or []
        if r.get("lmcache_failed") or lmc is None:
            rows.append([r["prompt_tokens"], "FAILED", ms(ours), ms(native), ", ".join(map(str, host)) or "-", "-", "-",
                         r.get("lmcache_failed") or "no reload"])
            continue
        rows.append([r["prompt_tokens"], ms(lmc), ms(ours), ms(native), _med(host),
                     f"{lmc / ours:.2f}x" if ours else "-", f"{lmc / native:.2f}x" if native else "-", ""])
    if not rows:
        return ""
    return table(["prompt tok", "reload LMCache ms", "reload ours ms", "reload native ms", "LMCache hit tok",
                  "LMCache/ours", "LMCache/native", "note"], rows) + (
        "\nLMCache = vLLM's LMCacheConnectorV1 with LMCache's own adapter (host KV as native's and ours', chunks of "
        "256 tokens: its hits are whole chunks); hit tok = the request's cached tokens after the device reset")


def layerwise_ttft_table(res: dict) -> str:
    """Reload TTFT of ours loading layer by layer inside the step (``--layerwise``) beside ours and
    native (same reps, in turns), against max(transfer, forward): the most it can hide."""
    rows = []
    for r in res["rows"]:
        lw = (r.get("layerwise_s") or {}).get("median")
        if lw is None:
            continue
        ours, native = r["ours_s"].get("median"), r["native_s"].get("median")
        hit = r["device_hit_s"]["median"]
        best = max(r["ideal_s"] - hit, hit) if r.get("ideal_s") else None  # max(transfer, forward)
        rows.append([r["prompt_tokens"], ms(lw), ms(ours), ms(native), ms(r.get("layerwise_load_s")), ms(best),
                     _med(r.get("layerwise_host_tokens") or []) or "-",
                     f"{lw / ours:.2f}x" if ours else "-", f"{lw / native:.2f}x" if native else "-",
                     f"{lw / best:.2f}x" if best else "-"])
    if not rows:
        return ""
    head = ["prompt tok", "reload layerwise ms", "reload ours ms", "reload native ms", "layerwise transfer ms",
            "max(transfer, forward) ms", "from host tok", "layerwise/ours", "layerwise/native", "layerwise/max"]
    counters = res.get("layerwise") or {}
    return table(head, rows) + (f"\nlayerwise = ours with {layerwise_extra()}: the hit loads layer group by layer "
                                "group inside the step that computes the rest of the prompt; max(transfer, forward) = "
                                "ideal transfer (bytes / H2D) vs device-hit TTFT, the larger; its counters: "
                                + ", ".join(f"{k} {v}" for k, v in counters.items()))


def forward_profile_table(res: dict) -> str:
    """The profiled first forwards of native and ours (``--profile-reps``): medians of wall,
    CPU, host operators and device busy time, and the host operators whose self time differs
    most between the two (ours - native, ms per forward)."""
    rows, diffs = [], []
    for r in res["rows"]:
        per = {k: r.get(f"{k}_profiles") or [] for k in ("native", "ours")}
        for kind, ps in per.items():
            if ps:
                rows.append([r["prompt_tokens"], kind, len(ps)] + [_f(_med([p[k] for p in ps]), fmt) for k, fmt in (
                    ("wall_ms", "{:,.1f}"), ("cpu_ms", "{:,.1f}"), ("host_ops", "{:,.0f}"), ("host_self_ms", "{:,.1f}"),
                    ("device_ops", "{:,.0f}"), ("device_busy_ms", "{:,.1f}"), ("device_span_ms", "{:,.1f}"))])
        if per["native"] and per["ours"]:
            mean = lambda ps: {n: sum(t for p in ps for m, _, t in p["top_host"] if m == n) / len(ps)
                               for p in ps for n, _, _ in p["top_host"]}
            a, b = mean(per["native"]), mean(per["ours"])
            d = sorted(((b.get(n, 0.0) - a.get(n, 0.0), n) for n in set(a) | set(b)), key=lambda x: -abs(x[0]))[:3]
            diffs.append(f"{r['prompt_tokens']}: " + ", ".join(f"{n} {x:+.2f}" for x, n in d))
    if not rows:
        return ""
    head = ["prompt tok", "spec", "forwards", "wall ms", "CPU ms", "host ops", "host self ms", "device ops",
            "device busy ms", "device span ms"]
    return (table(head, rows) + "\nprofiled first forwards (torch.profiler, after the timed reps), medians; "
            "host operators with the largest self-time difference, ours - native (ms, among each side's top "
            "operators):\n" + "\n".join(diffs))


def _med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _f(x: float | None, fmt: str = "{:,.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def ttft_floor_table(res: dict) -> str:
    """What the asynchronous reload path can reach at best: native's fixed costs (its wall time less
    its load-scheduled-to-seen span: scheduling, the request's forward and its return) plus ours'
    bytes at the contiguous H2D rate; and where ours is above that floor (its load beyond the link
    time, its fixed costs beyond native's). Medians over reps, from the step timelines."""
    h2d = (res.get("bandwidth") or {}).get("h2d_gbps")

    def span(x: dict) -> float:
        return x["load_seen_ms"] - x["load_scheduled_ms"]

    def timed(steps: list) -> list:  # reps whose timeline saw the load (tensor parallel: it lives in the workers)
        return [x for x in steps if x.get("load_seen_ms") is not None and x.get("load_scheduled_ms") is not None]

    rows = []
    for r in res["rows"]:
        nb, ob, nbytes = timed(r.get("native_steps") or []), timed(r.get("ours_steps") or []), r.get("ours_load_bytes")
        if not (nb and ob and nbytes and h2d):
            continue
        link = nbytes / res.get("tp", 1) / (h2d * 1e9) * 1e3  # each rank's share on its own link
        n_fixed = _med([x["wall_ms"] - span(x) for x in nb])
        o_fixed = _med([x["wall_ms"] - span(x) for x in ob])
        n_wall, o_wall = _med([x["wall_ms"] for x in nb]), _med([x["wall_ms"] for x in ob])
        floor = n_fixed + link
        o_span = _med([span(x) for x in ob])
        dev, seen = r.get("ours_load_s"), r.get("ours_load_seen_s")  # device time; submit -> poll saw it
        parts = (["-"] * 3 if dev is None or seen is None else
                 [_f(o_span - seen * 1e3), _f((seen - dev) * 1e3), _f(dev * 1e3 - link, "{:+,.1f}")])
        rows.append([r["prompt_tokens"], _f(link), _f(n_fixed), _f(floor), f"{floor / n_wall:.2f}x", _f(n_wall),
                     _f(o_wall), f"{o_wall / n_wall:.2f}x", _f(o_wall - floor, "{:+,.1f}"),
                     _f(o_span - link, "{:+,.1f}"), *parts, _f(o_fixed - n_fixed, "{:+,.1f}")])
    if not rows:
        return ""
    head = ["prompt tok", "link ms", "native fixed ms", "floor ms", "floor/native", "native ms", "ours ms",
            "ours/native", "ours - floor", "ours' load beyond link", "of it: scheduled to submit",
            "submit to seen, beyond device time", "device time beyond link", "ours' fixed beyond native's"]
    return table(head, rows) + ("\nfloor = native's fixed costs (wall - load scheduled-to-seen) + ours' bytes at the "
                                "contiguous H2D rate: about the best an asynchronous reload can do here (a little "
                                "under it: the step that issues the load counts as native's span, not its fixed "
                                "cost); ours' load beyond link = its scheduled-to-seen span less the link time "
                                "(planning, enqueue, copies under the link rate, the poll), split into the time from "
                                "the step that scheduled it to ours' submit "
                                "(vLLM's step, the model-step set-up, ours' planning), from submit to a poll seeing "
                                "it beyond its device time (enqueue before the first copy, the poll), and the device "
                                "time beyond the link time; medians over reps")


def ttft_steps_table(res: dict) -> str:
    """Reload reps of native and ours side by side (they took turns): where each rep's time
    went, from its step timeline (medians, ms from the start of ``generate``), and the
    rep-by-rep difference ours - native."""
    rows = []
    variants = tuple(res.get("variants") or ())
    for r in res["rows"]:
        for kind in ("native", "ours", "layerwise", "lmcache") + variants:
            b = r.get(f"{kind}_steps") or []
            if not b:
                continue
            rows.append([r["prompt_tokens"], kind, len(b), _f(_med([x["wall_ms"] for x in b])),
                         _f(min(x["wall_ms"] for x in b)), _f(max(x["wall_ms"] for x in b)),
                         _f(_med([x["load_scheduled_ms"] for x in b])), _f(_med([x["load_seen_ms"] for x in b])),
                         _f(_med([x["forward_scheduled_ms"] for x in b])), _f(_med([x["steps"] for x in b]), "{:.0f}"),
                         _f(_med([x["longest_step_ms"] for x in b])), sum(x["flush_steps"] for x in b),
                         _f(max((x.get("gc_in_forward_ms", 0.0) for x in b), default=None)),
                         _f(_med([x.get("forward_ms") for x in b])), _f(_med([x.get("forward_cpu_ms") for x in b]))])
        for a, b in (("ours", "native"), ("layerwise", "ours"), ("lmcache", "native")) + tuple((v, "ours") for v in variants):
            ab, bb = r.get(f"{a}_steps") or [], r.get(f"{b}_steps") or []
            if ab and bb:
                d = [x["wall_ms"] - y["wall_ms"] for x, y in zip(ab, bb)]
                rows.append([r["prompt_tokens"], f"{a} - {b}", len(d), _f(_med(d), "{:+,.1f}"), _f(min(d), "{:+,.1f}"),
                             _f(max(d), "{:+,.1f}"), f"{a} faster in {sum(x < 0 for x in d)}/{len(d)}", "", "", "",
                             "", "", "", "", ""])
    if not rows:
        return ""
    head = ["prompt tok", "spec", "reps", "wall ms", "min", "max", "load scheduled at", "load seen at",
            "forward scheduled at", "steps", "longest step ms", "flush steps", "max gc in forward ms",
            "forward ms", "its CPU ms"]
    note = "".join(f"; {v} = ours with {env}" for v, env in (res.get("variants") or {}).items())
    return table(head, rows) + ("\nreload reps of native and ours in turns (the first alternates); \"at\" = ms "
                                "after generate() began, medians over reps; from each rep's engine step timeline; "
                                "forward = the model call that makes the first token, CPU = its thread's CPU time"
                                + note)


def miss_table(res: dict) -> str:
    rows = []
    off = res["runs"]["off"]
    base = ("off", "null", "native", "ours")
    for k in [k for k in base if k in res["runs"]] + [k for k in res["runs"] if k not in base]:
        xs = res["runs"].get(k, [])
        s = spread(xs)
        if not s["n"]:
            rows.append([k, "-", "-", "-", "-", "-", 0])
            continue
        rel = f"{(s['median'] / statistics.median(off) - 1) * 100:+.1f}%" if k != "off" and off else ""
        p = paired_change(xs, off) if k != "off" else {"n": 0}
        paired = f"{p['median'] * 100:+.1f}% ({p['min'] * 100:+.1f}..{p['max'] * 100:+.1f}%)" if p["n"] else ""
        rows.append([k, f"{s['median']:.3f}", f"{s['min']:.3f}-{s['max']:.3f}", rel, paired,
                     "" if k == "off" else ("yes" if outside_spread(xs, off) else "no"), s["n"]])
    text = (table(["offload", "median s", "min-max s", "vs off", "paired vs off (min..max)", "outside spread", "runs"],
                  rows)
            + f"\n{res['batch']} unique prompts x {res['prompt_tokens']} tokens, {res['max_tokens']} output tokens, "
              f"interleaved (the engines take turns going first) after one warm-up round; paired = median of the "
              f"per-round changes")
    tier = paired_change(res["runs"].get("ours-disk", []), res["runs"].get("ours", []))
    if tier["n"]:  # the disk tier's own cost when nothing is reused: against the same spec host-only
        text += (f"\nours-disk against ours (host only), paired: {tier['median'] * 100:+.1f}% "
                 f"({tier['min'] * 100:+.1f}..{tier['max'] * 100:+.1f}%, {tier['n']} rounds)")
    split = cost_split_table(res["runs"])
    if split:
        text += "\n\n" + split
    tot = res.get("step_totals") or {}
    whats = ["step", "schedule", "execute", "update", "start_load", "finished", "preempt", "gc"]
    trows = [[k, len(v)] + [_f(_med([r.get(w, [0, 0.0])[1] for r in v])) for w in whats] for k, v in tot.items() if v]
    if trows:
        text += "\n\n" + table(["engine", "rounds"] + [f"{w} ms" for w in whats], trows) + (
            "\nper round, medians: engine steps and their parts (schedule; execute = the model step with the "
            "connector's worker calls; preempt = handle_preemptions, where vLLM 0.23 submits the deferred stores; "
            "start_load = load submits; finished = polls)")
    sr = res.get("step_rows") or {}
    if sr.get("off"):
        text += "\n\n" + step_kind_table(sr, res["batch"])
        steady = steady_decode_table(sr, res["batch"])
        if steady:
            text += "\n\n" + steady
    clk = clock_table(res.get("clocks") or {})
    if clk:
        text += "\n\n" + clk
    thr = thread_cpu_table(res.get("threads") or {})
    if thr:
        text += "\n\n" + thr
    prof = step_profile_table(res.get("profiles") or {})
    if prof:
        text += "\n\n" + prof
    return text


def clock_table(clocks: dict[str, list[dict]]) -> str:
    """Per engine, medians over rounds of the SM clock, power and temperature (``gpu_clocks``)
    over the whole round and over its last part (the decode steps)."""
    cols = ("all_sm_mhz", "tail_sm_mhz", "all_mem_mhz", "all_power_w", "tail_power_w", "tail_temp_c")
    rows = [[k, len(v), _f(_med([r["samples"] for r in v]), "{:.0f}")]
            + [_f(_med([r.get(c) for r in v]), "{:,.0f}") for c in cols] for k, v in clocks.items() if v]
    if not rows:
        return ""
    return (table(["engine", "rounds", "samples", "SM MHz", "SM MHz, decode", "memory MHz", "power W",
                   "power W, decode", "temp C, decode"], rows)
            + "\nnvidia-smi every 50 ms beside each engine's round, medians; decode = the round's last 0.4 s")


def thread_cpu_table(threads: dict[str, list[dict]]) -> str:
    """Per engine, medians over rounds of the engine thread's CPU ms, the other threads' CPU ms,
    and the busiest other threads (by name: the median over rounds, a round without it counting 0)."""
    rows = []
    for k, v in threads.items():
        if not v:
            continue
        names: dict[str, list[float]] = {}
        for r in v:
            for n, ms in r.get("busiest", []):
                names.setdefault(n, []).append(ms)
        busiest = sorted(((statistics.median(ms + [0.0] * (len(v) - len(ms))), n) for n, ms in names.items()),
                         reverse=True)[:4]
        rows.append([k, len(v), _f(_med([r["main_ms"] for r in v])), _f(_med([r["others_ms"] for r in v])),
                     _f(_med([r["threads"] for r in v]), "{:.0f}"),
                     ", ".join(f"{n} {ms:,.1f}" for ms, n in busiest if ms > 0) or "-"])
    if not rows:
        return ""
    return (table(["engine", "rounds", "engine thread CPU ms", "other threads CPU ms", "threads",
                   "busiest others (ms)"], rows)
            + "\nper round, medians: CPU time (user + system, /proc) of the engine's own thread and of every other "
              "thread of its process")


def step_profile_table(profiles: dict[str, list[dict]], base: str = "off", top: int = 6) -> str:
    """The profiled engine steps per engine (``--miss-profile-step``): device busy time against its
    span (the difference: the device idle between its operations), then per engine the kernels, the
    idle gaps (named by the activities before and after them) and host operators whose time differs
    most from ``base``'s (mean ms per window; one that only one side has shows as all of its time)."""
    if not profiles:
        return ""
    keys = ("wall_ms", "cpu_ms", "device_ops", "device_busy_ms", "device_span_ms")
    idle = lambda p: p["device_span_ms"] - p["device_busy_ms"]  # noqa: E731
    rows = [[k, len(ps)] + [_f(_med([p[x] for p in ps]), "{:,.2f}") for x in keys] + [_f(_med([idle(p) for p in ps]), "{:,.2f}")]
            for k, ps in profiles.items() if ps]
    mean = lambda ps, part: {n: sum(t for p in ps for m, _, t in p.get(part, []) if m == n) / len(ps)  # noqa: E731
                             for p in ps for n, _, _ in p.get(part, [])}
    notes = []
    if profiles.get(base):
        for k, ps in profiles.items():
            if k == base or not ps:
                continue
            for part, what in (("top_device", "kernels"), ("top_gaps", "device idle before > after"),
                               ("top_host", "host self")):
                o, b = mean(ps, part), mean(profiles[base], part)
                d = sorted(((o.get(n, 0.0) - b.get(n, 0.0), n) for n in set(o) | set(b)), key=lambda x: -abs(x[0]))[:top]
                if d:
                    notes.append(f"{k} - {base}, {what}: " + "; ".join(f"{n} {x:+.3f}" for x, n in d))
    return (table(["engine", "windows", "wall ms", "CPU ms", "device ops", "device busy ms", "device span ms",
                   "device idle ms"], rows)
            + "\nprofiled engine steps (one window per extra round: torch.profiler, after the timed rounds), medians; "
              "idle = span - busy; the kernels and host operators whose time differs most (ms per window, among "
              "each side's top ones):\n" + "\n".join(notes))


def cost_split_table(runs: dict[str, list[float]]) -> str:
    """Each spec's no-reuse cost against offload off, as paired per-round medians with their 95%
    intervals; with a ``null`` engine (vLLM's connector, copies that cost nothing) also split
    into the connector framework (null vs off), which any spec pays, and its copies (spec vs null)."""
    if not runs.get("off"):
        return ""
    null = bool(runs.get("null"))
    bases = (("null", "its copies"), ("off", "all of it")) if null else (("off", "all of it"),)
    pairs = [("null", "off", "vLLM's connector, no copies")] if null else []
    pairs += [(k, base, what) for k in runs if k not in ("off", "null") and runs[k] for base, what in bases]
    if not pairs:
        return ""
    rows = []
    for k, base, what in pairs:
        ch = paired_ratios(runs[k], runs[base])
        ci = median_ci(ch)
        rows.append([f"{k} vs {base}", what, len(ch), f"{statistics.median(ch) * 100:+.2f}%",
                     f"{ci[0] * 100:+.2f}..{ci[1] * 100:+.2f}%" if ci else "-"])
    return (table(["compared", "cost of", "rounds", "paired median", "95% interval of the median"], rows)
            + ("\nnull = vLLM's own CPU offloading spec (same manager and sizing) whose stores finish at once "
               "without moving a byte (benchmarks/gpu_e2e/null_spec.py)" if null else ""))


def load_miss_runs(path: str | Path) -> dict[str, list[float]]:
    """Per-engine round walls of one miss run: from its ``miss.json`` (``.gz`` too), or from the
    "[miss] round N: off 4.1s, ..." lines of its log (a run cut off before writing its JSON)."""
    import gzip
    import re

    p = Path(path)
    raw = gzip.open(p, "rt").read() if p.suffix == ".gz" else p.read_text()
    if raw.lstrip().startswith("{"):
        data = json.loads(raw)
        if "runs" not in data:  # device.py's miss.json: {"layouts": {name: part}, "meta": ...}
            parts = {n: d for n, d in (data.get("layouts") or {}).items() if "runs" in d}
            if len(parts) != 1:
                raise ValueError(f"{p}: a miss.json needs exactly one layout with rounds to pool, it has "
                                 f"{sorted(parts) or 'none'}")
            data = next(iter(parts.values()))
        return {k: list(v) for k, v in data["runs"].items()}
    rounds = []
    for line in raw.splitlines():
        m = re.match(r"\[miss\] round (\d+): (.+)$", line.strip())
        if not m or m.group(1) == "0":  # round 0 is the warm-up (its line lists nothing)
            continue
        rounds.append({k: float(v) for k, v in re.findall(r"(\S+) ([0-9.]+)s", m.group(2))})
    if not rounds:
        raise ValueError(f"{p}: neither a miss.json nor a log with '[miss] round' lines")
    engines = list(dict.fromkeys(k for r in rounds for k in r))
    full = [r for r in rounds if len(r) == len(engines)]  # a round an engine failed in pairs nothing
    return {k: [r[k] for r in full] for k in engines}


def pool_miss_runs(runs_list: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Rounds of several miss runs, concatenated per engine; only engines every run had (pairs
    stay within a round)."""
    common = set.intersection(*(set(r) for r in runs_list)) if runs_list else set()
    if not common:
        raise ValueError(f"no engine is in every run (engines per run: {[sorted(r) for r in runs_list]})")
    out = {k: [] for k in runs_list[0] if k in common}
    for r in runs_list:
        n = min(len(r[k]) for k in out)
        for k in out:
            out[k] += r[k][:n]
    return out


def round_split(rows: list[list[float]], batch: int) -> dict[str, float]:
    """One round's steps summed by kind: prefill (more tokens than requests) and decode; wall
    ms of the steps and device ms of their forwards."""
    out = {"prefill_n": 0, "prefill_ms": 0.0, "prefill_gpu_ms": 0.0, "decode_n": 0, "decode_ms": 0.0,
           "decode_gpu_ms": 0.0}
    for tokens, step_ms, gpu_ms, *_ in rows:
        if not tokens:
            continue
        kind = "prefill" if tokens > batch else "decode"
        out[f"{kind}_n"] += 1
        out[f"{kind}_ms"] += step_ms
        out[f"{kind}_gpu_ms"] += gpu_ms
    return out


def step_kind_table(step_rows: dict[str, list], batch: int) -> str:
    """Per engine, medians over rounds of the prefill and decode steps' sums, and their paired
    change against offload off: says whether a cost is device time (the forward's kernels ran
    slower) or engine time, and in which kind of step."""
    split = {k: [round_split(r, batch) for r in v] for k, v in step_rows.items() if v}
    off = split["off"]
    keys = ["prefill_gpu_ms", "prefill_ms", "decode_gpu_ms", "decode_ms"]
    rows = []
    for k, v in split.items():
        row = [k, len(v), f"{_med([r['prefill_n'] for r in v]):.0f}/{_med([r['decode_n'] for r in v]):.0f}"]
        for key in keys:
            med = _med([r[key] for r in v])
            p = paired_change([r[key] for r in v], [r[key] for r in off]) if k != "off" else {"n": 0}
            row.append(f"{med:,.1f}" + (f" ({p['median'] * 100:+.1f}%)" if p["n"] else ""))
        rows.append(row)
    return (table(["engine", "rounds", "prefill/decode steps", "prefill device ms", "prefill step ms",
                   "decode device ms", "decode step ms"], rows)
            + "\nper round, medians (paired change vs off): device ms = CUDA-event time of the forwards the "
              "steps launched; step ms = the engine steps' wall time")


def steady_decode_table(step_rows: dict[str, list], batch: int, skip: int = 8) -> str:
    """Decode steps after the first ``skip`` (those the last prefill's stores overlap): per step,
    medians over rounds of the step's wall, its forward's device time and the host parts
    (``timeline.HOST_COLUMNS``), with the difference from off's median. Why: ours' steady decode
    steps ran ~0.15 ms longer than off's with the same kernels (a profile showed the device idle
    that much longer), so the question is whether a host part grew. Rows from before the host
    columns existed are left out."""
    def per_step(rows: list[list[float]]) -> list[float] | None:
        dec = [r for r in rows if r[0] and r[0] <= batch][skip:]
        if not dec or len(dec[0]) < 4 + len(HOST_COLUMNS):
            return None
        return [sum(r[k] for r in dec) / len(dec) for k in [1, 2] + list(range(4, 4 + len(HOST_COLUMNS)))]

    per = {k: [x for x in map(per_step, v) if x] for k, v in step_rows.items()}
    if not per.get("off"):
        return ""
    head = ["step", "device"] + list(HOST_COLUMNS)
    rows = []
    for k, v in per.items():
        if not v:
            continue
        row = [k, len(v)]
        for i in range(len(head)):
            xs, base = [r[i] for r in v], [r[i] for r in per["off"]]
            row.append(f"{_med(xs):.3f}" + (f" ({(_med(xs) - _med(base)) * 1e3:+.0f} us)" if k != "off" else ""))
        rows.append(row)
    return (table(["engine", "rounds"] + [f"{h} ms" for h in head], rows)
            + f"\ndecode steps after the first {skip} of each round, ms per step (medians over rounds; in brackets "
              "the difference from off's median): step = wall, device = the forward's CUDA-event time, the rest host "
              "wall time of the step's parts (connector = its wrapped worker calls: start_load, finished, preempt)")


def multiturn_table(res: dict) -> str:
    rows = []
    for s in res["summaries"]:
        srv = s.get("server") or {}
        nan = float("nan")
        rows.append([s["label"], f"{s['completed']}/{s['planned']}", s["requests_per_s"],
                     s["ttft_ms"].get("p50", nan), s["ttft_ms"].get("p99", nan),
                     100 * srv.get("prefix_hit_rate", nan), 100 * srv.get("external_hit_rate", nan),
                     srv.get("offload_load_bytes", nan) / 2**20])
    for e in res.get("errors", []):
        rows.append([e["label"], "failed", "-", "-", "-", "-", "-", "-"])
    text = table(["server", "ok", "req/s", "TTFT p50 ms", "TTFT p99 ms", "device prefix hit %",
                  "offload hit %", "loaded MiB"], rows)
    paired = multiturn_paired_table(res)
    return text + ("\n\n" + paired if paired else "")


def multiturn_paired_table(res: dict) -> str:
    """With several passes (``--mt-reps``): each server's change against off in the same pass,
    medians over passes with the range (req/s, and the median TPOT and TTFT of the pass)."""
    by: dict[str, dict[int, dict]] = {}
    for s in res["summaries"]:
        by.setdefault(s["label"], {})[s.get("rep", 0)] = s
    off = by.get("off", {})
    rows = []
    for label, per in by.items():
        reps = sorted(r for r in per if r in off)
        if label == "off" or len(reps) < 2:
            continue
        row = [label, len(reps)]
        for pick in (lambda s: s["requests_per_s"], lambda s: s["tpot_ms"].get("p50"),
                     lambda s: s["ttft_ms"].get("p50")):
            ch = paired_change([pick(per[r]) for r in reps], [pick(off[r]) for r in reps])
            row.append(f"{ch['median'] * 100:+.1f}% ({ch['min'] * 100:+.1f}..{ch['max'] * 100:+.1f}%)")
        rows.append(row)
    if not rows:
        return ""
    return (table(["server", "passes", "req/s vs off", "TPOT p50 vs off", "TTFT p50 vs off"], rows)
            + "\npaired by pass (all servers up, taking turns; new texts each pass): median change (min..max)")


def smoke_table(res: dict) -> str:
    """Each engine of the smoke run: started (s), tokens, host hits after a reset; then the tiny serving run."""
    rows = []
    for label, e in res.get("engines", {}).items():
        if e.get("error"):
            rows.append([label, "FAIL", _f(e.get("start_s")), "-", "-", "-", "-", e["error"].splitlines()[0][:160]])
            continue
        kv = e.get("kv") or {}
        rows.append([label, "ok" if e.get("ok") else "FAIL", _f(e.get("start_s")), len(e.get("tokens") or []),
                     e.get("host_tokens", "-"), "yes" if kv.get("cross_layer_blocks") else "no",
                     len(kv.get("kv_cache_groups") or []) or "-", e.get("why", "")])
    text = table(["engine", "result", "start s", "tokens", "host-hit tok after reset", "cross-layer", "KV groups",
                  "note"], rows) if rows else "(no engines)"
    head = meta_line(res.get("meta"))
    return (head + f"; {res.get('layers')} layers of each shape\n" if head else "") + text


def _pct(ch: dict) -> str:
    return f"{ch['median'] * 100:+.1f}% ({ch['min'] * 100:+.1f}..{ch['max'] * 100:+.1f}%)" if ch.get("n") else "-"


SERVE_METRICS = (  # (column, pick from a run, better when lower)
    ("req/s", lambda r: r["summary"].get("requests_per_s")),
    ("later TTFT p50", lambda r: r["summary"].get("ttft_later_ms", {}).get("p50")),
    ("later TTFT p90", lambda r: r["summary"].get("ttft_later_ms", {}).get("p90")),
    ("later TTFT p99", lambda r: r["summary"].get("ttft_later_ms", {}).get("p99")),
    ("TPOT p50", lambda r: r["summary"].get("tpot_ms", {}).get("p50")),
    ("TPOT p99", lambda r: r["summary"].get("tpot_ms", {}).get("p99")),
)


def serve_runs_by(res: dict) -> dict[str, dict[int, dict]]:
    """label -> pass -> run, runs without an error and with requests only (an LMCache pass marked
    ``failed``, degraded or without hits, is no number either)."""
    by: dict[str, dict[int, dict]] = {}
    for r in res.get("runs", []):
        if r.get("error") or r.get("failed") or not r.get("summary", {}).get("requests"):
            continue
        by.setdefault(r["label"], {})[r.get("pass_", 0)] = r
    return by


def serve_base(label: str, labels: list[str]) -> str | None:
    """What a server is paired against besides off: the native server of its own layout, else native."""
    lay = label.rpartition(":")[0]
    for cand in ((f"{lay}:native",) if lay else ()) + ("native",):
        if cand in labels and cand != label:
            return cand
    return None


def serve_one_table(res: dict) -> str:
    """One (layout, load): per server, medians over passes; then each server against native and off,
    paired by pass (the median and range of the per-pass change)."""
    by = serve_runs_by(res)
    load = res.get("load", {})
    labels = [s["label"] for s in res.get("servers", [])] or list(by)
    rows = []
    for label in labels:
        runs = list(by.get(label, {}).values())
        failed = [r for r in res.get("runs", []) if r.get("label") == label and r.get("failed")]
        note = f"FAILED in {len(failed)} pass(es): {failed[0]['failed']}"[:160] if failed else ""
        if not runs:
            err = note or next((e["error"] for e in res.get("errors", []) if e["label"] == label), "no run")
            rows.append([label, 0] + ["-"] * 13 + [str(err).splitlines()[0][:160]])
            continue
        med = lambda f: _med([f(r) for r in runs])  # noqa: E731
        m = lambda k: med(lambda r: r.get("metrics", {}).get(k))  # noqa: E731
        gib = lambda x: "-" if x is None else f"{x / 2**30:.2f}"  # noqa: E731
        rows.append([label, len(runs)] + [_f(med(f), "{:,.2f}" if name == "req/s" else "{:,.1f}")
                                          for name, f in SERVE_METRICS]
                    + [_f(m("external_hits"), "{:,.0f}"),
                       # vLLM's tokens by source where it has them (prefix_hits counts a deferred request's retries)
                       _f(m("prompt_local_cache_hit") if m("prompt_local_cache_hit") is not None else m("prefix_hits"),
                          "{:,.0f}"), _f(m("prompt_local_compute"), "{:,.0f}"),
                       f"{gib(m('load_bytes'))} / {_f(m('load_s'), '{:.2f}')}",
                       f"{gib(m('store_bytes'))} / {_f(m('store_s'), '{:.2f}')}",
                       _f(m("preemptions"), "{:,.0f}"), _f(med(lambda r: r["summary"].get("empty_outputs")), "{:.0f}"),
                       note])
    head = ["server", "passes", "req/s", "later TTFT p50 ms", "p90 ms", "p99 ms", "TPOT p50 ms", "TPOT p99 ms",
            "host-hit tok", "device-hit tok", "computed tok", "loaded GiB / s", "stored GiB / s", "preempted", "empty outputs",
            "note"]
    text = table(head, rows)
    # paired
    prow = []
    for label in labels:
        if label == "off" or label not in by:
            continue
        default = label.partition("/")[0] if "/" in label else None  # a variant: also against its default
        for base in [b for b in (default, serve_base(label, labels), "off") if b and b in by and b != label]:
            passes = sorted(set(by[label]) & set(by[base]))
            if not passes:
                continue
            row = [f"{label} vs {base}", len(passes)]
            for _, f in SERVE_METRICS:
                xs, bs = [f(by[label][p]) for p in passes], [f(by[base][p]) for p in passes]
                ok = [(x, b) for x, b in zip(xs, bs) if x is not None and b]
                row.append(_pct(paired_change([x for x, _ in ok], [b for _, b in ok])) if ok else "-")
            prow.append(row)
    if prow:
        text += "\n\n" + table(["compared", "passes"] + [n for n, _ in SERVE_METRICS], prow)
    lmc = lmcache_serve_lines(res)
    if lmc:
        text += "\n" + lmc
    ranks = disk_rank_lines(res)
    if ranks:
        text += "\n" + ranks
    logs = res.get("server_logs") or {}
    cl = ", ".join(f"{k} {'yes' if v.get('cross_layer_blocks') else 'no'}" for k, v in logs.items())
    times = ", ".join(f"{k} {v['compile_s']:.0f}+{v.get('graph_capture_s', 0):.0f}s" for k, v in logs.items()
                      if v.get("compile_s") is not None)
    cut = res.get("cut") or []
    text += (f"\n{load.get('clients')} clients, {load.get('active')} active conversations, {load.get('conversations')} "
             f"conversations x {load.get('user_turns')} turns per pass; device KV {load.get('device_tokens')} tokens "
             f"per server (upper: all conversations), host KV per offload server "
             f"{_host_gib(res)}; vLLM's "
             f"benchmark_serving_multi_turn.py, new texts each pass, the server going first alternates; later TTFT = "
             f"turns with a history; host-hit tok = vLLM's external prefix-cache hits; loaded/stored = vLLM's "
             f"kv_offload bytes / seconds; medians over passes; paired = median (min..max) of the per-pass change"
             + (f"\ncross-layer KV (server logs): {cl}" if cl else "")
             + (f"\ncompile + graph capture: {times}" if times else "")
             + (f"\ncut by the call's time budget: {len(cut)} run(s) not done" if cut else ""))
    errs = [e for e in res.get("errors", []) if e.get("pass", 0) >= 0 or e["label"] == "-"]
    if errs:
        text += "\n" + "\n".join(f"error {e['label']} pass {e.get('pass')}: {str(e['error'])[:300]}" for e in errs)
    return text


def lmcache_serve_lines(res: dict) -> str:
    """Per LMCache server, what its log said per pass (hit / to load / retrieved tokens; FAILED and why)."""
    lines = []
    for s in res.get("servers", []):
        if s.get("kind") not in ("lmcache", "lmcache-disk"):
            continue
        env = dict(s.get("env") or ())
        cfg = ", ".join(f"{k[len('LMCACHE_'):].lower()} {v}" for k, v in env.items()
                        if k in ("LMCACHE_MAX_LOCAL_CPU_SIZE", "LMCACHE_LOCAL_DISK", "LMCACHE_MAX_LOCAL_DISK_SIZE"))
        per = []
        for r in sorted((r for r in res.get("runs", []) if r.get("label") == s["label"]), key=lambda r: r.get("pass_", 0)):
            info = r.get("lmcache") or {}
            per.append(f"pass {r.get('pass_', 0)}: " + (f"FAILED ({r['failed']})" if r.get("failed") else
                       f"hit {info.get('hit_tokens', 0):,} / to load {info.get('loaded_tokens', 0):,} / retrieved "
                       f"{info.get('retrieved_tokens', 0):,} tokens in "
                       f"{info.get('lookups', 0)} lookups"))
        lines.append(f"LMCache {s['label']} ({cfg}; GiB per rank, chunks of 256 tokens), from its log: "
                     + ("; ".join(per) or "no pass"))
    return "\n".join(lines)


def disk_rank_lines(res: dict) -> str:
    """Per ours-disk server with more than one rank, its records by rank after each pass (files, GB)."""
    lines = []
    for label in sorted({r["label"] for r in res.get("runs", []) if len(r.get("disk_ranks_now") or {}) > 1}):
        per = [f"pass {r.get('pass_', 0)}: " + ", ".join(f"r{k} {v['files']:,} files {v['bytes'] / 1e9:.1f} GB"
                                                         for k, v in r["disk_ranks_now"].items())
               for r in sorted(res["runs"], key=lambda r: r.get("pass_", 0)) if r["label"] == label
               and r.get("disk_ranks_now")]
        lines.append(f"{label} disk records by rank, after each pass: " + "; ".join(per))
    return "\n".join(lines)


def _host_gib(res: dict) -> str:
    cpu = sorted({s["cpu_bytes"] for s in res.get("servers", []) if s.get("cpu_bytes")})
    return " / ".join(f"{c / 2**30:.1f} GiB" for c in cpu) or "-"


def serve_table(res: dict) -> str:
    """Every (layout, load) of a serve part under its header line."""
    out = []
    for r in res.get("runs", []):
        head = meta_line(res.get("meta"), {"name": r.get("layout"), "blocks": r.get("blocks"), "model": r.get("model"),
                                           "attention_backend": r.get("attention_backend")})
        out.append("\n".join(x for x in (f"### {r.get('layout')}, {r.get('load', {}).get('clients')} clients", head,
                                          serve_one_table(r)) if x))
    return "\n\n".join(out) if out else "(no serving runs)"


FORMATTERS = {"smoke": smoke_table, "smoke-serve": lambda res: serve_table(res), "correctness": per_layout(correctness_table), "ttft": per_layout(ttft_table),
              "miss": per_layout(miss_table), "serve": serve_table, "pair": pair_table,
              "reliability": reliability_table, "multiturn": multiturn_table}


def write_part(out_dir: str | Path, part: str, res: dict) -> str:
    """Write ``<part>.json`` and ``<part>.txt`` (the table) into ``out_dir``; return the table."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        text = FORMATTERS[part](res)
    except Exception as e:  # noqa: BLE001 - the JSON must come back even if a table cannot be made
        text = f"(no table: {type(e).__name__}: {e})"
    res = {**res, "table": text}
    (out / f"{part}.json").write_text(json.dumps(res, indent=1, default=str))
    (out / f"{part}.txt").write_text(text + "\n")
    return text


POOLED_METRICS = ("req/s", "later TTFT p50", "TPOT p50")  # of SERVE_METRICS; req/s as a change, the rest as ratios


def serve_pass_pairs(path: str | Path, layout: str, clients: int, a: str, b: str,
                     from_pass: int = 0) -> list[dict[str, float]]:
    """Per pass of one serve run (its ``serve.json``, ``.gz`` too) where servers ``a`` and ``b`` both
    finished on ``layout`` at ``clients`` (``serve_runs_by``'s runs): the change of a against b, each
    within its pass (the pass's texts are the same for both and its conditions close): req/s as
    a / b - 1, the latencies' p50 as a ratio. ``from_pass``: passes before it left out (a run's first
    pass is each server's first traffic: its warm-up falls on whichever server goes first)."""
    import gzip

    p = Path(path)
    data = json.loads(gzip.open(p, "rt").read() if p.suffix == ".gz" else p.read_text())
    pick = dict(SERVE_METRICS)
    out = []
    for run in data.get("runs", []):
        if run.get("layout") != layout or run.get("load", {}).get("clients") != clients:
            continue
        by = serve_runs_by(run)
        for k in sorted(k for k in set(by.get(a, {})) & set(by.get(b, {})) if k >= from_pass):
            row = {"pass": k}
            for name in POOLED_METRICS:
                x, y = pick[name](by[a][k]), pick[name](by[b][k])
                row[name] = (x / y - 1.0 if name == "req/s" else x / y) if x is not None and y else None
            out.append(row)
    return out


def pooled(xs: list[float]) -> dict[str, float]:
    """A pooled sample of per-pass changes: ``spread`` plus the mean and its standard error, and the
    median's 95% interval (``median_ci``) where n allows one."""
    out = spread(xs)
    if len(xs) >= 2:
        out.update(mean=statistics.mean(xs), se=statistics.stdev(xs) / len(xs) ** 0.5)
    ci = median_ci(xs)
    if ci:
        out.update(median_lo=ci[0], median_hi=ci[1])
    return out


def pooled_serve_table(groups: dict[str, list[dict[str, float]]]) -> tuple[str, dict]:
    """One row per group of passes (a run, or several pooled) and metric: median (95% interval),
    mean +- standard error, range, passes below 0 (req/s) or above 1 (latencies). Returns the table
    and the numbers."""
    rows, doc = [], {}
    for label, passes in groups.items():
        doc[label] = {}
        for name in POOLED_METRICS:
            is_rate = name == "req/s"
            xs = [p[name] for p in passes if p[name] is not None]
            if not xs:
                continue
            s = doc[label][name] = pooled(xs)
            f = (lambda v: f"{v * 100:+.1f}%") if is_rate else (lambda v: f"{v:.3f}x")
            worse = sum(x < 0 for x in xs) if is_rate else sum(x > 1 for x in xs)
            ci = f" ({f(s['median_lo'])}..{f(s['median_hi'])})" if "median_lo" in s else ""
            mean = (f"{f(s['mean'])} +- {s['se'] * (100 if is_rate else 1):.{1 if is_rate else 3}f}"
                    if "se" in s else "-")
            rows.append([label, name, len(xs), f(s["median"]) + ci, mean, f"{f(s['min'])}..{f(s['max'])}",
                         f"{worse} of {len(xs)}"])
    return table(["passes", "metric", "n", "median (95% interval)", "mean +- s.e.", "range", "worse than b"],
                 rows), doc
