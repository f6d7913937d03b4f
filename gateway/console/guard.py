"""What every console response and request passes: security headers, the session cookie, and
for anything that changes state the CSRF token and a same-origin check."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.console.sessions import Session, Sessions
from gateway.errors import Forbidden, Unauthorized

COOKIE = "gateway_console"
# Over TLS the cookie is ``__Host-`` prefixed: a browser takes it only with Secure, Path=/ and no
# Domain, so a neighbouring host (a sibling subdomain, or plain HTTP on this host) cannot set or
# overwrite the session a login here starts (RFC 6265bis 4.1.3.2). Over plain HTTP a browser
# refuses a Secure cookie, so the unprefixed name stays, scoped to /console.
HOST_COOKIE = "__Host-" + COOKIE
CSRF_HEADER = "x-csrf-token"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "font-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "X-Frame-Options": "DENY",  # frame-ancestors for browsers that predate it
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}


class SecureHeaders:
    """ASGI middleware: the headers above on every /console response (errors included); any other
    path passes through untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.headers = [(name.lower().encode(), value.encode()) for name, value in HEADERS.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not (scope["path"] == "/console" or scope["path"].startswith("/console/")):
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                present = {name.lower() for name, _ in message.get("headers", [])}
                message["headers"] = [*message.get("headers", []),
                                      *((n, v) for n, v in self.headers if n not in present)]
            await send(message)

        await self.app(scope, receive, with_headers)


def over_tls(request: Request) -> bool:
    """Served over TLS: directly, or through the workers' forwarder (which says so in X-Forwarded-Proto;
    a client that sends it itself only changes its own cookie's Secure flag)."""
    return request.url.scheme == "https" or request.headers.get("x-forwarded-proto") == "https"


def same_origin(request: Request) -> None:
    """A state-changing request must come from the console's own pages: a browser says where a
    request comes from (Sec-Fetch-Site, Origin) and a page elsewhere cannot forge either."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site != "same-origin":
        raise Forbidden(f"cross-site request refused (Sec-Fetch-Site: {site})")
    origin = request.headers.get("origin")
    if origin is not None:
        # the host and port the browser was sent to (the scheme may be hidden by the workers' forwarder;
        # one port serves one scheme)
        scheme, _, where = origin.partition("://")
        own = request.headers.get("host", "")
        if scheme not in ("http", "https") or where != own:
            raise Forbidden(f"cross-origin request refused (Origin {origin}, expected this gateway's {own})")


def session_cookie(request: Request) -> str | None:
    """The session id the request's cookie carries: over TLS only the ``__Host-`` one."""
    if over_tls(request):
        return request.cookies.get(HOST_COOKIE)
    return request.cookies.get(COOKIE)


def session_of(request: Request, sessions: Sessions) -> Session:
    session = sessions.get(session_cookie(request))
    if session is None:
        raise Unauthorized("not logged in (or the session ended): log in with your token")
    return session


def change_allowed(request: Request, sessions: Sessions) -> Session:
    """The session behind a state-changing request: same origin, the session's CSRF token, an operator."""
    same_origin(request)
    session = session_of(request, sessions)
    if not session.csrf_matches(request.headers.get(CSRF_HEADER)):
        raise Forbidden("missing or wrong CSRF token (X-CSRF-Token): reload the console")
    if not session.who.operator:
        raise Forbidden(f"'{session.who.name}' is a viewer: the console is read-only for viewer tokens")
    return session


def set_cookie(response: Response, request: Request, session: Session, ttl_s: float) -> None:
    if over_tls(request):
        response.set_cookie(HOST_COOKIE, session.id, max_age=int(ttl_s), path="/", httponly=True,
                            samesite="strict", secure=True)
    else:
        response.set_cookie(COOKIE, session.id, max_age=int(ttl_s), path="/console", httponly=True,
                            samesite="strict")


def clear_cookie(response: Response, request: Request) -> None:
    if over_tls(request):
        response.delete_cookie(HOST_COOKIE, path="/", httponly=True, samesite="strict", secure=True)
    else:
        response.delete_cookie(COOKIE, path="/console", httponly=True, samesite="strict")
