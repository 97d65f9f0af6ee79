"""A page lives while some session holds it, until eviction, quarantine or erasure removes it.

Pages saved without a session (``save_pages(None, ...)``, the vLLM writer's path) are held
by the namespace's page-cache session. Once a page left the catalog (a full disk evicted it,
or it was quarantined), every session that held it must know, in every process: a session
that still believed it held the page would skip its reference when the page is stored
again, leaving a page no session references. ``check()`` must be ``[]`` after every step.

Sizes: pages of 64 bytes sealed into 92; a save of 2 pages writes a segment of
32 + 2 * (32 + 92) = 280 bytes; the disk holds 3 of them (900 bytes), and a 4th evicts
the oldest one (down to 95 %: 840 of 855 bytes).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import dss
from dss.core.crypto import OVERHEAD

LAYOUT = dss.Layout(name="life", page_tokens=4, page_bytes=64)
SEGMENT = 32 + 2 * (32 + OVERHEAD + 64)
DISK = 3 * SEGMENT + 60


def prompt(n: int) -> list[int]:
    return [n] * 8 + [99]


def payloads(n: int) -> dict[int, bytes]:
    return {i: bytes([n * 2 + i]) * 64 for i in range(2)}


def save(store: dss.Store, n: int, user_id: str = "u") -> int:
    """Save ``n`` pages without a session; how many were new."""
    return store.save_pages(None, prompt(n), payloads(n), tenant_id="t", user_id=user_id, layout=LAYOUT).num_new


def sound(*stores: dss.Store) -> None:
    """Every invariant holds, and every page row is held by some session."""
    for store in stores:
        assert store.check() == []
    unheld = "SELECT COUNT(*) FROM pages p WHERE NOT EXISTS (SELECT 1 FROM session_pages r WHERE r.page_id = p.page_id)"
    assert stores[0].sql(unheld).rows == [(0,)]


def page_count(store: dss.Store) -> int:
    return store.sql("SELECT COUNT(*) FROM pages").rows[0][0]


def test_sessionless_pages_stored_again_after_eviction_are_held(open_store: Callable[..., dss.Store]) -> None:
    store = open_store(disk_bytes=DISK)
    for n in range(4):
        assert save(store, n) == 2
        sound(store)
    assert page_count(store) == 6  # the 4th save evicted the 1st
    assert save(store, 0) == 2  # evicted: stored again (evicting the save of 1)
    sound(store)
    assert save(store, 1) == 2  # (evicting the save of 2)
    sound(store)
    assert page_count(store) == 6
    store.close()
    again = open_store(disk_bytes=DISK)
    found = again.lookup(prompt(1), layout=LAYOUT, user_id="u", tenant_id="t")
    assert (found.matched_tokens, found.tiers) == (8, {"disk": 8})
    assert again.read_pages(found.pages) == list(payloads(1).values())
    sound(again)


def test_a_commit_after_its_session_pages_were_evicted_holds_them_again(open_store: Callable[..., dss.Store]) -> None:
    store = open_store(disk_bytes=DISK)
    store.create_session("a", user_id="u", tenant_id="t", layout=LAYOUT)
    store.commit("a", prompt(0), payloads(0))
    for n in range(1, 4):  # one session each: a session's own earlier versions would be abandoned, and go first
        store.create_session(f"b{n}", user_id="u", tenant_id="t", layout=LAYOUT)
        store.commit(f"b{n}", prompt(n), payloads(n))
        sound(store)
    held_by_a = f"SELECT COUNT(*) FROM session_pages WHERE session_ref = {store.mirror.state('a', 't').ref}"
    assert store.sql(held_by_a).rows == [(0,)]  # a's pages were evicted
    store.commit("a", prompt(0) + [7], payloads(0))
    sound(store)
    assert store.sql(held_by_a).rows == [(2,)]
    assert store.delete_session("b3") == 2  # the pages of b3's version; a's stay
    sound(store)
    assert store.resume("a", prompt(0)).matched_tokens == 8


def test_a_page_quarantined_then_stored_again_is_held(tmp_path: Path) -> None:
    with dss.open(tmp_path / "s", host_bytes=0) as store:
        save(store, 0)  # this handle caches the page-cache session, holding both pages
        (segment,) = (tmp_path / "s" / "segments").iterdir()
        data = bytearray(segment.read_bytes())
        data[-1] ^= 0x40  # last payload byte of page 1
        segment.write_bytes(bytes(data))
        found = store.lookup(prompt(0), layout=LAYOUT, user_id="u", tenant_id="t")
        assert store.read_pages(found.pages) == [payloads(0)[0], None]
        assert store.sql("SELECT COUNT(*) FROM quarantine").rows == [(1,)]
        sound(store)
        assert save(store, 0) == 1
        sound(store)
        assert page_count(store) == 2


def test_another_handle_evicting_a_cached_session_pages(open_store: Callable[..., dss.Store]) -> None:
    """Two handles share only the folder and the catalog, as two processes do."""
    a, b = open_store(disk_bytes=DISK), open_store(disk_bytes=DISK)
    save(a, 0)  # a caches the page-cache session and believes it holds these pages
    for n in range(1, 4):
        save(b, n, user_id="w")  # another namespace: a's session is not touched, but its pages are evicted
        sound(a, b)
    assert save(a, 0) == 2
    sound(a, b)
    assert save(b, 1, user_id="w") == 2
    sound(a, b)
    assert page_count(a) == 6


def test_deleting_sessions_that_share_pages_and_erasing_another_user(open_store: Callable[..., dss.Store]) -> None:
    store = open_store(disk_bytes=DISK)
    store.create_session("s", user_id="u", tenant_id="t", layout=LAYOUT)
    store.commit("s", prompt(0), payloads(0))
    assert save(store, 0) == 0  # the page cache shares the session's pages
    sound(store)
    assert store.delete_session("s") == 0  # the page cache still holds them
    sound(store)
    save(store, 1, user_id="v")
    evicted = {
        bytes(r[0])
        for r in store.sql("SELECT p.page_id FROM pages p JOIN users u ON u.id = p.user_ref WHERE u.user_id = 'v'").rows
    }
    assert len(evicted) == 2
    for n in range(2, 5):
        save(store, n)  # evicts v's pages and u's of save 2 (u's first pages, stored twice, are used the most)
        sound(store)
    assert page_count(store) == 6
    receipt = store.forget_user("v", tenant_id="t")
    assert receipt.verification.ok is True
    sound(store)
    feed = {bytes(r[0]) for r in store.sql("SELECT page_id FROM feed WHERE page_id IS NOT NULL").rows}
    assert not feed & evicted  # the eviction's feed rows went with v's namespace
    assert save(store, 2) == 2
    sound(store)


def test_a_real_second_process_evicts_while_this_one_caches(tmp_path: Path, catalog_url: str | None) -> None:
    folder = tmp_path / "store"
    with dss.open(folder, catalog_url=catalog_url, disk_bytes=DISK, mover=False) as store:
        save(store, 0)
        script = textwrap.dedent(f"""
            import dss
            layout = dss.Layout(name="life", page_tokens=4, page_bytes=64)
            with dss.open({str(folder)!r}, catalog_url={catalog_url!r}, disk_bytes={DISK}, mover=False) as store:
                for n in range(1, 4):
                    store.save_pages(None, [n] * 8 + [99], {{i: bytes([n * 2 + i]) * 64 for i in range(2)}},
                                     tenant_id="t", user_id="w", layout=layout)
                assert store.check() == [], store.check()
        """)
        subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
        sound(store)
        assert page_count(store) == 6
        assert save(store, 0) == 2
        sound(store)
