"""The errors dss raises.

Every error a caller can cause is a subclass of :class:`DssError` with a message that says
what was wrong and, where it helps, what to do. An operation that raises a ``DssError``
because of its input has changed nothing. The HTTP service maps ``status`` to the response
code, so a client can never cause a 500 with input it sends.
"""

from __future__ import annotations


class DssError(Exception):
    """Base class of every error dss raises on purpose."""

    status = 400

    @property
    def kind(self) -> str:
        """The class name, used as the problem type over HTTP."""
        return type(self).__name__


class InvalidInput(DssError):
    """An argument has the wrong type, range or shape."""


class InvalidTokens(InvalidInput):
    """Token ids must be integers in ``[0, 2**32)``, given as a sequence or an int buffer."""


class InvalidPage(InvalidInput):
    """A page payload has the wrong size, or its index lies beyond the committed tokens."""


class InvalidLayout(InvalidInput):
    """A layout field is missing or out of range."""


class NotFound(DssError):
    """Something named by the caller does not exist (or is not visible to the caller)."""

    status = 404


class UnknownSession(NotFound):
    """No session has that id."""


class UnknownVersion(NotFound):
    """No version has that id in the given session."""


class NoStore(NotFound):
    """No store is at the folder named (or its SQLite catalog file is missing), and the
    caller asked not to make one."""


class Conflict(DssError):
    """The request contradicts what the store already holds."""

    status = 409


class SessionExists(Conflict):
    """A session with that id exists with another owner or layout."""


class AmbiguousSession(Conflict):
    """A session id exists in several tenants; pass ``tenant_id``."""


class ErasureInProgress(Conflict):
    """The user's data is being erased (its key is destroyed); retry once the erasure finished."""


class ErasureIncomplete(DssError):
    """An erasure's verification found data of the user left somewhere; the job stays open."""

    status = 500


class ReadOnlyViolation(DssError):
    """``sql()`` refuses any statement that writes."""

    status = 403


class SqlError(InvalidInput):
    """A read-only SQL query failed to run (syntax, unknown table, ...)."""


class SchemaOutdated(DssError):
    """The catalog was made by an older dss; run ``dss db upgrade``."""

    status = 503


class SchemaTooNew(DssError):
    """The catalog was made by a newer dss than this one."""

    status = 503


class ConfigError(DssError):
    """A configuration value (file, ``DSS_*`` variable or argument) is invalid."""

    status = 500


class StoreFolderError(ConfigError):
    """The store folder, or a file or folder in it, cannot be made, opened or written: a
    read-only file system, a missing permission, a file where a folder should be. The message
    names the path and the cause."""


class StoreClosed(DssError):
    """The store was closed; open it again."""

    status = 503


# -- raised by the service and its client ---------------------------------------------------


class Unauthorized(DssError):
    """The request carries no API key, or one the service does not know."""

    status = 401


class Forbidden(DssError):
    """The API key may not do this (another tenant's data, or an admin-only endpoint)."""

    status = 403


class MethodNotAllowed(DssError):
    """The endpoint exists but not with this HTTP method."""

    status = 405


class PayloadTooLarge(InvalidInput):
    """A request body (or the pages a read asks for) exceeds the service's size limit."""

    status = 413


class Unavailable(DssError):
    """The service cannot be reached, or is shutting down; the request may be retried."""

    status = 503


class InternalError(DssError):
    """The service failed on its own (a bug or a broken disk); nothing the client sent caused it."""

    status = 500


class CatalogCorrupt(InternalError):
    """The catalog holds something dss cannot read back: a damaged database file, or a row
    that does not decode or authenticate. ``check()`` names the damage; restore a backup."""


class CatalogUnavailable(InternalError):
    """The catalog database cannot be reached or used (connection refused, locked, disk I/O)."""

    status = 503


class NoBackend(Unavailable):
    """The router has no healthy backend to send a request to; retry once one is back."""
