"""Reading a Prometheus endpoint as Prometheus does, for tests of every role's metrics."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def scrape(url: str) -> Samples:
    """name -> {sorted labels: value} of every sample at `url`."""
    out: Samples = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=5).text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """The one sample of `name` whose labels include `labels`."""
    found = [v for k, v in samples.get(name, {}).items() if set(labels.items()) <= set(k)]
    assert len(found) == 1, f"{name} {labels}: {len(found)} samples"
    return found[0]
