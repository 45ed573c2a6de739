"""The stage buffer's adaptive read-ahead: deeper while the trainer waits on the workers, back to its base
once their results are ready when asked for; the order of results never changes."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, wait

import pytest
from torchdata.nodes import IterableWrapper

from zephon.engine.lane import READ_AHEAD_BASE, READ_AHEAD_MOST, lane_depth
from zephon.engine.sources import ReadAhead, StageBuffer


class SlowThenFast:
    """A real one-thread executor whose tasks take ``delay`` seconds (the workers are the slower side)
    until ``delay`` is set to 0 (the trainer is)."""

    kind, num_workers = "thread", 1

    def __init__(self, delay: float) -> None:
        self.pool = ThreadPoolExecutor(1)
        self.delay = delay
        self.submitted = 0

    def submit(self, source: int, stage: int, item: int):
        self.submitted += 1
        delay = self.delay
        return self.pool.submit(lambda: (time.sleep(delay), item * 3)[1])


def test_read_ahead_rises_while_the_trainer_waits_and_settles_back():
    policy = ReadAhead(base=2, most=6, settle=4)
    executor = SlowThenFast(delay=0.05)
    node = StageBuffer(IterableWrapper(range(10_000)), executor, 0, 0, policy)
    taken = []
    # every head is still running when asked for (one worker, 50 ms a task): one deeper per wait
    for k in range(1, 7):
        taken.append(next(node))
        assert node.depth == min(policy.base + k, policy.most)
        assert len(node._pending) == node.depth  # what is in flight follows the depth
    # now the trainer is the slower side: every result is ready when asked for
    executor.delay = 0.0
    for k in range(1, 40):
        wait(list(node._pending))
        taken.append(next(node))
        assert node.depth == max(policy.most - k // policy.settle, policy.base)
    assert node.depth == policy.base and len(node._pending) == policy.base
    assert taken == [3 * i for i in range(len(taken))]  # in order throughout
    executor.pool.shutdown()


def test_one_depth_for_all_buffers_of_a_loader():
    """A wait on one lane's buffer deepens every lane's: the workers they share are what ran out of work."""
    policy = ReadAhead(base=1, most=4, settle=100)
    slow, idle = SlowThenFast(delay=0.05), SlowThenFast(delay=0.0)
    waiting = StageBuffer(IterableWrapper(range(100)), slow, 0, 0, policy)
    other = StageBuffer(IterableWrapper(range(100)), idle, 0, 0, policy)
    other.reset()  # torchdata resets a node on its first next(): before priming it
    other.prime()
    wait(list(other._pending))
    assert next(other) == 0 and policy.depth == 1 and len(other._pending) == 1
    for _ in range(3):
        next(waiting)
    assert policy.depth == 4 and waiting.depth == other.depth == 4
    wait(list(other._pending))
    assert next(other) == 3 and len(other._pending) == 4  # the other lane now reads 4 ahead as well
    slow.pool.shutdown()
    idle.pool.shutdown()


def test_a_fixed_depth_never_moves():
    executor = SlowThenFast(delay=0.02)
    node = StageBuffer(IterableWrapper(range(100)), executor, 0, 0, 3)
    assert [next(node) for _ in range(8)] == [3 * i for i in range(8)]
    assert node.depth == 3 and len(node._pending) == 3
    executor.pool.shutdown()


def test_read_ahead_defaults_and_validation():
    assert lane_depth(0) == 1 == lane_depth(0, bursty=True)  # inline: nothing is computed ahead
    assert lane_depth(2) == 2  # light tasks: a fixed depth
    first, second = lane_depth(2, bursty=True), lane_depth(2, bursty=True)
    assert (first.base, first.most, first.depth) == (READ_AHEAD_BASE, READ_AHEAD_MOST, READ_AHEAD_BASE) == (2, 8, 2)
    assert first is not second  # one per loader: loaders do not share their workers' load
    fixed = ReadAhead.of(5)
    assert (fixed.base, fixed.most, fixed.adapts) == (5, 5, False)
    for bad in [(0, 2), (3, 2), (1, 2, 0)]:
        with pytest.raises(ValueError, match="base <= most"):
            ReadAhead(*bad)
