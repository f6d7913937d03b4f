"""Sample model: OUTPUT0 = INPUT0 * version, with test-controlled faults.

Faults come from a JSON file named by $TRITON_SAMPLE_FAULTS, e.g.
``{"qc": {"3": {"error_rate": 0.3, "delay_ms": 200}}}``. ``client_error_rate`` answers that
share with INVALID_ARG (HTTP 400, as for a renamed input); ``overload_rate`` answers it the way
Triton answers when a model's queue is full (UNAVAILABLE "Exceeds maximum queue size": HTTP 503).
It is re-read when its
mtime changes (checked at most every 100 ms) so a test can break a version of a
running server without reloading it.
"""
import json
import os
import random
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class _Faults:
    def __init__(self, model, version):
        self._path = os.environ.get("TRITON_SAMPLE_FAULTS", "")
        self._model, self._version = model, version
        self._checked_at, self._mtime, self.error_rate, self.delay_s = 0.0, None, 0.0, 0.0
        self.client_error_rate = self.overload_rate = 0.0

    def refresh(self):
        now = time.monotonic()
        if not self._path or now - self._checked_at < 0.1:
            return
        self._checked_at = now
        try:
            mtime = os.stat(self._path).st_mtime_ns
        except OSError:
            self.error_rate, self.delay_s, self._mtime = 0.0, 0.0, None
            self.client_error_rate = self.overload_rate = 0.0
            return
        if mtime == self._mtime:
            return
        self._mtime = mtime
        try:
            with open(self._path) as f:
                spec = json.load(f).get(self._model, {}).get(self._version, {})
        except (OSError, ValueError):
            spec = {}
        self.error_rate = float(spec.get("error_rate", 0.0))
        self.delay_s = float(spec.get("delay_ms", 0.0)) / 1000.0
        self.client_error_rate = float(spec.get("client_error_rate", 0.0))
        self.overload_rate = float(spec.get("overload_rate", 0.0))


def _wait(seconds):
    """time.sleep overshoots by ~0.1-0.3 ms, as much as the sub-millisecond delays the judge's
    tests add to a sub-millisecond model: sleep all but the last millisecond, spin through it."""
    deadline = time.perf_counter() + seconds
    if seconds > 0.001:
        time.sleep(seconds - 0.001)
    while time.perf_counter() < deadline:
        pass


class TritonPythonModel:
    def initialize(self, args):
        self.version = args["model_version"]
        self.factor = np.float32(int(self.version))
        self.faults = _Faults(json.loads(args["model_config"])["name"], self.version)
        self.rng = random.Random()

    def execute(self, requests):
        self.faults.refresh()
        if self.faults.delay_s:
            _wait(self.faults.delay_s)
        responses = []
        for request in requests:
            err = self._fault()
            if err is not None:
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=err))
                continue
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            out = pb_utils.Tensor("OUTPUT0", (x * self.factor).astype(np.float32))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses

    def _fault(self):
        faults, draw = self.faults, self.rng.random()
        if draw < faults.error_rate:
            return pb_utils.TritonError(f"injected fault in version {self.version}")
        draw -= faults.error_rate
        if draw < faults.client_error_rate:
            return pb_utils.TritonError(f"injected client error in version {self.version}: unexpected input",
                                        pb_utils.TritonError.INVALID_ARG)
        draw -= faults.client_error_rate
        if draw < faults.overload_rate:
            return pb_utils.TritonError("Exceeds maximum queue size", pb_utils.TritonError.UNAVAILABLE)
        return None
