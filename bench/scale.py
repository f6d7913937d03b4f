"""What the gateway costs at real size: sweeps over models, workers (and more), one table each.

Every sweep runs against ``bench/stub_triton.py`` (``--models N``: a repository of N models that
answers any of them at once, so only the gateway is measured), on free loopback ports, and
stops everything it started. Configurations are interleaved over ``--rounds`` (the order flips
every round) and each table shows min / median / max over the rounds; ratios are taken within
one run. On a shared machine, read a wide spread as the machine and a shifted one as a cost.

    .venv/bin/python bench/scale.py                       # every sweep, one round
    .venv/bin/python bench/scale.py --only models --models 1,1000,5000 --rounds 3
    .venv/bin/python bench/scale.py --only workers --rounds 3

Adding a sweep: a module beside this one defines a function decorated with
``scale_harness.sweep(name, help)`` taking the parsed arguments and returning
``scale_harness.Table`` objects, and an ``add_arguments(parser)`` for its options; list the
module in ``SWEEP_MODULES`` below.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

import scale_harness
from scale_harness import SWEEPS

SWEEP_MODULES = ("scale_models", "scale_data")  # each registers its sweeps on import


def main() -> int:
    modules = [importlib.import_module(name) for name in SWEEP_MODULES]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="sweeps: " + "; ".join(f"{s.name}: {s.help}" for s in SWEEPS.values()))
    parser.add_argument("--only", default="", help=f"comma-separated sweeps to run (of {', '.join(SWEEPS)}); "
                        "default: all")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds per configuration (default 1)")
    parser.add_argument("--base", default="", help="run another commit's gateway (git archive COMMIT), e.g. the "
                        "figures before a change; the stub and the sweeps stay this tree's")
    parser.add_argument("--versus", default="", help="run this tree's gateway and COMMIT's, each configuration "
                        "interleaved within every round (before / after in one run)")
    for module in modules:
        module.add_arguments(parser)
    args = parser.parse_args()
    chosen = [name for name in args.only.split(",") if name] or list(SWEEPS)
    unknown = [name for name in chosen if name not in SWEEPS]
    if unknown:
        parser.error(f"unknown sweep(s) {', '.join(unknown)}: choose from {', '.join(SWEEPS)}")
    for tool in ("wrk", "h2load"):  # h2load: the gRPC rows of the data-plane sweeps
        if not shutil.which(tool):
            print(f"bench/scale.py: {tool} not found (make bench installs it)", file=sys.stderr)
            return 2
    if not shutil.which("wrk"):
        print("bench/scale.py: wrk not found (make bench installs it)", file=sys.stderr)
        return 2
    started = time.monotonic()
    tables = []
    with tempfile.TemporaryDirectory(prefix="gateway-scale-base-") as base:
        if args.base:
            scale_harness.TREES = {args.base: scale_harness.extract(args.base, Path(base))}
        elif args.versus:
            scale_harness.TREES = {"this tree": scale_harness.ROOT,
                                   args.versus: scale_harness.extract(args.versus, Path(base))}
        for name in chosen:
            print(f"# sweep {name}: {SWEEPS[name].help}", flush=True)
            tables += SWEEPS[name].run(args)
    print()
    for table in tables:
        print(table.render(), end="\n\n")
    print(f"bench/scale.py {' '.join(sys.argv[1:])}: {time.monotonic() - started:.0f} s, gateway "
          f"{' and '.join(scale_harness.TREES)}; the machine may be shared "
          "(figures are min / median / max over rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
