"""Bearer-token authentication for /admin: every token has an actor name for the audit trail."""

from __future__ import annotations

import hmac

from gateway.errors import AdminDisabled, Unauthorized


class Authenticator:
    def __init__(self, tokens: dict[str, str], insecure: bool = False) -> None:
        self._tokens = [(name, token.encode()) for name, token in tokens.items()]
        self.insecure = insecure

    @property
    def enabled(self) -> bool:
        return bool(self._tokens) or self.insecure

    def actor(self, authorization: str | None) -> str:
        """The actor behind an ``Authorization`` header, or Unauthorized."""
        if not self._tokens:
            if self.insecure:
                return "anonymous"
            raise AdminDisabled("the admin API is disabled: set GATEWAY_ADMIN_TOKEN (or run with --insecure-admin)")
        scheme, _, presented = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not presented:
            raise Unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
        candidate = presented.strip().encode()
        found = None
        for name, token in self._tokens:  # compare with every token: timing says nothing about which matched
            if hmac.compare_digest(candidate, token):
                found = name
        if found is None:
            raise Unauthorized("invalid bearer token")
        return found
