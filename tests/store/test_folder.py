"""One store folder per catalog: a second folder on the same catalog is refused at open."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import dss
from dss.store.folder import ID_FILE
from tests.conftest import LAYOUT, pages_for

T = list(range(1, 13))


def test_a_second_folder_on_one_catalog_is_refused(catalog_url: str | None, tmp_path: Path) -> None:
    url = catalog_url or f"sqlite:///{tmp_path / 'first' / 'catalog.db'}"
    first = dss.open(tmp_path / "first", catalog_url=url)
    first.create_session("s", layout=LAYOUT)
    first.commit("s", T, pages_for(T))
    with pytest.raises(dss.ConfigError, match="belongs to another store folder"):
        dss.open(tmp_path / "second", catalog_url=url)
    again = dss.open(tmp_path / "first", catalog_url=url)
    assert again.resume("s", T).matched_tokens == 12
    assert again.read_pages(again.resume("s", T).pages) == list(pages_for(T).values())
    assert again.check() == [] and first.check() == []
    again.close()
    first.close()


def test_the_folder_keeps_its_catalog_across_reopens(store_path: Path) -> None:
    with dss.open(store_path) as store:
        store.create_session("s", layout=LAYOUT)
    text = (store_path / ID_FILE).read_text()
    assert text.startswith("dss-store-id v1\n") and len(bytes.fromhex(text.split("\n")[1])) == 16
    with dss.open(store_path) as store:
        assert store.session("s").session_id == "s"
    assert (store_path / ID_FILE).read_text() == text


def test_a_damaged_store_id_is_a_config_error(store_path: Path) -> None:
    dss.open(store_path).close()
    (store_path / ID_FILE).write_text("garbage")
    with pytest.raises(dss.ConfigError, match="is damaged"):
        dss.open(store_path)


@pytest.mark.parametrize("name", ["a?b", "a#b", "a%20b", "a b", "a%b", "a@b:c"])
def test_a_folder_name_that_urls_would_misread_keeps_its_catalog_inside(tmp_path: Path, name: str) -> None:
    """The SQLite catalog's URL is built from the path, not pasted into one: ``?`` would start a
    query string (the catalog landing at ``.../a``), ``#`` a fragment, ``%20`` would decode to a space."""
    home = tmp_path / name
    with dss.open(home) as store:
        store.create_session("s", layout=LAYOUT)
        store.commit("s", T, pages_for(T))
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]
    assert (home / "catalog.db").is_file()
    with dss.open(home) as store:
        assert store.resume("s", T).matched_tokens == 12
        assert store.sql("SELECT COUNT(*) FROM versions").rows == [(1,)]
        assert store.check() == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


# -- the file system refusing the open ------------------------------------------------------------
# The tests run as root, whom permission bits do not stop: each failure below is one that stops
# root too (something in the way of a file or folder the open makes, a read-only mount).


def _in_the_way(home: Path, name: str, kind: str) -> None:
    """Put a folder or a file where the open wants a file or a folder."""
    home.mkdir(parents=True, exist_ok=True)
    if kind == "folder":
        (home / name).mkdir()
    else:
        (home / name).write_text("in the way")


@pytest.mark.parametrize(
    ("name", "kind", "message"),
    [
        (".lock", "folder", "cannot open the lock file {home}/.lock: Is a directory"),
        ("catalog.db", "folder", "cannot open the catalog file {home}/catalog.db: Is a directory"),
        (ID_FILE, "folder", "cannot read the store id file {home}/store-id: Is a directory"),
        ("epoch", "folder", "cannot open the epoch file {home}/epoch: Is a directory"),
        ("segments", "file", "cannot set up the page files at {home}/segments: File exists"),
        ("tmp", "file", "cannot set up the page files at {home}/tmp: File exists"),
        ("locks", "file", "cannot set up the page files at {home}/locks: File exists"),
    ],
)
def test_a_file_system_failure_at_each_open_step_is_a_store_folder_error(
    tmp_path: Path, name: str, kind: str, message: str
) -> None:
    home = tmp_path / "h"
    _in_the_way(home, name, kind)
    before = sorted(p.name for p in home.iterdir())
    with pytest.raises(dss.StoreFolderError) as caught:
        dss.open(home, master_key="ab" * 32)
    assert str(caught.value) == message.format(home=home)
    assert isinstance(caught.value, dss.DssError)
    assert name in sorted(p.name for p in home.iterdir()) and set(before) <= {p.name for p in home.iterdir()}


