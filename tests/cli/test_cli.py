"""The command line: exit codes and exact output, tables and --json."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import dss
from dss.catalog.schema import SCHEMA_REVISION
from dss.cli.demo import run as run_demo
from dss.cli.main import main
from tests.conftest import LAYOUT, pages_for

T = list(range(1, 13))


@pytest.fixture
def home(tmp_path: Path) -> str:
    with dss.open(tmp_path / "h") as store:
        store.create_session("chat", user_id="alice", tenant_id="acme", layout=LAYOUT)
        v1 = store.commit("chat", T, pages_for(T), label="one")
        store.commit("chat", T + [1, 2], label="two")
        store.rollback("chat", v1.version_id)
    return str(tmp_path / "h")


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_sessions_table_and_json(home: str) -> None:
    code, out = run("--home", home, "sessions")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["session_id", "tenant_id", "user_id", "layout", "head", "versions", "last_access"]
    assert lines[1].split()[:6] == ["chat", "acme", "alice", "test", "1", "2"]
    code, out = run("--home", home, "sessions", "--json")
    assert code == 0
    (row,) = json.loads(out)
    assert {k: row[k] for k in ("session_id", "tenant_id", "user_id", "head", "versions")} == {
        "session_id": "chat",
        "tenant_id": "acme",
        "user_id": "alice",
        "head": 1,
        "versions": 2,
    }


def test_versions(home: str) -> None:
    code, out = run("--home", home, "versions", "chat", "--json")
    assert code == 0
    assert [(v["version_id"], v["parent_id"], v["tokens"], v["label"], v["head"]) for v in json.loads(out)] == [
        (1, None, 12, "one", True),
        (2, 1, 14, "two", False),
    ]


def test_sql_and_its_refusals(home: str) -> None:
    code, out = run("--home", home, "sql", "SELECT tenant_id, num_versions FROM session_summary", "--json")
    assert (code, json.loads(out)) == (0, [{"tenant_id": "acme", "num_versions": 2}])
    code, out = run("--home", home, "sql", "DELETE FROM sessions")
    assert code == 1
    assert out == "error: ReadOnlyViolation: sql() runs read-only queries only: not authorized\n"


def test_sql_says_when_max_rows_cut_the_result(home: str) -> None:
    """Three pages, ``--max-rows 2``: two rows on stdout and one line on stderr; with ``--json``
    stdout keeps its shape (a list of rows) and stderr says the same as a JSON object. A result
    that fits, even exactly, says nothing."""
    query = "SELECT page_index FROM pages ORDER BY page_index"
    result = CliRunner().invoke(main, ["--home", home, "sql", query, "--max-rows", "2"])
    assert (result.exit_code, result.stdout, result.stderr) == (
        0,
        "page_index\n0\n1\n",
        "dss sql: the result was cut at 2 rows (--max-rows 2); the query returns more\n",
    )
    result = CliRunner().invoke(main, ["--home", home, "sql", query, "--max-rows", "2", "--json"])
    assert (result.exit_code, json.loads(result.stdout), json.loads(result.stderr)) == (
        0,
        [{"page_index": 0}, {"page_index": 1}],
        {"truncated": True, "max_rows": 2},
    )
    for extra in ([], ["--json"]):
        result = CliRunner().invoke(main, ["--home", home, "sql", query, "--max-rows", "3", *extra])
        assert (result.exit_code, result.stderr) == (0, "")


def test_unknown_session_message(home: str) -> None:
    assert run("--home", home, "versions", "nope") == (1, "error: UnknownSession: no session 'nope'\n")


def test_check(home: str) -> None:
    assert run("--home", home, "check") == (0, "ok: every invariant holds\n")
    assert run("--home", home, "check", "--json") == (0, '{"ok": true, "problems": []}\n')
    segment = next((Path(home) / "segments").iterdir())
    segment.unlink()
    code, out = run("--home", home, "check")
    assert code == 1 and out == f"problem: page file {segment.name} is in the catalog but missing on disk\n"


def test_db_upgrade_and_current(tmp_path: Path) -> None:
    home = str(tmp_path / "new")
    assert run("--home", home, "db", "current") == (1, f"error: NoStore: no store at {home}\n")
    assert run("--home", home, "db", "upgrade") == (0, "catalog upgraded from empty to 0007\n")
    assert run("--home", home, "db", "upgrade") == (0, "catalog already at revision 0007\n")
    assert run("--home", home, "db", "current") == (0, "0007\n")


def test_demo_reuses_and_verifies(tmp_path: Path) -> None:
    code, out = run("--home", str(tmp_path / "demo"), "demo")
    assert code == 0, out
    assert out.endswith("integrity check: ok\n")
    rows = run_demo(lambda: dss.open(tmp_path / "demo"), lambda line: None)  # a second run starts afresh
    assert [(r["step"], r["prompt"], r["reused"], r["tiers"], r["verified"]) for r in rows] == [
        ("turn 1", 640, 0, "-", True),
        ("turn 2", 790, 736, "host 736", True),
        ("turn 3", 965, 928, "host 928", True),
        ("undo turn 3, ask again", 975, 928, "host 928", True),
        ("regenerate turn 3", 975, 928, "host 928", True),
        ("branch at turn 1", 810, 736, "host 736", True),
        ("new chat, same user", 640, 576, "host 576", True),  # the shared system prompt, by chain hash
        ("after restart", 1105, 1056, "disk 1056", True),
    ]


def test_help_everywhere() -> None:
    for args in ([], ["demo"], ["sessions"], ["versions"], ["sql"], ["check"], ["stats"], ["db"], ["db", "upgrade"]):
        code, out = run(*args, "--help")
        assert code == 0 and "Usage:" in out


def test_no_help_shows_rst_markup() -> None:
    """Every command's and group's --help (the docstrings click shows) reads as plain text: no
    ``literal`` backticks and no Sphinx roles."""
    shown = {}
    for path in sorted(command_paths(main) | {()}):
        code, out = run(*path, "--help")
        assert code == 0 and out.startswith("Usage: "), path
        marks = [mark for mark in ("``", ":class:", ":func:", ":meth:", ":mod:", ":attr:", ":data:") if mark in out]
        if marks:
            shown[" ".join(path)] = marks
    assert shown == {}
    assert run("stats", "--help")[1].count("fill: active bytes over capacity") == 1


def test_python_dash_m(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dss", "--home", str(tmp_path), "sessions"], capture_output=True, text=True
    )
    assert (result.returncode, result.stdout, result.stderr) == (1, "", f"error: NoStore: no store at {tmp_path}\n")
    dss.open(tmp_path).close()
    result = subprocess.run(
        [sys.executable, "-m", "dss", "--home", str(tmp_path), "sessions"], capture_output=True, text=True
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "(none)\n", "")


# -- --home and --catalog-url after the command name, for every command ------------------------


def command_paths(group: click.Group, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    out: set[tuple[str, ...]] = set()
    for name, command in group.commands.items():
        out.add((*prefix, name))
        if isinstance(command, click.Group):
            out |= command_paths(command, (*prefix, name))
    return out


def walk_cases(home: str, url: str) -> list[tuple[tuple[str, ...], list[str], Callable[[int, str], bool]]]:
    """``(command path, the words before the options, what its output must show)`` for every
    command and group: each shows something only the store at ``home`` and ``url`` holds."""
    return [
        (
            ("sessions",),
            ["sessions", "--json"],
            lambda code, out: code == 0 and json.loads(out)[0]["session_id"] == "talk",
        ),
        (("versions",), ["versions", "talk", "--json"], lambda code, out: code == 0 and len(json.loads(out)) == 2),
        (
            ("sql",),
            ["sql", "SELECT COUNT(*) AS n FROM versions", "--json"],
            lambda code, out: (code, json.loads(out)) == (0, [{"n": 2}]),
        ),
        (("check",), ["check"], lambda code, out: (code, out) == (0, "ok: every invariant holds\n")),
        (("stats",), ["stats", "--json"], lambda code, out: code == 0 and json.loads(out)[1]["bytes"] > 0),
        (
            ("explain",),
            ["explain", "talk", "1", "2", "3", "--json"],
            lambda code, out: code == 0 and json.loads(out)["nearest"]["session_id"] == "talk",
        ),
        (
            ("forget-user",),
            ["forget-user", "alice", "--tenant", "acme", "--dry-run"],
            lambda code, out: code == 0 and out.startswith("user 'alice' of tenant 'acme': 1 sessions, 2 versions"),
        ),
        (("audit",), ["audit", "--json"], lambda code, out: (code, out) == (0, "[]\n")),
        (
            ("compact",),
            ["compact", "--dry-run", "--json"],
            lambda code, out: code == 0 and json.loads(out)["bytes_before"] > 0,
        ),
        (
            ("db",),
            ["db", "--home", home, "--catalog-url", url, "current"],
            lambda code, out: (code, out) == (0, f"{SCHEMA_REVISION}\n"),
        ),
        (
            ("db", "upgrade"),
            ["db", "upgrade"],
            lambda code, out: (code, out) == (0, f"catalog already at revision {SCHEMA_REVISION}\n"),
        ),
        (("db", "current"), ["db", "current"], lambda code, out: (code, out) == (0, f"{SCHEMA_REVISION}\n")),
        (
            ("keys",),
            ["keys", "--home", home, "--catalog-url", url, "list"],
            lambda code, out: (code, out) == (0, "(none)\n"),
        ),
        (("keys", "add"), ["keys", "add", "acme", "--json"], lambda code, out: json.loads(out)["tenant_id"] == "acme"),
        (
            ("keys", "list"),
            ["keys", "list", "--json"],
            lambda code, out: [k["tenant_id"] for k in json.loads(out)] == ["acme"],
        ),
        (("keys", "remove"), ["keys", "remove", "nosuchkey"], lambda code, out: code == 1 and "nosuchkey" in out),
        (("serve",), ["serve"], lambda code, out: code == 1 and f"cannot read server config file {home}" in out),
        (
            ("route",),
            ["route", "--backend", "a=http://127.0.0.1:9", "--dry-run"],
            lambda code, out: (
                (code, out)
                == (
                    0,
                    (
                        "dss route (kv) on http://127.0.0.1:8078 in front of "
                        f"a=http://127.0.0.1:9; store {home}: 1 sessions\n"
                    ),
                )
            ),
        ),
        (("demo",), ["demo"], lambda code, out: code == 0 and out.startswith(f"dss demo in {home}\n")),
    ]


def test_every_command_takes_home_and_catalog_url_after_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given after the name, both options name the store; nothing falls back to ./dss-data or
    to a catalog in the store folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DSS_HOME", raising=False)
    monkeypatch.delenv("DSS_CATALOG_URL", raising=False)
    home = str(tmp_path / "h")
    url = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    with dss.open(home, catalog_url=url) as store:
        store.create_session("talk", user_id="alice", tenant_id="acme", layout=LAYOUT)
        store.commit("talk", T, pages_for(T))
        store.commit("talk", T + [1])
    cases = walk_cases(home, url)
    assert {path for path, _, _ in cases} == command_paths(main)
    failed = []
    for path, words, shows in cases:
        args = words if path in {("db",), ("keys",)} else [*words, "--home", home, "--catalog-url", url]
        if path == ("serve",):  # serve stops at a broken config file it finds in the store folder
            (Path(home) / "dss-server.toml").write_text("this is = = not toml")
        result = CliRunner().invoke(main, args)
        try:
            ok = shows(result.exit_code, result.output)
        except ValueError:  # not the JSON it should be
            ok = False
        if not ok:
            failed.append(f"dss {' '.join(args)} -> {result.exit_code}: {result.output[:200]}")
    assert failed == []
    assert not (tmp_path / "dss-data").exists() and not (Path(home) / "catalog.db").exists()


def test_explain_names_the_divergence(tmp_path: Path) -> None:
    """A stored conversation and a prompt with one token changed at 6: text and JSON."""
    layout = dss.Layout(name="test", page_tokens=4, page_bytes=16, model="tiny", dtype="int8")
    tokens = list(range(10, 30))
    with dss.open(tmp_path / "x") as store:
        store.create_session("old", user_id="alice", layout=layout)
        store.commit("old", tokens, pages_for(tokens, layout))
        store.create_session("new", user_id="alice", layout=layout)
    prompt = tokens[:6] + [99] + tokens[7:]
    home = str(tmp_path / "x")
    code, out = run("--home", home, "explain", "new", ",".join(map(str, prompt)), "--context", "2")
    assert code == 0
    assert out.splitlines()[0] == "prompt: 20 tokens; reused now: 4 (from namespace)"
    assert out.splitlines()[2:] == [
        "first divergence: token 6",
        "  prompt [4:]: 14 15 | 99 17",
        "  stored [4:]: 14 15 | 16 17",
        "runs together again: prompt token 7, stored token 7, for 13 tokens",
        "without the divergence: 20 tokens reused (16 lost to it)",
        "recurring divergence positions (this process): 6 (1x)",
    ]
    assert out.splitlines()[1].startswith(
        "nearest stored version: session 'old' version 1 (20 tokens), Jaccard 0.619"
    )  # 13 of 21 shingles
    code, out = run("--home", home, "explain", "new", *map(str, prompt), "--json")
    data = json.loads(out)
    assert (code, data["divergence"], data["nearest"]["session_id"], data["lost_tokens"]) == (0, 6, "old", 16)
    code, out = run(
        "--home",
        home,
        "explain",
        "--user",
        "alice",
        "--layout",
        json.dumps(layout.to_dict()),
        "--json",
        *map(str, prompt),
    )
    assert (code, json.loads(out)["divergence"]) == (0, 6)
    assert run("--home", home, "explain", "new") == (
        1,
        "error: InvalidInput: give the prompt once: token ids as arguments, --tokens-file or --text-file\n",
    )
    assert run("--home", home, "explain", "new", "1", "x") == (1, "error: InvalidInput: token ids must be integers\n")


def test_explain_decodes_with_a_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "you", "are", "a", "helpful", "bot", "time", "monday", "tuesday", "hello", "there", "friend"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    layout = dss.Layout(name="test", page_tokens=2, page_bytes=16, model="tiny", dtype="int8")
    stored = tok.encode("you are a helpful bot time monday hello there friend").ids
    with dss.open(tmp_path / "x") as store:
        store.create_session("old", layout=layout)
        store.commit("old", stored, pages_for(stored, layout))
    (tmp_path / "p.txt").write_text("you are a helpful bot time tuesday hello there friend")
    code, out = run(
        "--home",
        str(tmp_path / "x"),
        "explain",
        "--user",
        "anonymous",
        "--layout",
        json.dumps(layout.to_dict()),
        "--tokenizer",
        str(path),
        "--text-file",
        str(tmp_path / "p.txt"),
        "--context",
        "2",
    )
    assert code == 0, out
    assert "first divergence: token 6" in out
    assert "  prompt text: 'bot time tuesday hello'" in out
    assert "  stored text: 'bot time monday hello'" in out


# -- forget-user ---------------------------------------------------------------------------------


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_forget_user_needs_its_tenant_for_the_erasure_and_the_dry_run(home: str) -> None:
    for extra in (["--yes"], ["--dry-run"]):
        code, out, err = invoke("--home", home, "forget-user", "alice", *extra)
        assert (code, out) == (2, "") and "Error: Missing option '--tenant'." in err
    with dss.open(home) as store:
        assert [s.session_id for s in store.sessions()] == ["chat"] and store.audit() == []


def test_forget_user_of_no_such_user_exits_3_with_a_no_such_user_receipt(home: str) -> None:
    code, out, err = invoke("--home", home, "forget-user", "alice", "--tenant", "other", "--dry-run")
    assert (code, out, err) == (3, "no such user: tenant 'other' has no user 'alice'; nothing to erase\n", "")
    code, out, err = invoke("--home", home, "forget-user", "alice", "--tenant", "other", "--yes", "--json")
    receipt = json.loads(out)
    assert (code, receipt["status"], receipt["user_known"], receipt["tenant_id"], "verification" in receipt) == (
        3,
        "no_such_user",
        False,
        "other",
        False,
    )
    assert err == "no such user: tenant 'other' has no user 'alice'; nothing was erased\n"
    code, out, _ = invoke("--home", home, "audit")
    assert code == 0 and out.splitlines()[1].split()[-2:] == ["0", "no_such_user"]
    code, out, err = invoke("--home", home, "forget-user", "alice", "--tenant", "acme", "--yes", "--json")
    assert (code, json.loads(out)["status"], json.loads(out)["removed"]["sessions"], err) == (0, "verified", 1, "")
    code, out, _ = invoke("--home", home, "audit", "--json")
    assert [(e["tenant_id"], e["receipt"]["status"]) for e in json.loads(out)] == [
        ("other", "no_such_user"),
        ("acme", "verified"),
    ]


def test_forget_user_help_documents_the_exit_statuses() -> None:
    code, out, _ = invoke("forget-user", "--help")
    assert code == 0 and "--tenant TEXT" in out and "[required]" in out
    assert "Exit status: 0 erased and verified; 3 the tenant has no such user" in " ".join(out.split())


# -- a missing store: commands that only read refuse it, commands that write make it and say so ---

NEEDS_A_STORE = [  # commands that read, and the destructive ones: a mistyped --home is an error, never a new store
    ["sessions"],
    ["versions", "chat"],
    ["sql", "SELECT 1 AS one"],
    ["check"],
    ["stats"],
    ["explain", "chat", "1", "2"],
    ["audit"],
    ["forget-user", "alice", "--tenant", "acme", "--dry-run"],
    ["forget-user", "alice", "--tenant", "acme", "--yes"],
    ["compact", "--dry-run"],
    ["compact", "--yes"],
    ["db", "current"],
]


@pytest.mark.parametrize("words", NEEDS_A_STORE, ids=lambda words: " ".join(words))
def test_a_command_that_reads_or_erases_refuses_a_missing_store_and_makes_nothing(
    tmp_path: Path, words: list[str]
) -> None:
    missing = tmp_path / "missing"
    assert invoke("--home", str(missing), *words) == (1, "", f"error: NoStore: no store at {missing}\n")
    assert not missing.exists()
    empty = tmp_path / "empty"  # a folder that holds no catalog is no store either
    empty.mkdir()
    assert invoke("--home", str(empty), *words) == (1, "", f"error: NoStore: no store at {empty}\n")
    assert list(empty.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_with_a_catalog_url_no_store_means_no_folder(catalog_url: str | None, tmp_path: Path) -> None:
    """A PostgreSQL catalog (or a SQLite one named by URL) lives outside the folder: a read of a
    missing folder is refused and makes neither the folder nor a catalog file."""
    url = catalog_url or f"sqlite:///{tmp_path / 'elsewhere.db'}"
    missing = tmp_path / "missing"
    for words in (["sessions"], ["check"], ["db", "current"]):
        assert invoke("--home", str(missing), "--catalog-url", url, *words) == (
            1,
            "",
            f"error: NoStore: no store at {missing}\n",
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_command_that_writes_makes_a_missing_store_and_says_so_once(tmp_path: Path) -> None:
    """Only the demo makes a store; the erasure and compaction then act on it without a word."""
    demo = tmp_path / "demo"
    code, out, err = invoke("--home", str(demo), "demo")
    assert (code, err) == (0, f"created a new store at {demo}\n") and out.startswith(f"dss demo in {demo}\n")
    code, out, err = invoke("--home", str(demo), "forget-user", "alice", "--tenant", "acme", "--yes")
    assert (code, json.loads(out)["status"], err) == (
        3,
        "no_such_user",
        "no such user: tenant 'acme' has no user 'alice'; nothing was erased\n",
    )
    assert invoke("--home", str(demo), "check") == (0, "ok: every invariant holds\n", "")
