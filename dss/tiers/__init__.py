"""Tiers: where page payloads live (see :mod:`dss.tiers.base` for the contracts), and the device
tier (:mod:`dss.tiers.device`), which pages engines hold in their own memory."""

from dss.tiers.base import CacheTier, DurableTier, Located, ReadFailure, ReadRequest, StoredPage
from dss.tiers.disk import DiskTier
from dss.tiers.host import HostTier

__all__ = ["CacheTier", "DiskTier", "DurableTier", "HostTier", "Located", "ReadFailure", "ReadRequest", "StoredPage"]
