"""Control-plane services: policies, state sync, model lifecycle, Triton model control."""
