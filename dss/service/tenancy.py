"""What one API key may do: the tenant each request acts in, admin checks, page visibility.

Rules (every request of the service goes through them):

* A request acts in its key's tenant. Passing ``tenant_id`` equal to it changes nothing.
* An admin key may name another tenant to *read* it (sessions, versions, tokens, resume,
  lookup, page reads); writes always go to the key's own tenant. Naming another tenant
  otherwise answers ``Forbidden`` (403), which says nothing about what that tenant holds.
* Another tenant's session or version is simply not found (404), exactly like a missing
  one: the store is always asked with ``tenant_id`` set, so it never looks elsewhere.
* A page id of another tenant reads as ``None``, exactly like a page no tier holds.
* SQL, ``check`` and tier statistics see every tenant, and erasing a user (``forget_user``, its
  dry run too) destroys a person's data, so they need an admin key.

Nothing here changes the store.
"""

from __future__ import annotations

from collections.abc import Sequence

from dss.core.validate import check_name
from dss.service.apikeys import Principal
from dss.service.problems import Forbidden, PayloadTooLarge
from dss.store import Store


class TenantScope:
    """One request's rights: its principal, applied to tenant names and page ids."""

    __slots__ = ("principal",)

    def __init__(self, principal: Principal) -> None:
        self.principal = principal

    @property
    def tenant_id(self) -> str:
        """The key's own tenant."""
        return self.principal.tenant_id

    def reading(self, tenant_id: str | None) -> str:
        """The tenant a read acts in; raises ``Forbidden`` if the key may not read ``tenant_id``."""
        if tenant_id is None or tenant_id == self.principal.tenant_id:
            return self.principal.tenant_id
        if not self.principal.is_admin:
            raise Forbidden(f"this API key may read only its own tenant {self.principal.tenant_id!r}")
        check_name("tenant_id", tenant_id)
        return tenant_id

    def writing(self, tenant_id: str | None) -> str:
        """The tenant a write acts in; raises ``Forbidden`` for any tenant but the key's own."""
        if tenant_id is None or tenant_id == self.principal.tenant_id:
            return self.principal.tenant_id
        raise Forbidden(f"writes go to the API key's own tenant {self.principal.tenant_id!r}, not {tenant_id!r}")

    def require_admin(self, what: str) -> None:
        """Raise ``Forbidden`` unless the key is an admin key."""
        if not self.principal.is_admin:
            raise Forbidden(f"{what} needs an admin API key")

    def page_tenant(self, tenant_id: str | None) -> str | None:
        """The tenant whose pages a page request may see: ``tenant_id`` if named (as :meth:`reading`
        allows), else the key's own; ``None`` (every tenant's) for an admin key naming none."""
        if tenant_id is None and self.principal.is_admin:
            return None
        return self.reading(tenant_id)

    def read_pages(
        self,
        store: Store,
        page_ids: Sequence[bytes],
        max_bytes: int,
        *,
        tenant_id: str | None = None,
        load: bool = True,
    ) -> list[bytes | None]:
        """``store.read_pages`` restricted to pages this key may read, of ``tenant_id`` if named
        (others are ``None``).

        Raises ``PayloadTooLarge`` when the visible pages hold more than ``max_bytes``.
        """
        sizes = store.page_sizes(page_ids, tenant_id=self.page_tenant(tenant_id))
        visible = [pid for pid in dict.fromkeys(page_ids) if pid in sizes]
        total = sum(sizes[pid] for pid in visible)
        if total > max_bytes:
            raise PayloadTooLarge(f"the pages asked for hold {total} bytes; read at most {max_bytes} bytes per request")
        payloads = dict(zip(visible, store.read_pages(visible, load=load))) if visible else {}
        return [payloads.get(pid) for pid in page_ids]
