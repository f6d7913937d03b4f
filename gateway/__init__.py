"""triton-gateway: a traffic-splitting reverse proxy in front of NVIDIA Triton."""

from __future__ import annotations

__version__ = "0.1.0"
