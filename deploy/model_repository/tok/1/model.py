"""Decoupled sample model: streams max_tokens tokens, delay_ms apart."""
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


def _scalar(request, name, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else int(tensor.as_numpy().reshape(-1)[0])


class TritonPythonModel:
    def initialize(self, args):
        self.version = args["model_version"]

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self._stream, args=(request,), daemon=True).start()
        return None

    def _stream(self, request):
        sender = request.get_response_sender()
        count = _scalar(request, "max_tokens", 3)
        delay_s = _scalar(request, "delay_ms", 0) / 1000.0
        for i in range(count):
            if i and delay_s:
                time.sleep(delay_s)
            token = np.array([f"v{self.version}:{i}".encode()], dtype=np.object_)
            sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("text_output", token)]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
