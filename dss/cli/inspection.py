"""The commands that read the store: ``sessions``, ``versions``, ``sql``, ``check``, ``stats``, ``explain``."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from dss.cli.context import Context, DssCommandError, guard, pass_ctx
from dss.cli.tables import emit as _emit


@click.command()
@click.option("--tenant", default=None, help="Only this tenant's sessions.")
@click.option("--user", default=None, help="Only this user's sessions.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_ctx
@guard
def sessions(ctx: Context, tenant: str | None, user: str | None, as_json: bool) -> None:
    """List sessions with their owner, head and number of versions."""
    with ctx.open() as store:
        rows = [
            {
                "session_id": s.session_id,
                "tenant_id": s.tenant_id,
                "user_id": s.user_id,
                "layout": s.layout.name,
                "head": s.head_id,
                "versions": s.num_versions,
                "last_access": s.last_access,
            }
            for s in store.sessions(tenant_id=tenant, user_id=user)
        ]
    _emit(rows, as_json)


@click.command()
@click.argument("session_id")
@click.option("--tenant", default=None, help="Tenant of the session (needed if several tenants use the id).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_ctx
@guard
def versions(ctx: Context, session_id: str, tenant: str | None, as_json: bool) -> None:
    """List the versions of a session (the head is marked)."""
    with ctx.open() as store:
        rows = [
            {
                "version_id": v.version_id,
                "parent_id": v.parent_id,
                "tokens": v.num_tokens,
                "label": v.label,
                "head": v.is_head,
                "pinned": v.is_pinned,
                "created_at": v.created_at,
            }
            for v in store.versions(session_id, tenant_id=tenant)
        ]
    _emit(rows, as_json)


@click.command()
@click.argument("query")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option(
    "--max-rows",
    default=10_000,
    show_default=True,
    type=click.IntRange(min=1),
    help="Stop after this many rows (standard error says when the result was cut).",
)
@pass_ctx
@guard
def sql(ctx: Context, query: str, as_json: bool, max_rows: int) -> None:
    """Run a read-only SQL query on the catalog (views: session_summary, user_summary, tier_usage, ...)."""
    with ctx.open() as store:
        result = store.sql(query, max_rows=max_rows + 1)  # one more row tells whether there are more
    rows = result.rows[:max_rows]
    _emit([dict(zip(result.columns, row)) for row in rows], as_json, columns=result.columns)
    if len(result.rows) > max_rows:
        click.echo(
            json.dumps({"truncated": True, "max_rows": max_rows})
            if as_json
            else f"dss sql: the result was cut at {max_rows} rows (--max-rows {max_rows}); the query returns more",
            err=True,
        )


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_ctx
@guard
def check(ctx: Context, as_json: bool) -> None:
    """Verify every invariant of the store; exit 1 if any is broken."""
    with ctx.open() as store:
        problems = store.check()
    if as_json:
        click.echo(json.dumps({"ok": not problems, "problems": problems}))
    elif problems:
        for problem in problems:
            click.echo(f"problem: {problem}")
    else:
        click.echo("ok: every invariant holds")
    if problems:
        sys.exit(1)


STATS_COLUMNS = (
    "tier",
    "pages",
    "bytes",
    "capacity",
    "fill",
    "inactive",
    "high",
    "low",
    "hits",
    "misses",
    "promotions",
    "demotions",
    "evictions",
    "moved_bytes",
)
"""The columns of ``dss stats``' table of tiers."""


