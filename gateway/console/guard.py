"""What every console response and request passes: security headers, the session cookie, and
for anything that changes state the CSRF token and a same-origin check."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from gateway.console.sessions import Session, Sessions
from gateway.errors import Forbidden, Unauthorized

COOKIE = "gateway_console"
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


def secure_headers(response: Response) -> Response:
    for name, value in HEADERS.items():
        response.headers.setdefault(name, value)
    return response


def same_origin(request: Request) -> None:
    """A state-changing request must come from the console's own pages: a browser says where a
    request comes from (Sec-Fetch-Site, Origin) and a page elsewhere cannot forge either."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site != "same-origin":
        raise Forbidden(f"cross-site request refused (Sec-Fetch-Site: {site})")
    origin = request.headers.get("origin")
    if origin is not None:
        own = f"{request.url.scheme}://{request.headers.get('host', '')}"
        if origin != own:
            raise Forbidden(f"cross-origin request refused (Origin {origin}, expected {own})")


def session_of(request: Request, sessions: Sessions) -> Session:
    session = sessions.get(request.cookies.get(COOKIE))
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
    response.set_cookie(COOKIE, session.id, max_age=int(ttl_s), path="/console", httponly=True,
                        samesite="strict", secure=request.url.scheme == "https")


def clear_cookie(response: Response, request: Request) -> None:
    response.delete_cookie(COOKIE, path="/console", httponly=True, samesite="strict",
                           secure=request.url.scheme == "https")
