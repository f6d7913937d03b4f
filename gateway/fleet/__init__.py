"""Fleets: named groups of Triton servers, balanced per request, health-checked, loaded together.

Public surface: ``config`` (FleetSpec & co., read by settings), ``registry.Fleets`` (all fleets,
started and stopped together), ``balancer.Fleet`` (``pick`` / ``admit`` on the request path),
``forward.FleetHttp`` / ``forward.FleetGrpc`` (the upstream clients over a fleet),
``health.FleetMonitor`` and ``members.Server``. Data plane: nothing here imports services,
store, admin or rollout; model control reaches in through ``Fleet.on_join``.
"""
