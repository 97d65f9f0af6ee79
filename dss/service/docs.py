"""The browsable API: the bearer scheme the OpenAPI document declares, and ``/docs`` and ``/redoc``
on assets the service serves itself.

:data:`BEARER` is a dependency of every protected route, so the document says each needs
``Authorization: Bearer <key>`` and Swagger UI's "Authorize" sends it; it checks nothing (the key
is checked by :class:`~dss.service.middleware.AuthMiddleware` before any route runs).
:func:`add_docs` serves Swagger UI and ReDoc from the ``fastapi-offline`` package's copies of their
scripts and style sheets (FastAPI's own pages load them from a CDN), so the pages work on a host
without the internet. Neither page needs a key: they describe the API, not its data.
"""

from __future__ import annotations

import importlib.resources

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import Response
from fastapi.security import HTTPBearer
from fastapi.staticfiles import StaticFiles

BEARER = HTTPBearer(
    auto_error=False,
    scheme_name="bearer",
    description="An API key of `dss keys add`, sent as `Authorization: Bearer <key>`.",
)
"""Declares the bearer scheme in the OpenAPI document (so /docs sends the key); the key itself is
checked by :class:`~dss.service.middleware.AuthMiddleware`, before any route runs."""


DOCS_ASSETS = "/docs/assets"
"""Where the browsable API's scripts, style sheet and icon are served from (the ``fastapi-offline``
package's copies of Swagger UI and ReDoc), so /docs and /redoc work without the internet."""


def add_docs(app: FastAPI) -> None:
    """``/docs`` (Swagger UI) and ``/redoc`` on local assets; neither needs a key (the document lists
    the API, not its data), and "Try it out" sends the key given under "Authorize"."""
    app.mount(
        DOCS_ASSETS,
        StaticFiles(directory=str(importlib.resources.files("fastapi_offline") / "static")),
        name="docs-assets",
    )

    @app.get("/docs", include_in_schema=False)
    def docs() -> Response:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="dss API",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon.png",
            swagger_ui_parameters={"persistAuthorization": True},
        )

    @app.get("/redoc", include_in_schema=False)
    def redoc() -> Response:
        return get_redoc_html(
            openapi_url="/openapi.json",
            title="dss API",
            redoc_js_url=f"{DOCS_ASSETS}/redoc.standalone.js",
            redoc_favicon_url=f"{DOCS_ASSETS}/favicon.png",
            with_google_fonts=False,
        )
