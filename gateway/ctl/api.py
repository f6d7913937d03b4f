"""The admin API as ``gateway ctl`` calls it: JSON in, JSON out, an error's message raised."""

from __future__ import annotations

from typing import Any

import httpx


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Api:
    def __init__(self, url: str, token: str | None) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=30)
        self.warnings: list[str] = []  # what the answers said a change did beyond what it named

    def call(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> Any:
        response = self.client.request(method, path, json=body, headers=headers or {})
        try:
            payload = response.json()
        except ValueError:
            payload = {"error": response.text}
        if response.status_code >= 400:
            raise ApiError(response.status_code, payload.get("error", str(payload)) if isinstance(payload, dict)
                           else str(payload))
        if isinstance(payload, dict) and isinstance(payload.get("warnings"), list):
            self.warnings += [str(warning) for warning in payload["warnings"]]
        return payload
