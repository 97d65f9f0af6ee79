"""The multi-turn benchmark's workload (``benchmarks/chats.py``) and reuse arithmetic
(``benchmarks/multiturn.py``), and tiny runs of ``benchmarks/multiturn.py`` and
``benchmarks/ttft.py`` on the real model (slow: each starts vLLM engines), of
``benchmarks/tiers.py`` on a published trace and without sessions, of ``benchmarks/policies.py``
(host policies simulated on a trace), of ``benchmarks/commit_processes.py`` on PostgreSQL (slow:
it starts processes), of ``benchmarks/lsh.py`` (next turns) and of ``benchmarks/blend.py`` on the
real model (slow).

The tiny runs only show that the benchmarks run end to end and print their tables; their
timings mean nothing at these sizes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import chats
import multiturn
import policies
import tiers
from workload import WorkloadSpec


class TemplateOnly:
    """A stand-in tokenizer: one token per word of each message, 0 between messages, 1 to end."""

    def apply_chat_template(
        self, messages: list[dict[str, str]], *, add_generation_prompt: bool, tokenize: bool
    ) -> dict[str, list[int]]:
        assert add_generation_prompt and tokenize
        ids: list[int] = []
        for message in messages:
            ids += [len(word) + 2 for word in message["content"].split()] + [0]
        return {"input_ids": ids + [1]}


def test_twenty_conversations_of_ten_user_turns_in_everyday_words() -> None:
    assert len(chats.CHATS) == 20
    assert len({chat.topic for chat in chats.CHATS}) == 20
    for chat in chats.CHATS:
        assert len(chat.turns) == 10, chat.topic
        assert len(set(chat.turns)) == 10, chat.topic
        for message in chat.turns:
            assert 10 <= len(message.split()) <= 60, (chat.topic, message)


def test_a_turn_is_the_system_prompt_then_each_earlier_exchange_then_its_message() -> None:
    chat = chats.CHATS[3]
    out = chats.messages(chat, 2, ["first reply", "second reply"])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert out[0]["content"] == chats.SYSTEM
    assert [m["content"] for m in out[1:]] == [
        chat.turns[0],
        "first reply",
        chat.turns[1],
        "second reply",
        chat.turns[2],
    ]
    with pytest.raises(ValueError, match="needs 2 earlier replies"):
        chats.messages(chat, 2, ["only one"])
    with pytest.raises(ValueError, match="turns 0 to 9"):
        chats.messages(chat, 10, ["r"] * 10)


def test_render_returns_the_template_token_ids_whichever_form_the_tokenizer_returns() -> None:
    ids = chats.render(TemplateOnly(), chats.CHATS[0], 0, [])
    assert ids[-1] == 1 and ids.count(0) == 2 and all(isinstance(t, int) for t in ids)
    later = chats.render(TemplateOnly(), chats.CHATS[0], 1, ["a reply"])
    assert later[: len(ids) - 1] == ids[:-1]


def served(prompt: list[int], reply: list[int], cached: int = 0) -> multiturn.Served:
    return multiturn.Served(prompt, reply, cached, 0.1)


def test_the_ideal_is_the_block_aligned_prefix_the_previous_turn_computed() -> None:
    block = multiturn.BLOCK
    first = served(list(range(100)), list(range(100, 140)))  # KV computed for 100 + 39 tokens
    computed = first.prompt + first.reply[:-1]
    oracle = {(0, 0): first, (0, 1): served(first.prompt + first.reply + list(range(500, 530)), [7])}
    assert multiturn.ideal(oracle, 0, 0) == 0
    assert multiturn.ideal(oracle, 0, 1) == len(computed) // block * block == 128
    # a reply rendered back differently: reuse ends where the tokens part
    oracle[0, 1] = served(first.prompt + first.reply[:20] + [9] * 60, [7])
    assert multiturn.ideal(oracle, 0, 1) == 96
    # never the whole prompt: the engine computes at least its last token
    oracle[0, 1] = served(computed[:128], [7])
    assert multiturn.ideal(oracle, 0, 1) == 96


def test_the_summary_counts_reuse_beyond_the_ideal_and_outputs_equal_to_the_oracle() -> None:
    oracle = {
        (0, 0): served(list(range(64)), [1, 2], cached=32),
        (0, 1): served(list(range(64)) + [1, 2] + list(range(200, 260)), [3], cached=64),
    }
    mine = {(0, 0): served(oracle[0, 0].prompt, [1, 2], cached=32), (0, 1): served(oracle[0, 1].prompt, [4], cached=32)}
    figures = multiturn.summary(mine, oracle)
    assert figures["ideal"] == 64 and figures["reused"] == 64 and figures["beyond"] == 32
    assert figures["same"] == 1 and figures["requests"] == 2
    assert figures["prompt"] == 64 + 126


def run_benchmark(*args: str, timeout: int) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout


def table_rows(out: str) -> dict[str, list[str]]:
    rows: dict[str, list[str]] = {}
    for line in out.splitlines():
        if line.startswith("| ") and not line.startswith("| condition") and not line.startswith("| tokens"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.slow
def test_multiturn_runs_and_dss_answers_as_the_oracle() -> None:
    out = run_benchmark(
        "benchmarks/multiturn.py", "--conversations", "2", "--turns", "2", "--reply-tokens", "4", timeout=1800
    )
    rows = table_rows(out)
    assert sorted(rows) == ["oracle (big KV cache)", "vLLM + dss", "vLLM alone"], out
    oracle, dss_row = rows["oracle (big KV cache)"], rows["vLLM + dss"]
    assert oracle[0] == dss_row[0] == rows["vLLM alone"][0]  # the same prompts in every condition
    assert float(oracle[3].rstrip("%")) >= 100.0  # the oracle serves at least the ideal
    assert dss_row[-1] == oracle[-1] == "4/4"
    assert "rerun: .venv/bin/python benchmarks/multiturn.py --conversations 2 --turns 2" in out


@pytest.mark.slow
def test_ttft_runs_on_the_real_model() -> None:
    out = run_benchmark("benchmarks/ttft.py", "--sizes", "256", "--reps", "1", "--hit-reps", "1", timeout=1800)
    assert "SmolLM2-135M-Instruct bf16" in out
    rows = table_rows(out)
    assert list(rows) == ["256"], out


def test_a_trace_replays_as_lookups_and_the_same_replay_gives_the_same_figures() -> None:
    """The first 60 requests of the synthetic Mooncake trace, twice: the figures are the same
    (the mover steps on the trace's clock, not the wall clock)."""
    first, again = (
        [r.as_dict() for r in tiers.run_trace("synthetic", disks=(0.4,), watermarks=[(0.99, 0.97)], limit=60)]
        for _ in range(2)
    )
    assert first == again
    assert [(r["policy"], r["disk"], r["capacity"]) for r in first] == [
        ("dss", 0.4, 0.02),
        ("lru", 0.4, 0.02),
        ("dss 0.99/0.97", 0.4, 0.02),
        ("belady", 0.4, 0.02),
    ]
    assert all(r["prompt_tokens"] == first[0]["prompt_tokens"] for r in first)
    bound = first[-1]
    assert all(r["total_share"] <= bound["total_share"] for r in first)  # Belady bounds the total


def test_every_simulated_policy_serves_what_fits_and_belady_bounds_them_all() -> None:
    """Three pages read twice fit a cache of three: every policy hits the second pass. On the
    start of a published trace, Belady's optimum serves at least what any policy does."""
    reads = ["a", "b", "c", "a", "b", "c"]
    hits = {}
    for name, make in policies.policies(3, reads).items():
        cache = make()
        hits[name] = [cache.read(p) for p in reads]
    assert hits == {name: [False] * 3 + [True] * 3 for name in hits} and len(hits) == 11
    rows = policies.run("synthetic", 0.05, limit=300)
    assert [r.policy for r in rows][:2] == ["lru", "slru"] and rows[-1].policy == "belady"
    assert all(r.reads == rows[0].reads > 0 and r.hits <= rows[-1].hits for r in rows)
    out = run_benchmark("benchmarks/policies.py", "--requests", "200", timeout=300)
    assert "| count oracle |" in out and "best online policy:" in out and "rerun: " in out


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--capacity", "0"], "--capacity must be a share in (0, 1], not 0.0"),
        (["--requests", "0"], "--requests must be at least 1, not 0"),
        (["--trace", "no-such-trace"], "no trace 'no-such-trace'"),
        (["--trace", "README.md"], "cannot read trace 'README.md'"),
    ],
)
def test_the_policy_simulation_refuses_bad_arguments(arguments: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/policies.py", *arguments],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and message in done.stderr and done.stdout == "", done.stderr


def test_the_tier_benchmark_prints_its_table_and_bars() -> None:
    out = run_benchmark(
        "benchmarks/tiers.py", "--trace", "synthetic", "--requests", "40", "--disks", "0.2", timeout=600
    )
    assert "trace synthetic: 40 requests" in out
    assert "disk 0.2x,   2% host: dss/lru host share" in out and "points below" not in out


def test_the_chat_workload_replays_without_sessions() -> None:
    rows = tiers.run(
        (0.05,), ("dss", "lru", "belady", "dss+prefetch"), 1, WorkloadSpec(turns=40), disks=(0.4,), sessions=False
    )
    assert [r.policy for r in rows] == ["dss", "lru", "belady"]  # no prefetch without sessions
    dss_row, lru_row, bound = rows
    assert dss_row.prompt_tokens == lru_row.prompt_tokens == bound.prompt_tokens
    assert bound.total_share >= max(dss_row.total_share, lru_row.total_share)


@pytest.mark.slow
def test_commits_of_one_and_two_processes_on_one_catalog() -> None:
    from tests.conftest import PG_URL

    out = run_benchmark(
        "benchmarks/commit_processes.py", "--catalog", PG_URL, "--processes", "1", "2", "--duration", "1", timeout=600
    )
    lines = out.splitlines()
    assert lines[1].split() == ["processes", "commits", "commits/s", "per", "process", "x", "1", "proc", "p50", "ms", "p99", "ms", "SQL", "Python", "fsync"]  # fmt: skip
    assert [line.split()[0] for line in lines[2:4]] == ["1", "2"]
    assert all("missing or different after reopening: 0; check(): []" in line for line in lines[4:6])


def test_the_lsh_benchmark_prints_the_next_turn_figures() -> None:
    out = run_benchmark("benchmarks/lsh.py", "--chats", "20", "--turns", "4", "--queries", "10", timeout=600)
    rows = table_rows(out)
    assert rows["next turn: right conversation first"] == ["1.000", ">= 0.95"]
    assert rows["next turn: recall at containment >= 0.9"][1] == ">= 0.95"
    assert "next turn: lookup with / without prefixes" in rows


@pytest.mark.slow
def test_the_blend_benchmark_runs_on_the_real_model(smollm2_model: Path) -> None:
    out = run_benchmark(
        "benchmarks/blend.py",
        *("--chats", "1", "--reply-tokens", "8", "--turns", "3", "4", "--shares", "0", "1"),
        *("--selections", "computed", "last:8"),
        timeout=1200,
    )
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith(("| timestamp", "| dropped"))]
    assert [tuple(c.strip() for c in r[:4]) for r in rows[2:]] == [
        (kind, selection, share, "2")  # two prompts a kind: turns 3 and 4
        for kind in ("timestamp", "dropped")
        for selection in ("computed", "last:8")
        for share in ("0.00", "1.00")
    ]
    assert all(
        r[5].strip() == r[8].strip() == "1.000" for r in rows[2:] if r[2].strip() == "1.00"
    )  # recomputing all: the same first token and the same 16 teacher-forced ones
    assert "rerun: PYTHONPATH=. .venv/bin/python benchmarks/blend.py --chats 1 --reply-tokens 8 --turns 3 4" in out


