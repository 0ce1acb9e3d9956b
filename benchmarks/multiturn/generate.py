"""Synthetic multi-turn conversations, seeded, offline.

Input: a config in the spirit of vLLM's ``generate_multi_turn.json`` (``filetype:
generate_conversations``; ``num_turns`` counts messages, user + assistant, rounded up to even)
plus our keys ``num_system_prompts`` (distinct shared system prompts = common prefixes),
``max_context_tokens`` and ``seed``. Text comes from local text files or, with no files, from
vocabulary words ``w0 w1 ...`` (one token each for the tiny test model). Lengths are counted in
whitespace words, which equal tokens for the tiny model and are ~1.3 tokens for real tokenizers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import BenchError
from .dists import Dist, parse_dist

FORMAT = "vllm-npu-offload-multiturn/1"
VOCAB_WORDS = 960  # w0..w959 all exist in the tiny model's vocabulary

DEFAULT_CONFIG: dict[str, Any] = {
    "filetype": "generate_conversations",
    "num_conversations": 24,
    "text_files": [],
    "seed": 0,
    "num_system_prompts": 1,
    "prompt_input": {
        "num_turns": {"distribution": "uniform", "min": 12, "max": 18},
        "common_prefix_num_tokens": {"distribution": "constant", "value": 500},
        "prefix_num_tokens": {"distribution": "lognormal", "average": 1000, "max": 5000},
        "num_tokens": {"distribution": "uniform", "min": 120, "max": 160},
    },
    "prompt_output": {"num_tokens": {"distribution": "uniform", "min": 80, "max": 120}},
}


@dataclass
class Conversation:
    id: str
    messages: list[dict[str, Any]]  # system?, then user/assistant pairs; assistant has num_tokens

    @property
    def turns(self) -> list[tuple[str, int]]:
        """(user text, answer length in tokens) per user turn; the stored answers are unused on replay."""
        out, msgs = [], self.messages
        for i, m in enumerate(msgs):
            if m["role"] != "user":
                continue
            nxt = msgs[i + 1] if i + 1 < len(msgs) and msgs[i + 1]["role"] == "assistant" else None
            n = nxt.get("num_tokens") if nxt else None
            if n is None:
                n = max(1, len(nxt["content"].split())) if nxt else 64
            out.append((m["content"], int(n)))
        return out

    @property
    def system(self) -> str | None:
        return self.messages[0]["content"] if self.messages and self.messages[0]["role"] == "system" else None


class _Text:
    """Draws n-word passages: from the files' words (random offset, wrapping) or vocabulary words."""

    def __init__(self, files: list[str], rng: np.random.Generator):
        self.rng, self.words = rng, []
        for f in files:
            p = Path(f)
            if not p.is_file():
                raise BenchError(f"text file {f!r} does not exist (text_files / --text-file)")
            self.words += p.read_text(encoding="utf-8", errors="replace").split()
        if files and not self.words:
            raise BenchError(f"text files {files} contain no words")

    def take(self, n: int) -> str:
        if n <= 0:
            return ""
        if not self.words:
            return " ".join(f"w{i}" for i in self.rng.integers(0, VOCAB_WORDS, size=n))
        start = int(self.rng.integers(0, len(self.words)))
        return " ".join(self.words[(start + k) % len(self.words)] for k in range(n))


def _get(cfg: dict, path: str, default: Any = None) -> Any:
    cur: Any = cfg
    for k in path.split("."):
        if not isinstance(cur, dict) or k not in cur:
            return default
        cur = cur[k]
    return cur


