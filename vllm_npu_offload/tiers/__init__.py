"""Tiers below host memory: KV records that outlive the host buffer.

The host tier (``offload_worker``) stays the only one the device talks to; a lower tier moves whole
host records (one offloaded chunk, every layer) between a rank's host buffer and its storage. The
scheduler side decides (``disk_tier.DiskTier``); each rank's worker only executes reads and writes
into its own host buffer (``disk_worker.DiskTierServer``), on its own threads. Contracts:
``contract.py``; the record format and checksums: ``record.py``; file I/O: ``disk_io.py``.
Nothing here imports vLLM.
"""
