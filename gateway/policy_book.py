"""The policy book: where the control plane hands policies to the data plane.

Readers (every request) call :meth:`PolicyBook.get`; writers (admin API, rollout controller,
store change feed) call :meth:`PolicyBook.put` / :meth:`PolicyBook.remove`. A write builds a
new immutable mapping and swaps it in with one assignment, so a request sees either the
old or the new policy of a model, never a half-applied one, and needs no lock.

Revisions only grow within one store generation, so the book ignores a revision it has
already passed, unless told to ``force`` it (state sync does that when the store itself
went back: a wiped or failed-over store), or :meth:`PolicyBook.rebuild` replaces everything
with what a new store generation holds.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
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
        self.generation: str | None = None  # the store generation the book was last rebuilt from
        # Models whose Triton config has a sequence batcher (``sequence_affinity: auto`` follows
        # it), learnt from Triton off the request path (``services.model_configs``).
        self._sequence_models: frozenset[str] = frozenset()
        # Models whose stable target is another model's name (their metadata calls are answered
        # for it): a gRPC metadata call reads its message only when there is one.
        self.renamed_stables: frozenset[str] = frozenset()
        self.get = self._snapshot.get  # rebound on every swap: one attribute lookup per request

    def snapshot(self) -> Mapping[str, Policy]:
        return self._snapshot

    def on_change(self, listener: Listener) -> None:
        """Call ``listener(model, policy_or_None)`` after every swap (metrics, logs)."""
        self._listeners.append(listener)

    def compile(self, model: str, spec: PolicySpec, revision: int) -> Policy:
        """``sequence_affinity: auto`` is on when the model, or a model its targets name, batches sequences."""
        batched = not self._sequence_models.isdisjoint(spec.models(model))
        return compile_policy(model, spec, revision, self._default_sticky_header, batched)

    def sequence_models(self) -> frozenset[str]:
        return self._sequence_models

    def set_sequence_models(self, models: Collection[str]) -> None:
        """Triton's configs say these models (and no others) batch sequences: recompile the
        policies whose ``auto`` affinity changes with it, in one swap."""
        models = frozenset(models)
        changed = models ^ self._sequence_models
        self._sequence_models = models
        if not changed:
            return
        redo = [m for m, p in self._snapshot.items()
                if p.spec.sequence_affinity == "auto" and not changed.isdisjoint(p.spec.models(m))]
        if redo:
            self._swap({**self._snapshot, **{m: self.compile(m, self._snapshot[m].spec, self._snapshot[m].revision)
                                             for m in redo}}, redo)
            for model in redo:
                self._notify(model, self._snapshot[model])

    def revision(self, model: str) -> int | None:
        """The last revision applied for the model (a delete included), None if none was."""
        return self._revisions.get(model)

    def known(self) -> set[str]:
        """Every model the book has a revision for, deleted ones included."""
        return set(self._revisions)

    def put(self, model: str, spec: PolicySpec, revision: int, force: bool = False) -> Policy:
        """Install ``spec`` unless the book already holds the same or a newer revision
        (``force``: install it anyway, the store says so)."""
        current = self._snapshot.get(model)
        if not force and self._revisions.get(model, -1) >= revision:
            return current  # type: ignore[return-value]
        self._revisions[model] = revision
        policy = self.compile(model, spec, revision)
        self._swap({**self._snapshot, model: policy}, (model,))
        self._notify(model, policy)
        return policy

    def remove(self, model: str, revision: int | None = None, force: bool = False) -> None:
        """Back to passthrough; with a revision, only if it is newer than what the book has
        (``force``: whatever the book has; without a revision the model is forgotten)."""
        if revision is None:
            self._revisions.pop(model, None)
        elif not force and self._revisions.get(model, -1) >= revision:
            return
        else:
            self._revisions[model] = revision
        if model in self._snapshot:
            self._swap({m: p for m, p in self._snapshot.items() if m != model}, (model,))
            self._notify(model, None)

    def rebuild(self, generation: str, specs: Mapping[str, tuple[PolicySpec, int]], tombstones: Mapping[str, int],
                keep: Collection[str] = ()) -> None:
        """Become exactly what a store generation holds: ``specs`` (model -> spec, revision),
        ``tombstones`` (deleted: model -> revision); every other model leaves the book,
        except those in ``keep`` (records that could not be read: the last good policy stays).
        One swap, so a request sees the old book or the new one."""
        policies = {model: policy for model, policy in self._snapshot.items() if model in keep}
        revisions = {model: rev for model, rev in self._revisions.items() if model in keep}
        changed = [model for model in self._snapshot if model not in keep and model not in specs]
        for model, (spec, revision) in specs.items():
            current = self._snapshot.get(model)
            if current is not None and current.revision == revision and current.spec == spec:
                policies[model] = current  # unchanged: keep the compiled one
            else:
                policies[model] = self.compile(model, spec, revision)
                changed.append(model)
            revisions[model] = revision
        revisions.update(tombstones)
        self._revisions = revisions
        self.generation = generation
        self._swap(policies)
        for model in changed:
            self._notify(model, policies.get(model))

    def override(self, model: str, spec: PolicySpec) -> Policy:
        """Install ``spec`` now, keeping the recorded revision, so the next stored revision still
        replaces it. For a rollback while the store is down: this replica stops sending traffic to
        the canary at once; the store's record catches up when it is back."""
        policy = self.compile(model, spec, self._revisions.get(model, 0))
        self._swap({**self._snapshot, model: policy}, (model,))
        self._notify(model, policy)
        return policy

    def _swap(self, policies: dict[str, Policy], changed: Collection[str] | None = None) -> None:
        """``changed``: the only models whose policy differs from the current snapshot (None: any may)."""
        if changed is None:
            self.renamed_stables = frozenset(m for m, p in policies.items() if p.renamed_stable is not None)
        else:
            renamed = {m for m in changed if m in policies and policies[m].renamed_stable is not None}
            self.renamed_stables = (self.renamed_stables - set(changed)) | renamed
        snapshot = MappingProxyType(policies)
        self._snapshot = snapshot
        self.get = snapshot.get

    def _notify(self, model: str, policy: Policy | None) -> None:
        for listener in self._listeners:
            listener(model, policy)
