"""Models of the GPU end-to-end runs: real shapes with dummy weights, tiny random ones, a tokenizer.

Real shapes (``SHAPES``) are configs only, for ``load_format=dummy``: an 8B Llama (one uniform KV
group), a Gemma-2-9B (sliding-window and global layers: two KV-cache groups) and a DeepSeek-V2-Lite
with dense MLPs (MLA, no MoE: the stripped wheel has no ``_moe_C``). The correctness part uses tiny
random-weight models of the same architectures (``build_tiny``), whose greedy tokens vary.

The serving tokenizer (``build_tokenizer``) is word-level with 1000 ids: vLLM's multi-turn client
writes "Please rewrite the following text and add more content:" and "N is a nice number..." into
every prompt, so those words and the numbers are in it; the rest are ``w0``, ``w1``, ... and the
corpus (``write_corpus``) is made of them, so every text token is a real, distinct id. Only ``eos``
is a special token (and the client's ``min_tokens`` keeps it from being sampled): every id a dummy
model samples streams as a visible word that tokenizes back to the same id.
CPU-only (transformers, tokenizers); unit-tested.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

SERVE_VOCAB = 1000
# ids 0-3 (config: bos 1, eos 2, pad 3); plain words, so a sampled one streams as text and re-tokenizes to itself
SPECIALS = ["unk", "bos", "eos", "pad"]
# What vLLM 0.23's benchmarks/multi_turn/bench_dataset.py writes around the corpus text.
CLIENT_WORDS = ["Please", "rewrite", "the", "following", "text", "and", "add", "more", "content", ":", "is", "a",
                "nice", "number", "...", ",", "."]
MAX_CONVERSATION_ID = 255  # numbers 0..255 are words (the client's conversation ids)


@dataclass(frozen=True)
class Shape:
    name: str
    arch: str  # HF architecture
    config: dict  # HF config kwargs (vocab_size set per use)
    what: str
    vocab_size: int  # the real model's
    tiny: dict = field(default_factory=dict)  # the tiny random model's config kwargs

    @property
    def layers(self) -> int:
        return self.config["num_hidden_layers"]

    def kv_bytes_per_token(self, dtype_bytes: int = 2, layers: int | None = None) -> int:
        """Device KV bytes per token over all layers (sliding-window layers counted in full)."""
        c = self.config
        L = layers or c["num_hidden_layers"]
        if self.arch == "DeepseekV2ForCausalLM":  # MLA: one latent of kv_lora_rank + rope dims per layer
            return L * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * dtype_bytes
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return L * 2 * c["num_key_value_heads"] * head_dim * dtype_bytes

    def params(self, vocab_size: int | None = None, layers: int | None = None) -> int:
        """Parameter count (for memory planning), embeddings of ``vocab_size`` (default: the real one)."""
        c, v = self.config, vocab_size or self.vocab_size
        h, inter, L = c["hidden_size"], c["intermediate_size"], layers or c["num_hidden_layers"]
        mlp = 3 * h * inter
        if self.arch == "DeepseekV2ForCausalLM":
            nh, nope, rope, vd, r = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                                     c["v_head_dim"], c["kv_lora_rank"])
            attn = h * nh * (nope + rope) + h * (r + rope) + r * nh * (nope + vd) + nh * vd * h
            return 2 * v * h + L * (attn + mlp)
        hd = c.get("head_dim") or h // c["num_attention_heads"]
        attn = h * c["num_attention_heads"] * hd * 2 + 2 * h * c["num_key_value_heads"] * hd
        emb = v * h if c.get("tie_word_embeddings") else 2 * v * h
        return emb + L * (attn + mlp)

    def weight_bytes(self, vocab_size: int | None = None, dtype_bytes: int = 2, layers: int | None = None) -> int:
        return self.params(vocab_size, layers) * dtype_bytes


SHAPES: dict[str, Shape] = {
    "llama8b": Shape(
        "llama8b", "LlamaForCausalLM",
        dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=8, max_position_embeddings=40960, rope_theta=500000.0),
        "Llama-3-8B shape (32 layers, 8 KV heads x 128; one uniform KV-cache group)", 128256,
        tiny=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096)),
    "gemma2_9b": Shape(
        "gemma2_9b", "Gemma2ForCausalLM",
        dict(hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
             num_key_value_heads=8, head_dim=256, sliding_window=4096, attn_logit_softcapping=50.0,
             final_logit_softcapping=30.0, query_pre_attn_scalar=256, max_position_embeddings=40960,
             hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
        "Gemma-2-9B shape (42 layers alternating sliding window 4096 / global, 8 KV heads x 256, soft-capping: "
        "two KV-cache groups)", 256000,
        tiny=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, sliding_window=256, attn_logit_softcapping=50.0,
                  final_logit_softcapping=30.0, query_pre_attn_scalar=64, max_position_embeddings=4096,
                  hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
    "dsv2_lite": Shape(
        "dsv2_lite", "DeepseekV2ForCausalLM",
        dict(hidden_size=2048, intermediate_size=10944, num_hidden_layers=27, num_attention_heads=16,
             num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
             qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=27, moe_intermediate_size=1408,
             n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6, max_position_embeddings=40960,
             rope_theta=10000.0),
        "DeepSeek-V2-Lite shape with dense MLPs in all 27 layers (MLA: kv_lora_rank 512 + rope 64; no MoE)", 102400,
        tiny=dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
                  qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=3, moe_intermediate_size=128,
                  n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, max_position_embeddings=4096,
                  rope_theta=10000.0)),
}
TOKEN_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=3)


def _config(shape: Shape, overrides: dict, vocab_size: int, layers: int | None = None):
    """The HF config object of ``shape`` (transformers' class for its architecture)."""
    import transformers

    kw = {**overrides, **TOKEN_IDS, "vocab_size": vocab_size}
    if layers is not None:  # fewer layers (smoke runs): same per-layer shapes
        kw["num_hidden_layers"] = layers
        if "first_k_dense_replace" in kw:
            kw["first_k_dense_replace"] = layers
    if shape.arch == "Gemma2ForCausalLM":  # even layers slide, odd ones are global (Gemma-2's pattern)
        kw["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                             for i in range(kw["num_hidden_layers"])]
    cls = {"LlamaForCausalLM": "LlamaConfig", "Gemma2ForCausalLM": "Gemma2Config",
           "DeepseekV2ForCausalLM": "DeepseekV2Config"}[shape.arch]
    return getattr(transformers, cls)(**kw, architectures=[shape.arch])


def build_tokenizer(out: Path) -> Path:
    """The word-level serving tokenizer (``SERVE_VOCAB`` ids) into ``out``."""
    from vllm_npu_offload.demo.tiny_model import word_tokenizer

    # eos only: a special token is dropped from the streamed text, and a dummy model may sample any id
    hf = word_tokenizer(SPECIALS + CLIENT_WORDS + [str(i) for i in range(MAX_CONVERSATION_ID + 1)], SERVE_VOCAB,
                        "unk", eos_token="eos")
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out)
    return out


def corpus_words() -> list[str]:
    """The plain words of the serving tokenizer (``w0``...): what the corpus is made of."""
    n = SERVE_VOCAB - len(SPECIALS) - len(CLIENT_WORDS) - (MAX_CONVERSATION_ID + 1)
    return [f"w{i}" for i in range(n)]


def write_corpus(path: Path, n_words: int, seed: int) -> Path:
    """``n_words`` random corpus words (new texts for every ``seed``), 16 to a line."""
    rng = random.Random(seed)
    words = corpus_words()
    lines = [" ".join(rng.choice(words) for _ in range(16)) for _ in range((n_words + 15) // 16)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (dst / f.name).write_bytes(f.read_bytes())


def build_shape_model(out: Path, shape: str, vocab_size: int | None = None, layers: int | None = None) -> str:
    """Config-only model of ``shape`` (for ``load_format=dummy``) plus the serving tokenizer.

    ``vocab_size``: the real one by default; ``SERVE_VOCAB`` where a server detokenizes (every id
    must be a word). ``layers``: fewer layers of the same shape (smoke runs)."""
    sh = SHAPES[shape]
    marker = out / ".shape_model"
    key = {"shape": shape, "vocab": vocab_size or sh.vocab_size, "layers": layers, "config": sh.config}
    if marker.exists() and json.loads(marker.read_text()) == key:
        return str(out)
    tok = build_tokenizer(out.parent / "serve-tokenizer")
    out.mkdir(parents=True, exist_ok=True)
    _config(sh, sh.config, vocab_size or sh.vocab_size, layers).save_pretrained(out)
    _copy_tokenizer(tok, out)
    marker.write_text(json.dumps(key))
    return str(out)


def build_tiny(out: Path, shape: str, seed: int = 0) -> str:
    """A tiny random-weight model of ``shape``'s architecture (saved weights, vocab ``SERVE_VOCAB``)."""
    import torch
    import transformers

    sh = SHAPES[shape]
    marker = out / ".tiny_model"
    key = {"shape": shape, "seed": seed, "tiny": sh.tiny}
    if marker.exists() and json.loads(marker.read_text()) == key:
        return str(out)
    tok = build_tokenizer(out.parent / "serve-tokenizer")
    cfg = _config(sh, sh.tiny, SERVE_VOCAB)
    torch.manual_seed(seed)
    model = getattr(transformers, sh.arch)(cfg)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    _copy_tokenizer(tok, out)
    marker.write_text(json.dumps(key))
    return str(out)


__all__ = ["SHAPES", "SERVE_VOCAB", "Shape", "build_shape_model", "build_tiny", "build_tokenizer", "corpus_words",
           "write_corpus"]