def test_a_store_folder_under_a_file_is_a_store_folder_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(dss.StoreFolderError) as caught:
        dss.open(tmp_path / "file" / "store")
    assert str(caught.value) == f"cannot make the store folder {tmp_path}/file/store: Not a directory"
    with pytest.raises(dss.StoreFolderError) as caught:
        dss.open(tmp_path / "file")
    assert str(caught.value) == f"cannot make the store folder {tmp_path}/file: File exists"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


READ_ONLY_CHILD = """
import json, sys
import dss
try:
    dss.open(sys.argv[1], master_key="ab" * 32).close()
    print(json.dumps(["opened", ""]))
except Exception as exc:
    print(json.dumps([type(exc).__name__, str(exc)]))
"""


def _can_mount_read_only(tmp_path: Path) -> bool:
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    result = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            f"mount --bind {probe} {probe} && mount -o remount,bind,ro {probe} && ! touch {probe}/x 2>/dev/null",
        ],
        capture_output=True,
    )
    probe.rmdir()
    return result.returncode == 0


def test_a_read_only_file_system_is_a_store_folder_error_at_every_kind_of_folder(tmp_path: Path) -> None:
    """A real read-only mount (a private bind mount in a mount namespace): a new folder on it, an
    empty folder, and a store made before the mount each fail with the path and the cause."""
    if not _can_mount_read_only(tmp_path):
        pytest.skip("no mount namespace here (unshare -m) to mount a folder read-only")
    ro = tmp_path / "ro"
    (ro / "empty").mkdir(parents=True)
    dss.open(ro / "store", master_key="ab" * 32).close()
    script = tmp_path / "child.py"
    script.write_text(READ_ONLY_CHILD)
    answers = {}
    for name in ("new", "empty", "store"):
        result = subprocess.run(
            [
                "unshare",
                "-m",
                "sh",
                "-c",
                f'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && exec "$2" "$3" "$1/{name}"',
                "sh",
                str(ro),
                sys.executable,
                str(script),
            ],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        assert result.returncode == 0, result.stderr
        answers[name] = json.loads(result.stdout)
    assert answers == {
        "new": ["StoreFolderError", f"cannot make the store folder {ro}/new: Read-only file system"],
        "empty": ["StoreFolderError", f"cannot open the lock file {ro}/empty/.lock: Read-only file system"],
        "store": ["StoreFolderError", f"cannot open the lock file {ro}/store/.lock: Read-only file system"],
    }
    assert sorted(p.name for p in ro.iterdir()) == ["empty", "store"] and list((ro / "empty").iterdir()) == []
    with dss.open(ro / "store", master_key="ab" * 32) as store:  # writable again outside the namespace
        assert store.check() == []


# -- create=False: open only a store that exists ----------------------------------------------------


def test_create_false_opens_an_existing_store_and_refuses_a_missing_one(tmp_path: Path) -> None:
    with pytest.raises(dss.NoStore) as caught:
        dss.open(tmp_path / "missing", create=False)
    assert str(caught.value) == f"no store at {tmp_path}/missing"
    (tmp_path / "empty").mkdir()
    with pytest.raises(dss.NoStore) as caught:
        dss.open(tmp_path / "empty", create=False)
    assert str(caught.value) == f"no store at {tmp_path}/empty"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"] and list((tmp_path / "empty").iterdir()) == []
    with dss.open(tmp_path / "made") as store:
        store.create_session("s", layout=LAYOUT)
    with dss.open(tmp_path / "made", create=False) as store:
        assert [s.session_id for s in store.sessions()] == ["s"]
    with pytest.raises(dss.InvalidInput, match="create must be True or False, not str"):
        dss.open(tmp_path / "made", create="no")


def test_create_false_with_a_catalog_url_needs_the_folder(catalog_url: str | None, tmp_path: Path) -> None:
    """With a catalog elsewhere (PostgreSQL, or a SQLite file named by URL), no store means no folder."""
    url = catalog_url or f"sqlite:///{tmp_path / 'elsewhere.db'}"
    with pytest.raises(dss.NoStore) as caught:
        dss.open(tmp_path / "missing", catalog_url=url, create=False)
    assert str(caught.value) == f"no store at {tmp_path}/missing"
    assert not (tmp_path / "missing").exists() and not (tmp_path / "elsewhere.db").exists()
    with dss.open(tmp_path / "h", catalog_url=url) as store:
        store.create_session("s", layout=LAYOUT)
    with dss.open(tmp_path / "h", catalog_url=url, create=False) as store:
        assert [s.session_id for s in store.sessions()] == ["s"]
