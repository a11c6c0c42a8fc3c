"""The host pool on its own: aligned blocks, the ring's wrap-around, reclaiming from the oldest
block, back-pressure (a reservation waits for a release), cancellation and closing."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import EVENT_TIMEOUT_S

from dcp_datastates.snapshot import pool as pool_module
from dcp_datastates.snapshot.pool import ALIGN, HostPool, block_slack, live_pools

#: The ring tests below use byte-sized pools; the block alignment there is 64.
SMALL = 64


def never() -> bool:
    return False


def test_blocks_are_aligned_and_counted() -> None:
    pool = HostPool(1000, align=SMALL)
    assert pool.capacity == 1024 and pool.allocated_bytes == 0  # allocated lazily
    a = pool.reserve(10, cancelled=never)
    b = pool.reserve(100, cancelled=never)
    assert (a, b) == (0, SMALL)
    assert pool.in_use == SMALL + 128 and pool.allocated_bytes == 1024
    pool.release(a)
    pool.release(b)
    assert pool.in_use == 0 and pool.peak_in_use == SMALL + 128
    pool.close()
    assert pool.allocated_bytes == 0


def test_a_writer_pool_hands_out_blocks_on_4_kib_in_memory() -> None:
    # The flush writes a tensor's bytes from its block with O_DIRECT (localfile.py), which
    # needs the address aligned: every block starts on ALIGN, in the buffer and in memory
    # (a writer's pool is mapped: populate=True on the CPU, pinned with a GPU).
    assert ALIGN == 4096
    pool = HostPool(3 * ALIGN + 100, populate=True)
    assert pool.capacity == 4 * ALIGN
    offsets = [pool.reserve(n, cancelled=never) for n in (1, ALIGN + 1, 10)]
    assert offsets == [0, ALIGN, 3 * ALIGN]
    for offset in offsets:
        assert pool.view(offset, 1).data_ptr() % ALIGN == 0
        pool.release(offset)
    pool.close()


def test_the_automatic_pool_holds_a_state_whose_blocks_round_up() -> None:
    # The worst layout block_slack allows for: tensors of coalesce_bytes + 1 bytes each, every
    # one in its own block and rounded up by ALIGN - 1, alternating with tiny tensors that each
    # get a block of their own. Their blocks must fit the pool sized for their bytes.
    coalesce = 1 << 20
    sizes = [coalesce + 1, 8] * 16
    need = sum(pool_module._align(n) for n in sizes)
    assert need > sum(sizes)
    assert sum(sizes) + block_slack(sum(sizes), coalesce) >= need


def test_the_ring_wraps_around_to_the_start_once_the_oldest_block_is_free() -> None:
    pool = HostPool(1024, align=SMALL)
    first = pool.reserve(448, cancelled=never)
    second = pool.reserve(448, cancelled=never)
    assert (first, second) == (0, 448)
    pool.release(first)
    # 128 bytes left at the end, 448 free at the start: the next block wraps to offset 0.
    third = pool.reserve(400, cancelled=never)
    assert third == 0
    # wrapped: free space is only [448, 448) now; a 64-byte block does not fit before `second`
    assert pool._try_reserve(64) is None
    pool.release(second)
    fourth = pool.reserve(448, cancelled=never)
    assert fourth == 448
    pool.release(third)
    pool.release(fourth)
    assert pool.in_use == 0
    pool.close()


def test_space_is_reclaimed_from_the_oldest_block_forward() -> None:
    pool = HostPool(1024, align=SMALL)
    a = pool.reserve(512, cancelled=never)
    b = pool.reserve(512, cancelled=never)
    pool.release(b)  # released out of order: its space waits for `a`
    assert pool.in_use == 512
    assert pool._try_reserve(64) is None
    pool.release(a)
    assert pool.reserve(1024, cancelled=never) == 0


def test_a_reservation_waits_for_a_release_back_pressure() -> None:
    pool = HostPool(1024, align=SMALL)
    held = pool.reserve(1024, cancelled=never)
    got: list[int | None] = []
    waiter = threading.Thread(target=lambda: got.append(pool.reserve(512, cancelled=never)))
    waiter.start()
    time.sleep(0.1)
    assert not got, "the reservation did not wait for space"
    pool.release(held)
    waiter.join(EVENT_TIMEOUT_S)
    assert got == [0]


def test_a_waiting_reservation_is_cancelled_by_wake_and_on_stall_runs_while_it_waits() -> None:
    pool = HostPool(1024, align=SMALL)
    pool.reserve(1024, cancelled=never)
    cancel = threading.Event()
    stalls: list[float] = []
    got: list[int | None] = []

    def on_stall() -> None:
        stalls.append(time.monotonic())
        cancel.set()
        pool.wake()

    waiter = threading.Thread(
        target=lambda: got.append(pool.reserve(64, cancelled=cancel.is_set, on_stall=on_stall))
    )
    waiter.start()
    waiter.join(EVENT_TIMEOUT_S)
    assert got == [None] and stalls


def test_a_piece_larger_than_the_pool_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot fit"):
        HostPool(1024, align=SMALL).reserve(2048, cancelled=never)


def test_close_refuses_blocks_in_use_and_discard_drops_everything() -> None:
    pool = HostPool(1024, align=SMALL)
    pool.reserve(64, cancelled=never)
    assert pool in live_pools()
    with pytest.raises(RuntimeError, match="1 blocks in use"):
        pool.close()
    pool.discard()
    assert pool.allocated_bytes == 0 and pool.in_use == 0
    assert pool not in live_pools()
