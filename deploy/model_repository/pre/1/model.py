"""Sample pre-processor (ensemble ``pipe``): INPUT0 = RAW + 1."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            raw = pb_utils.get_input_tensor_by_name(request, "RAW").as_numpy()
            out = pb_utils.Tensor("INPUT0", (raw + np.float32(1)).astype(np.float32))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses
