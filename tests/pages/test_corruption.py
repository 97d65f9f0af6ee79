"""Corrupted page files: every read detects the damage, counts a miss, quarantines the page.

No read may ever return bytes other than those committed.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import sqlalchemy as sa

import dss
from dss.tiers import disk

LAYOUT = dss.Layout(name="c", page_tokens=4, page_bytes=64)
TOKENS = list(range(1, 41))  # 10 pages


def original(i: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(LAYOUT.page_bytes))


@pytest.fixture(params=["copied", "mapped"])
def reads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A page-file test that uses this runs twice: with page files copied out of the page cache (``pread``, what
    runs of these small pages get) and mapped from it (every run, however small)."""
    if request.param == "mapped":
        monkeypatch.setattr(disk, "MAP_BYTES", 0)


def build(folder: Path) -> None:
    with dss.open(folder) as store:
        store.create_session("s", layout=LAYOUT)
        store.commit("s", TOKENS, {i: original(i) for i in range(10)})


def segment(folder: Path) -> Path:
    files = list((folder / "segments").iterdir())
    assert len(files) == 1
    return files[0]


def location(store: dss.Store, index: int) -> tuple[int, int]:
    ((offset, length),) = store.sql(
        'SELECT l."offset", l.length FROM page_locations l JOIN pages p ON p.page_id = l.page_id '
        "WHERE p.page_index = :i",
        {"i": index},
    ).rows
    return offset, length


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.usefixtures("reads")
def test_flipped_payload_byte_is_a_miss_and_quarantined(tmp_path: Path) -> None:
    build(tmp_path)
    with dss.open(tmp_path) as store:
        offset, length = location(store, 3)
        flip(segment(tmp_path), offset + length - 1)  # last payload byte of page 3
        result = store.resume("s", TOKENS)
        assert result.matched_tokens == 40  # not known to be bad until read
        got = store.read_pages(result.pages)
        assert got == [original(i) if i != 3 else None for i in range(10)]
        quarantined = store.sql("SELECT tier, reason FROM quarantine").rows
        # sealed records are authenticated by their AES-GCM tag (not hashed a second time)
        assert quarantined == [("disk", quarantined[0][1])] and "fails authentication" in quarantined[0][1]
        assert store.resume("s", TOKENS).matched_tokens == 12  # pages 0..2 only
        assert store.check() == []


@pytest.mark.usefixtures("reads")
def test_a_plaintext_page_with_a_flipped_byte_fails_its_checksum(tmp_path: Path) -> None:
    with dss.open(tmp_path, encrypt=False) as store:
        store.create_session("s", layout=LAYOUT)
        store.commit("s", TOKENS, {i: original(i) for i in range(10)})
    with dss.open(tmp_path, encrypt=False) as store:
        offset, length = location(store, 3)
        flip(segment(tmp_path), offset + length - 1)
        assert store.read_pages(store.resume("s", TOKENS).pages) == [original(i) if i != 3 else None for i in range(10)]
        assert "fails its checksum" in store.sql("SELECT reason FROM quarantine").rows[0][0]
        assert store.check() == []


@pytest.mark.usefixtures("reads")
def test_a_sealed_record_whose_flag_is_cleared_is_never_served_as_plaintext(tmp_path: Path) -> None:
    """The flags are outside the checksum: a sealed record flagged plain would pass it, and its
    ciphertext be served as KV; its length (page plus nonce and tag) gives it away."""
    build(tmp_path)
    with dss.open(tmp_path) as store:
        offset, _ = location(store, 6)
        path = segment(tmp_path)
        data = bytearray(path.read_bytes())
        data[offset + 20] &= 0xFE  # flags (u32 after the 16-byte id and the u32 length): sealed bit off
        path.write_bytes(bytes(data))
        got = store.read_pages(store.resume("s", TOKENS).pages)
        assert got == [original(i) if i != 6 else None for i in range(10)]
        assert "wrong length for its flags" in store.sql("SELECT reason FROM quarantine").rows[0][0]
        assert store.check() == []


@pytest.mark.usefixtures("reads")
def test_flipped_header_byte_is_detected(tmp_path: Path) -> None:
    build(tmp_path)
    with dss.open(tmp_path) as store:
        offset, _ = location(store, 5)
        flip(segment(tmp_path), offset + 2)  # inside the page id of page 5's record
        got = store.read_pages(store.resume("s", TOKENS).pages)
        assert got == [original(i) if i != 5 else None for i in range(10)]
        assert "another page" in store.sql("SELECT reason FROM quarantine").rows[0][0]


@pytest.mark.usefixtures("reads")
def test_truncated_file_loses_only_the_pages_past_the_cut(tmp_path: Path) -> None:
    build(tmp_path)
    with dss.open(tmp_path) as store:
        offset, _ = location(store, 6)
        path = segment(tmp_path)
        size = path.stat().st_size
        with open(path, "r+b") as f:
            f.truncate(offset + 10)  # page 6 torn, 7..9 gone
        got = store.read_pages(store.resume("s", TOKENS).pages)
        assert got == [original(i) if i < 6 else None for i in range(10)]
        assert store.sql("SELECT COUNT(*) FROM quarantine").rows == [(4,)]
        assert store.resume("s", TOKENS).matched_tokens == 24
        assert store.check() == [f"page file {path.name} has {offset + 10} bytes, the catalog says {size}"]


