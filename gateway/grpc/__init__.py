"""gRPC: status codes, message framing and routing fields, the upstream client and both fronts."""