def _tier_row(tier: str, values: dict[str, Any]) -> dict[str, Any]:
    """A tier's row of ``dss stats``: its fill, inactive bytes and watermarks as shares of capacity."""
    capacity = values["capacity"] or 1
    inactive = values.get("inactive_bytes", 0)
    return {
        "tier": tier,
        "fill": round((values["bytes"] - inactive) / capacity, 4),
        "inactive": inactive,
        "high": round(values["high_watermark"] / capacity, 4),
        "low": round(values["low_watermark"] / capacity, 4),
        **values,
    }


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_ctx
@guard
def stats(ctx: Context, as_json: bool) -> None:
    """Show how full each tier is against its watermarks, and what the placement policy did.

    One row per tier (fill: active bytes over capacity, what the watermarks measure;
    inactive: bytes of host pages the mover demoted, still readable until their room is
    needed; high and low: the watermarks as shares of the capacity), then a prefetch
    line and the MinHash-LSH index's size. Counters are this process's: for a live
    store's, ask the service that holds it (GET /v1/stats of dss serve).
    """
    with ctx.open() as store:
        data = store.stats()
    rows = [_tier_row(tier, data[tier]) for tier in ("host", "disk")]
    rows.append({"tier": "prefetch", **data["prefetch"]})
    lsh = data["lsh"]
    if as_json:
        _emit([*rows, {"tier": "lsh", **lsh}], True)
        return
    table = [
        {
            **row,
            "fill": f"{row['fill']:.0%}" + (" (over high)" if row["fill"] > row["high"] else ""),
            "high": f"{row['high']:.0%}",
            "low": f"{row['low']:.0%}",
        }
        for row in rows[:2]
    ]
    _emit(table, False, STATS_COLUMNS)
    prefetch = data["prefetch"]
    click.echo(
        f"prefetch: {prefetch['issued']} pages moved up, {prefetch['hits']} read from host, "
        f"{prefetch['wasted']} left unread; policy {data['policy']['name']}"
    )
    click.echo(
        f"lsh index: {lsh['entries']} entries in {lsh['indexes']} indexes (capacity {lsh['capacity']}, "
        f"{lsh['storage']})"
    )


@click.command()
@click.argument("session_id", required=False)
@click.argument("tokens", nargs=-1)
@click.option(
    "--tokens-file",
    type=click.File("r"),
    default=None,
    help="Token ids: a JSON list or whitespace-separated ints ('-': stdin).",
)
@click.option("--text-file", type=click.File("r"), default=None, help="The prompt as text (needs --tokenizer).")
@click.option(
    "--tokenizer",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="A tokenizer.json (Hugging Face tokenizers): decodes the windows, encodes --text-file.",
)
@click.option("--tenant", default=None, help="Tenant of the session, or of --user.")
@click.option("--user", default=None, help="Without a session: the user whose namespace to search.")
@click.option("--layout", "layout_json", default=None, help="Without a session: the layout, as JSON.")
@click.option("--context", default=8, show_default=True, help="Tokens shown on each side of the divergence.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_ctx
@guard
def explain(
    ctx: Context,
    session_id: str | None,
    tokens: tuple[str, ...],
    tokens_file: Any,
    text_file: Any,
    tokenizer: str | None,
    tenant: str | None,
    user: str | None,
    layout_json: str | None,
    context: int,
    as_json: bool,
) -> None:
    """Why exact reuse of a prompt stops where it does: its first divergence from the nearest
    stored version (the session's, or any of its namespace and layout), the tokens around it,
    and the reuse it costs. Token ids as arguments ("1 2 3" or "1,2,3"), or from a file.
    With --user (and --layout) there is no SESSION_ID: every argument is a token id."""
    from dss.cli.explain import describe, explanation_json, load_tokenizer, read_prompt

    if user is not None and session_id is not None:
        tokens = (session_id, *tokens)
        session_id = None

    coder = load_tokenizer(tokenizer) if tokenizer is not None else None
    prompt = read_prompt(tokens, tokens_file, text_file, coder)
    layout = None
    if layout_json is not None:
        from dss.core.types import Layout

        try:
            layout = Layout.from_dict(json.loads(layout_json))
        except json.JSONDecodeError as exc:
            raise DssCommandError(f"InvalidInput: --layout is not JSON: {exc.msg}") from None
    decode = coder.decode if coder is not None else None
    with ctx.open() as store:
        why = store.explain(
            session_id, prompt, tenant_id=tenant, user_id=user, layout=layout, decode=decode, context=context
        )
    if as_json:
        click.echo(json.dumps(explanation_json(why)))
    else:
        click.echo(describe(why))
