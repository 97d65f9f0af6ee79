"""The MkDocs hook that writes the generated reference pages at build time.

A page asks for a generated section with a marker line of its own, ``<!-- generated: NAME -->``;
:func:`on_page_markdown` replaces it with :data:`GENERATORS`' text for ``NAME``:

``cli``
    Every ``dss`` command, from the click group in ``dss.cli.main``: usage, help, arguments
    and every option with its help and default.
``store-settings``, ``server-settings``, ``connector-settings``
    Every setting of the store (``dss.core.config.StoreConfig``), of ``dss serve``
    (``dss.service.config.ServerConfig``) and of the vLLM connector's
    ``kv_connector_extra_config`` (``dss_adapters.vllm.settings.Settings``): its name, its
    ``DSS_*`` variable, its default and its description, read from the models' fields.
``http``
    The HTTP API, from the service app's OpenAPI document (:mod:`httpapi`).

Nothing generated is committed. A setting, command or option without a description stops the
build (:class:`Undocumented`), so the pages stay complete.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterator
from typing import Any

import click
import httpapi

MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.MULTILINE)


class Undocumented(Exception):
    """A command, option or setting has no description to put on its page."""


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs hook: the page with every generated marker replaced by its section."""
    return MARKER.sub(lambda match: generated(match.group(1)), markdown)


@functools.cache
def generated(name: str) -> str:
    """The Markdown of the generated section ``name`` (see the module docstring)."""
    if name not in GENERATORS:
        raise KeyError(f"no generated section {name!r}; known: {sorted(GENERATORS)}")
    return GENERATORS[name]()


# -- the command line --


def cli_reference() -> str:
    """Every command of ``dss``, depth first, with its options."""
    from dss.cli.main import main

    return "\n".join(_command(path, command) for path, command in commands(main))


def commands(group: click.Group, path: str = "dss") -> Iterator[tuple[str, click.Command]]:
    """``(full name, command)`` of the group and every command under it, depth first."""
    yield path, group
    for name in sorted(group.commands):
        command = group.commands[name]
        if isinstance(command, click.Group):
            yield from commands(command, f"{path} {name}")
        else:
            yield f"{path} {name}", command


def _command(path: str, command: click.Command) -> str:
    if not (command.help or "").strip():
        raise Undocumented(f"the command {path!r} has no help text")
    ctx = click.Context(command, info_name=path)
    usage = " ".join([path, *command.collect_usage_pieces(ctx)])
    lines = [f"## `{path}`\n", f"`{usage}`\n", _paragraphs(command.help), ""]
    if command.epilog:
        lines += [_paragraphs(command.epilog), ""]
    arguments = [p for p in command.params if isinstance(p, click.Argument)]
    if arguments:
        lines.append(
            "Arguments: "
            + ", ".join(f"`{a.human_readable_name}`" + ("" if a.required else " (optional)") for a in arguments)
            + ".\n"
        )
    options = [p for p in command.params if isinstance(p, click.Option) and not p.hidden]
    if isinstance(command, click.Group) or options:
        lines += ["| option | meaning |", "|---|---|"]
        lines += [f"| {_names(option)} | {_option_help(path, option)} |" for option in options]
        lines.append("| `-h`, `--help` | Show the command's help and exit. |")
    if isinstance(command, click.Group):
        lines.append("\nCommands: " + ", ".join(f"`{path} {name}`" for name in sorted(command.commands)) + ".")
    return "\n".join(lines) + "\n"


def _names(option: click.Option) -> str:
    names = ", ".join(f"`{name}`" for name in [*option.opts, *option.secondary_opts])
    if not option.is_flag and option.metavar:
        names += f" `{option.metavar}`"
    elif not option.is_flag and not option.count:
        names += f" `{option.type.get_metavar(option, click.Context(click.Command('x'))) or option.type.name.upper()}`"
    return names


