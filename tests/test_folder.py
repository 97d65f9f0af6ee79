"""One store folder per catalog: a second folder on the same catalog is refused at open."""

from __future__ import annotations

from pathlib import Path

import pytest

import dss
from dss.folder import ID_FILE
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
