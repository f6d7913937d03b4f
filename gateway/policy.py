"""The policy vocabulary: what SREs write (YAML config or the admin API) about one model's traffic.

These types are shared by the data plane (``routing`` compiles a :class:`PolicySpec` once into
the form the hot path reads), the store (which keeps specs with revisions) and the control
plane (admin API, rollouts, lifecycle), so they live apart from all three.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from gateway.fleet.config import DEFAULT_FLEET

Version = Annotated[str, Field(pattern=r"^[1-9][0-9]{0,18}$", description="Triton version number, as a string")]


DOT_SEGMENTS = frozenset([".", ".."])


def not_dot_segment(name: str) -> str:
    """A model name is a directory of Triton's model repository: ``.`` and ``..`` name the
    repository itself and its parent, and a load of ``..`` would read outside it."""
    if name in DOT_SEGMENTS:
        raise ValueError(f"'{name}' is not a model name: '.' and '..' name directories, not models")
    return name


# What the admin API, the console's actions and the config's policies take as a model name.
ModelName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,128}$"), AfterValidator(not_dot_segment)]
# Where traffic goes (a "target"), in one string that reads the same in the API, YAML, the CLI
# and the console:
#
#   [fleet ":"] version               "3", "green:3": a version of the model the client called
#   [fleet ":"] model ["@" version]   "qc_2026_12", "qc_2026_12@2": another model (Triton's
#                                     default version of it, or that version)
#
# ":" always ends a fleet and "@" always starts a model's version, so "qc_2026_12@2" cannot be
# read as version 2 on a fleet named qc_2026_12 (which "qc_2026_12:2" is, as it was before
# model targets existed): "@" reads as "at version", as in pip's and npm's name@version. A target
# that is only digits is a version; a model a target names has a non-digit. "default:3" names
# the default fleet (the fleet `default` of the config) and is stored as "3", the one spelling
# the data plane looks up: a named fleet is any other name.
DEFAULT_FLEET_PREFIX = f"{DEFAULT_FLEET}:"
_FLEET = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
_VERSION = re.compile(r"[1-9][0-9]{0,18}")
# A model name as ModelName takes it, which has neither separator (a model of digits only is
# written as a version would be, so a target never names one).
_MODEL = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_SHOWN = 80  # characters of a refused target quoted in its error


@dataclass(frozen=True, slots=True)
class TargetName:
    """A target key read: ``fleet`` None is the default fleet; ``model`` None is the model the
    client called; ``version`` None is Triton's default version of ``model`` (never with model None)."""

    fleet: str | None
    model: str | None
    version: str | None

    @property
    def key(self) -> str:
        """The canonical spelling (the default fleet unnamed)."""
        fleet = "" if self.fleet is None else f"{self.fleet}:"
        if self.model is None:
            return f"{fleet}{self.version}"
        return f"{fleet}{self.model}" if self.version is None else f"{fleet}{self.model}@{self.version}"

    def renames(self, model: str) -> bool:
        """Requests of ``model`` routed here go to another model's name."""
        return self.model is not None and self.model != model


def parse_target(key: str) -> TargetName:
    """A target key (the grammar above) read; ValueError naming what is wrong."""
    shown = repr(key[:_SHOWN])
    fleet, sep, rest = key.partition(":")
    if not sep:
        fleet, rest = "", key
    elif not _FLEET.fullmatch(fleet):
        raise ValueError(f"target {shown}: '{fleet[:_SHOWN]}' is not a fleet name (lower-case letters, digits, "
                         "'_' and '-', at most 63; a model's version is written model@version)")
    model, at, version = rest.partition("@")
    if at and not _VERSION.fullmatch(version):
        raise ValueError(f"target {shown}: after '@' comes a version number (1 to 19 digits, no leading 0)")
    if not at and rest.isascii() and rest.isdigit():
        if not _VERSION.fullmatch(rest):
            raise ValueError(f"target {shown}: a version is 1 to 19 digits without a leading 0")
        return TargetName(_fleet_or_default(fleet), None, rest)
    if not _MODEL.fullmatch(model) or model.isdigit() or model in DOT_SEGMENTS:
        raise ValueError(f"target {shown}: '{model[:_SHOWN]}' is neither a version nor a model name (a model name "
                         "has letters, digits, '_', '.' and '-', not only digits, at most 128, not '.' or '..')")
    return TargetName(_fleet_or_default(fleet), model, version or None)


