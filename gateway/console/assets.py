"""The console's static files: served under content-hashed (our own) or versioned (vendored)
names, so a browser may cache each for a year and never sees a stale one after an upgrade."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

STATIC = Path(__file__).parent / "static"
VENDOR = STATIC / "vendor"
TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
         ".png": "image/png", ".svg": "image/svg+xml", ".txt": "text/plain; charset=utf-8"}
OWN = ("console.js", "charts.js", "actions.js", "console.css", "favicon.svg")
IMMUTABLE = "public, max-age=31536000, immutable"


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str


class Assets:
    """Every file the page loads, read once at start, by the name the page asks for."""

    def __init__(self) -> None:
        self.files: dict[str, Asset] = {}
        self.urls: dict[str, str] = {}  # logical name -> /console/static/<served name>
        for name in OWN:
            body = (STATIC / name).read_bytes()
            stem, dot, ext = name.rpartition(".")
            served = f"{stem}.{hashlib.sha256(body).hexdigest()[:12]}{dot}{ext}"
            self._add(name, served, body)
        for entry in json.loads((VENDOR / "manifest.json").read_text())["files"]:
            body = (VENDOR / entry["file"]).read_bytes()
            if hashlib.sha256(body).hexdigest() != entry["sha256"]:
                raise RuntimeError(f"vendored {entry['file']} does not match its manifest's SHA-256: "
                                   "run python -m gateway.console.vendor")
            self._add(entry["name"], f"vendor/{entry['file']}", body)
        self.page = (STATIC / "console.html").read_text().replace(
            "{{", "\x00").replace("}}", "\x01")
        for name, url in self.urls.items():
            self.page = self.page.replace(f"\x00{name}\x01", url)
        if "\x00" in self.page:
            raise RuntimeError("console.html names an asset that does not exist")

    def _add(self, name: str, served: str, body: bytes) -> None:
        self.files[served] = Asset(body, TYPES[Path(served).suffix])
        self.urls[name] = f"/console/static/{served}"