def test_the_load_path_benchmark_runs_both_stores() -> None:
    out = run_benchmark("benchmarks/loadpath.py", "--tokens", "64", "--rounds", "1", timeout=600)
    rows = list(table_rows(out))
    assert rows[:3] == ["store", "sealed", "plain"], out  # "store": the header row
    assert rows[3] == "per layer (baseline)" and len(rows) == 5, out  # the same pages from RAM
    assert "sealing cost on the read path: fed" in out
    assert "rerun: PYTHONPATH=. .venv/bin/python benchmarks/loadpath.py --tokens 64 --rounds 1" in out


def test_a_trace_replays_with_disks_of_lower_precision_holding_more_pages() -> None:
    """The same disk bytes hold 1.94x int8 pages: dss@int8 serves at least dss's total."""
    rows = tiers.run_trace("synthetic", policies=("dss",), disks=(0.2,), limit=60, encodings=("int8",))
    assert [r.policy for r in rows] == ["dss", "dss@int8"]
    assert tiers.pages_per_disk(1000, "int8") == 1939 and tiers.pages_per_disk(1000, "exact") == 1000
    assert rows[1].total_share >= rows[0].total_share


@pytest.mark.slow
def test_the_precision_benchmark_runs_on_the_real_model() -> None:
    out = run_benchmark(
        "benchmarks/precision.py", "--chats", "1", "--turn", "1", "--ttft-tokens", "256", "--reps", "1", timeout=1800
    )
    rows = table_rows(out)
    assert list(rows)[1:] == ["exact split vs full forward (floor)", "exact", "int8", "fp8", "k8v4"], out
    assert rows["int8"][4] == "0.52" and rows["k8v4"][4] == "0.40"  # bytes per page x exact
    assert len(rows["int8"]) == 12
    assert "bars (int8):" in out
