"""API keys (dss.service.apikeys): stored hashed, atomically, 0600; the key ring follows the file."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path

import pytest

from dss.core.errors import ConfigError, InvalidInput, NotFound
from dss.service.apikeys import KeyRing, Principal, add_key, hash_key, read_keys, remove_key
from dss.service.problems import Unauthorized


def test_add_key_stores_only_the_hash_in_a_versioned_private_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    key, entry = add_key(path, "acme", is_admin=True, label="gateway")
    assert re.fullmatch(r"dss_[0-9a-f]{12}_[A-Za-z0-9_-]{43}", key)
    assert entry.key_id == key.split("_")[1]
    assert entry.sha256 == hashlib.sha256(key.encode()).hexdigest() == hash_key(key)
    text = path.read_text()
    assert key not in text and key.split("_", 2)[2] not in text  # the secret may itself hold "_"
    data = json.loads(text)
    assert list(data) == ["format", "keys"] and data["format"] == "dss-api-keys v1"
    assert data["keys"] == [
        {
            "key_id": entry.key_id,
            "sha256": entry.sha256,
            "tenant_id": "acme",
            "is_admin": True,
            "label": "gateway",
            "created_at": data["keys"][0]["created_at"],
        }
    ]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".api-keys-")] == []  # no temp left behind


def test_keys_accumulate_and_remove_revokes_one(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    _, a = add_key(path, "acme")
    _, b = add_key(path, "beta")
    assert [(k.key_id, k.tenant_id, k.is_admin) for k in read_keys(path)] == [
        (a.key_id, "acme", False),
        (b.key_id, "beta", False),
    ]
    assert remove_key(path, a.key_id) == a
    assert read_keys(path) == [b]
    with pytest.raises(NotFound, match=f"no API key '{a.key_id}' in {path}"):
        remove_key(path, a.key_id)


def test_bad_input_and_malformed_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    with pytest.raises(InvalidInput, match="tenant_id must be a printable string"):
        add_key(path, "")
    assert not path.exists()
    assert read_keys(tmp_path / "absent.json") == []
    path.write_text('{"format": "dss-api-keys v2", "keys": []}')
    with pytest.raises(ConfigError, match=r"is not a valid 'dss-api-keys v1' file: format: Input should be"):
        read_keys(path)
    path.write_text("not json")
    with pytest.raises(ConfigError, match="is not a valid 'dss-api-keys v1' file"):
        KeyRing(path)


def test_key_ring_authenticates_and_follows_the_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    key, entry = add_key(path, "acme", is_admin=True)
    ring = KeyRing(path, reload_interval_s=0)
    assert ring.authenticate(key) == Principal(entry.key_id, "acme", True)
    with pytest.raises(Unauthorized, match="unknown API key"):
        ring.authenticate(key + "x")
    with pytest.raises(Unauthorized, match="this endpoint needs an API key"):
        ring.authenticate(None)
    later, _ = add_key(path, "beta")
    assert ring.authenticate(later).tenant_id == "beta"
    remove_key(path, entry.key_id)
    with pytest.raises(Unauthorized, match="unknown API key"):
        ring.authenticate(key)


def test_a_broken_keys_file_keeps_the_keys_read_before(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "keys.json"
    key, _ = add_key(path, "acme")
    ring = KeyRing(path, reload_interval_s=0)
    path.write_text("{broken")
    assert ring.authenticate(key).tenant_id == "acme"
    assert "keeping the previous API keys" in caplog.text


def test_revocation_waits_for_the_reload_interval(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    key, entry = add_key(path, "acme")
    ring = KeyRing(path, reload_interval_s=3600)
    remove_key(path, entry.key_id)
    assert ring.authenticate(key).tenant_id == "acme"  # checked again only after the interval
    ring.reload_interval_s = 0
    with pytest.raises(Unauthorized):
        ring.authenticate(key)
