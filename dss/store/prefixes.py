"""Shared prefixes: a tenant's pinned sessions, written and listed through the history and the
operators' methods (the one role that needs both)."""

from __future__ import annotations

from collections.abc import Mapping

from dss.core.errors import InvalidTokens
from dss.core.tokens import TOKEN_BYTES, TokenInput, pack
from dss.core.types import Layout, Version
from dss.core.validate import check_label, check_layout, check_name, check_pages
from dss.sessions.matcher import SHARED_USER, shared_session_id
from dss.store.history import History
from dss.store.operations import Operations


class Prefixes(History, Operations):
    """Shared prefixes (see :class:`dss.store.Store`)."""

    def register_prefix(
        self,
        tokens: TokenInput,
        pages: Mapping[int, bytes],
        *,
        layout: Layout,
        tenant_id: str = "default",
        label: str | None = None,
    ) -> Version:
        """Share a prefix (a system prompt, tool definitions) with every user of the tenant.

        Its pages belong to the tenant, not to any user: every session of the tenant with
        the same layout resumes them, erasing a user leaves them, and they are pinned.
        """
        check_layout(layout)
        check_name("tenant_id", tenant_id)
        check_label(label)
        buf = pack(tokens)
        if not buf:
            raise InvalidTokens("a shared prefix needs at least one token")
        check_pages(pages, len(buf) // TOKEN_BYTES, layout)  # all checked before the tenant's shared session is made
        session_id = shared_session_id(layout)
        self._create(session_id, SHARED_USER, tenant_id, layout)
        version = self.commit(session_id, tokens, pages, label=label, tenant_id=tenant_id)
        return self.pin(session_id, version.version_id, tenant_id=tenant_id)

    def shared_prefixes(self, *, tenant_id: str = "default") -> list[Version]:
        """The registered shared prefixes of a tenant (every layout), oldest first."""
        check_name("tenant_id", tenant_id)
        out: list[Version] = []
        for info in self.sessions(tenant_id=tenant_id, user_id=SHARED_USER):
            out.extend(self.versions(info.session_id, tenant_id=tenant_id))
        return out
