"""``dss serve``, ``dss route`` and ``dss keys``: the service's commands, added to the ``dss`` command line.

:func:`register` is called by :mod:`dss.cli.main`. FastAPI and uvicorn are imported only when
``dss serve`` runs, so every other command works without the ``server`` extra.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import TYPE_CHECKING, Any, NoReturn

import click

from dss.cli.tables import emit
from dss.core.config import StoreConfig, load_config
from dss.core.errors import DssError
from dss.service.apikeys import add_key, read_keys, remove_key
from dss.service.config import ServerConfig, load_server_config

if TYPE_CHECKING:
    from dss.service.backends import RouterConfig


def _fail(message: str) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(1)


def _server_config(
    ctx: click.Context, home: str | None, config_file: str | None, **overrides: Any
) -> tuple[StoreConfig, ServerConfig]:
    """The store and server configurations for a command (``--home`` here wins over ``dss --home``)."""
    parent = ctx.find_root().obj
    store_config = load_config(home or getattr(parent, "home", None), catalog_url=getattr(parent, "catalog_url", None))
    return store_config, load_server_config(store_config.home, config_file, **overrides)


_home_option = click.option("--home", default=None, help="Store folder [default: dss --home, $DSS_HOME or ./dss-data].")
_config_option = click.option(
    "--config",
    "config_file",
    default=None,
    type=click.Path(dir_okay=False),
    help="Server config TOML [default: $DSS_SERVER_CONFIG or HOME/dss-server.toml].",
)


@click.command()
@_home_option
@_config_option
@click.option("--host", default=None, help="Address to listen on [default: 127.0.0.1; $DSS_SERVER_HOST].")
@click.option("--port", default=None, type=int, help="Port [default: 8077; $DSS_SERVER_PORT].")
@click.option("--keys-file", default=None, help="API keys file [default: HOME/api-keys.json; $DSS_SERVER_KEYS_FILE].")
@click.option("--max-body-bytes", default=None, help="Largest request body, e.g. 32MiB [$DSS_SERVER_MAX_BODY_BYTES].")
@click.option("--max-tokens", default=None, type=int, help="Most tokens per request [$DSS_SERVER_MAX_TOKENS].")
@click.option(
    "--public-metrics/--no-public-metrics",
    default=None,
    help="Serve /metrics without an API key [default: off; $DSS_SERVER_PUBLIC_METRICS].",
)
@click.option("--threads", default=None, type=int, help="Threads running store calls [default: 32].")
@click.option("--access-log/--no-access-log", default=None, help="Log every request line [default: off].")
@click.option(
    "--log-level",
    default=None,
    type=click.Choice(["critical", "error", "warning", "info", "debug"]),
    help="Log level [default: info; $DSS_SERVER_LOG_LEVEL].",
)
@click.pass_context
def serve(ctx: click.Context, /, home: str | None, config_file: str | None, **options: Any) -> None:
    """Serve the store over HTTP until SIGTERM or Ctrl-C (in-flight requests finish first)."""
    try:
        store_config, config = _server_config(ctx, home, config_file, **options)
    except DssError as exc:
        _fail(f"{exc.kind}: {exc}")
        return
    try:
        from dss.service.server import serve as run
    except ModuleNotFoundError as exc:
        _fail(f"dss serve needs the server extra ({exc.name} is missing): pip install 'dss-store[server]'")
        return
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.log_level != "debug":
        logging.getLogger("alembic").setLevel(logging.WARNING)
    try:
        run(store_config, config)
    except DssError as exc:
        _fail(f"{exc.kind}: {exc}")


@click.group()
def keys() -> None:
    """Manage the service's API keys (stored hashed; a new key is shown once)."""