def _pos_int(v: Any, name: str, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise BenchError(f"{name} = {v!r}: must be an integer >= {minimum}")
    return v


def generate(cfg: dict[str, Any], seed: int | None = None) -> dict[str, Any]:
    """Conversations for ``cfg``; identical output for identical (cfg, seed)."""
    if cfg.get("filetype", "generate_conversations") != "generate_conversations":
        raise BenchError(f"filetype = {cfg.get('filetype')!r}: only 'generate_conversations' configs generate")
    seed = int(cfg.get("seed", 0) if seed is None else seed)
    n_conv = _pos_int(cfg.get("num_conversations"), "num_conversations")
    n_sys = _pos_int(cfg.get("num_system_prompts", 1), "num_system_prompts")
    max_ctx = cfg.get("max_context_tokens")
    if max_ctx is not None:
        _pos_int(max_ctx, "max_context_tokens")
    files = cfg.get("text_files") or []
    if not isinstance(files, list):
        raise BenchError(f"text_files = {files!r}: must be a list of paths")

    def dist(path: str, default: Any) -> Dist:
        return parse_dist(_get(cfg, path, default), path)

    turns_d = dist("prompt_input.num_turns", 2)
    common_d = dist("prompt_input.common_prefix_num_tokens", 0)
    prefix_d = dist("prompt_input.prefix_num_tokens", 0)
    user_d = dist("prompt_input.num_tokens", 64)
    answer_d = dist("prompt_output.num_tokens", 32)

    rng = np.random.default_rng(seed)
    text = _Text(files, rng)
    systems = [text.take(common_d.sample(rng)[0]) for _ in range(n_sys)]
    convs = []
    for c in range(n_conv):
        n_msgs = max(2, turns_d.sample(rng)[0])
        n_user = (n_msgs + 1) // 2  # messages rounded up to even, as vLLM does
        msgs: list[dict[str, Any]] = []
        used = 0
        if systems[c % n_sys]:
            msgs.append({"role": "system", "content": systems[c % n_sys]})
            used = len(systems[c % n_sys].split())
        prefix = prefix_d.sample(rng)[0]
        for t in range(n_user):
            u_len = max(1, user_d.sample(rng)[0]) + (prefix if t == 0 else 0)
            a_len = max(1, answer_d.sample(rng)[0])
            if max_ctx is not None and used + u_len + a_len > max_ctx:
                if t == 0:
                    raise BenchError(f"max_context_tokens = {max_ctx} leaves no room for the first turn "
                                     f"({used} system + {u_len} user + {a_len} answer words)")
                break
            msgs.append({"role": "user", "content": text.take(u_len)})
            msgs.append({"role": "assistant", "content": text.take(a_len), "num_tokens": a_len})
            used += u_len + a_len
        convs.append({"id": f"conv-{c}", "messages": msgs})
    return {"format": FORMAT, "seed": seed, "config": cfg, "conversations": convs}


def load_conversations(path: str, seed: int | None = None) -> list[Conversation]:
    """Read our output, a generator config (generated on the fly), or an OpenAI-style list
    ``[{"id", "messages": [...]}]`` as produced by vLLM's convert_sharegpt_to_openai.py."""
    p = Path(path)
    if not p.is_file():
        raise BenchError(f"input file {path!r} does not exist")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise BenchError(f"input file {path!r} is not valid JSON: {e}") from None
    if isinstance(data, dict) and data.get("filetype") == "generate_conversations":
        data = generate(data, seed)
    raw = data.get("conversations") if isinstance(data, dict) else data
    if not isinstance(raw, list) or not raw:
        raise BenchError(f"input file {path!r}: expected a non-empty 'conversations' list, a list of "
                         f"{{'id','messages'}} or a config with filetype 'generate_conversations'")
    out = []
    for i, c in enumerate(raw):
        msgs = c.get("messages") if isinstance(c, dict) else None
        if not isinstance(msgs, list) or not any(isinstance(m, dict) and m.get("role") == "user" for m in msgs):
            raise BenchError(f"input file {path!r}: conversation #{i} has no user message")
        conv = Conversation(str(c.get("id", f"conv-{i}")), msgs)
        out.append(conv)
    return out


def stats(convs: list[Conversation]) -> dict[str, float]:
    turns = [len(c.turns) for c in convs]
    return {"conversations": len(convs), "requests": sum(turns), "turns_min": min(turns), "turns_max": max(turns),
            "user_words_mean": float(np.mean([len(u.split()) for c in convs for u, _ in c.turns])),
            "answer_tokens_mean": float(np.mean([a for c in convs for _, a in c.turns]))}