@pytest.mark.usefixtures("reads")
def test_missing_file_is_a_miss(tmp_path: Path) -> None:
    build(tmp_path)
    with dss.open(tmp_path) as store:
        segment(tmp_path).unlink()
        assert store.read_pages(store.resume("s", TOKENS).pages) == [None] * 10
        assert store.resume("s", TOKENS).matched_tokens == 0
        assert store.check() == []


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.usefixtures("reads")
def test_random_damage_never_returns_wrong_bytes(tmp_path: Path, seed: int) -> None:
    build(tmp_path)
    rng = random.Random(seed)
    path = segment(tmp_path)
    data = bytearray(path.read_bytes())
    for _ in range(rng.randrange(1, 6)):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    if rng.random() < 0.3:
        del data[rng.randrange(len(data)) :]
    path.write_bytes(bytes(data))
    with dss.open(tmp_path) as store:
        refs = store.resume("s", TOKENS).pages
        got = store.read_pages(refs)
        for ref, payload in zip(refs, got):
            assert payload is None or payload == original(ref.index)
        bad = sum(p is None for p in got)
        assert store.sql("SELECT COUNT(*) FROM quarantine").rows == [(bad,)]
        assert store.read_pages(refs) == got  # asked again: same answer, nothing new quarantined
        assert store.sql("SELECT COUNT(*) FROM quarantine").rows == [(bad,)]


# -- a damaged catalog: a typed error from every call, and check() names the damage -------------


SESSION = dss.Layout(name="rows", page_tokens=4, page_bytes=16)


def two_users(open_store) -> dss.Store:
    """Sessions 's' of user 'u' and 'o' of user 'o', each with one version and two pages."""
    store = open_store()
    for session_id, user_id in (("s", "u"), ("o", "o")):
        store.create_session(session_id, user_id=user_id, tenant_id="t", layout=SESSION)
        store.commit(session_id, TOKENS[:8], {0: bytes(16), 1: bytes([1]) * 16})
    return store


def damage(store: dss.Store, statement: str, **params: object) -> None:
    """Change catalog rows behind dss's back, as a failing disk or a careless operator would."""
    with store.catalog.engine.begin() as conn:
        conn.execute(sa.text(statement), params)


def refused(store: dss.Store, message: str) -> None:
    """Every call that needs the damaged rows raises ``CatalogCorrupt`` with ``message``."""
    for call in (
        lambda: store.session("s"),
        lambda: store.resume("s", TOKENS),
        lambda: store.tokens("s"),
        lambda: store.commit("s", TOKENS),
        lambda: store.versions("s"),
    ):
        with pytest.raises(dss.CatalogCorrupt, match=re.escape(message)):
            call()


def test_a_token_history_that_does_not_authenticate(open_store) -> None:
    store = two_users(open_store)
    damage(
        store,
        "UPDATE versions SET suffix = :junk WHERE session_ref = :ref",
        junk=bytes(range(60)),
        ref=store.mirror.state("s", "t").ref,
    )
    store = open_store()  # a fresh handle reads the damaged rows
    message = "a token history or label of session 's' (tenant 't') does not authenticate: the catalog row is damaged"
    refused(store, message)
    assert store.check() == [message]
    assert store.resume("o", TOKENS).matched_tokens == 8  # the other user's session is sound


def test_a_data_key_that_does_not_authenticate(open_store) -> None:
    store = two_users(open_store)
    ((user_ref,),) = store.sql("SELECT id FROM users WHERE user_id = 'u'").rows
    damage(store, "UPDATE user_keys SET wrapped = :junk WHERE user_ref = :ref", junk=bytes(60), ref=user_ref)
    store = open_store()
    message = (
        f"the data key of namespace {user_ref} does not authenticate under the master key: the catalog row is damaged"
    )
    refused(store, message)
    assert store.check() == [message]
    assert store.resume("o", TOKENS).matched_tokens == 8


@pytest.mark.parametrize(
    "spec, reason",
    [
        ("{not json", "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
        ("[1, 2]", "a layout must be a mapping of field names to values, not list"),
        (
            '{"name": "rows", "page_tokens": 4, "page_bytes": 16, "scale": NaN}',
            "layout field 'scale' must be a finite number, got nan",
        ),
    ],
)
def test_a_layout_row_that_does_not_decode(open_store, spec: str, reason: str) -> None:
    store = two_users(open_store)
    damage(store, "UPDATE layouts SET spec = :spec", spec=spec)
    store = open_store()
    message = f"layout 1 in the catalog does not decode ({reason}): the row is damaged"
    refused(store, message)
    with pytest.raises(dss.CatalogCorrupt, match=re.escape(message)):
        store.sessions()
    assert store.check() == [message]


def test_an_audit_receipt_that_does_not_decode(open_store) -> None:
    store = two_users(open_store)
    store.forget_user("nobody", tenant_id="t")
    damage(store, "UPDATE audit SET receipt = '{oops'")
    with pytest.raises(dss.CatalogCorrupt, match="a catalog row does not decode"):
        store.audit()
    assert store.check() == ["audit receipt 1 does not decode: the row is damaged"]


def test_a_damaged_catalog_file(tmp_path: Path) -> None:
    folder = tmp_path / "s"
    build(folder)
    store = dss.open(folder)
    path = folder / "catalog.db"
    size = path.stat().st_size
    with open(path, "r+b") as f:  # everything after the first database page
        f.seek(4096)
        f.write(b"\xff" * (size - 4096))
    assert store.check() == ["the catalog cannot be read: database disk image is malformed"]
    with pytest.raises(dss.CatalogCorrupt, match="the catalog database is damaged: database disk image is malformed"):
        store.sessions()
    store.close()
    with pytest.raises(dss.CatalogCorrupt, match="the catalog database is damaged: database disk image is malformed"):
        dss.open(folder)
    path.write_bytes(b"not a database" * 100)
    with pytest.raises(dss.CatalogCorrupt, match="the catalog database is damaged: file is not a database"):
        dss.open(folder)
