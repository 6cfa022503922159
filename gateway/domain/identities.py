"""Who may see a session: identities as the web layer resolves them (``web/identity.py``).

An identity owns the sessions it creates, except an open-mode one
(``client:<address>``): an address is a key for limits only, since it
changes behind NAT and load balancers, so it owns nothing.
"""

from __future__ import annotations

#: Open-mode identities: limits per client, no session visibility.
CLIENT_PREFIX = "client:"


def owner_check(identity: str) -> str:
    """Whom the store checks a session's owner against: nobody in open mode."""
    return "" if identity.startswith(CLIENT_PREFIX) else identity
