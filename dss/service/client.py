"""A client of ``dss serve`` with the API of the embedded store: switch with one line.

    store = dss.open("dss-data")                                   # in this process
    store = dss.connect("http://127.0.0.1:8077", api_key=KEY)      # through the service

:class:`Client` has the methods of :class:`dss.Store` with the same arguments, results
(:class:`~dss.Version`, :class:`~dss.Session`, :class:`~dss.ResumeResult`, :class:`~dss.SqlResult`)
and errors (the same :class:`~dss.DssError` subclasses, with the store's messages). The
differences are those of a shared service:

* Every call acts in the API key's tenant; ``tenant_id`` defaults to it (``create_session``
  and ``sessions`` included). An admin key may name another tenant to read it.
* ``sql``, ``check``, ``stats``, ``count_sessions``, ``compact``, ``run_mover`` and
  the engines' reports (``mark_resident``, ``evicted``, ``forget_engine``: an engine serves every
  tenant) need an admin key (else ``Forbidden``).
* Transport failures raise :class:`~dss.service.problems.Unavailable` (status 503). A timed-out
  write may or may not have happened; nothing is retried once a request was sent.
* A request carries at most the service's ``max_tokens`` tokens and ``max_body_bytes``
  bytes (``PayloadTooLarge``); see :meth:`Client.info`.

A client is thread-safe (one connection pool); close it, or use it as a context manager.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from dss.approx.explanation import Explanation
from dss.approx.nearest import Decode
from dss.core.tokens import TokenInput
from dss.core.types import Layout, SavedPages, Session, SqlResult, Version
from dss.core.validate import check_callback, check_flag, check_version_id
from dss.erasure.documents import AuditEntry, Plan, Receipt
from dss.service import codec
from dss.service.codec import load
from dss.service.engine_calls import EngineCalls
from dss.service.transport import encode_pages, layout_dict, params_of, token_list
from dss.sessions.resume import Candidate, ResumeResult
from dss.writes.compaction import Compaction


class Client(EngineCalls):
    """A ``dss serve`` service seen through the :class:`dss.Store` API (see the module docstring).

    ``api_key`` defaults to ``DSS_API_KEY``; ``timeout`` is seconds per request; ``retries``
    re-attempts a connection that could not be made (nothing was sent, so this is safe for
    writes); ``transport`` replaces the HTTP transport (tests).
    """

    # -- the service -----------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """``GET /healthz``: ``{"status": "ok", "version": ...}``; raises ``Unavailable`` when closing."""
        return dict(self._call("GET", "/healthz"))

    def info(self) -> dict[str, Any]:
        """The key's tenant and admin flag, the service's limits and its resume rates."""
        return dict(self._call("GET", "/v1/info"))

    # -- sessions --------------------------------------------------------------------------

    def create_session(
        self, session_id: str, *, user_id: str = "anonymous", tenant_id: str | None = None, layout: Layout
    ) -> Session:
        """:meth:`dss.Store.create_session` in the key's tenant (idempotent for the same owner and layout)."""
        body = {"session_id": session_id, "user_id": user_id, "layout": layout_dict(layout), "tenant_id": tenant_id}
        return load(Session, self._call("POST", "/v1/sessions", json=body))

    def session(self, session_id: str, *, tenant_id: str | None = None) -> Session:
        """:meth:`dss.Store.session`; raises ``UnknownSession``."""
        return load(
            Session, self._call("GET", "/v1/session", params=params_of(session_id=session_id, tenant_id=tenant_id))
        )

    def sessions(
        self, *, tenant_id: str | None = None, user_id: str | None = None, all_tenants: bool = False
    ) -> list[Session]:
        """The key's tenant's sessions (``all_tenants``: every tenant's, admin key), oldest first."""
        params = params_of(tenant_id=tenant_id, user_id=user_id, all_tenants="true" if all_tenants else None)
        return [load(Session, s) for s in self._call("GET", "/v1/sessions", params=params)]

    def count_sessions(self) -> int:
        """:meth:`dss.Store.count_sessions`: every tenant's sessions (admin key)."""
        return int(self._call("GET", "/v1/sessions/count")["num_sessions"])

    def delete_session(self, session_id: str, *, tenant_id: str | None = None) -> int:
        """:meth:`dss.Store.delete_session`: the number of pages released."""
        out = self._call("DELETE", "/v1/session", params=params_of(session_id=session_id, tenant_id=tenant_id))
        return int(out["num_pages_released"])

    # -- versions --------------------------------------------------------------------------

    def commit(
        self,
        session_id: str,
        tokens: TokenInput,
        pages: Mapping[int, bytes] | None = None,
        *,
        label: str | None = None,
        tenant_id: str | None = None,
    ) -> Version:
        """:meth:`dss.Store.commit`; returns once the service has made the version durable."""
        body = {
            "session_id": session_id,
            "tokens": token_list(tokens),
            "pages": encode_pages(pages),
            "label": label,
            "tenant_id": tenant_id,
        }
        return load(Version, self._call("POST", "/v1/commit", json=body))

    def save_pages(
        self,
        session_id: str | None,
        tokens: TokenInput,
        pages: Mapping[int, bytes],
        *,
        tenant_id: str | None = None,
        user_id: str | None = None,
        layout: Layout | None = None,
    ) -> SavedPages:
        """:meth:`dss.Store.save_pages`: every given page's id, and how many were new."""
        body = {
            "session_id": session_id,
            "tokens": token_list(tokens),
            "pages": encode_pages(pages) or {},
            "tenant_id": tenant_id,
            "user_id": user_id,
            "layout": layout_dict(layout) if layout is not None else None,
        }
        return codec.saved_from(self._call("POST", "/v1/pages", json=body))

    def rollback(self, session_id: str, version_id: int, *, tenant_id: str | None = None) -> Version:
        """:meth:`dss.Store.rollback`: the version that is now the head."""
        body = {"session_id": session_id, "version_id": check_version_id(version_id), "tenant_id": tenant_id}
        return load(Version, self._call("POST", "/v1/rollback", json=body))

    def branch(
        self,
        session_id: str,
        version_id: int,
        new_session_id: str,
        *,
        tenant_id: str | None = None,
        label: str | None = None,
    ) -> Session:
        """:meth:`dss.Store.branch`: the new session."""
        body = {
            "session_id": session_id,
            "version_id": check_version_id(version_id),
            "new_session_id": new_session_id,
            "label": label,
            "tenant_id": tenant_id,
        }
        return load(Session, self._call("POST", "/v1/branch", json=body))

    def versions(self, session_id: str, *, tenant_id: str | None = None) -> list[Version]:
        """:meth:`dss.Store.versions`, oldest first."""
        rows = self._call("GET", "/v1/versions", params=params_of(session_id=session_id, tenant_id=tenant_id))
        return [load(Version, v) for v in rows]

    def tokens(self, session_id: str, version_id: int | None = None, *, tenant_id: str | None = None) -> list[int]:
        """:meth:`dss.Store.tokens` (default the head)."""
        if version_id is not None:
            check_version_id(version_id)
        params = params_of(session_id=session_id, version_id=version_id, tenant_id=tenant_id)
        return list(self._call("GET", "/v1/tokens", params=params)["tokens"])

    def pin(self, session_id: str, version_id: int, *, pinned: bool = True, tenant_id: str | None = None) -> Version:
        """:meth:`dss.Store.pin`."""
        check_flag("pinned", pinned)
        body = {
            "session_id": session_id,
            "version_id": check_version_id(version_id),
            "pinned": pinned,
            "tenant_id": tenant_id,
        }
        return load(Version, self._call("POST", "/v1/pin", json=body))

    # -- resume and pages ------------------------------------------------------------------

    def resume(
        self, session_id: str, tokens: TokenInput, *, tenant_id: str | None = None, approximate: bool | None = None
    ) -> ResumeResult:
        """:meth:`dss.Store.resume`."""
        body = {
            "session_id": session_id,
            "tokens": token_list(tokens),
            "tenant_id": tenant_id,
            "approximate": approximate,
        }
        return codec.resume_from(self._call("POST", "/v1/resume", json=body), self._resume_rates())

    def lookup(
        self,
        tokens: TokenInput,
        *,
        layout: Layout,
        user_id: str = "anonymous",
        tenant_id: str | None = None,
        approximate: bool | None = None,
    ) -> ResumeResult:
        """:meth:`dss.Store.lookup` in the key's tenant."""
        body = {
            "tokens": token_list(tokens),
            "layout": layout_dict(layout),
            "user_id": user_id,
            "tenant_id": tenant_id,
            "approximate": approximate,
        }
        return codec.resume_from(self._call("POST", "/v1/lookup", json=body), self._resume_rates())

    def nearest(
        self,
        tokens: TokenInput,
        *,
        session_id: str | None = None,
        tenant_id: str | None = None,
        user_id: str | None = None,
        layout: Layout | None = None,
        k: int = 5,
    ) -> list[Candidate]:
        """:meth:`dss.Store.nearest`."""
        body = {
            "tokens": token_list(tokens),
            "session_id": session_id,
            "tenant_id": tenant_id,
            "user_id": user_id,
            "layout": layout_dict(layout) if layout is not None else None,
            "k": k,
        }
        return [load(Candidate, c) for c in self._call("POST", "/v1/nearest", json=body)["candidates"]]

    def explain(
        self,
        session_id: str | None,
        tokens: TokenInput,
        *,
        tenant_id: str | None = None,
        user_id: str | None = None,
        layout: Layout | None = None,
        decode: Decode | None = None,
        context: int = 8,
    ) -> Explanation:
        """:meth:`dss.Store.explain` (``decode`` runs here, on the windows the service returns)."""
        check_callback("decode", decode)
        body = {
            "tokens": token_list(tokens),
            "session_id": session_id,
            "tenant_id": tenant_id,
            "user_id": user_id,
            "layout": layout_dict(layout) if layout is not None else None,
            "context": context,
        }
        why = load(Explanation, self._call("POST", "/v1/explain", json=body))
        if decode is not None and why.divergence is not None:
            why = replace(why, prompt_text=decode(why.prompt_window), stored_text=decode(why.stored_window))
        return why

    def prefetch_candidates(
        self,
        tokens: TokenInput,
        *,
        session_id: str | None = None,
        tenant_id: str | None = None,
        user_id: str | None = None,
        layout: Layout | None = None,
        promote: bool = True,
    ) -> list[bytes]:
        """:meth:`dss.Store.prefetch_candidates` (``promote`` reads the pages into the service's host tier)."""
        check_flag("promote", promote)
        body = {
            "tokens": token_list(tokens),
            "session_id": session_id,
            "tenant_id": tenant_id,
            "user_id": user_id,
            "layout": layout_dict(layout) if layout is not None else None,
            "promote": promote,
        }
        return [bytes.fromhex(p) for p in self._call("POST", "/v1/prefetch_candidates", json=body)["page_ids"]]

    def register_prefix(
        self,
        tokens: TokenInput,
        pages: Mapping[int, bytes],
        *,
        layout: Layout,
        tenant_id: str | None = None,
        label: str | None = None,
    ) -> Version:
        """:meth:`dss.Store.register_prefix` in the key's tenant: the pinned version of the shared prefix."""
        body = {
            "tokens": token_list(tokens),
            "pages": encode_pages(pages) or {},
            "layout": layout_dict(layout),
            "label": label,
            "tenant_id": tenant_id,
        }
        return load(Version, self._call("POST", "/v1/prefixes", json=body))

    def shared_prefixes(self, *, tenant_id: str | None = None) -> list[Version]:
        """:meth:`dss.Store.shared_prefixes` of the key's tenant, oldest first."""
        return [load(Version, v) for v in self._call("GET", "/v1/prefixes", params=params_of(tenant_id=tenant_id))]

    # -- erasure ---------------------------------------------------------------------------

    def forget_user(
        self, user_id: str, *, tenant_id: str, dry_run: bool = False, progress: Callable[[str], None] | None = None
    ) -> Receipt | Plan:
        """:meth:`dss.Store.forget_user` of tenant ``tenant_id`` (the key's own; an admin key may
        name another only for a dry run): the receipt (or, ``dry_run``, the plan).

        The service does the whole erasure in one request; ``progress`` is called once, with
        a summary, when it answers. An erasure that timed out resumes when called again.
        """
        check_flag("dry_run", dry_run)
        body = {"user_id": user_id, "dry_run": dry_run, "tenant_id": tenant_id}
        answer = self._call("POST", "/v1/forget_user", json=body)
        if progress is not None:
            progress(f"{'planned' if dry_run else 'erased'} user {user_id!r}")
        return Plan.model_validate(answer) if dry_run else Receipt.model_validate(answer)

    def audit(self, *, tenant_id: str | None = None, all_tenants: bool = False) -> list[AuditEntry]:
        """:meth:`dss.Store.audit` of the key's tenant (``all_tenants``: every tenant's, admin key)."""
        params = params_of(tenant_id=tenant_id, all_tenants="true" if all_tenants else None)
        return [AuditEntry.model_validate(entry) for entry in self._call("GET", "/v1/audit", params=params)]

    # -- inspection (admin key) ------------------------------------------------------------

    def sql(self, query: str, params: dict[str, Any] | None = None, *, max_rows: int = 10_000) -> SqlResult:
        """:meth:`dss.Store.sql` (admin key)."""
        return codec.sql_from(
            self._call("POST", "/v1/sql", json={"query": query, "params": params, "max_rows": max_rows})
        )

    def check(self) -> list[str]:
        """:meth:`dss.Store.check` (admin key)."""
        return list(self._call("GET", "/v1/check")["problems"])

    def prefetch(self, session_id: str, *, tenant_id: str | None = None, wait: bool = False) -> int:
        """:meth:`dss.Store.prefetch`: pages of the head moving up to host (``wait``: the service answers
        once they moved)."""
        check_flag("wait", wait)
        body = {"session_id": session_id, "tenant_id": tenant_id, "wait": wait}
        return int(self._call("POST", "/v1/prefetch", json=body)["num_pages"])

    def compact(self, *, dry_run: bool = False) -> Compaction:
        """:meth:`dss.Store.compact` of the service's disk tier (admin key)."""
        check_flag("dry_run", dry_run)
        return load(Compaction, self._call("POST", "/v1/compact", json={"dry_run": dry_run}))

    def run_mover(self) -> dict[str, int]:
        """:meth:`dss.Store.run_mover` in the service (admin key): pages moved per tier."""
        return {tier: int(n) for tier, n in self._call("POST", "/v1/mover").items()}

    def stats(self) -> dict[str, Any]:
        """:meth:`dss.Store.stats` of the service's store (admin key)."""
        return dict(self._call("GET", "/v1/stats"))
