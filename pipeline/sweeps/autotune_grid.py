"""A finite search space, run point by point: enumerated once, or sampled without repeats.

A space whose every parameter is a ``choice()`` or an integer range (``range()``,
``tag(int, interval())``) is a finite grid: the product of the parameters' sizes. Optuna's
samplers draw with replacement, so a study of 20 trials over a 3-value ``choice()`` measures
each value about 7 times. Here:

- ``n_trials`` at least the number of untried points: every untried point is enqueued once, in
  grid order, and the study runs exactly that many trials.
- fewer trials than points: the sampler proposes; a proposal of a point already tried is not
  run (it stays in the study as a failed trial with the user attribute ``repeat_of``, which
  Optuna's samplers and views leave out) and an untried point, drawn with the seed, runs
  in its place.

"Tried" covers this sweep's trials (a point that fails is not run again in the same sweep) and,
for a stored study (``hydra.sweeper.storage``), the trials of earlier sweeps that completed: a
point whose earlier trials all failed (or never finished) is untried, and runs again.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Any

Point = tuple[str, ...]


def grid_values(dist: Any) -> list[Any] | None:
    """Every value of one Optuna distribution, or None when it is continuous."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    if isinstance(dist, CategoricalDistribution):
        return list(dist.choices)
    if isinstance(dist, IntDistribution):
        return list(range(dist.low, dist.high + 1, dist.step))
    return None


def space_size(space: dict[str, Any]) -> int | None:
    """The number of points of a finite space; None when a parameter is continuous."""
    size = 1
    for dist in space.values():
        values = grid_values(dist)
        if values is None:
            return None
        size *= len(values)
    return size


@dataclass
class FiniteSpace:
    """The points of a finite space, which of them a study has tried (point -> trial), and how
    many of the untried ones failed in earlier sweeps (``failed_before``: they run again)."""

    space: dict[str, Any]
    points: list[dict[str, Any]]
    tried: dict[Point, int]
    rng: random.Random = field(repr=False)
    failed_before: int = 0

    @classmethod
    def of(cls, space: dict[str, Any], study: Any, seed: int | None) -> FiniteSpace | None:
        """The space's grid (None for a continuous space) and the study's completed points."""
        from optuna.trial import TrialState

        values = {k: grid_values(d) for k, d in space.items()}
        if any(v is None for v in values.values()):
            return None
        keys = list(space)
        points = [
            dict(zip(keys, combo, strict=True))
            for combo in itertools.product(*(values[k] or [] for k in keys))
        ]
        found = cls(space, points, {}, random.Random(seed))
        grid = {found.key(p) for p in points}
        failed = set()
        for trial in study.get_trials(
            deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL)
        ):
            if trial.user_attrs.get("repeat_of") is None and set(trial.params) == set(keys):
                point = found.key(trial.params)
                if point not in grid:
                    continue
                if trial.state == TrialState.COMPLETE:
                    found.tried.setdefault(point, trial.number)
                else:
                    failed.add(point)
        found.failed_before = len(failed - set(found.tried))
        return found

    def key(self, params: dict[str, Any]) -> Point:
        return tuple(str(params[k]) for k in self.space)

    @property
    def untried(self) -> list[dict[str, Any]]:
        return [p for p in self.points if self.key(p) not in self.tried]

    def enqueue_all(self, study: Any) -> int:
        """Queue every untried point once, in grid order; the number queued."""
        left = self.untried
        for point in left:
            study.enqueue_trial(point, skip_if_exists=False)
        return len(left)

    def ask(self, study: Any) -> Any:
        """The study's next trial, at a point no trial has tried yet."""
        from optuna.trial import TrialState

        trial = study.ask(self.space)
        while (earlier := self.tried.get(self.key(trial.params))) is not None:
            trial.set_user_attr("repeat_of", earlier)
            study.tell(trial, state=TrialState.FAIL)
            left = self.untried
            if not left:
                raise RuntimeError("every point of the search space was tried")
            study.enqueue_trial(self.rng.choice(left), skip_if_exists=False)
            trial = study.ask(self.space)
        self.tried[self.key(trial.params)] = trial.number
        return trial


__all__ = ["FiniteSpace", "grid_values", "space_size"]
