"""Sample sequence model: OUTPUT0 = (running sum of INPUT0 in this sequence) * version.

The sequence batcher gives every request its sequence's START / END flags and correlation id
(CORRID) as control inputs; the sums live here, one per open sequence, dropped at END.
"""
import numpy as np
import triton_python_backend_utils as pb_utils


def _scalar(request, name):
    return int(pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)[0])


class TritonPythonModel:
    def initialize(self, args):
        self.version = int(args["model_version"])
        self.sums = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            corrid = _scalar(request, "CORRID")
            if _scalar(request, "START"):
                self.sums[corrid] = 0
            total = self.sums.get(corrid, 0) + _scalar(request, "INPUT0")
            if _scalar(request, "END"):
                self.sums.pop(corrid, None)
            else:
                self.sums[corrid] = total
            out = pb_utils.Tensor("OUTPUT0", np.array([[total * self.version]], dtype=np.int32))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses
