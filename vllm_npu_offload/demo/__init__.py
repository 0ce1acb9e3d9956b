"""The README demo: a tiny offline Llama, a real vLLM engine, a multi-turn chat served from host KV."""
