"""forget_user: plan, receipt, audit, raw-byte canaries, shared prefixes, the key destroyed first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import dss
from dss.catalog import erasures as erasure_rows
from dss.core.tokens import pack
from dss.erasure.documents import Check

LAYOUT = dss.Layout(name="e", page_tokens=8, page_bytes=256)
CANARY_TOKENS = [0xC0FFEE00 + i for i in range(64)]  # 8 pages; distinctive as packed bytes


def canary_page(i: int) -> bytes:
    return (b"CANARY-PAGE-%03d-" % i) * 16


def other_page(i: int) -> bytes:
    return (b"bob-page-%03d----" % i) * 16


def populate(store: dss.Store) -> None:
    """alice: 3 sessions on disk and host sharing an 8-page prefix (so 8 + 3 pages), one with a
    rollback and a branch; bob: 2 sessions of 8 pages each."""
    for n in range(3):
        store.create_session(f"alice-{n}", user_id="alice", tenant_id="acme", layout=LAYOUT)
        tokens = CANARY_TOKENS + [n] * 8
        store.commit(f"alice-{n}", tokens, {i: canary_page(i + 8 * n) for i in range(9)})
    v1 = store.versions("alice-0")[0].version_id
    store.commit("alice-0", CANARY_TOKENS + [7] * 16)
    store.rollback("alice-0", v1)
    store.branch("alice-0", v1, "alice-fork")
    for n in range(2):
        store.create_session(f"bob-{n}", user_id="bob", tenant_id="acme", layout=LAYOUT)
        tokens = [100 + n] * 64
        store.commit(f"bob-{n}", tokens, {i: other_page(i + 8 * n) for i in range(8)})


FIND = """
import json, pathlib, sys
folder, needles = json.loads(sys.stdin.read())
needles = [bytes.fromhex(n) for n in needles]
files = [p for p in pathlib.Path(folder).rglob("*") if p.is_file()]
print(json.dumps(sorted(str(p) for p in files if any(n in p.read_bytes() for n in needles))))
"""


def found(folder: Path, needles: list[bytes]) -> list[str]:
    """The files under ``folder`` holding any of ``needles``, read by a child process: a process
    with the store open must not open the catalog's files itself (closing one drops its locks)."""
    done = subprocess.run(
        [sys.executable, "-c", FIND],
        input=json.dumps([str(folder), [n.hex() for n in needles]]),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return json.loads(done.stdout)


NEEDLES = [canary_page(i)[:32] for i in (*range(9), 16, 24)] + [
    pack(CANARY_TOKENS)[i : i + 32] for i in range(0, 224, 32)
]


def test_plan_receipt_and_audit(store: dss.Store) -> None:
    populate(store)
    plan = store.forget_user("alice", tenant_id="acme", dry_run=True)
    assert {k: getattr(plan, k) for k in ("user_known", "key_present", "sessions", "versions", "pages")} == {
        "user_known": True,
        "key_present": True,
        "sessions": 4,
        "versions": 5,
        "pages": 11,
    }
    assert plan.tiers["disk"].pages == 11 and plan.tiers["disk"].files == 3
    assert plan.tiers["host"].model_dump(exclude_none=True) == {"pages": 11, "bytes": 11 * 256}
    assert len(store.sessions()) == 6  # a dry run changes nothing
    receipt = store.forget_user("alice", tenant_id="acme")
    assert {k: getattr(receipt, k) for k in ("kind", "tenant_id", "user_id", "user_known", "key_destroyed")} == {
        "kind": "forget-user",
        "tenant_id": "acme",
        "user_id": "alice",
        "user_known": True,
        "key_destroyed": True,
    }
    assert receipt.removed.model_dump(exclude_none=True) == {
        "sessions": 4,
        "versions": 5,
        "pages": 11,
        "tiers": {
            "disk": {"pages": 11, "bytes": plan.tiers["disk"].bytes, "files": 3},
            "host": {"pages": 11, "bytes": 11 * 256},
        },
    }
    assert receipt.status == "verified" and receipt.verification is not None
    assert receipt.verification.ok and [c.name for c in receipt.verification.checks] == [
        "catalog rows",
        "page files",
        "host tier",
        "catalog files",
        "lsh index",
    ]
    assert len(receipt.page_ids_sha256) == 64
    (entry,) = store.audit()
    assert entry.receipt == receipt and entry.user_id == "alice"
    assert [s.session_id for s in store.sessions()] == ["bob-0", "bob-1"]
    assert store.resume("bob-1", [101] * 64).matched_tokens == 64
    assert store.read_pages(store.resume("bob-1", [101] * 64).pages)[0] == other_page(8)
    assert store.check() == []
    again = store.forget_user("alice", tenant_id="acme")  # nothing left: a receipt that says so
    assert (again.status, again.user_known, again.removed.pages, again.verification) == ("no_such_user", False, 0, None)
    assert [e.receipt.status for e in store.audit()] == ["verified", "no_such_user"]


def test_forget_user_names_its_tenant(store: dss.Store) -> None:
    populate(store)
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'tenant_id'"):
        store.forget_user("alice")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'tenant_id'"):
        store.forget_user("alice", dry_run=True)  # type: ignore[call-arg]
    with pytest.raises(dss.InvalidInput, match="tenant_id must be a printable string"):
        store.forget_user("alice", tenant_id="")
    assert store.audit() == [] and len(store.sessions()) == 6


def test_forget_user_of_no_such_user_is_a_distinct_receipt_and_audit_row(store: dss.Store) -> None:
    """alice exists in tenant acme only: erasing her in tenant default finds no such user, says
    so in the plan, the receipt and the audit row (never "verified"), and erases nothing."""
    populate(store)
    plan = store.forget_user("alice", tenant_id="default", dry_run=True)
    assert (plan.tenant_id, plan.user_known, plan.key_present, plan.sessions, plan.pages) == (
        "default",
        False,
        False,
        0,
        0,
    )
    receipt = store.forget_user("alice", tenant_id="default")
    assert receipt.model_dump(exclude={"started_at", "finished_at"}, exclude_none=True) == {
        "kind": "forget-user",
        "erasure_id": 1,
        "tenant_id": "default",
        "user_id": "alice",
        "status": "no_such_user",
        "user_known": False,
        "key_destroyed": False,
        "removed": {"sessions": 0, "versions": 0, "pages": 0, "tiers": {}},
        "page_ids_sha256": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    }
    (entry,) = store.audit()
    assert (entry.tenant_id, entry.user_id, entry.receipt) == ("default", "alice", receipt)
    with store.catalog.read() as conn:
        assert (erasure_rows.job(conn, 1).state, erasure_rows.open_jobs(conn)) == ("no_such_user", [])
    assert len(store.sessions(tenant_id="acme")) == 6 and store.check() == []


@pytest.mark.parametrize("encrypt", [True, False], ids=["sealed", "plaintext"])
def test_canaries_leave_no_byte_in_the_store_folder(tmp_path: Path, encrypt: bool) -> None:
    folder = tmp_path / "store"
    with dss.open(folder, encrypt=encrypt) as store:
        populate(store)
        with store.catalog.engine.connect() as conn:  # sql() may not read user_keys
            (wrapped,) = conn.exec_driver_sql(
                "SELECT k.wrapped FROM user_keys k JOIN users u ON u.id = k.user_ref WHERE u.user_id = 'alice'"
            ).one()
        alice_files = [
            folder / "segments" / name
            for (name,) in store.sql(
                "SELECT g.name FROM segments g JOIN users u ON u.id = g.user_ref WHERE u.user_id = 'alice'"
            ).rows
        ]
        ciphertext = [f.read_bytes()[100:132] for f in alice_files]
        if encrypt:
            assert found(folder, NEEDLES) == []  # sealed at rest: no plaintext ever
        else:
            assert found(folder, NEEDLES)  # the scan does find plaintext where it is
        store.forget_user("alice", tenant_id="acme")
        assert found(folder, NEEDLES + ciphertext + [wrapped, b"alice-fork"]) == []
        assert all(not f.exists() for f in alice_files)
        assert store.resume("bob-0", [100] * 64).matched_tokens == 64
        assert store.check() == []


def test_shared_prefix_pages_stay_and_user_pages_go(store: dss.Store) -> None:
    system = list(range(5000, 5032))  # 4 pages, registered by the operator
    store.register_prefix(system, {i: other_page(90 + i) for i in range(4)}, layout=LAYOUT, tenant_id="acme")
    store.create_session("a", user_id="alice", tenant_id="acme", layout=LAYOUT)
    tokens = system + CANARY_TOKENS
    assert store.resume("a", tokens).matched_tokens == 32  # the shared prefix
    store.commit("a", tokens, {i: canary_page(i) for i in range(4, 12)})  # alice's own pages only
    assert store.resume("a", tokens + [1]).matched_tokens == 96
    receipt = store.forget_user("alice", tenant_id="acme")
    assert receipt.removed.pages == 8
    store.create_session("b", user_id="bob", tenant_id="acme", layout=LAYOUT)
    result = store.resume("b", tokens)
    assert result.matched_tokens == 32
    assert store.read_pages(result.pages) == [other_page(90 + i) for i in range(4)]
    assert store.check() == []


def first_step(store: dss.Store, user_id: str, tenant_id: str) -> int:
    """Start an erasure job and run only its first step (the key is destroyed); return its id."""
    from dss.catalog import erasures, namespaces
    from dss.catalog.database import now
    from dss.erasure.documents import Job
    from dss.erasure.job import _plan

    with store.catalog.write() as tx:
        user_ref = namespaces.find_user(tx.conn, tenant_id, user_id)
        job = Job(**_plan(tx.conn, tenant_id, user_id, user_ref).model_dump(), started_at=now().isoformat())
        job_id = erasures.insert_job(tx.conn, tenant_id, user_id, user_ref, job.model_dump_json())
    with store.catalog.read() as conn:
        row = erasures.job(conn, job_id)
    store.eraser._destroy_key(row, job)
    return job_id


def test_key_goes_first_and_blocks_the_user_until_done(store: dss.Store) -> None:
    populate(store)
    refs = store.resume("alice-1", CANARY_TOKENS).pages
    other = dss.open(store.config.home, catalog_url=store.config.catalog_url)  # opening finishes open jobs
    job = first_step(store, "alice", "acme")  # only the first step: the key is gone
    try:
        assert other.read_pages(refs) == [None] * len(refs)  # nothing readable, though the files are there
        with pytest.raises(dss.ErasureInProgress):
            other.tokens("alice-1", tenant_id="acme")
        with pytest.raises(dss.ErasureInProgress):
            other.create_session("new", user_id="alice", tenant_id="acme", layout=LAYOUT)
        with pytest.raises(dss.ErasureInProgress):  # this process made sessions there: its commit group checks too
            store.create_session("new", user_id="alice", tenant_id="acme", layout=LAYOUT)
        assert store.read_pages(refs) == [None] * len(refs)
    finally:
        other.close()
    receipt = store.eraser.run(job)
    assert receipt.verification.ok and receipt.removed.sessions == 4
    store.create_session("new", user_id="alice", tenant_id="acme", layout=LAYOUT)  # a new namespace, empty
    assert store.resume("new", CANARY_TOKENS).matched_tokens == 0


def test_other_processes_drop_their_caches(open_store) -> None:
    a, b = open_store(), open_store()
    populate(a)
    refs = b.resume("alice-2", CANARY_TOKENS).pages
    assert b.read_pages(refs)[0] == canary_page(0) and b.host.used_bytes > 0
    a.forget_user("alice", tenant_id="acme")
    assert b.read_pages(refs) == [None] * len(refs)
    with pytest.raises(dss.UnknownSession):
        b.resume("alice-2", CANARY_TOKENS, tenant_id="acme")
    assert b.host.used_bytes == 0 or all(ref.page_id not in b.host for ref in refs)
    assert b.check() == []


def test_master_key_must_live_outside_and_match(tmp_path: Path) -> None:
    with pytest.raises(dss.ConfigError, match="inside the store folder"):
        dss.open(tmp_path / "s", master_key_file=tmp_path / "s" / "master.key")
    dss.open(tmp_path / "s").close()
    with pytest.raises(dss.ConfigError, match="another master key"):
        dss.open(tmp_path / "s", master_key="ab" * 32)
    assert oct(os.stat(os.environ["DSS_MASTER_KEY_FILE"]).st_mode & 0o777) == "0o600"


def test_the_job_keeps_no_page_id_and_no_file_name(store: dss.Store) -> None:
    populate(store)
    ids = [
        bytes(r[0])
        for r in store.sql(
            "SELECT p.page_id FROM pages p JOIN users u ON u.id = p.user_ref WHERE u.user_id = 'alice'"
        ).rows
    ]
    names = [
        r[0]
        for r in store.sql(
            "SELECT g.name FROM segments g JOIN users u ON u.id = g.user_ref WHERE u.user_id = 'alice'"
        ).rows
    ]
    assert (len(ids), len(names)) == (11, 3)
    receipt = store.forget_user("alice", tenant_id="acme")
    (plan,) = [r[0] for r in store.sql("SELECT plan FROM erasures").rows]
    assert json.loads(plan)["receipt"] == receipt.model_dump(exclude_none=True)
    kept = plan + json.dumps([e.model_dump() for e in store.audit()])
    assert [n for n in names if n in kept] == []
    assert [i for i in ids if i.hex() in kept.lower() or i in kept.encode()] == []
    removed = json.loads(plan)["removed"]
    assert len(removed["sample"]) == 11 and len(removed["file_digests"]) == 3 and "files" not in removed


def test_the_scanner_finds_hex_and_binary_ids_by_their_needles(tmp_path: Path, monkeypatch) -> None:
    from dss.core import rawscan

    binary, text, upper, absent = (bytes([n]) * 4 + os.urandom(12) for n in (1, 2, 3, 4))
    needles = [rawscan.needle(i) for i in (binary, text, upper, absent)]
    decoy = absent[:4] + bytes(12)  # the prefix of a needle, but not its id
    files = {
        "bin": b"x" * 1000 + binary + b"y" * 7,
        "hex": b'{"id": "' + text.hex().encode() + b'"}',
        "upper": b"X'" + upper.hex().upper().encode() + b"'",
        "decoy": decoy + decoy.hex().encode(),
        "empty": b"",
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    paths = [str(tmp_path / name) for name in (*files, "missing")]
    assert rawscan.scan(paths, needles) == {
        str(tmp_path / "bin"): 1,
        str(tmp_path / "hex"): 1,
        str(tmp_path / "upper"): 1,
        str(tmp_path / "decoy"): 0,
        str(tmp_path / "empty"): 0,
    }
    assert all(i.hex() not in json.dumps(needles) for i in (binary, text, upper, absent))
    monkeypatch.setattr(rawscan, "CHUNK_BYTES", 7)  # every id straddles reads
    assert [rawscan.found_in(p, needles) for p in paths[:5]] == [1, 1, 1, 0, 0]


@pytest.mark.slow
def test_erasures_among_many_commits_leave_no_page_id_in_the_catalog(tmp_path: Path) -> None:
    """40 users, each with 16 pages, erased one after another while another session keeps
    committing (4 new pages a step, rolling back now and then). Page splits copy index cells
    around, and ``secure_delete`` does not zero the stale copies they leave in a page's unused
    space: without rebuilding the catalog, verification found a sampled id within the first 25
    erasures in every trial. Every erasure must verify, and none of the ids may be left at the end."""
    import random

    rng = random.Random(7)
    folder = tmp_path / "store"
    erased: list[bytes] = []
    with dss.open(folder) as store:
        store.create_session("busy", user_id="bob", tenant_id="acme", layout=LAYOUT)
        for step in range(400):
            user = f"gone-{step // 10}"
            if step % 10 == 0:
                store.create_session(user, user_id=user, tenant_id="acme", layout=LAYOUT)
                tokens = [rng.randrange(1000) for _ in range(16 * 8)]
                store.commit(user, tokens, {i: canary_page(i) for i in range(16)})
            if step % 10 == 5:
                erased += [
                    bytes(r[0])
                    for r in store.sql(
                        "SELECT p.page_id FROM pages p JOIN users u ON u.id = p.user_ref WHERE u.user_id = :u",
                        {"u": user},
                    ).rows
                ]
                assert store.forget_user(user, tenant_id="acme").verification.ok
            versions = store.versions("busy")
            if versions and rng.random() < 0.3:
                store.rollback("busy", rng.choice(versions).version_id)
            tokens = store.tokens("busy") + [rng.randrange(1000) for _ in range(4 * 8)]
            store.commit("busy", tokens, {i: other_page(i % 100) for i in range(len(tokens) // 8)})
        assert store.check() == []
    assert len(erased) == 40 * 16
    assert found(folder, erased + [page_id.hex().encode() for page_id in erased]) == []


class Stop(Exception):
    """Raised by a progress callback to stop an erasure between two steps."""


def stop_at(step: str) -> Callable[[str], None]:
    def progress(now: str) -> None:
        if now == step:
            raise Stop(now)

    return progress


def test_a_commit_of_another_store_is_fenced_from_the_moment_the_job_is_recorded(open_store) -> None:
    """The job is recorded, the key not yet destroyed: another store that cached the key still
    cannot commit (the fence is checked in its write transaction), nor make a session there."""
    store, other = open_store(), open_store()
    populate(store)
    tokens = other.tokens("alice-1", tenant_id="acme")
    with pytest.raises(Stop):
        store.forget_user("alice", tenant_id="acme", progress=stop_at("planned -> key_destroyed"))
    with pytest.raises(dss.ErasureInProgress, match="this user's data is being erased"):
        other.commit("alice-1", tokens + [1] * 8, tenant_id="acme")
    with pytest.raises(dss.ErasureInProgress):
        other.create_session("new", user_id="alice", tenant_id="acme", layout=LAYOUT)
    other.commit("bob-1", [101] * 72, tenant_id="acme")  # another namespace is not fenced
    receipt = store.forget_user("alice", tenant_id="acme")
    assert (receipt.erasure_id, receipt.status, receipt.removed.sessions) == (1, "verified", 4)


def test_a_retry_resumes_the_same_job_after_the_user_row_is_gone(store: dss.Store) -> None:
    populate(store)
    with pytest.raises(Stop):  # stopped after the purge: the user's row is gone, the job open
        store.forget_user("alice", tenant_id="acme", progress=stop_at("catalog_purged -> files_deleted"))
    with pytest.raises(dss.ErasureInProgress):
        store.create_session("new", user_id="alice", tenant_id="acme", layout=LAYOUT)
    receipt = store.forget_user("alice", tenant_id="acme")
    assert (receipt.erasure_id, receipt.status, receipt.removed.sessions) == (1, "verified", 4)
    with store.catalog.read() as conn:
        assert [erasure_rows.job(conn, 1).state, erasure_rows.open_jobs(conn)] == ["done", []]
    assert [e.receipt.erasure_id for e in store.audit()] == [1]


def test_a_failed_verification_sweeps_once_then_the_job_is_final_and_reported(store: dss.Store, monkeypatch) -> None:
    populate(store)
    verify = store.eraser.verify
    failures = iter([True])  # the first verification finds something; the second does not

    def once(*args: object) -> list[Check]:
        return [*verify(*args), *([Check(name="planted", ok=False, detail="1 left")] if next(failures, False) else [])]

    monkeypatch.setattr(store.eraser, "verify", once)
    receipt = store.forget_user("alice", tenant_id="acme")
    assert receipt.status == "verified" and receipt.verification is not None and receipt.verification.ok
    monkeypatch.setattr(
        store.eraser, "verify", lambda *args: [*verify(*args), Check(name="planted", ok=False, detail="1 left")]
    )
    with pytest.raises(
        dss.ErasureIncomplete,
        match=r"erasure 2 failed verification twice \(its receipt, status "
        r"'failed', is in the audit table\): planted: 1 left",
    ):
        store.forget_user("bob", tenant_id="acme")
    with pytest.raises(dss.ErasureIncomplete, match="erasure 2 failed verification twice"):
        store.eraser.run(2)  # final: running it again reports the same, changes nothing
    with store.catalog.read() as conn:
        assert [erasure_rows.job(conn, 2).state, erasure_rows.open_jobs(conn)] == ["failed", []]
    assert [(e.user_id, e.receipt.status) for e in store.audit()] == [("alice", "verified"), ("bob", "failed")]
    assert store.eraser.resume_all() == []  # a final job is not run again at every open
