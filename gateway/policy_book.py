"""The policy book: where the control plane hands policies to the data plane.

Readers (every request) call :meth:`PolicyBook.get`; writers (admin API, rollout controller,
store change feed) call :meth:`PolicyBook.put` / :meth:`PolicyBook.remove`. A write builds a
new immutable mapping and swaps it in with one assignment, so a request sees either the
old or the new policy of a model, never a half-applied one, and needs no lock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from gateway.policy import PolicySpec
from gateway.routing import Policy, compile_policy

Listener = Callable[[str, "Policy | None"], None]


class PolicyBook:
    def __init__(self, default_sticky_header: str = "x-user-id") -> None:
        self._snapshot: Mapping[str, Policy] = MappingProxyType({})
        self._default_sticky_header = default_sticky_header
        self._listeners: list[Listener] = []
        self._revisions: dict[str, int] = {}  # last applied revision per model, deletes included
        self.get = self._snapshot.get  # rebound on every swap: one attribute lookup per request

    def snapshot(self) -> Mapping[str, Policy]:
        return self._snapshot

    def on_change(self, listener: Listener) -> None:
        """Call ``listener(model, policy_or_None)`` after every swap (metrics, logs)."""
        self._listeners.append(listener)

    def compile(self, model: str, spec: PolicySpec, revision: int) -> Policy:
        return compile_policy(model, spec, revision, self._default_sticky_header)

    def put(self, model: str, spec: PolicySpec, revision: int) -> Policy:
        """Install ``spec`` unless the book already holds the same or a newer revision."""
        current = self._snapshot.get(model)
        if self._revisions.get(model, -1) >= revision:
            return current  # type: ignore[return-value]
        self._revisions[model] = revision
        policy = self.compile(model, spec, revision)
        self._swap({**self._snapshot, model: policy})
        self._notify(model, policy)
        return policy

    def remove(self, model: str, revision: int | None = None) -> None:
        """Back to passthrough; with a revision, only if it is newer than what the book has."""
        if revision is not None:
            if self._revisions.get(model, -1) >= revision:
                return
            self._revisions[model] = revision
        if model in self._snapshot:
            self._swap({m: p for m, p in self._snapshot.items() if m != model})
            self._notify(model, None)

    def override(self, model: str, spec: PolicySpec) -> Policy:
        """Install ``spec`` now, keeping the recorded revision, so the next stored revision still
        replaces it. For a rollback while the store is down: this replica stops sending traffic to
        the canary at once; the store's record catches up when it is back."""
        policy = self.compile(model, spec, self._revisions.get(model, 0))
        self._swap({**self._snapshot, model: policy})
        self._notify(model, policy)
        return policy

    def _swap(self, policies: dict[str, Policy]) -> None:
        snapshot = MappingProxyType(policies)
        self._snapshot = snapshot
        self.get = snapshot.get

    def _notify(self, model: str, policy: Policy | None) -> None:
        for listener in self._listeners:
            listener(model, policy)
