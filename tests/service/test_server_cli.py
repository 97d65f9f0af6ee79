"""``dss keys`` and ``dss serve`` (dss.cli.service): exit codes and exact messages."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from dss.cli.main import main
from dss.service.apikeys import read_keys


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_keys_add_prints_the_key_once_and_stores_its_hash(tmp_path: Path) -> None:
    code, out, err = run("keys", "add", "acme", "--admin", "--label", "gw", "--home", str(tmp_path))
    assert code == 0
    key = out.strip()
    assert re.fullmatch(r"dss_[0-9a-f]{12}_[A-Za-z0-9_-]{43}", key)
    key_id = key.split("_")[1]
    assert err == f"key {key_id} for tenant 'acme' (admin): store it now, it is not shown again\n"
    [entry] = read_keys(tmp_path / "api-keys.json")
    assert (entry.key_id, entry.tenant_id, entry.is_admin, entry.label) == (key_id, "acme", True, "gw")
    assert key not in (tmp_path / "api-keys.json").read_text()


def test_keys_list_and_remove(tmp_path: Path) -> None:
    home = str(tmp_path)
    assert run("keys", "list", "--home", home) == (0, "(none)\n", "")
    code, out, _ = run("--home", home, "keys", "add", "beta", "--json")  # the group's --home works too
    added = json.loads(out)
    assert (code, added["tenant_id"], added["is_admin"]) == (0, "beta", False)
    code, out, _ = run("keys", "list", "--json", "--home", home)
    [row] = json.loads(out)
    assert row == {
        "key_id": added["key_id"],
        "tenant_id": "beta",
        "is_admin": False,
        "label": None,
        "created_at": row["created_at"],
    }
    code, out, _ = run("keys", "list", "--home", home)
    assert out == (
        f"key_id        tenant_id  is_admin  created_at           label\n"
        f"{added['key_id']}  beta       False     {row['created_at'].replace('T', ' ')[:19]}  -\n"
    )
    assert run("keys", "remove", added["key_id"], "--home", home) == (
        0,
        f"removed key {added['key_id']} of tenant 'beta'\n",
        "",
    )
    code, out, err = run("keys", "remove", added["key_id"], "--home", home)
    assert (code, out) == (1, "")
    assert err == f"error: NotFound: no API key '{added['key_id']}' in {tmp_path / 'api-keys.json'}\n"


def test_keys_add_refuses_a_bad_tenant(tmp_path: Path) -> None:
    code, out, err = run("keys", "add", "a\tb", "--home", str(tmp_path))
    assert (code, out) == (1, "")
    assert err == "error: InvalidInput: tenant_id must be a printable string of 1 to 256 characters, got 'a\\tb'\n"


def test_serve_refuses_bad_configuration_before_listening(tmp_path: Path) -> None:
    code, out, err = run("serve", "--home", str(tmp_path), "--port", "70000")
    assert (code, out) == (1, "")
    assert err == (
        "error: ConfigError: invalid dss server configuration: port: Input should be less than or equal "
        "to 65535 (from argument)\n"
    )
    (tmp_path / "api-keys.json").write_text("{}")
    code, _, err = run("serve", "--home", str(tmp_path), "--port", "8077")
    assert code == 1
    assert err.startswith(
        f"error: ConfigError: the API keys file {tmp_path / 'api-keys.json'} is not a valid 'dss-api-keys v1' file"
    )


def test_the_cli_works_without_the_server_extra(tmp_path: Path) -> None:
    """With fastapi and uvicorn missing, every command but serve still runs."""
    script = (
        "import sys; sys.modules['fastapi'] = None; sys.modules['uvicorn'] = None; "
        "from dss.cli.main import main; main()"
    )

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=60, check=False
        )

    helped = cli("--help")
    assert helped.returncode == 0 and "serve " in helped.stdout and "keys " in helped.stdout
    assert cli("keys", "list", "--home", str(tmp_path)).stdout == "(none)\n"
    served = cli("serve", "--home", str(tmp_path))
    assert served.returncode == 1
    assert served.stderr == (
        "error: dss serve needs the server extra (fastapi is missing): pip install 'dss-store[server]'\n"
    )


def test_keys_list_prints_a_table_with_a_header_row(tmp_path: Path) -> None:
    home = str(tmp_path)
    first = json.loads(run("keys", "add", "acme", "--admin", "--label", "gateway", "--json", "--home", home)[1])
    second = json.loads(run("keys", "add", "beta", "--json", "--home", home)[1])
    created = {
        row["key_id"]: row["created_at"].replace("T", " ")[:19]
        for row in json.loads(run("keys", "list", "--json", "--home", home)[1])
    }
    code, out, err = run("keys", "list", "--home", home)
    assert (code, err) == (0, "")
    assert out == (
        f"key_id        tenant_id  is_admin  created_at           label\n"
        f"{first['key_id']}  acme       True      {created[first['key_id']]}  gateway\n"
        f"{second['key_id']}  beta       False     {created[second['key_id']]}  -\n"
    )
