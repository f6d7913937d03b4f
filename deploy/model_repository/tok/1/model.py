"""Decoupled sample model: streams max_tokens tokens, delay_ms apart, with test-controlled faults.

Faults come from the JSON file named by $TRITON_SAMPLE_FAULTS, as for ``qc`` (re-read when its
mtime changes, checked at most every 100 ms), e.g. ``{"tok": {"2": {"first_delay_ms": 20}}}``:
``first_delay_ms`` delays the first response, ``delay_ms`` every response (the first too), so
a test can slow one version's streams without the clients sending anything different.
"""
import json
import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


def _scalar(request, name, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else int(tensor.as_numpy().reshape(-1)[0])


class _Faults:
    def __init__(self, model, version):
        self._path = os.environ.get("TRITON_SAMPLE_FAULTS", "")
        self._model, self._version = model, version
        self._checked_at, self._mtime, self.delay_s, self.first_delay_s = 0.0, None, 0.0, 0.0

    def refresh(self):
        """Called by execute() only (one thread); the streaming threads just read the delays."""
        now = time.monotonic()
        if not self._path or now - self._checked_at < 0.1:
            return
        self._checked_at = now
        try:
            mtime = os.stat(self._path).st_mtime_ns
        except OSError:
            self.delay_s = self.first_delay_s = 0.0
            self._mtime = None
            return
        if mtime == self._mtime:
            return
        self._mtime = mtime
        try:
            with open(self._path) as f:
                spec = json.load(f).get(self._model, {}).get(self._version, {})
        except (OSError, ValueError):
            spec = {}
        self.delay_s = float(spec.get("delay_ms", 0.0)) / 1000.0
        self.first_delay_s = float(spec.get("first_delay_ms", 0.0)) / 1000.0


class TritonPythonModel:
    def initialize(self, args):
        self.version = args["model_version"]
        self.faults = _Faults(json.loads(args["model_config"])["name"], self.version)

    def execute(self, requests):
        self.faults.refresh()
        for request in requests:
            threading.Thread(target=self._stream, args=(request,), daemon=True).start()
        return None

    def _stream(self, request):
        sender = request.get_response_sender()
        count = _scalar(request, "max_tokens", 3)
        delay_s = _scalar(request, "delay_ms", 0) / 1000.0
        faults = self.faults
        for i in range(count):
            pause = (delay_s if i else faults.first_delay_s) + faults.delay_s
            if pause:
                time.sleep(pause)
            token = np.array([f"v{self.version}:{i}".encode()], dtype=np.object_)
            sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("text_output", token)]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
