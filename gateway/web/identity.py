"""Who is calling: an API key, a trusted header from the API gateway, or nobody.

Modes, by settings: with ``api_keys`` every call needs ``Authorization:
Bearer <key>``; else with ``identity_header`` every call needs that header
(set by the API gateway in front, which authenticated the caller); with
neither the service is open. Identities never contain the key itself: an
API key becomes ``key:<sha256 prefix>``.

Open mode has no identities to keep sessions apart, but its limits must not
be one bucket for the whole world (one noisy client would starve everyone):
each client is ``client:<address>``, the peer address, or the address a
trusted proxy (``trusted_proxies``) put last in ``X-Forwarded-For``. That
key counts sessions and requests only; it does not hide sessions, because a
client's address changes behind NAT and load balancers, and in open mode a
session id is the only secret anyway.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
from collections.abc import Mapping

from gateway import errors
from gateway.domain.identities import CLIENT_PREFIX

logger = logging.getLogger(__name__)

def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class IdentityResolver:
    def __init__(self, api_keys: str | None, identity_header: str | None,
                 trusted_proxies: str | None = None) -> None:
        self._proxies = [ipaddress.ip_network(p.strip(), strict=False)
                         for p in (trusted_proxies or "").split(",") if p.strip()]
        entries = [k.strip() for k in (api_keys or "").split(",") if k.strip()]
        #: Only digests are kept in memory, so a dump of the process holds no key.
        self._digests = [e.removeprefix("sha256:").lower() if e.startswith("sha256:") else _digest(e)
                         for e in entries]
        self._header = identity_header.lower() if identity_header else None
        if self._digests:
            self.mode = "api_key"
        elif self._header:
            self.mode = "identity_header"
        else:
            self.mode = "open"

    def describe(self) -> str:
        if self.mode == "open":
            return ("OPEN: no API keys and no identity header configured; anyone with a session id "
                    "can use it, and limits apply per client address")
        if self.mode == "api_key":
            return f"API keys required ({len(self._digests)} configured)"
        return f"identity taken from the trusted header {self._header!r}"

    def resolve(self, headers: Mapping[str, str], peer: str | None = None) -> str:
        if self.mode == "api_key":
            return self._from_api_key(headers.get("authorization", ""))
        if self.mode == "identity_header":
            value = headers.get(self._header or "", "").strip()
            if not value or len(value) > 256 or not value.isprintable():
                raise errors.Unauthorized(f"the {self._header} header identifying the caller is missing")
            return f"hdr:{value}"
        return CLIENT_PREFIX + self._client_address(headers, peer)

    def _client_address(self, headers: Mapping[str, str], peer: str | None) -> str:
        """The peer, or the nearest address a trusted proxy saw (right to left)."""
        address = peer or "unknown"
        if not self._proxies:  # nobody's X-Forwarded-For is trusted: skip parsing it on every request
            return address[:64]
        hops = [h.strip() for h in headers.get("x-forwarded-for", "").split(",") if h.strip()]
        while hops and self._trusted(address):
            address = hops.pop()
        return address[:64]

    def _trusted(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in network for network in self._proxies)

    def _from_api_key(self, authorization: str) -> str:
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise errors.Unauthorized("send an API key as `Authorization: Bearer <key>`")
        presented = _digest(key.strip())
        # Compare against every entry, in constant time each, so timing tells
        # neither which key nor how much of one matched.
        matched = False
        for stored in self._digests:
            matched |= hmac.compare_digest(presented, stored)
        if not matched:
            raise errors.InvalidApiKey("the API key is not valid")
        return f"key:{presented[:16]}"
