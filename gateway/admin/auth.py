"""Bearer-token authentication for /admin, the console and the data ports' Triton control:
every token has an actor name for the audit trail and a role. Admin tokens are operators; viewer
tokens (``viewer_tokens``) may only read (``GET /admin/*`` and the console's pages), and the
server refuses their writes. Every wrong token counts against its client in one
:class:`~gateway.admin.throttle.TokenThrottle`, and a client past its free tries waits (429)
before its next token is even compared. SIGHUP replaces the tokens (:meth:`Authenticator.replace`)."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Literal

from gateway.admin.throttle import TokenThrottle
from gateway.errors import AdminDisabled, Forbidden, Unauthorized

Role = Literal["operator", "viewer"]


@dataclass(frozen=True)
class Identity:
    name: str
    role: Role

    @property
    def operator(self) -> bool:
        return self.role == "operator"


class Authenticator:
    def __init__(self, tokens: dict[str, str], insecure: bool = False, viewers: dict[str, str] | None = None,
                 throttle: TokenThrottle | None = None) -> None:
        self.throttle = throttle or TokenThrottle()
        self._tokens: list[tuple[str, bytes, Role]] = []
        self.insecure = insecure
        self.replace(tokens, insecure, viewers)

    def replace(self, tokens: dict[str, str], insecure: bool = False, viewers: dict[str, str] | None = None
                ) -> set[Identity]:
        """New tokens (SIGHUP): from now on only these are taken. Returns the identities whose
        token is gone or was replaced (a rotated token may be a leaked one): their sessions end."""
        before = self._digests()
        self._tokens = [(name, digest(token), "operator") for name, token in tokens.items()]
        self._tokens += [(name, digest(token), "viewer") for name, token in (viewers or {}).items()]
        self.insecure = insecure
        after = self._digests()
        return {who for who, token in before.items() if after.get(who) != token}

    def _digests(self) -> dict[Identity, bytes]:
        return {Identity(name, role): token for name, token, role in self._tokens}

    @property
    def tokenless(self) -> bool:
        """``--insecure-admin`` with no token configured: every request is the anonymous operator."""
        return self.insecure and not self._tokens

    @property
    def enabled(self) -> bool:
        return any(role == "operator" for _, _, role in self._tokens) or self.insecure

    def actor(self, authorization: str | None, client: str = "", where: str = "the admin API") -> str:
        """The operator behind an ``Authorization`` header: Unauthorized, or Forbidden for a viewer."""
        who = self.identify(authorization, client, where)
        if not who.operator:
            raise Forbidden(f"'{who.name}' holds a read-only (viewer) token: this needs an operator's admin token")
        return who.name

    def identify(self, authorization: str | None, client: str = "", where: str = "the admin API") -> Identity:
        """Who sends an ``Authorization: Bearer`` header, and their role; Unauthorized otherwise
        (TooManyAttempts while ``client`` is locked out)."""
        if not self.enabled:
            raise AdminDisabled("the admin API is disabled: set GATEWAY_ADMIN_TOKEN (or run with --insecure-admin)")
        if not self._tokens:
            return Identity("anonymous", "operator")  # --insecure-admin
        scheme, _, presented = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not presented:
            raise Unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
        return self.token_identity(presented.strip(), client, where)

    def token_identity(self, presented: str, client: str = "", where: str = "the console") -> Identity:
        """Who holds the token (the console's login form sends it bare); Unauthorized otherwise,
        and TooManyAttempts (the token not compared) while ``client`` is locked out."""
        if not self.enabled:
            raise AdminDisabled("the admin API is disabled: set GATEWAY_ADMIN_TOKEN (or run with --insecure-admin)")
        if not self._tokens:
            return Identity("anonymous", "operator")
        self.throttle.check(client)
        candidate = digest(presented)
        found: Identity | None = None
        for name, token, role in self._tokens:  # compare with every token: timing says nothing about which matched
            if hmac.compare_digest(candidate, token):
                found = Identity(name, role)
        if found is None:
            self.throttle.failed(client, where)  # logs the first failure and each lockout, not every guess
            raise Unauthorized("invalid bearer token")
        return found


def digest(token: str) -> bytes:
    """What tokens are compared as: SHA-256 digests, all 32 bytes long. ``hmac.compare_digest``
    takes constant time only for inputs of equal length (it returns at once otherwise), so
    comparing the tokens themselves told a guesser each token's length."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()

