"""The README is a front door and docs/ a site that builds: no broken link, no stale reference.

``make docs`` runs ``mkdocs build --strict``; the same build runs here, so a broken link or
anchor (a warning in strict mode) fails ``make test``. The generated tables (rollout spec,
rollout transitions) must be what the models say today.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from markdown.extensions.toc import slugify

from gateway.devtools import rollout_reference
from gateway.rollout.phases import ALLOWED, Phase
from gateway.rollout.spec import THRESHOLDS_ONLY
from gateway.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_the_site_builds_with_no_warning(tmp_path: Path) -> None:
    result = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0 and "WARNING" not in result.stderr, result.stderr
    assert (tmp_path / "site" / "rollouts" / "index.html").exists()


@pytest.mark.parametrize("broken", ["[the judge](judge.md#no-such-heading)", "[gone](no-such-page.md)"])
def test_a_broken_link_fails_the_build(tmp_path: Path, broken: str) -> None:
    """The check above can fail: the same site with one broken link or anchor does not build."""
    docs = tmp_path / "docs"
    shutil.copytree(DOCS, docs)
    (docs / "index.md").write_text((docs / "index.md").read_text() + f"\nSee {broken}.\n")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config["docs_dir"] = str(docs)
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    result = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0 and broken.split("(")[1].rstrip(")") in result.stderr, result.stderr


def anchors(page: Path) -> set[str]:
    """The ids mkdocs gives a page's headings (markdown's toc slugify)."""
    return {slugify(re.sub(r"`", "", line.lstrip("#").strip()), "-")
            for line in page.read_text().splitlines() if re.match(r"#{1,6} ", line)}


def test_the_readme_is_a_front_door() -> None:
    """At most 250 lines: the two commands first, then what it is, the ports, a first canary, the
    policy file, the console and where to read on; every link into docs/ lands on a page and a
    heading that exist (the site build does not see the README)."""
    text = README.read_text()
    assert len(text.splitlines()) <= 250, len(text.splitlines())
    assert text.startswith("# triton-gateway\n\n```sh\nmake demo")
    headings = [line[3:] for line in text.splitlines() if line.startswith("## ")]
    for needed in ("What it is", "Ports", "A first canary", "The policy file", "The console", "Where to read on"):
        assert any(h.startswith(needed) for h in headings), (needed, headings)
    targets = [link for link in LINK.findall(text) if not link.startswith(("http://", "https://"))]
    assert len(targets) >= 15, targets
    for target in targets:
        path, _, anchor = target.partition("#")
        assert (ROOT / path).is_file(), target
        if anchor:
            assert anchor in anchors(ROOT / path), target


def test_every_docs_page_is_in_the_site_nav() -> None:
    nav = json.dumps(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    assert sorted(p.name for p in DOCS.glob("*.md") if f'"{p.name}"' not in nav) == []


def test_the_rollout_references_are_generated_from_the_models() -> None:
    reference = rollout_reference
    spec_page, guide = (DOCS / "rollout-spec.md").read_text(), (DOCS / "rollouts.md").read_text()
    assert reference.embedded(spec_page, reference.SPEC_BEGIN, reference.SPEC_END) == reference.spec_markdown(), \
        "run `gateway rollout-reference` and paste the spec table into docs/rollout-spec.md"
    assert reference.embedded(guide, reference.TRANSITIONS_BEGIN, reference.TRANSITIONS_END) == \
        reference.transitions_markdown(), "run `gateway rollout-reference`: paste the transitions into docs/rollouts.md"


def test_every_allowed_state_change_is_explained_and_drawn() -> None:
    edges = {(current, target) for current, targets in ALLOWED.items() for target in targets}
    assert set(rollout_reference.TRANSITIONS) == edges
    guide = (DOCS / "rollouts.md").read_text()
    diagram = guide.split("## States", 1)[1].split("```", 2)[1]
    assert all(phase.value in diagram for phase in Phase), diagram


def rollout_bodies(text: str) -> list[dict[str, object]]:
    """The JSON of every `curl ... /rollout -d '...'` in a page's shell blocks."""
    return [json.loads(body) for body in re.findall(r"/rollout[\s\\]+-d\s+'(\{.*?\})'", text, re.S)]


