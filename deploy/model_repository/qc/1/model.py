"""Sample model: OUTPUT0 = INPUT0 * (version + factor_offset), with test-controlled faults.

``factor_offset`` is a parameter of the model's config (0 when absent): ``qc`` answers
INPUT0 * version, and ``qc_2026_12`` (a model named per version, offset 10) INPUT0 * 11 from
its version 1 and INPUT0 * 12 from its version 2, so a caller can tell which model answered.

Faults come from a JSON file named by $TRITON_SAMPLE_FAULTS, e.g.
``{"qc": {"3": {"error_rate": 0.3, "delay_ms": 200}}}``. ``client_error_rate`` answers that
share with INVALID_ARG (HTTP 400, as for a renamed input); ``overload_rate`` answers it the way
Triton answers when a model's queue is full (UNAVAILABLE "Exceeds maximum queue size": HTTP 503).
``raise_rate`` makes that share of executions raise (Triton fails every request of the batch and
counts them as BACKEND failures; an error put in a response, as ``error_rate`` does, Triton counts
as a success). ``cold_s`` with ``cold_delay_ms``: a version loaded after the fault was set sleeps
that much more per execution during its first ``cold_s`` seconds (a cold start). It is re-read
when its mtime changes (checked at most every 100 ms) so a test can break a version of a
running server without reloading it.

Without faults, the config's ``compute_ms`` parameter ("3:20": version 3 sleeps 20 ms per
execution) makes a version slower in compute for good (the ``batched`` sample model).
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
        self.client_error_rate = self.overload_rate = self.raise_rate = 0.0
        self.cold_until, self.cold_delay_s = 0.0, 0.0
        self._started = time.monotonic()

    def refresh(self):
        now = time.monotonic()
        if not self._path or now - self._checked_at < 0.1:
            return
        self._checked_at = now
        try:
            mtime = os.stat(self._path).st_mtime_ns
        except OSError:
            self.error_rate, self.delay_s, self._mtime = 0.0, 0.0, None
            self.client_error_rate = self.overload_rate = self.raise_rate = 0.0
            self.cold_until, self.cold_delay_s = 0.0, 0.0
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
        self.raise_rate = float(spec.get("raise_rate", 0.0))
        self.cold_until = self._started + float(spec.get("cold_s", 0.0))
        self.cold_delay_s = float(spec.get("cold_delay_ms", 0.0)) / 1000.0

    def delay(self):
        """Seconds to sleep in this execution: the fault's delay, plus the cold start's while it lasts."""
        return self.delay_s + (self.cold_delay_s if time.monotonic() < self.cold_until else 0.0)


def _wait(seconds):
    """time.sleep overshoots by ~0.1-0.3 ms, as much as the sub-millisecond delays the judge's
    tests add to a sub-millisecond model: sleep all but the last millisecond, spin through it."""
    deadline = time.perf_counter() + seconds
    if seconds > 0.001:
        time.sleep(seconds - 0.001)
    while time.perf_counter() < deadline:
        pass


def _compute_ms(config, version):
    """This version's ``compute_ms`` from the config's parameters ("2:5,3:20"), 0 when unnamed."""
    spec = config.get("parameters", {}).get("compute_ms", {}).get("string_value", "")
    for entry in spec.split(","):
        named, _, ms = entry.partition(":")
        if named.strip() == version:
            return float(ms)
    return 0.0


class TritonPythonModel:
    def initialize(self, args):
        self.version = args["model_version"]
        config = json.loads(args["model_config"])
        offset = config.get("parameters", {}).get("factor_offset", {}).get("string_value", "0")
        self.factor = np.float32(int(self.version) + int(offset))
        self.faults = _Faults(config["name"], self.version)
        self.rng = random.Random()
        self.compute_s = _compute_ms(config, self.version) / 1000.0

    def execute(self, requests):
        self.faults.refresh()
        if self.faults.raise_rate and self.rng.random() < self.faults.raise_rate:
            raise RuntimeError(f"injected exception in execute of version {self.version}")
        delay = self.faults.delay() + self.compute_s
        if delay:
            _wait(delay)
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
