"""Weight versions of samples and their staleness against the trainer's version."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from ember_core.types import Sample

INITIAL_WEIGHT_VERSION = "-1"
"""Weight version of the initial weights; after training rollout i the version is str(i)."""
UNLOADED_WEIGHT_VERSION = "unloaded"
"""Weight version of servers launched from another checkpoint than the trainer's initial export
(`RolloutEngine.launch`) until the driver loads the export into them: not an integer, so a
sample generated from those weights is refused (`sample_version`), never taken for version
-1."""


def sample_version(sample: Sample) -> int:
    """The oldest weight version a sample's tokens came from (`Sample.weight_version`, the
    first span's under partial rollouts).

    Raises:
        ValueError: A weight version that is not an integer, naming the sample.
    """
    try:
        return int(sample.weight_version)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(
            f"sample {sample.index} (group {sample.group_index}): weight_version="
            f"{sample.weight_version!r}; every engine must report the version it serves "
            f"(meta_info.weight_version: {INITIAL_WEIGHT_VERSION} for the initial weights, "
            "then the rollout id of each push)"
        ) from None


def staleness_metrics(
    samples: Sequence[Sample], trainer_version: int, max_staleness: int
) -> dict[str, float]:
    """The rollout's staleness: its mean (`rollout/staleness`), its largest value, a
    histogram (`rollout/staleness_<g>`: the fraction of samples g versions old, for every g
    from 0 to `max_staleness`) and, under partial rollouts, the fraction of samples whose
    response spans several versions (`rollout/multi_version_samples`).

    Raises:
        ValueError: A sample whose weight version is not an integer, naming it.
    """
    gaps = [trainer_version - sample_version(s) for s in samples]
    n = max(len(gaps), 1)
    metrics = {
        "rollout/staleness": float(statistics.fmean(gaps)) if gaps else 0.0,
        "rollout/staleness_max": float(max(gaps, default=0)),
    }
    for g in range(max_staleness + 1):
        metrics[f"rollout/staleness_{g}"] = sum(gap == g for gap in gaps) / n
    spans = [len(s.weight_versions or ()) > 1 for s in samples]
    metrics["rollout/multi_version_samples"] = sum(spans) / n
    return metrics


def beyond_bound(samples: Sequence[Sample], rollout_id: int, max_staleness: int) -> int:
    """How many samples of rollout `rollout_id` are staler than `max_staleness` would be when
    the rollout is trained (by the trainer holding version `rollout_id - 1`)."""
    return sum(rollout_id - 1 - sample_version(s) > max_staleness for s in samples)
