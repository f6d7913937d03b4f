"""The demo's second story: a canary of ``qc`` v3 inside the ensemble ``pipe`` (pre -> qc v2 -> post).

The gateway loads the variant ``pipe__qc_3`` on both Tritons, splits ``pipe`` between the
ensemble and the variant while clients keep calling ``pipe``, judges the arms end to end and
attributes the difference to qc's versions, then pins qc 3 in ``pipe`` itself and unloads the
variant (docs/ensembles.md). Each answer's QC_VERSION (the sample post-processor's) shows which
qc ran inside it; the story counts them per arm: a request never mixes the arms' stages.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rich.console import Console
from rich.table import Table

PIPE_BODY = json.dumps({"inputs": [{"name": "RAW", "datatype": "FP32", "shape": [1, 4],
                                    "data": [1, 2, 3, 4]}]}).encode()
ROLLOUT = {"composing": "qc@3", "judge": "thresholds", "steps": [20, 50, 100], "interval_s": 3,
           "min_requests": 20, "max_p99_ratio": 3, "min_p99_delta_ms": 50}
TIMEOUT_S = 90.0


def call_pipe(url: str) -> tuple[str, int] | None:
    """(the arm that answered, the qc version inside it), None for a failed request."""
    try:
        request = urllib.request.Request(url + "/v2/models/pipe/infer", data=PIPE_BODY)
        with urllib.request.urlopen(request, timeout=10) as response:
            answer = json.loads(response.read())
            arm = response.headers["x-gateway-model-version"]
    except OSError:
        return None
    return arm, next(o["data"][0] for o in answer["outputs"] if o["name"] == "QC_VERSION")


def ensemble_story(console: Console, url: str, admin: Any) -> bool:
    """Run the story against the gateway at ``url`` (``admin``: the demo's admin call); True when the
    canary was promoted into pipe with no request mixing the arms."""
    seen: Counter[tuple[str, int] | None] = Counter()
    stop = threading.Event()

    def clients() -> None:
        with ThreadPoolExecutor(3) as pool:
            while not stop.is_set():
                for answer in pool.map(lambda _: call_pipe(url), range(6)):
                    seen[answer] += 1
                time.sleep(0.02)

    loader = threading.Thread(target=clients, daemon=True)
    loader.start()
    try:
        admin(url, "POST", "/admin/models/pipe/rollout", ROLLOUT)
        deadline = time.monotonic() + TIMEOUT_S
        doc = admin(url, "GET", "/admin/models/pipe/rollout")
        while (doc["state"] == "progressing" or (doc.get("variant") or {}).get("state") != "unloaded") \
                and time.monotonic() < deadline:
            time.sleep(0.5)
            doc = admin(url, "GET", "/admin/models/pipe/rollout")
    finally:
        stop.set()
        loader.join(15)
    table = Table(title="pipe's answers: the arm that answered, and the qc version its stages ran")
    for column in ("arm (x-gateway-model-version)", "QC_VERSION", "answers"):
        table.add_column(column, justify="right")
    for key, count in sorted(seen.items(), key=lambda item: str(item[0])):
        arm, version = key if key is not None else ("failed", "-")
        table.add_row(arm, str(version), str(count))
    console.print(table)
    variant = doc.get("variant") or {}
    console.print(f"   {doc['state']}: {doc['reason']}")
    if (variant.get("attribution") or {}).get("summary"):
        console.print(f"   inside Triton: {variant['attribution']['summary']}")
    mixed = [key for key in seen if key is not None and (key[0] == "pipe__qc_3") != (key[1] == 3)
             and key != ("1", 3)]  # ("1", 3): pipe itself, once it pins qc 3
    return doc["state"] == "promoted" and variant.get("state") == "unloaded" and not mixed and not seen[None]
