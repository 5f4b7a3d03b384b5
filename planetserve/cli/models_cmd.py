"""`planetserve models`: train, list, inspect and try the project's own model family."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from planetserve.cli import console, emit_json, err_console, fail, table
from planetserve.models import layout, recipes
from planetserve.models.recipes import DEFAULT_PRESET, NAMES, PRESETS

if TYPE_CHECKING:
    from planetserve.models.family import ModelReport
    from planetserve.models.train import StepCallback

data_option = click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help=f"Data directory (default: ${layout.DATA_ENV}, else ~/.cache/planetserve).",
)
preset_option = click.option(
    "--preset", type=click.Choice(sorted(PRESETS)), default=DEFAULT_PRESET, show_default=True,
    help="full: the real family (gt trains in minutes on two cores); quick: a miniature one for tests.",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")


@click.group("models", short_help="Train, list and try the model family every node can build.")
def group() -> None:
    """The model family every node can build itself: gt (reference), small and tiny (weaker
    models a dishonest node could serve), gt-int8 and gt-int4 (quantized gt). Nothing is downloaded."""


PROGRESS_COLUMNS = (
    TextColumn("{task.description:>8}"),
    BarColumn(),
    MofNCompleteColumn(),
    TimeElapsedColumn(),
    TextColumn("{task.fields[loss]}"),
)
"""A training progress bar: model, steps, time, loss."""


class RichReporter:
    """One progress bar per model (steps and training loss) on the given console."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.tasks: dict[str, tuple[TaskID, int]] = {}

    def note(self, message: str) -> None:
        self.progress.console.print(f"[dim]{message}[/]")

    def begin(self, name: str, steps: int) -> StepCallback:
        total = steps or 1
        task = self.progress.add_task(name, total=total, loss="")
        self.tasks[name] = (task, total)

        def on_step(step: int, loss: float) -> None:
            self.progress.update(task, completed=step, loss=f"loss {loss:.3f}")

        return on_step

    def end(self, report: ModelReport) -> None:
        ppl = report.stamp.get("eval", {}).get("held_out_ppl")
        summary = f"{report.action}" + (f", held-out PPL {ppl:.1f}" if ppl else "")
        if report.name in self.tasks:
            task, total = self.tasks[report.name]
            self.progress.update(task, completed=total, loss=summary)
        else:
            self.progress.console.print(f"{report.name}: {summary}")


def _split(values: tuple[str, ...]) -> list[str]:
    names = [n for v in values for n in v.split(",") if n]
    unknown = sorted(set(names) - set(NAMES))
    if unknown:
        fail(f"unknown model(s) {', '.join(unknown)}; the family is {', '.join(NAMES)}")
    return names


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


@group.command("train")
@preset_option
@data_option
@click.option("--only", multiple=True, metavar="NAME", help="Train only these (repeat or comma-separate).")
@click.option("--force", is_flag=True, help="Retrain even where the cached checkpoint matches the recipe.")
@json_option
def train(preset: str, data_dir: Path | None, only: tuple[str, ...], force: bool, as_json: bool) -> None:
    """Train the family into DATA_DIR/models/<name>/, skipping checkpoints that match the recipe."""
    from planetserve.models.family import train_family

    names = _split(only)  # refused before the progress display opens
    with Progress(*PROGRESS_COLUMNS, console=err_console if as_json else console) as progress:
        reports = train_family(preset, data_dir, names, force, RichReporter(progress))
    rows = [_report_row(r) for r in reports]
    if as_json:
        emit_json(rows)
        return
    table(
        f"{preset} family (ids {recipes.ORG}/<name>) in {layout.data_dir(data_dir)}",
        ["name", "action", "params", "held-out PPL", "gt-sample PPL", "seconds"],
        [
            [
                r["name"],
                r["action"],
                f"{r['params']:,}" if r["params"] else "-",
                _fmt(r["held_out_ppl"]),
                _fmt(r["gt_sample_ppl"]),
                _fmt(r["seconds"]),
            ]
            for r in rows
        ],
    )


def _report_row(report: ModelReport) -> dict[str, Any]:
    stamp = report.stamp
    scores = stamp.get("eval") or {}
    return {
        "name": report.name,
        "model_id": recipes.model_id(report.name),
        "action": report.action,
        "path": str(report.path),
        "params": stamp.get("params"),
        "held_out_ppl": scores.get("held_out_ppl"),
        "gt_sample_ppl": scores.get("gt_sample_ppl"),
        "seconds": (stamp.get("training") or {}).get("seconds"),
    }


