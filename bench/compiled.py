"""Compiled hot modules (mypyc) against the same source interpreted, interleaved, in one run.

Issue 26 item 5 names compiled hot modules as one way to a cheaper request. This measures what
they buy: it extracts ``--commit`` twice, applies bench/compiled.patch to both (the source changes
mypyc needs: it has no async generators and no nested classes, reads class constants only when
Final, rejects interpreted subclasses of a compiled class unless allowed, and checks at run time
the types the stubs declare, where httptools' ``parse_url`` says bytes and returns None), compiles
the hot modules in one copy with mypyc (gcc and the Python headers needed), then runs bench/ab.py's
interleaved rounds: A = the compiled copy, B = the same source interpreted (and nginx with
``--nginx``). Every option after the script's own goes to ab.py.

    .venv/bin/python bench/compiled.py --rounds 5 --only http --nginx
    .venv/bin/python bench/compiled.py --stub --rounds 7 --only http      # the gateways' cost alone

The figures measured with it are in bench/compiled.md. The patch is not on main: the compiled
build was not adopted (see that note); if main has moved so that it no longer applies, say so and stop.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import ab  # noqa: E402

PATCH = HERE / "compiled.patch"
# the HTTP path's Python, from bench/profiles/after-http.top.txt
HOT_MODULES = ["gateway/routing.py", "gateway/pipeline.py", "gateway/upstream.py", "gateway/http_output.py",
               "gateway/batched_transport.py", "gateway/http_front.py", "gateway/proxy/http.py",
               "gateway/proxy/limits.py", "gateway/telemetry/recorder.py", "gateway/fleet/forward.py"]


def prepared(commit: str, into: Path) -> Path:
    """``commit``'s source with the patch mypyc needs applied (both sides run the same source)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    applied = subprocess.run(["git", "apply", str(PATCH)], cwd=into, capture_output=True, text=True)
    if applied.returncode:
        raise SystemExit(f"bench/compiled.patch does not apply to {commit}:\n{applied.stdout}{applied.stderr}")
    return into


def compile_hot_modules(tree: Path, modules: list[str]) -> None:
    print(f"compiling {len(modules)} modules with mypyc (a minute or three) ...", flush=True)
    started = time.monotonic()
    built = subprocess.run([sys.executable, "-m", "mypyc", *modules], cwd=tree, capture_output=True, text=True)
    if built.returncode:
        raise SystemExit(f"mypyc failed:\n{built.stdout[-4000:]}{built.stderr[-4000:]}")
    # an extension that did not build would leave its module interpreted without a word: check each
    names = [module.removesuffix(".py").replace("/", ".") for module in modules]
    check = ("import importlib, sys\n"
             "bad = [n for n in sys.argv[1:] if not importlib.import_module(n).__file__.endswith('.so')]\n"
             "raise SystemExit(f'interpreted: {bad}' if bad else 0)")
    subprocess.run([sys.executable, "-c", check, *names], cwd=tree, env={"PYTHONPATH": str(tree)}, check=True)
    print(f"compiled in {time.monotonic() - started:.0f} s: {', '.join(names)}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="HEAD", help="the source both sides run (default HEAD)")
    parser.add_argument("--modules", nargs="+", default=HOT_MODULES, help="the modules to compile (paths)")
    args, ab_args = parser.parse_known_args()
    workdir = Path(tempfile.mkdtemp(prefix="gateway-compiled-"))
    try:
        compiled = prepared(args.commit, Path(tempfile.mkdtemp(prefix="compiled-", dir=workdir)))
        compile_hot_modules(compiled, args.modules)
        # ab.py's side A is the tree it lives in and its side B a commit it extracts: point A at the
        # compiled copy and make B the same patched source, interpreted.
        ab.ROOT = compiled
        ab.extract = lambda commit, into: prepared(commit, into)
        sys.argv = [sys.argv[0], "--base", args.commit, *ab_args]
        print("A = compiled hot modules, B = the same source interpreted", flush=True)
        return ab.main()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
