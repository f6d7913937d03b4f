"""Refresh the console's vendored JavaScript/CSS from the npm registry: ``python -m
gateway.console.vendor`` (``--check`` only verifies the files against the manifest).

The pinned releases are listed in PINS; each file is taken from the package tarball that
``npm pack`` downloads, checked against the registry's published integrity hash, copied under a
versioned name and recorded with its SHA-256 in ``static/vendor/manifest.json``. The gateway
refuses to start when a vendored file does not match the manifest. Nothing is built.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VENDOR = Path(__file__).parent / "static" / "vendor"
# (npm package, version, file in the tarball, logical name the page uses, name served)
PINS = [
    ("uplot", "1.6.32", "package/dist/uPlot.iife.min.js", "uplot.js", "uplot-1.6.32.min.js"),
    ("uplot", "1.6.32", "package/dist/uPlot.min.css", "uplot.css", "uplot-1.6.32.min.css"),
    ("uplot", "1.6.32", "package/LICENSE", "uplot.license", "uplot-1.6.32.LICENSE.txt"),
]


def _pack(package: str, version: str, workdir: Path) -> Path:
    print(f"npm pack {package}@{version}", file=sys.stderr)
    out = subprocess.run(["npm", "pack", f"{package}@{version}", "--json", "--pack-destination", str(workdir)],
                         check=True, capture_output=True, text=True, cwd=workdir)
    info = json.loads(out.stdout)[0]
    tarball: Path = workdir / str(info["filename"])
    algorithm, _, expected = info["integrity"].partition("-")
    digest = base64.b64encode(hashlib.new(algorithm, tarball.read_bytes()).digest()).decode()
    if digest != expected:
        raise SystemExit(f"{tarball.name}: integrity mismatch with the registry's {info['integrity']}")
    return tarball


def refresh() -> None:
    files = []
    with tempfile.TemporaryDirectory() as tmp:
        tarballs: dict[tuple[str, str], Path] = {}
        for package, version, member, name, served in PINS:
            key = (package, version)
            if key not in tarballs:
                tarballs[key] = _pack(package, version, Path(tmp))
            with tarfile.open(tarballs[key]) as archive:
                extracted = archive.extractfile(member)
                if extracted is None:
                    raise SystemExit(f"{package}@{version} has no {member}")
                body = extracted.read()
            (VENDOR / served).write_bytes(body)
            files.append({"package": package, "version": version, "source": member, "name": name, "file": served,
                          "sha256": hashlib.sha256(body).hexdigest(), "bytes": len(body)})
    (VENDOR / "manifest.json").write_text(json.dumps({"files": files}, indent=2) + "\n")
    print(f"wrote {len(files)} files and {VENDOR / 'manifest.json'}", file=sys.stderr)


def check() -> int:
    bad = 0
    for entry in json.loads((VENDOR / "manifest.json").read_text())["files"]:
        body = (VENDOR / entry["file"]).read_bytes()
        if hashlib.sha256(body).hexdigest() != entry["sha256"]:
            print(f"{entry['file']}: SHA-256 differs from the manifest", file=sys.stderr)
            bad += 1
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only verify the vendored files against the manifest")
    args = parser.parse_args(argv)
    if args.check:
        return check()
    refresh()
    return 0


if __name__ == "__main__":
    sys.exit(main())
