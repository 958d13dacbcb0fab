"""The timed all-to-all of the communication telemetry, in a one-process gloo group: a rank that sends or
receives no rows (an expert shard no token chose) is timed and counted, and the backward is the all-to-all
with the splits swapped, as torch.distributed.nn.functional's."""

import torch
import torch.distributed as dist

from moe_core.train.parallel import CommStats, TimedAllToAll, timed_all_to_all


def test_timed_all_to_all_counts_rows_and_handles_empty_sends(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        stats = CommStats()
        empty = timed_all_to_all(torch.empty(0, 4), [0], [0], None, stats, me=0)
        assert empty.shape == (0, 4) and stats.bytes_sent == stats.bytes_recv == 0 and stats.seconds >= 0
        x = torch.randn(3, 4, requires_grad=True)
        y = TimedAllToAll.apply(x, [3], [3], None, stats, 0)
        (y * torch.arange(4.0)).sum().backward()
        assert torch.equal(y, x) and torch.equal(x.grad, torch.arange(4.0).expand(3, 4))
        assert stats.bytes_sent == 0  # to itself: nothing crosses the wire
    finally:
        dist.destroy_process_group()
