"""``gateway``: serve, run a local Triton, run the demo, and talk to the admin API.

Every sub-command has ``--help``. Bad settings print one line naming the field and exit 2.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway import __version__


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    return int(args.handler(args) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gateway",
        description="Traffic-splitting reverse proxy for NVIDIA Triton Inference Server (KServe v2).",
    )
    parser.add_argument("--version", action="version", version=f"triton-gateway {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the gateway", description=(
        "Run the gateway. Settings come from GATEWAY_* environment variables, over an optional YAML file; "
        "the flags below override both. See configs/gateway.yaml for an example."))
    serve.add_argument("--config", metavar="FILE", help="YAML settings file (policies, timeouts, ...)")
    serve.add_argument("--host", help="listen address (default 127.0.0.1; GATEWAY_HOST)")
    serve.add_argument("--port", type=int, help="HTTP port (default 8080; GATEWAY_PORT)")
    serve.add_argument("--triton-url", help="Triton HTTP URL (default http://127.0.0.1:8000; GATEWAY_TRITON_URL)")
    serve.add_argument("--store-url", help="state store: sqlite:///path (default), redis://host:port/db; "
                       "GATEWAY_STORE_URL")
    serve.add_argument("--insecure-admin", action="store_true", default=None,
                       help="serve /admin without a token (a warning is logged); never in production")
    serve.add_argument("--workers", metavar="N", help="data-plane worker processes: a number, or auto for the cores "
                       "this process may use (default 1; GATEWAY_WORKERS). Above 1: one control plane in the "
                       "supervising process. SIGHUP re-reads --config: tokens and policies apply at once, workers "
                       "are replaced for the rest; the log names what needs a restart")
    serve.set_defaults(handler=_serve)

    triton = commands.add_parser("triton", help="run a local Triton server from the nvidia-pytriton wheel",
                                 description="Start tritonserver with the sample model repository and wait.")
    triton.add_argument("--http-port", type=int, default=8000, help="HTTP port; gRPC and metrics use the next two")
    triton.add_argument("--repository", type=Path, default=None, help="model repository (default: the sample one)")
    triton.add_argument("--model", action="append", dest="models", help="model to load (repeatable; default: all "
                        "sample models)")
    triton.set_defaults(handler=_triton)

    reference = commands.add_parser("config-reference", help="print every setting as a Markdown table")
    reference.set_defaults(handler=_config_reference)
    rollout_reference = commands.add_parser(
        "rollout-reference", help="print every rollout-spec field and every rollout state change as Markdown",
        description="The tables docs/rollout-spec.md and docs/rollouts.md embed, generated from the models.")
    rollout_reference.set_defaults(handler=_rollout_reference)

    from gateway.ctl.commands import add_ctl_parser

    add_ctl_parser(commands)

    demo = commands.add_parser("demo", help="the canary story: a bad version rolled back, a good one promoted",
                               description="Start a local Triton and the gateway, drive steady traffic, run a "
                               "rollout to a faulty version (rolled back automatically) and then to a healthy one "
                               "(promoted), both judged by the default statistical judge against a same-size "
                               "baseline, and print what happened and the evidence each decision rested on. "
                               "About two minutes.")
    demo.add_argument("--keep-running", action="store_true", help="leave Triton and the gateway up afterwards")
    demo.set_defaults(handler=_demo)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from gateway.settings import Settings, SettingsError

    overrides: dict[str, Any] = {k: v for k, v in (("host", args.host), ("port", args.port),
                                                   ("triton_url", args.triton_url), ("store_url", args.store_url),
                                                   ("insecure_admin", args.insecure_admin),
                                                   ("workers", args.workers)) if v is not None}
    try:
        settings = Settings.load(args.config, **overrides)
    except SettingsError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2
    if settings.worker_count() > 1:
        from gateway.workers.supervisor import run_supervised

        return run_supervised(settings, args.config, overrides)
    from gateway.server import run

    return run(settings, args.config, overrides)


def _config_reference(args: argparse.Namespace) -> int:
    from gateway.devtools.config_reference import markdown

    print(markdown())
    return 0


def _rollout_reference(args: argparse.Namespace) -> int:
    from gateway.devtools.rollout_reference import markdown

    print(markdown())
    return 0


def _triton(args: argparse.Namespace) -> int:
    from gateway.devtools.local_triton import SAMPLE_MODELS, SAMPLE_REPOSITORY, LocalTriton, TritonUnavailable

    triton = LocalTriton(repository=args.repository or SAMPLE_REPOSITORY, models=tuple(args.models or SAMPLE_MODELS),
                         http_port=args.http_port, grpc_port=args.http_port + 1, metrics_port=args.http_port + 2)
    print(f"starting tritonserver on {triton.http_url} (gRPC {triton.grpc_url}) ...", flush=True)
    # SIGTERM stops the server as Ctrl-C does (it runs in a session of its own, so no signal sent
    # to this process reaches it; by default SIGTERM ended this process and left it running)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        triton.start()
        print(f"ready: {', '.join(triton.models)} from {triton.repository}; Ctrl-C stops it", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        triton.stop()  # graceful: it answers what is in flight and unloads its models
        print("tritonserver stopped", flush=True)
    except TritonUnavailable as exc:
        print(f"gateway triton: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        triton.stop()  # anything else ending this process (a no-op after the above)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM or SIGINT, once: a second one must not cut the server's stop short."""
    for each in (signal.SIGTERM, signal.SIGINT):
        signal.signal(each, lambda *_: None)
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _demo(args: argparse.Namespace) -> int:
    from gateway.devtools.demo import run_demo

    logging.basicConfig(level=logging.WARNING)
    return run_demo(keep_running=args.keep_running)
