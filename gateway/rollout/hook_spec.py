"""What a rollout spec says about its hooks: webhooks told of every transition, and gates
asked before the rollout moves. Validated here, so a bad URL or an unknown event name is a
4xx at ``POST /admin/models/{model}/rollout``, never a failure found mid-rollout."""

from __future__ import annotations

import hashlib
import hmac
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

Event = Literal["started", "step", "paused", "resumed", "promoted", "rolled_back", "aborted"]
EVENTS: tuple[Event, ...] = ("started", "step", "paused", "resumed", "promoted", "rolled_back", "aborted")
GateAt = Literal["pre_rollout", "each_step", "pre_promotion"]
SIGNATURE_HEADER = "X-Gateway-Signature"


def _http_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s) URL with a host")
    return url


class Webhook(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(max_length=2048, description="http(s) URL that receives a JSON POST per event")
    on: list[Event] = Field(default_factory=lambda: list(EVENTS), min_length=1,
                            description="the events to send (default: all)")
    secret: str | None = Field(None, min_length=1, max_length=256, description="HMAC-SHA256 key: the body's "
                               f"signature goes in {SIGNATURE_HEADER}: sha256=<hex>")

    _url = field_validator("url")(_http_url)


class Gate(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(max_length=2048, description="http(s) URL asked with a JSON POST; a 2xx answer lets it pass")
    at: GateAt = Field(description="pre_rollout: before starting (a refusal is a 409); each_step: before every "
                       "automatic step advance; pre_promotion: before the canary takes 100%")
    on_failure: Literal["hold", "rollback"] = Field("hold", description="hold: stay at the current step and ask "
                                                    "again next interval; rollback: roll back")
    timeout_s: float = Field(1.0, gt=0, le=60, description="longest wait for the answer (never longer than the "
                             "controller's call timeout)")

    _url = field_validator("url")(_http_url)


def sign(body: bytes, secret: str) -> str:
    """The X-Gateway-Signature value: a receiver recomputes it over the raw body it got."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
