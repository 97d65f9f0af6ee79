"""Reading pages into the caller's buffers (``read_pages(into=...)``): from host, from disk
sealed and plain, with exact contents; bad buffers refused before anything is read; a page
that fails verification is a miss whose buffer is never returned. ``ready`` is told each page
read once, as its buffer is filled: host hits first, then disk read by disk read."""

from __future__ import annotations

from pathlib import Path

import pytest

import dss
from dss.tiers.segment import IO_PAGES

LAYOUT = dss.Layout(name="r", page_tokens=4, page_bytes=64)
TOKENS = list(range(1, 25))  # 6 pages


LARGE = dss.Layout(name="large", page_tokens=4, page_bytes=300_000)
"""Pages large enough that a disk read holds at most IO_PAGES of them."""


def original(i: int, size: int = LAYOUT.page_bytes) -> bytes:
    return (bytes((i * 11 + j) % 251 for j in range(251)) * (size // 251 + 1))[:size]


def build(folder: Path, encrypt: bool, count: int = 6, layout: dss.Layout = LAYOUT) -> list[dss.PageRef]:
    tokens = list(range(1, 4 * count + 1))
    with dss.open(folder, encrypt=encrypt) as store:
        store.create_session("s", layout=layout)
        store.commit("s", tokens, {i: original(i, layout.page_bytes) for i in range(count)})
        return store.resume("s", tokens).pages


@pytest.mark.parametrize("encrypt", [True, False])
@pytest.mark.parametrize("host_bytes", [0, 1 << 20])
def test_pages_land_in_the_callers_buffers(tmp_path: Path, encrypt: bool, host_bytes: int) -> None:
    pages = build(tmp_path, encrypt)
    with dss.open(tmp_path, host_bytes=host_bytes) as store:
        store.read_pages(pages)  # with a host tier, the second read is served from it
        buffers = [bytearray(64) for _ in pages]
        got = store.read_pages(pages, into=buffers)
        assert [bytes(view) for view in got if view is not None] == [original(i) for i in range(6)]
        assert [bytes(b) for b in buffers] == [original(i) for i in range(6)]
        assert all(view is not None and view.obj is buffers[i] for i, view in enumerate(got))
        stats = store.stats()
        assert (stats["host"]["hits"] > 0) == (host_bytes > 0)


def test_bad_buffers_are_refused_before_anything_is_read(tmp_path: Path) -> None:
    pages = build(tmp_path, True)
    with dss.open(tmp_path, host_bytes=0) as store:
        before = store.stats()["disk"]["hits"]
        with pytest.raises(dss.InvalidInput, match="into must be a list of 6 writable buffers"):
            store.read_pages(pages, into=[bytearray(64)] * 5)
        with pytest.raises(dss.InvalidInput, match=r"into\[2\] must be a writable, contiguous buffer"):
            store.read_pages(pages, into=[bytearray(64), bytearray(64), b"x" * 64, *[bytearray(64)] * 3])
        with pytest.raises(dss.InvalidInput, match=r"into\[0\] must be a writable buffer, not int"):
            store.read_pages(pages, into=[0] * 6)
        short = [bytearray(64) for _ in range(5)] + [bytearray(63)]
        with pytest.raises(dss.InvalidInput, match="buffer 5 has 63 bytes; its page has 64"):
            store.read_pages(pages, into=short)
        assert short[0] == bytearray(64)  # nothing was read
        assert store.stats()["disk"]["hits"] == before


def test_a_page_that_fails_authentication_is_a_miss(tmp_path: Path) -> None:
    pages = build(tmp_path, True)
    (segment,) = (tmp_path / "segments").iterdir()
    data = bytearray(segment.read_bytes())
    data[-1] ^= 0x40  # the last page's tag
    segment.write_bytes(bytes(data))
    with dss.open(tmp_path, host_bytes=0) as store:
        told: list[int] = []
        got = store.read_pages(pages, into=[bytearray(64) for _ in pages], ready=told.extend)
        assert [v is None for v in got] == [False] * 5 + [True]
        assert [bytes(v) for v in got[:5] if v is not None] == [original(i) for i in range(5)]
        assert sorted(told) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("encrypt", [True, False])
def test_ready_hears_each_page_once_when_its_buffer_holds_it(tmp_path: Path, encrypt: bool) -> None:
    size = LARGE.page_bytes
    pages = build(tmp_path, encrypt, count=40, layout=LARGE)
    with dss.open(tmp_path, host_bytes=64 << 20) as store:
        store.read_pages(pages[30:])  # host holds the last ten
        buffers = [bytearray(size) for _ in pages]
        calls: list[list[int]] = []

        def ready(indexes: list[int]) -> None:
            assert all(bytes(buffers[i]) == original(i, size) for i in indexes)
            calls.append(list(indexes))

        got = store.read_pages(pages, into=buffers, ready=ready)
    assert all(view is not None for view in got)
    assert sorted(calls[0]) == list(range(30, 40))  # host's hits, at once
    assert len(calls) >= 3 and all(len(call) <= IO_PAGES for call in calls[1:])  # then each disk read's
    assert sorted(i for call in calls[1:] for i in call) == list(range(30))


def test_a_failing_ready_fails_the_read_and_changes_nothing_else(tmp_path: Path) -> None:
    pages = build(tmp_path, True)

    def ready(indexes: list[int]) -> None:
        raise RuntimeError("the caller's bug")

    with dss.open(tmp_path, host_bytes=0) as store:
        with pytest.raises(RuntimeError, match="the caller's bug"):
            store.read_pages(pages, into=[bytearray(64) for _ in pages], ready=ready)
        assert store.read_pages(pages) == [original(i) for i in range(6)]
        assert store.check() == []


def test_a_bad_ready_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    pages = build(tmp_path, True)
    with dss.open(tmp_path, host_bytes=0) as store:
        before = store.stats()["disk"]["hits"]
        with pytest.raises(dss.InvalidInput, match="ready is told which buffers are filled: give it with into"):
            store.read_pages(pages, ready=print)
        with pytest.raises(dss.InvalidInput, match="ready must be a function or None, not int"):
            store.read_pages(pages, into=[bytearray(64) for _ in pages], ready=3)
        assert store.stats()["disk"]["hits"] == before
