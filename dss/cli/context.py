"""What every ``dss`` command shares: the context (``--home``, ``--catalog-url``), opening
the store, and errors as one line with exit status 1."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from dss.core.config import StoreConfig, load_config
from dss.core.errors import DssError
from dss.store import Store
from dss.store.folder import has_store


class DssCommandError(click.ClickException):
    def format_message(self) -> str:
        return self.message

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.message}", err=True)


def guard(func: Callable[..., Any]) -> Callable[..., Any]:
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
