"""Every argument of every public ``Store`` method, given a value of the wrong type or shape,
raises a ``DssError`` subclass and changes nothing (catalog rows and files), on every catalog.

The table below follows the Python API page's table of methods (docs/python-api.md), one row per method: the arguments that
make a valid call, and for each argument the kind of values it must refuse. A test checks
that the table covers every public method, so a new one cannot be left out; every row's
valid call is made last and must succeed, so a refusal cannot come from the other arguments.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import sqlalchemy as sa

import dss
from tests.conftest import LAYOUT, page

T = list(range(100, 110))  # two full pages of LAYOUT and a tail of two tokens
PAGES = {0: page(1), 1: page(2)}
REFS = object()
"""Stands for the page references of a resume (known only once the store holds pages)."""


class Repeating(Mapping[Any, Any]):
    """A mapping whose iteration names an index more than once (as a list of pairs would)."""

    def __init__(self, pairs: list[tuple[Any, Any]]) -> None:
        self.pairs = pairs

    def __getitem__(self, key: Any) -> Any:
        return dict(self.pairs)[key]

    def __iter__(self) -> Iterator[Any]:
        return iter([key for key, _ in self.pairs])

    def __len__(self) -> int:
        return len(self.pairs)


_ANY = [object(), 1.5, np.float64(2.0), {"x"}, frozenset(), Path("x")]
"""Values no argument of the API accepts."""

BAD: dict[str, list[Any]] = {
    "id": [None, 1, True, b"s", ["s"], [], {"s": 1}, {}, ("s",), np.array(["s"]), "", "x" * 257, "a\nb", "\x00", *_ANY],
    "optional id": [1, True, b"s", ["s"], [], {"s": 1}, {}, ("s",), "", "x" * 257, "a\tb", *_ANY],
    "tokens": [
        None,
        "abc",
        b"ab",
        7,
        True,
        [True, False],
        [1, True],
        (False,),
        np.array([True, False]),
        [1.5],
        [-1],
        [2**32],
        [None],
        [[1]],
        {1: 2},
        np.zeros((2, 2), dtype=np.int32),
        np.array([1.5]),
        *_ANY,
    ],
    "pages": [
        "x",
        b"x",
        5,
        [page(1)],
        {0: 5},
        {"0": page(1)},
        {True: page(1)},
        {0: b"short"},
        {9: page(1)},
        {0: "text"},
        Repeating([(0, page(1)), (0, page(2))]),
        Repeating([(1, page(1)), (0, page(2)), (1, page(1))]),
        {np.int64(0): page(1)},
        *_ANY,
    ],
    "layout": [None, 1, "test", LAYOUT.to_dict(), [LAYOUT], *_ANY],
    "version_id": [None, True, "1", 1.5, [1], np.int64(1), b"1", *_ANY],
    "optional version_id": [True, "1", [1], np.int64(1), *_ANY],
    "label": [5, True, b"x", ["x"], "x" * 257, "\ud800", *_ANY],
    "flag": [None, 1, 0, "yes", "", [], np.bool_(True), *_ANY],
    "page ids": [
        None,
        5,
        "abc",
        b"x" * 16,
        [1],
        [True],
        [b"short"],
        [None],
        ["00" * 16],
        [dss.PageRef(0, dss.PageId(b"x"), "host")],
        np.array([1, 2]),
        {b"x" * 16},
        *_ANY,
    ],
    "query": [None, 5, b"SELECT 1", ["SELECT 1"], "", *_ANY],
    "params": ["x", 5, [1], [("a", 1)], {1: 2}, *_ANY],
    "max_rows": [None, 0, -1, True, "5", 2.0, *_ANY],
    "callback": [5, "print", [print], *_ANY],
}


class Row(NamedTuple):
    method: str
    valid: dict[str, Any]
    """A valid call: positional arguments are the keys named in ``positional``."""
    kinds: dict[str, str]
    """The kind of bad values each argument must refuse (keys of ``BAD``)."""
    positional: tuple[str, ...] = ()


def rows(v1: int) -> list[Row]:
    """The API, in an order in which every row's valid call leaves the next rows valid."""
    return [
        Row(
            "create_session",
            {"session_id": "s", "user_id": "u", "tenant_id": "t", "layout": LAYOUT},
            {"session_id": "id", "user_id": "id", "tenant_id": "id", "layout": "layout"},
            ("session_id",),
        ),
        Row(
            "session",
            {"session_id": "s", "tenant_id": "t"},
            {"session_id": "id", "tenant_id": "optional id"},
            ("session_id",),
        ),
        Row("sessions", {"tenant_id": "t", "user_id": "u"}, {"tenant_id": "optional id", "user_id": "optional id"}),
        Row(
            "commit",
            {"session_id": "s", "tokens": T, "pages": PAGES, "label": "l", "tenant_id": "t"},
            {"session_id": "id", "tokens": "tokens", "pages": "pages", "label": "label", "tenant_id": "optional id"},
            ("session_id", "tokens", "pages"),
        ),
        Row(
            "save_pages",
            {"session_id": "s", "tokens": T, "pages": PAGES, "tenant_id": "t"},
            {"session_id": "id", "tokens": "tokens", "pages": "pages", "tenant_id": "optional id"},
            ("session_id", "tokens", "pages"),
        ),
        Row(
            "save_pages",
            {"session_id": None, "tokens": T, "pages": PAGES, "tenant_id": "t", "user_id": "u", "layout": LAYOUT},
            {"tokens": "tokens", "pages": "pages", "tenant_id": "id", "user_id": "id", "layout": "layout"},
            ("session_id", "tokens", "pages"),
        ),
        Row(
            "rollback",
            {"session_id": "s", "version_id": v1, "tenant_id": "t"},
            {"session_id": "id", "version_id": "version_id", "tenant_id": "optional id"},
            ("session_id", "version_id"),
        ),
        Row(
            "branch",
            {"session_id": "s", "version_id": v1, "new_session_id": "b", "tenant_id": "t", "label": "l"},
            {
                "session_id": "id",
                "version_id": "version_id",
                "new_session_id": "id",
                "tenant_id": "optional id",
                "label": "label",
            },
            ("session_id", "version_id", "new_session_id"),
        ),
        Row(
            "versions",
            {"session_id": "s", "tenant_id": "t"},
            {"session_id": "id", "tenant_id": "optional id"},
            ("session_id",),
        ),
        Row(
            "tokens",
            {"session_id": "s", "version_id": v1, "tenant_id": "t"},
            {"session_id": "id", "version_id": "optional version_id", "tenant_id": "optional id"},
            ("session_id", "version_id"),
        ),
        Row(
            "pin",
            {"session_id": "s", "version_id": v1, "pinned": True, "tenant_id": "t"},
            {"session_id": "id", "version_id": "version_id", "pinned": "flag", "tenant_id": "optional id"},
            ("session_id", "version_id"),
        ),
        Row(
            "resume",
            {"session_id": "s", "tokens": T, "tenant_id": "t"},
            {"session_id": "id", "tokens": "tokens", "tenant_id": "optional id"},
            ("session_id", "tokens"),
        ),
        Row(
            "lookup",
            {"tokens": T, "layout": LAYOUT, "user_id": "u", "tenant_id": "t"},
            {"tokens": "tokens", "layout": "layout", "user_id": "id", "tenant_id": "id"},
            ("tokens",),
        ),
        Row(
            "register_prefix",
            {"tokens": T, "pages": PAGES, "layout": LAYOUT, "tenant_id": "t", "label": "l"},
            {"tokens": "tokens", "pages": "pages", "layout": "layout", "tenant_id": "id", "label": "label"},
            ("tokens", "pages"),
        ),
        Row("shared_prefixes", {"tenant_id": "t"}, {"tenant_id": "id"}),
        Row(
            "read_pages",
            {"pages": REFS, "tenant_id": "t", "load": True},
            {"pages": "page ids", "tenant_id": "optional id", "load": "flag"},
            ("pages",),
        ),
        Row(
            "prefetch",
            {"session_id": "s", "tenant_id": "t", "wait": True},
            {"session_id": "id", "tenant_id": "optional id", "wait": "flag"},
            ("session_id",),
        ),
        Row(
            "page_sizes",
            {"page_ids": REFS, "tenant_id": "t"},
            {"page_ids": "page ids", "tenant_id": "optional id"},
            ("page_ids",),
        ),
        Row(
            "forget_user",
            {"user_id": "u", "tenant_id": "t", "dry_run": True, "progress": None},
            {"user_id": "id", "tenant_id": "id", "dry_run": "flag", "progress": "callback"},
            ("user_id",),
        ),
        Row("audit", {"tenant_id": "t"}, {"tenant_id": "optional id"}),
        Row(
            "sql",
            {"query": "SELECT COUNT(*) FROM sessions", "params": None, "max_rows": 5},
            {"query": "query", "params": "params", "max_rows": "max_rows"},
            ("query", "params"),
        ),
        Row(
            "delete_session",
            {"session_id": "b", "tenant_id": "t"},
            {"session_id": "id", "tenant_id": "optional id"},
            ("session_id",),
        ),
        Row(
            "nearest",
            {"tokens": T, "session_id": "s", "tenant_id": "t", "k": 5},
            {"tokens": "tokens", "session_id": "optional id", "tenant_id": "optional id", "k": "max_rows"},
            ("tokens",),
        ),
        Row(
            "explain",
            {"session_id": "s", "tokens": T, "tenant_id": "t", "decode": None},
            {"tokens": "tokens", "tenant_id": "optional id", "decode": "callback"},
            ("session_id", "tokens"),
        ),
        Row(
            "prefetch_candidates",
            {"tokens": T, "session_id": "s", "tenant_id": "t", "promote": False},
            {"tokens": "tokens", "session_id": "optional id", "tenant_id": "optional id", "promote": "flag"},
            ("tokens",),
        ),
        Row("compact", {"dry_run": True}, {"dry_run": "flag"}),
        Row(
            "mark_resident",
            {"engine_id": "e", "page_ids": REFS},
            {"engine_id": "id", "page_ids": "page ids"},
            ("engine_id", "page_ids"),
        ),
        Row(
            "evicted",
            {"engine_id": "e", "page_ids": REFS},
            {"engine_id": "id", "page_ids": "page ids"},
            ("engine_id", "page_ids"),
        ),
        Row(
            "residency",
            {"session_id": "s", "tenant_id": "t"},
            {"session_id": "id", "tenant_id": "optional id"},
            ("session_id",),
        ),
        Row("forget_engine", {"engine_id": "e"}, {"engine_id": "id"}, ("engine_id",)),
    ]