@keys.command("add")
@click.argument("tenant")
@click.option("--admin", is_flag=True, help="An admin key: may read every tenant and run SQL.")
@click.option("--label", default=None, help="A note shown by `dss keys list`.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_home_option
@_config_option
@click.pass_context
def keys_add(
    ctx: click.Context,
    tenant: str,
    admin: bool,
    label: str | None,
    as_json: bool,
    home: str | None,
    config_file: str | None,
) -> None:
    """Make a new API key for TENANT and print it (only now: only its hash is stored)."""
    try:
        _, config = _server_config(ctx, home, config_file)
        key, entry = add_key(config.keys_file, tenant, is_admin=admin, label=label)
    except DssError as exc:
        _fail(f"{exc.kind}: {exc}")
        return
    if as_json:
        click.echo(
            json.dumps({"key": key, "key_id": entry.key_id, "tenant_id": entry.tenant_id, "is_admin": entry.is_admin})
        )
        return
    click.echo(key)
    click.echo(
        f"key {entry.key_id} for tenant {tenant!r}{' (admin)' if admin else ''}: store it now, it is not shown again",
        err=True,
    )


@keys.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_home_option
@_config_option
@click.pass_context
def keys_list(ctx: click.Context, as_json: bool, home: str | None, config_file: str | None) -> None:
    """List the keys: id, tenant, admin flag, label, creation time (never the keys themselves)."""
    try:
        _, config = _server_config(ctx, home, config_file)
        entries = read_keys(config.keys_file)
    except DssError as exc:
        _fail(f"{exc.kind}: {exc}")
        return
    if as_json:
        click.echo(
            json.dumps(
                [
                    {
                        "key_id": k.key_id,
                        "tenant_id": k.tenant_id,
                        "is_admin": k.is_admin,
                        "label": k.label,
                        "created_at": k.created_at.isoformat(timespec="seconds"),
                    }
                    for k in entries
                ]
            )
        )
        return

    emit(
        [
            {
                "key_id": k.key_id,
                "tenant_id": k.tenant_id,
                "is_admin": k.is_admin,
                "created_at": k.created_at,
                "label": k.label,
            }
            for k in entries
        ],
        False,
    )


@keys.command("remove")
@click.argument("key_id")
@_home_option
@_config_option
@click.pass_context
def keys_remove(ctx: click.Context, key_id: str, home: str | None, config_file: str | None) -> None:
    """Revoke the key KEY_ID (a running service stops accepting it within a second)."""
    try:
        _, config = _server_config(ctx, home, config_file)
        entry = remove_key(config.keys_file, key_id)
    except DssError as exc:
        _fail(f"{exc.kind}: {exc}")
        return
    click.echo(f"removed key {entry.key_id} of tenant {entry.tenant_id!r}")


@click.command()
@click.option(
    "--backend",
    "backends",
    multiple=True,
    required=True,
    metavar="NODE=URL",
    help="A vLLM OpenAI-compatible server and its node id, e.g. node-a=http://10.0.0.5:8000 (repeat).",
)
@click.option(
    "--policy",
    type=click.Choice(["kv", "hash", "round_robin"]),
    default="kv",
    show_default=True,
    help="kv: the node holding most of the session's pages; hash: consistent hashing with bounded load.",
)
@_home_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8078, type=int, show_default=True, help="Port.")
@click.option(
    "--load-factor",
    default=2.0,
    type=float,
    show_default=True,
    help="Most requests in flight on one node, as a multiple of the mean.",
)
@click.option("--health-interval", default=1.0, type=float, show_default=True, help="Seconds between health checks.")
@click.option("--no-store", is_flag=True, help="Do not open the store (kv routes by the router's memory only).")
@click.option("--max-body-bytes", default="32MiB", show_default=True, help="Largest request body (413 beyond).")
@click.option(
    "--graceful-timeout",
    default=5.0,
    type=float,
    show_default=True,
    help="On SIGTERM, seconds in-flight requests may take before they are cancelled.",
)
@click.option("--dry-run", is_flag=True, help="Check the settings and the store, say what would run, and exit.")
@click.option(
    "--log-level",
    default="info",
    type=click.Choice(["critical", "error", "warning", "info", "debug"]),
    show_default=True,
    help="Log level.",
)
@click.pass_context
def route(
    ctx: click.Context,
    /,
    backends: tuple[str, ...],
    policy: str,
    home: str | None,
    host: str,
    port: int,
    load_factor: float,
    health_interval: float,
    no_store: bool,
    max_body_bytes: str,
    graceful_timeout: float,
    dry_run: bool,
    log_level: str,
) -> None:
    """Proxy vLLM's OpenAI API (/v1/completions, /v1/chat/completions), sending each session
    to the node that holds its KV; fails over when a backend dies."""
    try:
        from dss.service.backends import StoreHoldings
        from dss.service.router import serve_router
    except ModuleNotFoundError as exc:
        _fail(f"dss route needs the server extra ({exc.name} is missing): pip install 'dss-store[server]'")
        return
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = _router_config(
        backends=backends,
        policy=policy,
        host=host,
        port=port,
        load_factor=load_factor,
        health_interval_s=health_interval,
        max_body_bytes=max_body_bytes,
        graceful_timeout_s=graceful_timeout,
    )
    store = None
    try:
        if policy == "kv" and not no_store:
            from dss.store import Store

            parent = ctx.find_root().obj
            store = Store(
                load_config(home or getattr(parent, "home", None), catalog_url=getattr(parent, "catalog_url", None))
            )
        if dry_run:
            where = f"store {store.config.home}: {store.count_sessions()} sessions" if store is not None else "no store"
            click.echo(
                f"dss route ({policy}) on http://{host}:{port} in front of "
                f"{', '.join(f'{n}={u}' for n, u in config.backends)}; {where}"
            )
            return
        serve_router(config, StoreHoldings(store) if store is not None else None, log_level=log_level)
    except DssError as exc:
        _fail(f"{exc.kind}: {exc}")
    finally:
        if store is not None:
            store.close()


def _router_config(*, backends: tuple[str, ...], **settings: Any) -> RouterConfig:
    """The router's validated settings; an invalid one ends the command with its message."""
    from pydantic import ValidationError

    from dss.service.backends import RouterConfig, parse_backends

    try:
        return RouterConfig(backends=parse_backends(backends), **settings)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        _fail(f"ConfigError: invalid router configuration: {problems}")
    except DssError as exc:
        _fail(f"{exc.kind}: {exc}")


def register(group: click.Group) -> None:
    """Add ``serve``, ``route`` and ``keys`` to the ``dss`` command group."""
    group.add_command(serve)
    group.add_command(route)
    group.add_command(keys)
