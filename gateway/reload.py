"""SIGHUP: the config file read again, and every changed setting applied where it can be, or
named as needing a restart.

Where a setting lives decides how it applies:

- :data:`LIVE`: the control plane applies it at once (:meth:`gateway.app.Gateway.reconfigure`):
  tokens (a removed or replaced token's console sessions end, and it is refused from then on: a
  removed operator token still wrote a policy after a reload, audited), ``metrics_token``,
  ``trusted_proxies``, the console's session length, the log level, and the declared policies;
- every other setting is the data plane's: with ``--workers`` each worker is replaced by one
  built with the new settings (one at a time, each new one serving before the old one drains);
  one process has no second data plane to replace it with, so there those need a restart;
- :data:`READ_ONCE`: what the control plane (or the supervisor) built from at start: the store,
  the metrics source and controller, the fleets it health-checks and loads versions on, the
  node's sequence-pin table, the worker count, the metrics port. A change there is named in
  the log (and in ``/admin/workers``) as needing a restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.settings import Settings

LIVE = frozenset(["admin_token", "admin_tokens", "viewer_tokens", "insecure_admin", "metrics_token",
                  "trusted_proxies", "console_session_ttl_s", "log_level", "policies"])
READ_ONCE = frozenset([
    "store_url", "audit_max_events", "audit_max_age_days", "resync_interval_s", "sync_unready_after_s",
    "metrics_source", "prometheus_url", "controller_enabled", "controller_tick_s", "controller_lease_ttl_s",
    "controller_call_timeout_s", "model_repository", "fleets", "triton_url", "triton_grpc_url", "triton_ca_file",
    "triton_client_cert_file", "triton_client_key_file", "fleet_dns_refresh_s", "fleet_health_interval_s",
    "fleet_eject_after", "max_sequence_pins", "max_sequence_pins_per_client", "workers", "worker_listeners",
    "worker_stall_s", "metrics_port", "sticky_header"])


@dataclass
class Reload:
    """What one SIGHUP changed, and what became of each change."""

    source: str
    applied: list[str] = field(default_factory=list)  # in force now
    restart: list[str] = field(default_factory=list)  # changed in the file, not in force until a restart
    # workers: every old worker has closed its listeners (until then one may still take a
    # connection, with the old settings: a removed token); None in one process (no workers)
    workers_replaced: bool | None = None

    def describe(self) -> str:
        applied = ", ".join(self.applied) or "nothing changed"
        if not self.restart:
            return f"SIGHUP: settings from {self.source} applied: {applied}"
        return (f"SIGHUP: settings from {self.source} applied: {applied}; changed but in force only after a "
                f"restart: {', '.join(self.restart)}")

    def document(self) -> dict[str, object]:
        document: dict[str, object] = {"source": self.source, "applied": self.applied,
                                       "restart_needed": self.restart}
        if self.workers_replaced is not None:
            document["workers_replaced"] = self.workers_replaced
        return document


def changed(old: Settings, new: Settings) -> list[str]:
    """The settings whose values differ, in the order Settings declares them."""
    return [name for name in Settings.model_fields if getattr(old, name) != getattr(new, name)]


def sort_out(names: list[str], data_plane_replaced: bool, source: str) -> Reload:
    """Each changed setting: applied (live, or by the workers' replacement) or needing a restart."""
    reload = Reload(source)
    for name in names:
        if name in LIVE or data_plane_replaced and name not in READ_ONCE:
            reload.applied.append(name)
        else:
            reload.restart.append(name)
    return reload
