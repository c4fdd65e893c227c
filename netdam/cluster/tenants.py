"""A pool tenant's keys (SPEC.md 11.9, "Tenant tags"): what the state file keeps of its
credential, the public id its sealed requests name, and the key their tag proves.

A tenant holds a 64-bit credential, drawn by the switch. Its ALLOC, FREE and QUERY leave sealed
with a control tag (SPEC.md 2.6) under the tenant's **tag key**, and name the tenant by its **id**
in ``rkey``: the credential itself never travels. Both derive from the SHA-256 digest of the
credential, the one thing the switch's state file keeps of it, so the switch knows every tenant's
key, tenants created before tags included, and a client computes them from its credential.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

from netdam.cluster.clusterfile import derive, derived_key


@dataclass(frozen=True)
class TenantKeys:
    """A tenant's id (u32, never 0: the ``rkey`` of its sealed requests) and tag key (16 bytes)."""

    id: int
    tag_key: bytes


def credential_digest(credential: int) -> str:
    """What the state file keeps of a tenant credential: SHA-256 of its 8 bytes (LE), hex."""
    return hashlib.sha256(credential.to_bytes(8, "little")).hexdigest()


@functools.cache  # the switch derives its whole tenant table again after every ALLOC and FREE
def tenant_keys(digest: str) -> TenantKeys:
    """The keys of the tenant whose credential digest (hex) is *digest* (SPEC.md 8.1's
    derivation: SHA-256 of the digest, a zero byte and the label)."""
    secret = bytes.fromhex(digest)
    return TenantKeys(derived_key(secret, "tenant-id"), derive(secret, "tenant-tag")[:16])


def tenant_keys_of(credential: int) -> TenantKeys:
    """The keys of the tenant whose credential is *credential* (a client's view)."""
    return tenant_keys(credential_digest(credential))