def _fleet_or_default(fleet: str) -> str | None:
    return None if not fleet or fleet == DEFAULT_FLEET else fleet


def canonical_target(key: str) -> str:
    """``"default:3"`` -> ``"3"``; ValueError for a key that is not a target."""
    return parse_target(key).key


def plain_target(key: str) -> str:
    """``"default:3"`` -> ``"3"``; any other target key as it is."""
    return key.removeprefix(DEFAULT_FLEET_PREFIX)


TargetKey = Annotated[str, Field(min_length=1, max_length=300, description="version, fleet:version, model or "
                                 "model@version (with fleet: in front for a named fleet)"),
                      AfterValidator(canonical_target)]


def split_target(key: str) -> tuple[str | None, str]:
    """``"green:3"`` -> ("green", "3"); ``"3"`` -> (None, "3"): None is the default fleet. The
    second part is the rest of the key (``"qc_2026_12@2"`` for a model target)."""
    fleet, sep, rest = key.partition(":")
    return (fleet, rest) if sep else (None, key)


def target_order(key: str) -> tuple[int, str, int, str]:
    """Sort key for targets, oldest first: versions of the called model by number, then other
    models by name (a name per release sorts by its date: qc_2026_11 before qc_2026_12) and
    version; then fleet (the default fleet first). Sticky users are laid out newest first."""
    target = parse_target(key)
    return (0 if target.model is None else 1, target.model or "", int(target.version or 0), target.fleet or "")


Percent = Annotated[Decimal, Field(ge=0, le=100, decimal_places=2)]


def _distinct_targets(weights: object) -> object:
    """Refuse two keys for one target ("3" and "default:3"), which would otherwise merge silently."""
    if isinstance(weights, Mapping):
        seen: dict[str, str] = {}
        for key in weights:
            if isinstance(key, str):
                try:
                    canonical = canonical_target(key)
                except ValueError:
                    continue  # the key's own validation says why
                other = seen.setdefault(canonical, key)
                if other != key:
                    raise ValueError(f"weights name one target twice: '{other}' and '{key}' "
                                     "(default: is the default fleet)")
    return weights


Weights = Annotated[dict[TargetKey, Percent], BeforeValidator(_distinct_targets)]
# "auto": on exactly when Triton's config of the model has a sequence batcher (the gateway
# reads it off the request path); true / false force it on or off whatever the config says.
SequenceAffinity = bool | Literal["auto"]
HeaderName = Annotated[str, Field(pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,128}$")]


class HeaderRule(BaseModel):
    """``header: equals -> version``: e.g. ``x-canary: always`` sends a tester to version 3."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    header: HeaderName
    equals: str = Field(max_length=1024)
    version: TargetKey


class ShadowSpec(BaseModel):
    """Mirror ``percent`` of the model's routed requests to ``version`` (``"green:3"``: on fleet
    green); clients never see it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    version: TargetKey
    percent: Annotated[Decimal, Field(gt=0, le=100, decimal_places=2)]