@group.command("list")
@preset_option
@data_option
@json_option
def list_models(preset: str, data_dir: Path | None, as_json: bool) -> None:
    """The family: parameters, where each model lives, and whether it is trained for PRESET."""
    spec = PRESETS[preset]
    rows = []
    for name in spec.names:
        directory = layout.model_dir(name, data_dir)
        stamp = layout.read_stamp(directory) or {}
        rows.append(
            {
                "name": name,
                "model_id": recipes.model_id(name),
                "role": spec.recipe(name).role,
                "params": stamp.get("params") or recipes.param_count(spec, name),
                "state": layout.state(spec, name, data_dir),
                "trained_preset": stamp.get("preset"),
                "held_out_ppl": (stamp.get("eval") or {}).get("held_out_ppl"),
                "path": str(directory),
            }
        )
    if as_json:
        emit_json(rows)
        return
    table(
        f"model family, {preset} preset (ids {recipes.ORG}/<name>)",
        ["name", "params", "state", "held-out PPL", "path"],
        [
            [
                r["name"],
                f"{r['params']:,}",
                _state_label(r, preset),
                _fmt(r["held_out_ppl"]),
                r["path"],
            ]
            for r in rows
        ],
    )
    if any(r["state"] != "current" for r in rows):
        console.print(
            f"train with: planetserve models train --preset {preset}"
            + (f" --data-dir {data_dir}" if data_dir else "")
        )


def _state_label(row: dict[str, Any], preset: str) -> str:
    if row["state"] != "stale":
        return row["state"]
    trained = row["trained_preset"]
    return "stale (older recipe)" if trained == preset else f"stale ({trained} preset)"


def _count_params(directory: Path) -> int | None:
    """From the safetensors header, without loading the weights (None for other formats)."""
    from safetensors import safe_open

    path = directory / "model.safetensors"
    if not path.is_file():
        return None
    total = 0
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            shape = f.get_slice(key).get_shape()
            count = 1
            for dim in shape:
                count *= dim
            total += count
    return total


@group.command("show")
@click.argument("name")
@data_option
@json_option
def show(name: str, data_dir: Path | None, as_json: bool) -> None:
    """Configuration, parameters and measured quality of NAME (a family name or a checkpoint directory)."""
    from planetserve.models.loading import ModelError, check_files, resolve

    try:
        model_id, directory = resolve(name, data_dir)
        check_files(directory)
        config = json.loads((directory / "config.json").read_text())
        params = _count_params(directory)
    except ModelError as exc:
        fail(str(exc))
    except (OSError, ValueError) as exc:
        fail(f"cannot read the checkpoint in {directory}: {exc}")
    stamp = layout.read_stamp(directory) or {}
    info = {
        "model_id": model_id,
        "path": str(directory),
        "params": params,
        "config": config,
        "preset": stamp.get("preset"),
        "recipe": stamp.get("recipe"),
        "eval": stamp.get("eval"),
        "training": stamp.get("training"),
        "quantization": stamp.get("quantization"),
    }
    if as_json:
        emit_json(info)
        return
    console.print(f"[bold]{model_id}[/]  {directory}")
    arch = (
        f"{config.get('model_type')}: {config.get('num_hidden_layers')} layers, hidden "
        f"{config.get('hidden_size')}, heads {config.get('num_attention_heads')}/"
        f"{config.get('num_key_value_heads')}, vocab {config.get('vocab_size')}, "
        f"context {config.get('max_position_embeddings')}"
    )
    lines = [("params", f"{params:,}" if params else "?"), ("architecture", arch)]
    if stamp:
        scores = stamp.get("eval") or {}
        lines += [
            ("preset", stamp.get("preset")),
            (
                "held-out",
                f"loss {_fmt(scores.get('held_out_loss'))}, PPL {_fmt(scores.get('held_out_ppl'))}"
                f" ({scores.get('held_out_tokens')} tokens)",
            ),
            (
                "gt samples",
                f"loss {_fmt(scores.get('gt_sample_loss'))}, PPL {_fmt(scores.get('gt_sample_ppl'))}"
                f" ({scores.get('gt_sample_tokens')} tokens)",
            ),
        ]
        if stamp.get("training"):
            t = stamp["training"]
            lines.append(
                (
                    "training",
                    f"{t['steps']} steps, {t['tokens']:,} tokens, final loss "
                    f"{t['final_loss']:.3f}, {t['seconds']:.0f} s",
                )
            )
        if stamp.get("quantization"):
            q = stamp["quantization"]
            lines.append(("quantization", f"int{q['bits']} {q['method']} of {stamp.get('source')}"))
    for label, value in lines:
        console.print(f"  {label:13} {value}")


@group.command("generate")
@click.argument("name")
@click.argument("prompt")
@data_option
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(1, 4096),
              help="Most tokens to generate.")
@click.option("--raw", is_flag=True, help="Continue PROMPT as plain text instead of as a chat message.")
def generate(name: str, prompt: str, data_dir: Path | None, max_tokens: int, raw: bool) -> None:
    """Greedy sample from NAME: PROMPT as a user chat message (or, with --raw, text to continue)."""
    import torch

    from planetserve.models.loading import ModelError, load

    torch.set_num_threads(min(2, torch.get_num_threads()))
    try:
        loaded = load(name, data_dir)
    except ModelError as exc:
        fail(str(exc))
    tok = loaded.tokenizer
    if raw:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
    else:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
    with torch.inference_mode():
        out = loaded.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=list(loaded.stop_token_ids),
            pad_token_id=tok.pad_token_id,
        )
    click.echo(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).rstrip())