WITHOUT_ARGUMENTS = {"check", "stats", "count_sessions", "close", "is_closed", "run_mover"}


def test_the_table_covers_every_public_method() -> None:
    public = {name for name in dir(dss.Store) if not name.startswith("_")}
    assert public - WITHOUT_ARGUMENTS == {row.method for row in rows(1)}


def catalog_state(store: dss.Store, folder: Path) -> tuple[Any, ...]:
    """Row counts of every catalog table, heads, pins and sequence numbers, and the store
    folder's files (read on the store's own engine: ``sql()`` is under test here)."""
    tables = [
        "tenants",
        "users",
        "user_keys",
        "layouts",
        "sessions",
        "versions",
        "pages",
        "page_locations",
        "session_pages",
        "segments",
        "quarantine",
        "erasures",
        "audit",
        "feed",
        "catalog_seq",
        "store_meta",
    ]
    with store.catalog.engine.connect() as conn:
        counts = conn.execute(sa.text(" UNION ALL ".join(f"SELECT '{t}', COUNT(*) FROM {t}" for t in tables))).all()
        pinned = conn.execute(sa.text("SELECT id, pinned FROM versions ORDER BY id")).all()
        heads = conn.execute(sa.text("SELECT id, head_id, seq FROM sessions ORDER BY id")).all()
        seq = conn.execute(sa.text("SELECT seq FROM catalog_seq")).all()
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and "catalog.db" not in p.name)
    return sorted(counts), pinned, heads, seq, files