def ctl_starts(text: str) -> list[str]:
    return [line for line in text.splitlines() if "gateway ctl rollout start" in line]


def test_statistical_examples_use_no_thresholds_only_field() -> None:
    """min_requests, max_p99_ratio... are read by the thresholds judge only: an example (docs,
    README) or the console's suggestion that shows them for a statistical rollout teaches a
    setting that changes nothing."""
    pages = [README, *DOCS.glob("*.md")]
    bodies = [body for page in pages for body in rollout_bodies(page.read_text())]
    assert len(bodies) >= 4, "the examples are still found"
    for body in bodies:
        if body.get("judge", "statistical") == "statistical":
            assert not THRESHOLDS_ONLY & set(body), body
    flags = {f"--{name.replace('_', '-')}" for name in THRESHOLDS_ONLY}
    for line in (line for page in pages for line in ctl_starts(page.read_text())):
        if "--judge thresholds" not in line:
            assert not any(flag in line for flag in flags), line
    console = (ROOT / "gateway" / "console" / "static" / "actions.js").read_text()
    for line in console.splitlines():
        if "thresholds" not in line:
            assert not any(re.search(rf"\b{name}\b", line) for name in THRESHOLDS_ONLY), line


# A setting's default as the pages state it: "`request_timeout_s` (60 s)", "`max_body_bytes` (64 MiB, ...)".
STATED_DEFAULT = re.compile(r"`(\w+)` \(([^)]*)\)")
VALUE = re.compile(r"(\d[\d,.]*)\s*(s|ms|h|bytes|KiB|MiB|GiB)?")
SCALE = {"": 1, "s": 1, "ms": 1, "h": 3600, "bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def stated_defaults(text: str) -> list[tuple[str, str]]:
    """(setting, what the page says its default is) for each setting named with a value beside it;
    a parenthesis that says something else ("`port` (HTTP)") is no such claim."""
    found = []
    for name, said in STATED_DEFAULT.findall(text):
        head = re.split(r";|, | by default| or ", " ".join(said.split()))[0].strip()
        if name in Settings.model_fields and (head in ("unset", "none") or VALUE.fullmatch(head)):
            found.append((name, head))
    return found


def test_the_defaults_the_pages_state_are_the_settings_defaults() -> None:
    """A default changed in gateway/settings.py and not on the page that states it reads as a
    promise: docs/differences.md said `max_connections_per_client` (256) after it became 4,096, and
    a 429 after `queue_timeout_ms` (1 s) after that became unset (a request waits for its deadline)."""
    claims = [(page.name, name, head) for page in [README, *sorted(DOCS.glob("*.md"))]
              for name, head in stated_defaults(page.read_text())]
    assert len(claims) >= 30, claims  # the pages still state defaults this way
    wrong = []
    for page, name, head in claims:
        default = Settings.model_fields[name].default
        value = VALUE.fullmatch(head)
        if value is None:
            right = default is None
        else:
            right = isinstance(default, int | float) and not isinstance(default, bool) and \
                float(default) == float(value.group(1).replace(",", "")) * SCALE[value.group(2) or ""]
        if not right:
            wrong.append(f"{page}: `{name}` ({head}), the default is {default!r}")
    assert not wrong, wrong


def test_the_readmes_commands_run_as_written_in_a_fresh_shell() -> None:
    """`make demo` and `make test` make .venv but activate nothing: a README line that runs
    `gateway` is `.venv/bin/gateway`, or comes after a line that puts .venv/bin on PATH (the first
    canary's `gateway ctl` lines were "command not found" when copied as written)."""
    text, on_path, bare = README.read_text(), False, []
    blocks = re.findall(r"^```(?:sh|bash)\n(.*?)^```", text, re.S | re.M)
    for line in (line for block in blocks for line in block.splitlines()):
        code = line.split(" #")[0]
        if re.match(r"export PATH=\S*\.venv/bin", code):
            on_path = True
        if not on_path and re.search(r"(^|[;&|(]\s*)(\w+=\S+\s+)*gateway\s", code):
            bare.append(line)
    assert len(blocks) >= 3 and not bare, bare
