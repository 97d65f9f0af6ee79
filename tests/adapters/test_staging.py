"""Staging buffers between the store's host pages and an engine's KV tensors (``adapters/staging.py``).

The CPU cases run everywhere: plain memory, copies done when ``copy`` returns. The ``cuda``
cases (marked ``gpu``, skipped without a CUDA device) check what only a GPU shows: the
buffers are pinned, the copies are asynchronous and tracked by an event, and a buffer is
not handed out again before its copies are done.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from dss_adapters.staging import Staged, StagingPool

from dss import ConfigError, InvalidInput

needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PAGES = [bytes(range(8)), bytes(range(8, 16))]
PARTS = [(0, 2), (2, 6)]


def test_stage_lays_each_part_of_every_page_side_by_side() -> None:
    """Worked example: pages ``00..07`` and ``08..0f`` split at byte 2. Part 0 holds bytes
    [0, 2) of each page (``00 01`` / ``08 09``), part 1 bytes [2, 8); the buffer holds part 0
    of both pages, then part 1 of both (each part contiguous, so it moves in one copy)."""
    pool = StagingPool("cpu")
    staged = pool.stage(PAGES, PARTS)
    assert staged.num_pages == 2
    assert [p.tolist() for p in staged.parts] == [[[0, 1], [8, 9]], [[2, 3, 4, 5, 6, 7], [10, 11, 12, 13, 14, 15]]]
    assert staged.buffer.tolist() == [0, 1, 8, 9, 2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15]
    assert not staged.buffer.is_pinned()
    assert all(p.is_contiguous() for p in staged.parts)


def test_on_the_cpu_copies_run_at_once_and_the_buffer_is_reused() -> None:
    pool = StagingPool("cpu")
    target = torch.zeros((2, 8), dtype=torch.uint8)
    ran: list[torch.device] = []

    def work(staged: Staged) -> None:
        ran.append(staged.parts[0].device)
        target[:, :2] = staged.parts[0].to(pool.device, non_blocking=True)
        target[:, 2:] = staged.parts[1].to(pool.device, non_blocking=True)

    staged = pool.stage(PAGES, PARTS)
    first = staged.buffer.data_ptr()
    transfer = pool.copy(staged, work)
    assert ran == [torch.device("cpu")]  # done before copy returned
    assert transfer.is_done() and transfer.wait(0) and transfer.wait()
    assert target.numpy().tobytes() == PAGES[0] + PAGES[1]
    again = pool.stage([PAGES[1]], PARTS)  # smaller: the same buffer
    assert again.buffer.data_ptr() == first and pool.num_buffers == 1
    assert again.parts[1].tolist() == [list(range(10, 16))]


def test_a_reserved_buffer_is_filled_by_the_caller_and_goes_back_after_its_copy() -> None:
    """``reserve`` hands out the parts of a pool buffer without copying anything into them;
    after ``copy`` (here a failing one: the buffer still goes back) the same buffer is staged again."""
    pool = StagingPool("cpu")
    staged = pool.reserve(2, [2, 6])
    assert [tuple(p.shape) for p in staged.parts] == [(2, 2), (2, 6)] and staged.num_pages == 2
    staged.parts[1].fill_(7)
    assert staged.buffer[4:].tolist() == [7] * 12  # part 1 follows part 0 in the buffer

    def fail(staged: Staged) -> None:
        raise RuntimeError("refused")

    with pytest.raises(RuntimeError, match="refused"):
        pool.copy(staged, fail)
    assert pool.stage(PAGES, PARTS).buffer.data_ptr() == staged.buffer.data_ptr() and pool.num_buffers == 1


def test_a_larger_batch_replaces_a_free_buffer_when_the_pool_is_full() -> None:
    pool = StagingPool("cpu", max_buffers=1)
    pool.copy(pool.stage(PAGES[:1], PARTS), lambda staged: None)
    big = pool.stage(PAGES * 3, PARTS)
    assert pool.num_buffers == 1 and big.buffer.numel() == 6 * 8
    assert big.parts[0][5].tolist() == [8, 9]


def test_bad_input_is_refused_and_the_buffer_goes_back() -> None:
    with pytest.raises(ConfigError, match="max_buffers=0"):
        StagingPool("cpu", max_buffers=0)
    pool = StagingPool("cpu", max_buffers=1)
    with pytest.raises(InvalidInput, match="page 1 has 3 bytes; the parts need 8"):
        pool.stage([PAGES[0], b"abc"], PARTS)
    staged = pool.stage(PAGES, PARTS)  # the buffer came back: a full pool of one does not wait forever

    def fails(staged: Staged) -> None:
        raise RuntimeError("a copy failed")

    with pytest.raises(RuntimeError, match="a copy failed"):
        pool.copy(staged, fails)
    assert pool.stage(PAGES, PARTS).buffer.data_ptr() == staged.buffer.data_ptr()


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=needs_cuda)])
def test_on_cuda_buffers_are_pinned_and_copies_finish_with_their_event(device: str) -> None:
    """The copies are queued behind ``torch.cuda._sleep`` on the pool's stream, so they are
    certainly not done when ``copy`` returns; ``wait`` then sees their event complete."""
    pool = StagingPool(device, max_buffers=1)
    pages = [bytes([k]) * (1 << 20) for k in range(8)]
    target = torch.zeros((8, 1 << 20), dtype=torch.uint8, device=device)
    staged = pool.stage(pages, [(0, 1 << 20)])
    assert staged.buffer.is_pinned() and staged.parts[0].is_pinned()

    def work(staged: Staged) -> None:
        assert torch.cuda.current_stream(pool.device) == pool.stream
        torch.cuda._sleep(200_000_000)
        target.copy_(staged.parts[0].to(device, non_blocking=True))

    transfer = pool.copy(staged, work)
    assert not transfer.is_done()
    assert transfer.wait(timeout=60)
    assert transfer.is_done()
    assert target.cpu().numpy().tobytes() == b"".join(pages)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=needs_cuda)])
def test_on_cuda_a_large_copy_runs_on_the_pools_stream_after_copy_returns(device: str) -> None:
    """No artificial delay: 256 MiB of pinned pages take milliseconds to cross to the GPU, far
    longer than ``copy`` takes to queue them, so the transfer is not done when ``copy`` returns;
    timing events recorded around the copy on the pool's stream measure the copy itself, and the
    caller's stream is not held up by it (an event recorded there completes first)."""
    size, count = 32 << 20, 8
    pool = StagingPool(device, max_buffers=1)
    pages = [bytes([k]) * size for k in range(count)]
    target = torch.empty((count, size), dtype=torch.uint8, device=device)
    staged = pool.stage(pages, [(0, size)])
    assert staged.buffer.is_pinned()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def work(staged: Staged) -> None:
        assert torch.cuda.current_stream(pool.device) == pool.stream
        start.record()  # on the current stream: the pool's
        target.copy_(staged.parts[0], non_blocking=True)  # straight into the target: no allocation to time
        end.record()

    torch.cuda.synchronize()
    began = time.perf_counter()
    transfer = pool.copy(staged, work)
    queued_ms = (time.perf_counter() - began) * 1000
    done_at_return = transfer.is_done()
    caller = torch.cuda.Event()
    caller.record(torch.cuda.current_stream(pool.device))
    caller.synchronize()
    caller_first = not end.query()
    assert transfer.wait(timeout=60)
    copy_ms = start.elapsed_time(end)
    print(
        f"256 MiB host to device: queued in {queued_ms:.2f} ms, copied in {copy_ms:.2f} ms "
        f"({count * size / copy_ms / 1e6:.1f} GB/s)"
    )
    assert not done_at_return and queued_ms < copy_ms
    assert caller_first  # the caller's stream did not wait for the pool's
    assert torch.equal(target[:, :1].cpu().view(-1), torch.arange(count, dtype=torch.uint8))


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=needs_cuda)])
def test_on_cuda_a_full_pool_hands_out_a_buffer_only_once_its_copies_are_done(device: str) -> None:
    pool = StagingPool(device, max_buffers=1)
    target = torch.zeros((1, 1 << 20), dtype=torch.uint8, device=device)
    staged = pool.stage([b"\x01" * (1 << 20)], [(0, 1 << 20)])

    def work(staged: Staged) -> None:
        torch.cuda._sleep(200_000_000)
        target.copy_(staged.parts[0].to(device, non_blocking=True))

    transfer = pool.copy(staged, work)
    again = pool.stage([b"\x02" * (1 << 20)], [(0, 1 << 20)])  # waits for the first transfer
    assert transfer.is_done() and again.buffer.data_ptr() == staged.buffer.data_ptr()
    assert target.cpu().numpy().tobytes() == b"\x01" * (
        1 << 20
    )  # the second staging did not overwrite the buffer under the copy
    pool.copy(again, lambda staged: None).wait()
    pool.wait_all()


def test_a_thread_waits_for_a_buffer_another_thread_staged_until_that_one_is_copied() -> None:
    pool = StagingPool("cpu", max_buffers=1)
    staged = pool.stage(PAGES, PARTS)
    got: list[Staged] = []
    other = threading.Thread(target=lambda: got.append(pool.stage([PAGES[1]], PARTS)))
    other.start()
    other.join(0.2)
    assert other.is_alive() and got == []  # the pool's one buffer is staged, not copied yet
    pool.copy(staged, lambda staged: None)
    other.join(10)
    assert not other.is_alive() and got[0].buffer.data_ptr() == staged.buffer.data_ptr()
