"""The model family: corpus, tokenizer, deterministic training, checkpoints, quantization, loading, CLI."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from planetserve.cli import main
from planetserve.models import DATA_ENV, CheckpointError, ModelNotFound, load, model_dir
from planetserve.models import corpus as corpus_module
from planetserve.models.corpus import build_corpus, source_files
from planetserve.models.evaluate import continuation_loss, sample_continuations
from planetserve.models.family import materials, train_family
from planetserve.models.layout import read_stamp, state, write_stamp
from planetserve.models.quantize import fake_quantize
from planetserve.models.recipes import NAMES, PRESETS, QUICK, param_count
from planetserve.models.tokenizer import IM_END_ID, SPECIAL_TOKENS, render_chat

TEXTS = [
    "Return the number of items in a container.",
    "    def f(x):\n\treturn x ** 2  # indented, tabs\n\n",
    "naïve café — 東京 🚀 and ZWJ 👩‍💻",
    "",
    "<|im_start|> is special here",
]


def copy_family(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(".train.lock"))
    return target


def test_corpus_is_deterministic_and_sized():
    first, second = build_corpus(), materials(QUICK)[0]  # the second one is kept for training
    assert first is not second and first.to_bytes() == second.to_bytes()
    stats = first.stats()
    assert stats["documents"] > 3000 and stats["chars"] > 1_000_000
    assert 0.02 < stats["held_out_documents"] / stats["documents"] < 0.1
    texts = [d.text for d in first.documents]
    assert len(texts) == len(set(texts))
    assert {d.kind for d in first.documents} == {"module", "class", "function", "topic"}


def small_stdlib(root: Path) -> Path:
    """A stand-in stdlib of three documented modules, a test folder and a config- folder to skip."""
    for relative, doc in [("alpha.py", "Alpha parses the first kind of document there is."),
                          ("pkg/__init__.py", "The package of beta and its friends, documented."),
                          ("pkg/beta.py", "Beta writes the second kind of document out again."),
                          ("pkg/tests/test_beta.py", "Tests of beta that no corpus should ever hold."),
                          ("config-3.11/gamma.py", "Build configuration that is never a document.")]:
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(f'"""{doc}"""\n')
    return root


def test_a_corpus_is_built_once_then_read_from_its_cache(tmp_path, monkeypatch):
    root = small_stdlib(tmp_path / "lib")
    assert [p.relative_to(root).as_posix() for p in source_files(root)] == ["alpha.py", "pkg/__init__.py",
                                                                               "pkg/beta.py"]
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "data"))
    built = build_corpus(root)
    assert [d.title for d in built.documents] == ["alpha", "pkg", "pkg.beta"] and built.files == 3
    assert len(list((tmp_path / "data" / "corpus").glob("corpus-*.msgpack"))) == 1

    def parse_again(*_):
        raise AssertionError("parsed although the cache holds this corpus")

    with monkeypatch.context() as patched:
        patched.setattr(corpus_module, "parse_corpus", parse_again)
        again = build_corpus(root)
    assert again.to_bytes() == built.to_bytes() and again.files == built.files


def test_a_changed_source_file_or_a_damaged_cache_builds_the_corpus_afresh(tmp_path, monkeypatch):
    root = small_stdlib(tmp_path / "lib")
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "data"))
    build_corpus(root)
    (root / "pkg" / "beta.py").write_text(  # longer: its size tells it apart whatever the clock's grain
        '"""Beta now writes a third kind of document, a longer one."""\n')
    assert build_corpus(root).documents[-1].text == "Beta now writes a third kind of document, a longer one."
    for cached in (tmp_path / "data" / "corpus").glob("corpus-*.msgpack"):
        cached.write_bytes(cached.read_bytes()[:-40])  # cut short, as by a full disk
    assert build_corpus(root).documents[-1].text == "Beta now writes a third kind of document, a longer one."
    for cached in (tmp_path / "data" / "corpus").glob("corpus-*.msgpack"):
        cached.write_bytes(cached.read_bytes().replace(b"third", b"fifth"))  # its digest no longer matches
    assert build_corpus(root).documents[-1].text == "Beta now writes a third kind of document, a longer one."


def test_a_corpus_is_built_where_its_cache_cannot_be_written(tmp_path, monkeypatch):
    root = small_stdlib(tmp_path / "lib")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "corpus").write_text("a file where the cache folder would be")
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "data"))
    assert [d.title for d in build_corpus(root).documents] == ["alpha", "pkg", "pkg.beta"]
    assert (tmp_path / "data" / "corpus").read_text() == "a file where the cache folder would be"


def test_tokenizer_round_trips_and_renders_chat(quick_family):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir("gt", quick_family)), local_files_only=True)
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(len(SPECIAL_TOKENS)))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids[1:]) == text
    assert tok.decode(tok(TEXTS[0])["input_ids"], skip_special_tokens=True) == TEXTS[0]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is json?"}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == render_chat(messages, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")


def test_quick_training_is_deterministic(quick_family, tmp_path):
    materials.cache_clear()  # corpus, tokenizer and data too, not only the training loop
    again = train_family("quick", tmp_path, only=["gt"])
    assert [r.action for r in again] == ["trained"]
    original = read_stamp(model_dir("gt", quick_family))
    assert again[0].stamp["weights_sha256"] == original["weights_sha256"]
    assert again[0].stamp["tokenizer"] == original["tokenizer"]
    assert again[0].stamp["eval"] == original["eval"]
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        a, b = (model_dir("gt", d) / name for d in (quick_family, tmp_path))
        assert hashlib.sha256(a.read_bytes()).digest() == hashlib.sha256(b.read_bytes()).digest(), name


def test_checkpoint_loads_through_the_auto_classes(quick_family):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = model_dir("gt", quick_family)
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json"):
        assert (directory / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    ids = tok("Return the number of items", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids.shape[1]

    by_name = load("gt", data_dir=quick_family)
    by_id = load("planetserve/gt", data_dir=quick_family)
    by_path = load(directory)
    assert by_name.model_id == by_id.model_id == by_path.model_id == "planetserve/gt"
    assert by_name.path == directory and by_name.stamp["preset"] == "quick"
    assert IM_END_ID in by_name.stop_token_ids and by_name.max_model_len == QUICK.max_position_embeddings
    with torch.inference_mode():
        reference = model(ids).logits
        for loaded in (by_name, by_path):
            assert torch.equal(loaded.model(ids).logits, reference)
    assert load(directory, model_id="org/renamed").model_id == "org/renamed"


def test_quantized_variants_differ_from_gt_but_stay_close(quick_family):
    gt, int8, int4 = (load(n, data_dir=quick_family) for n in ("gt", "gt-int8", "gt-int4"))
    assert gt.quantization is None
    assert (int8.quantization["bits"], int4.quantization["bits"]) == (8, 4)
    ids = gt.tokenizer(["The json module encodes and decodes JSON documents."], return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        logits = [m.model(ids).logits for m in (gt, int8, int4)]
    d8, d4 = ((q - logits[0]).abs().max().item() for q in logits[1:])
    spread = logits[0].std().item()
    assert 0 < d8 < d4 < spread, (d8, d4, spread)
    assert d8 < 0.05 * spread
    # each row of a quantized weight sits on its own grid of at most 2*qmax+1 levels
    weight = int4.model.model.layers[0].self_attn.q_proj.weight
    assert all(len(torch.unique(row)) <= 15 for row in weight)
    assert torch.equal(fake_quantize(weight, 4), weight)
    assert torch.equal(int4.model.model.embed_tokens.weight, gt.model.model.embed_tokens.weight)


def test_smaller_models_are_worse_than_gt(quick_family):
    stamps = {n: read_stamp(model_dir(n, quick_family)) for n in NAMES}
    for metric in ("held_out_ppl", "gt_sample_ppl"):
        gt, small, tiny = (stamps[n]["eval"][metric] for n in ("gt", "small", "tiny"))
        assert gt < small < tiny, (metric, gt, small, tiny)
    # live, on text gt sampled itself: a node serving small or tiny cannot pass for gt
    gt = load("gt", data_dir=quick_family)
    questions = ["What does json.dumps() do?", "What is the os.path module for?", "Explain with in Python."]
    prompts = tuple(
        gt.tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"][0]
        for q in questions
    )
    samples = sample_continuations(gt.model, prompts, 48)
    losses = {n: continuation_loss(load(n, data_dir=quick_family).model, samples) for n in NAMES}
    assert losses["gt"] < losses["small"] < losses["tiny"], losses
    for variant in ("gt-int8", "gt-int4"):
        assert abs(losses[variant] - losses["gt"]) < 0.1 * (losses["small"] - losses["gt"]), losses


def test_param_count_matches_the_built_models():
    from transformers import LlamaForCausalLM

    from planetserve.models.train import llama_config

    for preset in PRESETS.values():
        for recipe in preset.models:
            if hasattr(recipe, "hidden_size"):
                with torch.device("meta"):
                    model = LlamaForCausalLM(llama_config(preset, recipe))
                assert param_count(preset, recipe.name) == sum(p.numel() for p in model.parameters())


def test_unknown_or_untrained_model_is_not_found(tmp_path):
    with pytest.raises(ModelNotFound, match="planetserve models train"):
        load("no-such-model", data_dir=tmp_path)
    with pytest.raises(ModelNotFound, match=f"planetserve models train.*--data-dir {tmp_path}"):
        load("gt", data_dir=tmp_path)
    with pytest.raises(ModelNotFound):
        load("planetserve/nope", data_dir=tmp_path)


def test_damaged_checkpoint_is_a_clear_error(quick_family, tmp_path):
    data = copy_family(quick_family, tmp_path / "data")
    directory = model_dir("small", data)
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="cannot load the checkpoint"):
        load("small", data_dir=data)
    weights.unlink()
    with pytest.raises(CheckpointError, match="missing model.safetensors"):
        load("small", data_dir=data)
    (model_dir("tiny", data) / "config.json").unlink()
    with pytest.raises(CheckpointError, match="missing config.json"):
        load(model_dir("tiny", data))


def test_stale_and_current_checkpoints(quick_family, tmp_path):
    data = copy_family(quick_family, tmp_path / "data")
    assert all(state(QUICK, n, data) == "current" for n in NAMES)
    assert all(state(PRESETS["full"], n, data) == "stale" for n in NAMES)
    stamp = read_stamp(model_dir("tiny", data))
    write_stamp(model_dir("tiny", data), stamp | {"recipe_hash": "0" * 64})
    reports = train_family("quick", data)
    assert {r.name: r.action for r in reports} == {"gt": "cached", "small": "cached", "tiny": "trained",
                                                   "gt-int8": "cached", "gt-int4": "cached"}
    retrained = read_stamp(model_dir("tiny", data))
    assert retrained["weights_sha256"] == stamp["weights_sha256"]
    assert retrained["eval"] == stamp["eval"]  # gt's samples: the same from its checkpoint as fresh
    assert not any(p.name.startswith(".tiny") for p in (data / "models").iterdir())


def run(*args: str) -> str:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


def test_cli(quick_family, tmp_path):
    listed = json.loads(run("models", "list", "--preset", "quick", "--data-dir", str(quick_family), "--json"))
    assert [r["name"] for r in listed] == list(NAMES) and {r["state"] for r in listed} == {"current"}
    empty = json.loads(run("models", "list", "--json", "--data-dir", str(tmp_path / "empty")))
    assert {r["state"] for r in empty} == {"missing"}

    data = copy_family(quick_family, tmp_path / "data")
    trained = json.loads(run("models", "train", "--preset", "quick", "--data-dir", str(data),
                             "--only", "tiny", "--force", "--json"))
    assert [(r["name"], r["action"]) for r in trained] == [("tiny", "trained")]
    run("models", "train", "--preset", "quick", "--data-dir", str(data))

    shown = json.loads(run("models", "show", "gt-int4", "--data-dir", str(data), "--json"))
    assert shown["model_id"] == "planetserve/gt-int4" and shown["quantization"]["bits"] == 4
    assert shown["params"] == param_count(QUICK, "gt-int4")
    assert "held-out" in run("models", "show", "gt", "--data-dir", str(data))
    assert run("models", "generate", "gt", "What is json?", "--data-dir", str(data), "--max-tokens", "4")

    missing = CliRunner().invoke(main, ["models", "show", "gt", "--data-dir", str(tmp_path / "empty")])
    assert missing.exit_code == 1 and "planetserve models train" in missing.output