class PolicySpec(BaseModel):
    """A model's routing policy as written by people: percentages summing to 100."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    weights: Weights = Field(
        description="target -> percent of traffic, at most two decimals, summing to 100; a target is a version "
        "of the model (\"3\"), another model (\"qc_2026_12\") or a version of it (\"qc_2026_12@2\"), with "
        "\"fleet:\" in front for a named fleet (\"green:3\")"
    )
    sticky_header: HeaderName | None = Field(
        default=None, description="header carrying a user id; None means the gateway default"
    )
    rules: list[HeaderRule] = Field(default_factory=list, max_length=64)
    shadow: ShadowSpec | None = Field(default=None, description="mirror a share of requests to a version")
    sequence_affinity: SequenceAffinity = Field(
        default="auto", description="keep Triton sequences on the version that served sequence_start (reads the "
        "request's JSON header): auto (on when the model's Triton config has a sequence batcher), true or false")

    @field_validator("weights")
    @classmethod
    def _weights_sum_to_100(cls, weights: dict[str, Decimal]) -> dict[str, Decimal]:
        if not weights:
            raise ValueError("weights must name at least one version")
        total = sum(weights.values(), Decimal(0))
        if total != 100:
            raise ValueError(f"weights must sum to 100, not {total}")
        return weights

    @model_validator(mode="after")
    def _rules_are_distinct(self) -> PolicySpec:
        seen = {(rule.header.lower(), rule.equals) for rule in self.rules}
        if len(seen) != len(self.rules):
            raise ValueError("rules repeat the same header and value")
        return self

    def basis_points(self) -> dict[str, int]:
        return {version: int(percent * 100) for version, percent in self.weights.items()}

    def versions(self) -> set[str]:
        """Every version this policy can send traffic to (weight > 0 or named by a rule)."""
        shadow = {self.shadow.version} if self.shadow else set()
        return {v for v, w in self.weights.items() if w > 0} | {rule.version for rule in self.rules} | shadow

    def models(self, model: str) -> frozenset[str]:
        """The Triton models ``model``'s policy sends requests to: itself, and the other models its
        targets name (whose configs decide ``sequence_affinity: auto``)."""
        keys = {*self.weights, *(rule.version for rule in self.rules)}
        return frozenset(parse_target(key).model or model for key in keys) | {model}

    def document(self) -> dict[str, object]:
        """JSON-ready form, weights as plain numbers (ints when whole)."""
        return {
            "weights": {v: (int(w) if w == w.to_integral_value() else float(w)) for v, w in self.weights.items()},
            "sticky_header": self.sticky_header,
            "rules": [rule.model_dump() for rule in self.rules],
            "shadow": {"version": self.shadow.version, "percent": float(self.shadow.percent)} if self.shadow else None,
            "sequence_affinity": self.sequence_affinity,
        }


def own_model_twice(model: str, spec: PolicySpec) -> str | None:
    """Why ``spec`` cannot be ``model``'s policy, or None: a target naming ``model`` itself at a
    version (``qc@3`` in qc's policy) is the same target as the plain version (``3``), and a
    policy naming both would split one target under two labels."""
    seen: dict[TargetName, str] = {}
    for key in spec.weights:
        target = parse_target(key)
        if target.model == model and target.version is not None:
            target = TargetName(target.fleet, None, target.version)
        other = seen.setdefault(target, key)
        if other != key:
            return (f"weights name one target twice: '{other}' and '{key}' ({model}@N is version N of {model} "
                    "itself: write N)")
    return None


def heaviest(weights: Mapping[str, Decimal | int]) -> str:
    """The version with the most weight; the newest (highest number) wins a tie."""
    return max(weights, key=lambda version: (weights[version], target_order(version)))


def with_weights(spec: PolicySpec | None, weights: Mapping[str, object]) -> PolicySpec:
    """The same policy with new weights, validated again (they must still sum to 100);
    a model without a policy gets one with only these weights."""
    base = spec.document() if spec is not None else {}
    return PolicySpec.model_validate({**base, "weights": dict(weights)})


def with_shadow(spec: PolicySpec, shadow: ShadowSpec | None) -> PolicySpec:
    """The same policy mirroring to ``shadow`` (None: mirroring nothing)."""
    return spec.model_copy(update={"shadow": shadow})


def without_version(spec: PolicySpec, version: str) -> PolicySpec:
    """The policy with ``version`` taken out of weights, rules and shadow; its weight goes to
    the heaviest remaining version. ValueError when no version is left to route to."""
    weights = {v: Decimal(str(w)) for v, w in spec.weights.items() if v != version}
    freed = spec.weights.get(version, Decimal(0))
    if freed and weights:
        weights[heaviest(weights)] += freed
    if not weights or sum(weights.values()) != 100:
        raise ValueError(f"cannot take version {version} out of the policy: nothing left to route to")
    doc = spec.document()
    doc["weights"] = weights
    doc["rules"] = [rule for rule in spec.rules if rule.version != version]
    if spec.shadow is not None and spec.shadow.version == version:
        doc["shadow"] = None
    return PolicySpec.model_validate(doc)