def call(store: dss.Store, row: Row, args: dict[str, Any]) -> Any:
    positional = [args.pop(name) for name in row.positional]
    return getattr(store, row.method)(*positional, **args)


def test_wrong_arguments_raise_a_dss_error_and_change_nothing(tmp_path: Path, catalog_url: str | None) -> None:
    folder = tmp_path / "store"
    store = dss.open(folder, catalog_url=catalog_url)
    try:
        store.create_session("s", user_id="u", tenant_id="t", layout=LAYOUT)
        v1 = store.commit("s", T, PAGES, tenant_id="t").version_id
        refs = store.resume("s", T, tenant_id="t").pages
        assert len(refs) == 2
        unrefused: list[str] = []
        for row in rows(v1):
            before = catalog_state(store, folder)
            for name, kind in row.kinds.items():
                for bad in BAD[kind]:
                    args = {k: refs if v is REFS else v for k, v in {**row.valid, name: bad}.items()}
                    try:
                        call(store, row, args)
                    except dss.DssError:
                        pass
                    except Exception as exc:  # noqa: BLE001 -- collected: the test lists every gap at once
                        unrefused.append(f"{row.method}({name}={bad!r:.40}) raised {type(exc).__name__}")
                        continue
                    else:
                        unrefused.append(f"{row.method}({name}={bad!r:.40}) was accepted")
                        continue
                    assert catalog_state(store, folder) == before, f"{row.method}({name}={bad!r:.40}) changed the store"
            # the valid call succeeds: the refusals came from the bad argument
            call(store, row, {k: refs if v is REFS else v for k, v in row.valid.items()})
        assert unrefused == []
        assert store.check() == []
    finally:
        store.close()


@pytest.mark.parametrize(
    ("pages", "message"),
    [
        (Repeating([(0, page(1)), (0, page(2))]), "page index 0 is given twice: give each page once"),
        (Repeating([(1, page(1)), (0, page(2)), (1, page(1))]), "page index 1 is given twice: give each page once"),
        ({"0": page(1)}, "page index '0' must be an int, not str"),
        ({np.int64(0): page(1)}, "page index np.int64(0) must be an int, not int64"),
    ],
)
@pytest.mark.parametrize("method", ["commit", "save_pages"])
def test_a_page_index_given_twice_or_not_as_an_int_is_refused_and_changes_nothing(
    tmp_path: Path, method: str, pages: Any, message: str
) -> None:
    """Two payloads for one index would leave one of them dropped without a word: refused, like a
    key that is not an int (numpy integers included, as for version ids)."""
    folder = tmp_path / "store"
    with dss.open(folder) as store:
        store.create_session("s", layout=LAYOUT)
        before = catalog_state(store, folder)
        with pytest.raises(dss.InvalidPage) as caught:
            getattr(store, method)("s", T, pages)
        assert str(caught.value) == message
        assert catalog_state(store, folder) == before
        assert store.versions("s") == [] and store.resume("s", T).matched_tokens == 0
        assert store.check() == []
