"""Fleets: named groups of Triton servers, balanced per request, health-checked, loaded together.

Public surface: ``config`` (FleetSpec & co., read by settings), ``registry.Fleets`` (all fleets,
started and stopped together), ``balancer.Fleet`` (``pick`` / ``admit`` on the request path),
``forward.FleetHttp`` (the HTTP upstream client over a fleet; its gRPC twin is
``grpc.fleet_upstream.FleetGrpc``), ``health.FleetMonitor`` and ``members.Server``. Data plane:
nothing here imports services, store, admin or rollout; model control reaches in through
``Fleet.on_join``. The upstream side: nothing here imports a front, gRPC or HTTP/2 either. A
request arrives with what the fleet chooses by (model, version, sequence fields), read once by
its front, and each server's gRPC connection is made by the factory the fleet is given.
"""
