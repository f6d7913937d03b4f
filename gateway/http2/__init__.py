"""Just enough HTTP/2 for the lean gRPC upstream client: framing (``connection``) and HPACK."""
