"""The bench's warm-up until the host heaps settle (flexshard.bench.settle): passes run until none grew
a rank's peak resident memory by more than 1 MiB, the largest growth over the ranks decides."""

from __future__ import annotations

import mmap

import torch

from flexshard.bench.settle import GROWTH_BYTES, minor_faults, peak_resident_bytes, settle
from flexshard.runtime.local import run_on_ranks

MIB = 1 << 20


def _fake_peak(growth_per_pass: list[int]):
    """A measure() whose value grows by growth_per_pass[i] during pass i (then by nothing)."""
    state = {"v": 0}

    def measure() -> int:
        return state["v"]

    def one_pass(i: int) -> None:
        state["v"] += growth_per_pass[i] if i < len(growth_per_pass) else 0

    return measure, one_pass


def test_settles_after_the_first_pass_that_grew_by_no_more_than_the_threshold():
    measure, one_pass = _fake_peak([30 * MIB, 8 * MIB, 2 * MIB, GROWTH_BYTES, 5 * MIB])
    # passes 1-3 grew by more than 1 MiB; pass 4 grew by exactly 1 MiB: settled after 4
    assert settle(one_pass, 20, measure) == 4


def test_stops_at_max_passes_and_runs_none_with_zero():
    measure, one_pass = _fake_peak([10 * MIB] * 30)
    assert settle(one_pass, 6, measure) == 6
    ran = []
    assert settle(ran.append, 0, measure) == 0 and ran == []


def test_peak_resident_bytes_counts_memory_written():
    before = peak_resident_bytes()
    keep = torch.ones(max(0, before // 4) + 64 * MIB // 4)  # past any earlier peak, every page written
    assert peak_resident_bytes() >= before + 60 * MIB and keep.numel() > 0


def test_minor_faults_count_the_pages_first_touched():
    # 16 MiB of fresh anonymous pages, written one byte per page: at least one fault each (4 KiB pages;
    # huge pages would fault fewer, so the test maps with none: MADV_NOHUGEPAGE where it exists)
    pages, page = 4096, mmap.PAGESIZE
    with mmap.mmap(-1, pages * page) as fresh:
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            fresh.madvise(mmap.MADV_NOHUGEPAGE)
        before = minor_faults()
        for i in range(0, pages * page, page):
            fresh[i] = 1
        grew = minor_faults() - before
        again = minor_faults()
        for i in range(0, pages * page, page):  # mapped now: no fault
            fresh[i] = 2
        assert pages <= grew < pages + 512 and minor_faults() - again < 64


def _grow_on_rank_one(rank: int, world: int) -> int:
    kept = []

    def one_pass(i: int) -> None:
        if rank == 1 and i < 3:  # only rank 1's heap grows, for 3 passes
            kept.append(torch.ones((peak_resident_bytes() + 16 * MIB) // 4))

    return settle(one_pass, 10)


def test_every_rank_runs_until_the_busiest_rank_settled():
    # rank 0 never grows, rank 1 grows for 3 passes: both run 4 (the largest growth over the ranks)
    assert run_on_ranks(_grow_on_rank_one, 2) == [4, 4]
