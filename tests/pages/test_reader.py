"""Reading pages into the caller's buffers (``read_pages(into=...)``): from host, from disk
sealed and plain, with exact contents; bad buffers refused before anything is read; a page
that fails verification is a miss whose buffer is never returned."""

from __future__ import annotations

from pathlib import Path

import pytest

import dss

LAYOUT = dss.Layout(name="r", page_tokens=4, page_bytes=64)
TOKENS = list(range(1, 25))  # 6 pages


def original(i: int) -> bytes:
    return bytes((i * 11 + j) % 251 for j in range(LAYOUT.page_bytes))


def build(folder: Path, encrypt: bool) -> list[dss.PageRef]:
    with dss.open(folder, encrypt=encrypt) as store:
        store.create_session("s", layout=LAYOUT)
        store.commit("s", TOKENS, {i: original(i) for i in range(6)})
        return store.resume("s", TOKENS).pages


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
        got = store.read_pages(pages, into=[bytearray(64) for _ in pages])
        assert [v is None for v in got] == [False] * 5 + [True]
        assert [bytes(v) for v in got[:5] if v is not None] == [original(i) for i in range(5)]
