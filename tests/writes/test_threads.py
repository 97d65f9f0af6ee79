"""Many threads on one store: page files are written outside the lock, commits stay exact."""

from __future__ import annotations

import threading

import dss
from tests.conftest import LAYOUT


def payload(tag: int, index: int) -> bytes:
    return bytes([tag % 256, index % 256]) * (LAYOUT.page_bytes // 2)


def test_concurrent_commits_and_saves(store: dss.Store) -> None:
    store.create_session("shared", layout=LAYOUT)
    errors: list[BaseException] = []
    done: dict[int, list[int]] = {}

    def worker(n: int) -> None:
        try:
            own = f"own-{n}"
            store.create_session(own, layout=LAYOUT)
            tokens: list[int] = []
            for turn in range(12):
                tokens = tokens + [n * 1000 + turn * 10 + i for i in range(6)]
                full = len(tokens) // LAYOUT.page_tokens
                store.commit(own, tokens, {i: payload(n, i) for i in range(full)})
                common = [7, 7, 7, 7, n, turn, 1, 2]  # the same first page for every thread
                store.save_pages("shared", common, {0: payload(99, 0), 1: payload(n * 16 + turn, 1)})
                store.commit("shared", common)
            done[n] = tokens
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    for n, tokens in done.items():
        result = store.resume(f"own-{n}", tokens)
        full = len(tokens) // LAYOUT.page_tokens
        assert result.matched_tokens == full * LAYOUT.page_tokens
        assert store.read_pages(result.pages) == [payload(n, i) for i in range(full)]
    assert len(store.versions("shared")) == 6 * 12
    assert store.check() == []
    assert sorted(store.disk.files()) == sorted(r[0] for r in store.sql("SELECT name FROM segments").rows)
