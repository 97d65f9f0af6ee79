"""The connector's background page writer, against a real embedded store (no engine needed)."""

from __future__ import annotations

import array
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from dss_adapters.vllm.settings import Scope
from dss_adapters.vllm.writer import PageWriter, WriteJob

import dss

LAYOUT = dss.Layout(name="vllm-test", page_tokens=4, page_bytes=16, model="tiny")
TOKENS = list(range(100, 112))  # three pages of four tokens


@pytest.fixture
def store(tmp_path: Path) -> Iterator[dss.Store]:
    store = dss.open(tmp_path / "store")
    yield store
    store.close()


def payload(*tags: int) -> np.ndarray:
    """One 16-byte row per page, every byte of row i equal to ``tags[i]``."""
    return np.array([[tag] * LAYOUT.page_bytes for tag in tags], dtype=np.uint8)


def job(req_id: str, scope: Scope, first_page: int, rows: np.ndarray, tokens: list[int] = TOKENS) -> WriteJob:
    return WriteJob(req_id, scope, array.array("I", tokens), first_page, rows)


def test_session_jobs_create_the_session_and_save_in_order(store: dss.Store) -> None:
    writer = PageWriter(store, LAYOUT, 1 << 20)
    scope = Scope("t", "u", "chat-1")
    writer.put(job("r1", scope, 0, payload(1, 2)))
    writer.put(job("r1", scope, 2, payload(3)))
    writer.flush()
    assert writer.take_done().saved == {"r1": 2}
    assert writer.take_done().saved == {}
    assert writer.num_pages_written == 3
    session = store.session("chat-1", tenant_id="t")
    assert (session.user_id, session.layout) == ("u", LAYOUT)
    result = store.resume("chat-1", TOKENS, tenant_id="t")
    assert result.matched_tokens == 12
    assert store.read_pages(result.pages) == [bytes([1]) * 16, bytes([2]) * 16, bytes([3]) * 16]
    writer.close()


def test_jobs_without_a_session_are_found_by_lookup_in_their_namespace_only(store: dss.Store) -> None:
    writer = PageWriter(store, LAYOUT, 1 << 20)
    writer.put(job("r1", Scope("t", "u", None), 0, payload(7, 8)))
    writer.close()
    assert writer.take_done().saved == {"r1": 1}
    found = store.lookup(TOKENS, layout=LAYOUT, user_id="u", tenant_id="t")
    assert found.matched_tokens == 8
    assert store.read_pages(found.pages) == [bytes([7]) * 16, bytes([8]) * 16]
    assert store.lookup(TOKENS, layout=LAYOUT, user_id="v", tenant_id="t").matched_tokens == 0


def test_a_session_of_another_owner_is_left_alone(store: dss.Store) -> None:
    store.create_session("chat-1", user_id="owner", tenant_id="t", layout=LAYOUT)
    writer = PageWriter(store, LAYOUT, 1 << 20)
    writer.put(job("r1", Scope("t", "intruder", "chat-1"), 0, payload(5)))
    writer.close()
    assert writer.take_done().saved == {"r1": 1}
    assert store.resume("chat-1", TOKENS, tenant_id="t").matched_tokens == 0
    assert store.lookup(TOKENS, layout=LAYOUT, user_id="intruder", tenant_id="t").matched_tokens == 4


def test_a_rejected_job_is_logged_counted_and_done(store: dss.Store, caplog: pytest.LogCaptureFixture) -> None:
    writer = PageWriter(store, LAYOUT, 1 << 20)
    writer.put(job("r1", Scope("t", "u", None), 0, payload(1, 2), tokens=TOKENS[:6]))  # page 1 is not full
    writer.put(job("r2", Scope("t", "u", None), 0, payload(9)))
    writer.close()
    assert writer.take_done().saved == {"r1": 1, "r2": 1}
    assert writer.num_failed_jobs == 1
    assert writer.num_pages_written == 1
    assert "saving 2 pages of request r1 failed: page index 1 is out of range" in caplog.text
    writer.raise_if_failed()


def test_an_unexpected_error_stops_the_writer_and_is_raised_in_the_engine_thread(store: dss.Store) -> None:
    writer = PageWriter(store, LAYOUT, 1 << 20)
    writer.put(WriteJob("r1", Scope("t", "u", None), array.array("I", TOKENS), 0, memoryview(b"x" * 16)))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="the dss-page-writer thread stopped") as info:
        writer.flush()
    assert isinstance(info.value.__cause__, AttributeError)
    with pytest.raises(RuntimeError):
        writer.put(job("r2", Scope("t", "u", None), 0, payload(1)))
    assert writer.take_done().saved == {}
    writer.close()