def _option_help(path: str, option: click.Option) -> str:
    if not (option.help or "").strip():
        raise Undocumented(f"the option {option.opts[0]} of {path!r} has no help text")
    text = _cell(option.help)
    if option.show_default and option.default is not None and not option.is_flag:
        text += f" Default: `{option.default}`."
    if option.required:
        text += " Required."
    if option.multiple:
        text += " May be given more than once."
    if option.envvar:
        text += f" Also `${option.envvar}`."
    return text


# -- the settings --


def store_settings() -> str:
    """Every field of :class:`dss.core.config.StoreConfig`: variable, default, meaning."""
    from dss.core import config

    variables = {field: name for name, field in config._ENV.items()}
    extra = {
        "home": f"`{config.DEFAULT_HOME}`",
        "master_key_file": "`~/.config/dss/master.key`",
        "clock": "`time.monotonic`",
    }
    return _table(config.StoreConfig.model_fields.items(), variables, extra, "keyword argument or `dss.toml` only")


def server_settings() -> str:
    """Every field of :class:`dss.service.config.ServerConfig`: variable, default, meaning."""
    from dss.service import config

    variables = {field: name for name, field in config._ENV.items()}
    extra = {"keys_file": f"`HOME/{config.KEYS_FILE_NAME}`"}
    return _table(config.ServerConfig.model_fields.items(), variables, extra, "—")


def _table(fields: Any, variables: dict[str, str], defaults: dict[str, str], no_variable: str) -> str:
    lines = ["| setting | variable | default | meaning |", "|---|---|---|---|"]
    for name, field in fields:
        if not field.description:
            raise Undocumented(f"the setting {name!r} has no description")
        variable = f"`{variables[name]}`" if name in variables else no_variable
        default = defaults.get(name) or _default(name, field.default)
        lines.append(f"| `{name}` | {variable} | {default} | {_cell(field.description)}{_bounds(field)} |")
    return "\n".join(lines) + "\n"


def _bounds(field: Any) -> str:
    """The range a field's validation enforces (`` Range: > 0, ≤ 1.``), or nothing."""
    signs = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤", "min_length": "length ≥", "max_length": "length ≤"}
    found = [
        f"{sign} {getattr(item, key)}"
        for item in field.metadata
        for key, sign in signs.items()
        if getattr(item, key, None) is not None
    ]
    return f" Range: {', '.join(found)}." if found else ""


def connector_settings() -> str:
    """Every key of the vLLM connector's ``kv_connector_extra_config``: default, meaning."""
    from dss_adapters.vllm.settings import Settings

    lines = ["| key | default | meaning |", "|---|---|---|"]
    for field in dataclasses.fields(Settings):
        description = field.metadata.get("description")
        if not description:
            raise Undocumented(f"the connector setting {field.name!r} has no description")
        if field.default is not dataclasses.MISSING:
            default = _default(field.name, field.default)
        elif field.default_factory is not dataclasses.MISSING:
            default = f"`{field.default_factory()}`"
        else:
            default = "required"
        lines.append(f"| `{field.name}` | {default} | {_cell(description)} |")
    return "\n".join(lines) + "\n"


def _default(name: str, value: Any) -> str:
    from pydantic_core import PydanticUndefined

    if value is PydanticUndefined or value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int) and name.endswith("bytes") and value >= 1 << 20:
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20)):
            if value % size == 0:
                return f"{value // size} {unit}"
    if isinstance(value, int) and name.endswith("quota"):
        return "0 (no quota)"
    return f"`{value}`"


def _paragraphs(text: str) -> str:
    return "\n\n".join(" ".join(p.split()) for p in text.replace("\b", "").split("\n\n") if p.strip())


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


GENERATORS: dict[str, Callable[[], str]] = {
    "cli": cli_reference,
    "store-settings": store_settings,
    "server-settings": server_settings,
    "connector-settings": connector_settings,
    "http": lambda: httpapi.http_reference(httpapi.openapi()),
}
