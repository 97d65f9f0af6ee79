"""The commands that erase, compact and migrate: ``forget-user``, ``compact``, ``audit``, ``db``."""

from __future__ import annotations

import json
import sys

import click

from dss.catalog.database import catalog_errors, open_catalog
from dss.cli.context import Context, DssCommandError, guard, pass_ctx
from dss.cli.progress import bar
from dss.cli.tables import emit as _emit
from dss.core.crypto import read_master_key
from dss.core.errors import NoStore
from dss.erasure.documents import STEPS, Plan
from dss.store.folder import has_store
from dss.writes.compaction import Compaction

NO_SUCH_USER_EXIT = 3
"""The exit status of ``dss forget-user`` (and its dry run) when the tenant has no such user."""


@click.command(
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
@guard
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


@click.command()
@click.option("--dry-run", is_flag=True, help="Print what compaction would do; change nothing.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_ctx
@guard
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


@click.command()
@click.option("--tenant", default=None, help="Only this tenant's receipts.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (the full receipts).")
@pass_ctx
@guard
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


@click.group()
def db() -> None:
    """Manage the catalog database."""


@db.command()
@pass_ctx
@guard
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
@guard
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
