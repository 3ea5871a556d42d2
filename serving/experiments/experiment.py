"""An A/B experiment over serving configurations: its arms, their weights, and which arm serves a
request (sticky by a key the client sends).

An arm is a model with `llm`'s interface (`llm`, or `llm_b` over another `llm_engine`
configuration, or another model version). The experiment file is JSON:

    {"name": "spec-on-off",
     "arms": [{"name": "control", "model": "llm", "weight": 50},
              {"name": "speculative", "model": "llm_b", "weight": 50}],
     "sticky_key": "user",          # the OpenAI `user` field; "header:X-User-Id"; "parameter:session"
     "holdout": 0.05}               # this share of keys is served by the first arm, outside the experiment

Assignment is weighted rendezvous hashing: each arm draws u = SHA-256(experiment, key, arm) in
(0, 1) and the arm with the smallest -ln(u) / weight serves (an exponential race: arm a wins with
probability weight_a / total). So the same key always gets the same arm while the weights stay;
changing one arm's weight moves keys only to or from that arm, and removing an arm (weight 0) moves
exactly its keys, spread over the others by their weights. The holdout is decided first, by its
own hash. A request without the key draws at random (not sticky).
"""
from __future__ import annotations

import hashlib
import math
import random
import re
from dataclasses import dataclass

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
KEY_SOURCES = ("user", "header:", "parameter:")


class ExperimentError(ValueError):
    """An experiment file or a weight change that cannot be used; the message says why."""


@dataclass(frozen=True, slots=True)
class Arm:
    name: str
    model: str  # the Triton model with llm's interface that serves it
    weight: float


@dataclass(frozen=True, slots=True)
class Assignment:
    arm: Arm
    in_experiment: bool  # False: held out (served by the first arm, not measured as an arm)


@dataclass(frozen=True, slots=True)
class Experiment:
    name: str
    arms: tuple[Arm, ...]
    sticky_key: str = "user"
    holdout: float = 0.0

    def __post_init__(self) -> None:
        if not NAME.match(self.name):
            raise ExperimentError("name: 1 to 64 letters, digits, '_', '.' or '-'")
        if not 2 <= len(self.arms) <= 16:
            raise ExperimentError("arms: 2 to 16 arms")
        names = [a.name for a in self.arms]
        if len(set(names)) != len(names) or not all(NAME.match(n) for n in names):
            raise ExperimentError("arms: unique names of 1 to 64 letters, digits, '_', '.' or '-'")
        if not all(NAME.match(a.model) for a in self.arms):
            raise ExperimentError("arms: each needs a model name")
        if any(not isinstance(a.weight, (int, float)) or a.weight < 0 for a in self.arms) or \
                sum(a.weight for a in self.arms) <= 0:
            raise ExperimentError("arms: weights must be >= 0 and not all 0")
        if not (self.sticky_key == "user" or
                (self.sticky_key.startswith(KEY_SOURCES[1:]) and len(self.sticky_key.split(":", 1)[1]) > 0)):
            raise ExperimentError('sticky_key: "user", "header:<name>" or "parameter:<name>"')
        if not isinstance(self.holdout, (int, float)) or not 0 <= self.holdout < 1:
            raise ExperimentError("holdout: a share in [0, 1)")

    @classmethod
    def from_dict(cls, values: dict) -> Experiment:
        try:
            arms = tuple(Arm(str(a["name"]), str(a["model"]), a.get("weight", 1)) for a in values["arms"])
            return cls(str(values["name"]), arms, values.get("sticky_key", "user"), values.get("holdout", 0.0))
        except (KeyError, TypeError, AttributeError) as e:
            raise ExperimentError(f"not an experiment: {e}") from None

    @property
    def control(self) -> Arm:
        return self.arms[0]

    def point(self, key: str | None, salt: str) -> float:
        """A number in (0, 1), the same for the same experiment, key and salt; random without a key."""
        if key is None:
            return random.random() or 0.5
        digest = hashlib.sha256(f"{self.name}\x00{salt}\x00{key}".encode()).digest()
        return (int.from_bytes(digest[:8], "big") + 0.5) / 2**64

    def assign(self, key: str | None) -> Assignment:
        if self.holdout and self.point(key, "\x00holdout") < self.holdout:
            return Assignment(self.control, False)
        live = [a for a in self.arms if a.weight > 0]
        arm = min(live, key=lambda a: -math.log(self.point(key, a.name)) / a.weight)
        return Assignment(arm, True)

    def with_weights(self, weights: dict[str, float]) -> Experiment:
        """The same experiment with some arms' weights changed (0 takes an arm out)."""
        unknown = set(weights) - {a.name for a in self.arms}
        if unknown:
            raise ExperimentError(f"weights: no arm {sorted(unknown)[0]!r}")
        arms = tuple(Arm(a.name, a.model, weights.get(a.name, a.weight)) for a in self.arms)
        return Experiment(self.name, arms, self.sticky_key, self.holdout)
