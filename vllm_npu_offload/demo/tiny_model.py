"""Build a tiny random-weight Llama and a word-level tokenizer offline (no model hub).

Head size 32 because vLLM's CPU attention supports only head sizes >= 32.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

VOCAB_SIZE = 1000
WORDS = "the quick brown fox jumps over lazy dog hello world".split()


def build_tiny_llama(out_dir: str | os.PathLike, seed: int = 0, num_layers: int = 2) -> Path:
    """Write config, weights and tokenizer to ``out_dir`` (reused if already complete)."""
    out = Path(out_dir)
    marker = out / ".tiny_llama_complete"
    if marker.exists() and json.loads(marker.read_text()) == {"seed": seed, "layers": num_layers}:
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_tok = word_tokenizer(["<unk>", "<s>", "</s>", "<pad>"] + WORDS, VOCAB_SIZE, "<unk>", unk_token="<unk>",
                            bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, pad_token_id=3,
    )
    out.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(cfg).save_pretrained(out)
    hf_tok.save_pretrained(out)
    marker.write_text(json.dumps({"seed": seed, "layers": num_layers}))
    return out


def word_tokenizer(words: list[str], vocab_size: int, unk: str, **specials):
    """A word-level tokenizer (offline, no model hub): ``words`` first, then ``w0``, ``w1``, ... up to
    ``vocab_size`` ids; ``specials`` are the Hugging Face wrapper's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for t in words:
        vocab.setdefault(t, len(vocab))
    i = 0
    while len(vocab) < vocab_size:
        vocab[f"w{i}"] = len(vocab)
        i += 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, **specials)


def random_words(n: int, seed: int) -> str:
    """``n`` whitespace-separated vocabulary words (one token each), deterministic for ``seed``."""
    import random

    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(VOCAB_SIZE - 20)}" for _ in range(n))
