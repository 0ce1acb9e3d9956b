"""A failed layer-group copy for layer-wise load tests: the transfers of one layer group of a
worker core (vLLM's KV group is core group 0, layer group g is core group 1 + g) fail on their
stream, as a failed copy does (the engine reports them with ``success=False``)."""

from __future__ import annotations


def fail_layer_group(core, group: int) -> None:
    """From now on, ``core``'s transfers that name layer group ``group`` fail (undo: ``del core.plan``)."""
    plan = core.plan

    def failing(direction, dev, sizes, *args, **kwargs):
        transfer = plan(direction, dev, sizes, *args, **kwargs)
        if len(sizes) > 1 + group and sizes[1 + group]:
            def broken(stream, *a, **k):
                raise RuntimeError("injected copy failure")
            transfer.enqueue = broken
        return transfer

    core.plan = failing
