"""`quick_family`: a data directory holding the quick preset of the model family, trained once per
test session, for any test that needs some trained model:

    def test_something(quick_family):
        loaded = planetserve.models.load("gt", data_dir=quick_family)   # or "planetserve/gt-int4", ...

Treat the directory as read-only (copy it to change it). With PLANETSERVE_TEST_MODELS set, that
directory is used instead and kept between sessions (training is skipped while it matches the recipe).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest

TEST_MODELS_ENV = "PLANETSERVE_TEST_MODELS"
DEEP_LAYERS = 6


@pytest.fixture(scope="session")
def quick_family(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from planetserve.models.family import train_family

    kept = os.environ.get(TEST_MODELS_ENV, "").strip()
    data = Path(kept) if kept else tmp_path_factory.mktemp("quick-family")
    train_family("quick", data)
    return data


@pytest.fixture(scope="session")
def deep_gt(quick_family: Path, tmp_path_factory: pytest.TempPathFactory):
    """The quick gt with its two trained layers repeated to six (layer i is trained layer i % 2), saved
    as a checkpoint directory and loaded the normal way: the quick family has too few layers to split
    in three."""
    from transformers import LlamaForCausalLM

    from planetserve.models import load

    gt = load("gt", data_dir=quick_family)
    config = copy.deepcopy(gt.model.config)
    config.num_hidden_layers = DEEP_LAYERS
    if getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"] * DEEP_LAYERS
    deep = LlamaForCausalLM(config)
    state = {k: v for k, v in gt.model.state_dict().items() if ".layers." not in k}
    for i in range(DEEP_LAYERS):
        prefix = f"model.layers.{i % 2}."
        state.update({k.replace(prefix, f"model.layers.{i}."): v
                      for k, v in gt.model.state_dict().items() if k.startswith(prefix)})
    deep.load_state_dict(state)
    directory = tmp_path_factory.mktemp("deep-gt")
    deep.save_pretrained(directory)
    gt.tokenizer.save_pretrained(directory)
    return load(directory)
