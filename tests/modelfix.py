"""`quick_family`: a data directory holding the quick preset of the model family, trained once per
test session, for any test that needs some trained model:

    def test_something(quick_family):
        loaded = planetserve.models.load("gt", data_dir=quick_family)   # or "planetserve/gt-int4", ...

Treat the directory as read-only (copy it to change it). With PLANETSERVE_TEST_MODELS set, that
directory is used instead and kept between sessions (training is skipped while it matches the recipe).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TEST_MODELS_ENV = "PLANETSERVE_TEST_MODELS"


@pytest.fixture(scope="session")
def quick_family(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from planetserve.models.family import train_family

    kept = os.environ.get(TEST_MODELS_ENV, "").strip()
    data = Path(kept) if kept else tmp_path_factory.mktemp("quick-family")
    train_family("quick", data)
    return data
