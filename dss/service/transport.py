"""The client's connection to ``dss serve``: one HTTP connection pool, a request and its answer
or the error its problem details name, and the client-side checks of what a request carries
(see :mod:`dss.service.client`)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, Self

import httpx

from dss.core.tokens import TokenInput, pack, unpack
from dss.core.validate import check_layout, page_payloads
from dss.core.version import VERSION
from dss.service import codec
from dss.service.config import default_api_key
from dss.service.problems import Unavailable, error_from_problem
from dss.sessions.resume import Rates


class Transport:
    """One service's connection pool, shared by the client's threads."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeout: float = 60.0,
        retries: int = 2,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        api_key = api_key if api_key is not None else default_api_key()
        headers = {"User-Agent": f"dss-client/{VERSION}"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout
        self._http = httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=timeout,
            transport=transport or httpx.HTTPTransport(retries=retries),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
        )
        self._rates: Rates | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Client({self.url!r})"

    def close(self) -> None:
        """Close the connection pool. Idempotent; the service and its store stay up."""
        self._http.close()

    @property
    def is_closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._http.is_closed

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _resume_rates(self) -> Rates:
        if self._rates is None:
            rates = codec.rates_from(self._call("GET", "/v1/info")["rates"])
            with self._lock:
                self._rates = rates
        return self._rates

    def _call(self, method: str, path: str, *, json: Any = None, params: dict[str, Any] | None = None) -> Any:
        """Send one request; the decoded JSON answer, or the ``DssError`` its problem details name."""
        try:
            response = self._http.request(method, path, json=json, params=params)
        except httpx.TimeoutException as exc:
            raise Unavailable(
                f"the dss service at {self.url} did not answer {method} {path} within "
                f"{self.timeout}s (a write may or may not have happened)"
            ) from exc
        except httpx.TransportError as exc:
            raise Unavailable(f"cannot reach the dss service at {self.url}: {exc}") from exc
        if response.status_code >= 400:
            try:
                body: Any = response.json()
            except ValueError:
                body = response.text
            raise error_from_problem(response.status_code, body)
        return response.json()


def params_of(**values: Any) -> dict[str, Any]:
    """Query parameters, those that are ``None`` left out."""
    return {k: v for k, v in values.items() if v is not None}


def layout_dict(layout: Any) -> dict[str, Any]:
    """A layout as JSON, refused here exactly as the store refuses it (``InvalidLayout``)."""
    return check_layout(layout).to_dict()


def token_list(tokens: TokenInput) -> list[int]:
    """Tokens as a list of ints, refused here exactly as the store refuses them (``InvalidTokens``)."""
    return unpack(pack(tokens))


def encode_pages(pages: Mapping[int, Any] | None) -> dict[str, str] | None:
    """Page payloads as base64 keyed by index; ``InvalidPage`` for what cannot be sent."""
    if pages is None:
        return None
    return {str(index): codec.encode_page(view.tobytes()) or "" for index, view in page_payloads(pages).items()}
