"""Configuration of ``dss serve``: one validated object from arguments, ``DSS_SERVER_*`` variables and a file.

This is the only module of the service that reads the environment (the store's own
settings come from :func:`dss.core.config.load_config`). Precedence, highest first: keyword
arguments (the command line), ``DSS_SERVER_*`` environment variables, the TOML file named
by ``DSS_SERVER_CONFIG`` or ``--config`` (else ``dss-server.toml`` in the store folder, if
present), the defaults below. Server settings live in their own file because the store's
``dss.toml`` accepts store settings only. Nothing mutates the resulting object.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dss.core.config import parse_size
from dss.core.errors import ConfigError

SERVER_FILE_NAME = "dss-server.toml"
KEYS_FILE_NAME = "api-keys.json"


class ServerConfig(BaseModel):
    """Everything ``dss serve`` needs beyond the store's own configuration. Immutable once built."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field("127.0.0.1", min_length=1, description="Address to listen on.")
    port: int = Field(8077, ge=1, le=65535, description="TCP port to listen on.")
    keys_file: Path = Field(description="JSON file of API keys (hashed), as `dss keys add` writes it.")
    max_body_bytes: int = Field(
        32 << 20, ge=1024, description="Largest request body; also the most page bytes one read returns."
    )
    max_tokens: int = Field(1 << 20, ge=1, le=1 << 31, description="Most tokens one request may carry.")
    public_metrics: bool = Field(False, description="Serve /metrics without an API key (else an admin key).")
    graceful_timeout_s: int = Field(30, ge=0, description="On SIGTERM, seconds in-flight requests may take to finish.")
    threads: int = Field(32, ge=1, le=1024, description="Threads running store calls.")
    access_log: bool = Field(False, description="Log every request line (it names session ids: off by default).")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field("info", description="Log level.")

    @field_validator("max_body_bytes", mode="before")
    @classmethod
    def _size(cls, value: Any) -> int:
        return parse_size(value)

    @property
    def url(self) -> str:
        """The base URL clients use."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


_ENV = {
    "DSS_SERVER_HOST": "host",
    "DSS_SERVER_PORT": "port",
    "DSS_SERVER_KEYS_FILE": "keys_file",
    "DSS_SERVER_MAX_BODY_BYTES": "max_body_bytes",
    "DSS_SERVER_MAX_TOKENS": "max_tokens",
    "DSS_SERVER_PUBLIC_METRICS": "public_metrics",
    "DSS_SERVER_GRACEFUL_TIMEOUT_S": "graceful_timeout_s",
    "DSS_SERVER_THREADS": "threads",
    "DSS_SERVER_ACCESS_LOG": "access_log",
    "DSS_SERVER_LOG_LEVEL": "log_level",
}


def load_server_config(
    home: str | os.PathLike[str], config_file: str | os.PathLike[str] | None = None, **overrides: Any
) -> ServerConfig:
    """Build a :class:`ServerConfig` for the store folder ``home``; raises ``ConfigError`` naming the
    bad value and where it came from. ``None`` overrides are ignored (an option not given)."""
    sources: dict[str, str] = {}
    file_path = config_file or os.environ.get("DSS_SERVER_CONFIG")
    file_values: dict[str, Any] = {}
    if file_path is None and (Path(home) / SERVER_FILE_NAME).is_file():
        file_path = Path(home) / SERVER_FILE_NAME
    if file_path is not None:
        try:
            with open(file_path, "rb") as f:
                file_values = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read server config file {file_path}: {exc}") from None
        sources.update({key: f"file {file_path}" for key in file_values})
    env = {field: os.environ[name] for name, field in _ENV.items() if os.environ.get(name)}
    sources.update({field: name for name, field in _ENV.items() if field in env})
    given = {k: v for k, v in overrides.items() if v is not None}
    sources.update({key: "argument" for key in given})
    values = {**file_values, **env, **given}
    values.setdefault("keys_file", Path(home) / KEYS_FILE_NAME)
    try:
        return ServerConfig(**values)
    except ValidationError as exc:
        problems = "; ".join(_describe(e, sources) for e in exc.errors())
        raise ConfigError(f"invalid dss server configuration: {problems}") from None


def default_api_key() -> str | None:
    """The API key clients use when none is given: ``DSS_API_KEY``, or ``None``."""
    return os.environ.get("DSS_API_KEY") or None


def _describe(error: Any, sources: dict[str, str]) -> str:
    field = ".".join(map(str, error["loc"]))
    source = sources.get(str(error["loc"][0])) if error["loc"] else None
    return f"{field}: {error['msg']}" + (f" (from {source})" if source else "")
