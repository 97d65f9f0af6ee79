"""Compaction: sparse segment files are rewritten, dead bytes stop counting, no page is lost.

The scenario (:func:`build`): session ``a`` commits 10 pages (one segment of 10 records);
session ``b`` shares a's first 3 pages and adds one (a second segment of 1 record). Deleting
``a`` leaves 7 of the first segment's 10 records dead: 868 of its 1272 bytes, 68 %, so it is
sparse at the default ``compact_dead_share`` (0.5); the second segment (no dead record) is not.
Sealed records are 32 (record header) + 64 (payload) + 28 (nonce and tag) = 124 bytes; a
segment's header is 32 (``tier_usage.dead_bytes`` counts headers too, sparseness does not).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

import dss
from dss.catalog.change import Change
from dss.cli.main import main
from dss.core.types import PageId

LAYOUT = dss.Layout(name="compact", page_tokens=4, page_bytes=64, model="tiny", dtype="int8")
A = list(range(100, 140))  # 10 pages
B = A[:12] + [7, 8, 9, 10]  # a's pages 0..2, and one of its own
RECORD = 32 + 64 + 28
SEG_A, SEG_B = 32 + 10 * RECORD, 32 + RECORD
COMPACTED = 32 + 3 * RECORD  # the new file: b's three pages from a's segment


def payload(tokens: list[int], i: int) -> bytes:
    return bytes([(tokens[i * 4] + i) % 256]) * 64


def pages(tokens: list[int]) -> dict[int, bytes]:
    return {i: payload(tokens, i) for i in range(len(tokens) // 4)}


def build(store: dss.Store) -> None:
    store.create_session("a", layout=LAYOUT)
    store.commit("a", A, pages(A))
    store.create_session("b", layout=LAYOUT)
    store.commit("b", B, pages(B))


def usage(store: dss.Store) -> tuple:
    return store.sql("SELECT tier, num_segments, bytes, num_pages, live_bytes, dead_bytes FROM tier_usage").rows[0]


def b_reads_back(store: dss.Store) -> bool:
    result = store.resume("b", B)
    return result.matched_tokens == 16 and store.read_pages(result.pages) == [payload(B, i) for i in range(4)]


def test_compaction_frees_dead_bytes_and_keeps_every_page(open_store: Callable[..., dss.Store]) -> None:
    store = open_store(compact_auto=False)
    build(store)
    store.delete_session("a")
    assert usage(store) == ("disk", 2, SEG_A + SEG_B, 4, 4 * RECORD, SEG_A + SEG_B - 4 * RECORD)
    files = store.disk.files()
    plan = store.compact(dry_run=True)
    assert plan == dss.Compaction(True, 1, 1, 3, SEG_A + SEG_B, COMPACTED + SEG_B, 0)
    assert store.disk.files() == files  # a dry run changes nothing
    done = store.compact()
    assert done == dss.Compaction(False, 1, 1, 3, SEG_A + SEG_B, COMPACTED + SEG_B, 0)
    assert done.freed_bytes == SEG_A - COMPACTED == 868
    assert usage(store) == ("disk", 2, COMPACTED + SEG_B, 4, 4 * RECORD, 64)
    assert sorted(store.disk.files().values()) == sorted([COMPACTED, SEG_B])
    assert store.stats()["disk"]["bytes"] == COMPACTED + SEG_B
    assert b_reads_back(store)
    assert store.compact() == dss.Compaction(False, 0, 0, 0, COMPACTED + SEG_B, COMPACTED + SEG_B, 0)
    store.close()
    store = open_store(compact_auto=False, compact_dead_share=0.01)  # a compacted file has no dead record
    assert store.compact(dry_run=True).segments == 0
    assert store.check() == []
    other = open_store()  # another handle reads the new locations from the catalog
    other.host.discard(other.host.ids())
    assert b_reads_back(other) and other.check() == []


def test_deleting_a_session_compacts_by_itself(open_store: Callable[..., dss.Store]) -> None:
    store = open_store()
    build(store)
    assert store.delete_session("a") == 7
    assert usage(store) == ("disk", 2, COMPACTED + SEG_B, 4, 4 * RECORD, 64)
    assert b_reads_back(store) and store.check() == []


def test_a_full_disk_compacts_before_it_evicts(open_store: Callable[..., dss.Store]) -> None:
    store = open_store(compact_auto=False)
    build(store)
    store.delete_session("a")
    store.close()
    c = [50, 51, 52, 53] * 4  # 4 new pages: a segment of 32 + 4 * 124 = 528 bytes
    store = open_store(disk_bytes=1600)  # 1428 + 528 would not fit; 560 + 528 does
    store.create_session("c", layout=LAYOUT)
    store.commit("c", c, pages(c))
    assert usage(store)[1:3] == (3, COMPACTED + SEG_B + 32 + 4 * 124)
    assert b_reads_back(store)  # nothing of b was evicted
    assert store.resume("c", c).tiers == {"host": 16}
    assert store.sql("SELECT COUNT(*) FROM quarantine").rows == [(0,)]
    assert store.check() == []


def test_a_page_moved_under_a_reader_is_a_miss_not_quarantined(open_store: Callable[..., dss.Store]) -> None:
    """A process that read a page's old location just before another compacted it finds the
    old file gone: that read misses, but the page is not quarantined and reads back next time."""
    writer = open_store(compact_auto=False)
    build(writer)
    reader = open_store(host_bytes=1)  # no page fits its host tier: every read goes to disk
    ids = [PageId(p.page_id) for p in reader.resume("b", B).pages]
    assert reader.read_pages(ids) == [payload(B, i) for i in range(4)]
    writer.delete_session("a")
    writer.compact()
    with reader.guard.lock:  # read as if the compaction happened right after the reader caught up
        stale = reader.reader.read(ids)
    assert stale.payloads == [None, None, None, payload(B, 3)]
    assert len(stale.bad) == 3
    reader.writer.apply(Change(quarantine=tuple(stale.bad)))
    assert reader.sql("SELECT COUNT(*) FROM quarantine").rows == [(0,)]
    assert reader.read_pages(ids) == [payload(B, i) for i in range(4)]
    assert reader.check() == [] and writer.check() == []


def test_a_corrupt_record_is_quarantined_by_compaction(open_store: Callable[..., dss.Store]) -> None:
    store = open_store(compact_auto=False, encrypt=False)
    build(store)
    store.delete_session("a")
    store.host.discard(store.host.ids())
    where = store.index.entries[PageId(store.resume("b", B).pages[1].page_id)].disk
    assert where is not None
    offset = where.offset
    path = store.disk.segments_dir / where.segment
    data = bytearray(path.read_bytes())
    data[offset + 40] ^= 0xFF  # a payload byte of b's page 1
    path.write_bytes(bytes(data))
    done = store.compact()
    assert (done.segments, done.pages, done.quarantined) == (1, 2, 1)
    reason = store.sql("SELECT reason FROM quarantine").rows[0][0]
    assert "fails its checksum" in reason
    result = store.resume("b", B)
    assert result.matched_tokens == 4  # page 0 only: page 1 is gone
    assert store.check() == []


@pytest.mark.parametrize("share", [0, -0.5, 1.5, float("nan"), "half"])
def test_a_nonsensical_dead_share_is_a_config_error(tmp_path: Path, share: object) -> None:
    with pytest.raises(dss.ConfigError, match="compact_dead_share"):
        dss.open(tmp_path / "s", compact_dead_share=share)


def test_dss_compact(tmp_path: Path) -> None:
    home = str(tmp_path / "h")
    with dss.open(home, compact_auto=False) as store:
        build(store)
        store.delete_session("a")
    runner = CliRunner()
    dry = runner.invoke(main, ["--home", home, "compact", "--dry-run", "--json"])
    assert dry.exit_code == 0 and json.loads(dry.output) == {
        "dry_run": True,
        "segments": 1,
        "new_segments": 1,
        "pages": 3,
        "bytes_before": SEG_A + SEG_B,
        "bytes_after": COMPACTED + SEG_B,
        "quarantined": 0,
        "freed_bytes": 868,
    }
    refused = runner.invoke(main, ["--home", home, "compact"])
    assert refused.exit_code == 1 and "refusing to compact without --yes" in refused.output
    done = runner.invoke(main, ["--home", home, "compact", "--yes"])
    assert (done.exit_code, done.output) == (
        0,
        f"rewrote 1 page files into 1 (3 pages): {SEG_A + SEG_B} -> {COMPACTED + SEG_B} bytes on disk, 868 freed\n",
    )
    again = runner.invoke(main, ["--home", home, "compact"])
    assert (again.exit_code, again.output) == (
        0,
        f"nothing to compact: no page file is sparse ({COMPACTED + SEG_B} bytes on disk)\n",
    )
    with dss.open(home) as store:
        assert b_reads_back(store) and store.check() == []
