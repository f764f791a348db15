"""``hicache-draft demo``: speculative decoding across a restart, with and without draft offload.

This module imports nothing heavy: the models, torch and the runner load when the command runs.
"""

from __future__ import annotations

import json

import click

from hicache_draft.errors import ConfigError, HiCacheDraftError, PluginError

PAIR_NAMES = ("mha", "mla", "dsa")  # hicache_draft.demo.pairs.PairName, without importing torch here
_PHASE_NAMES = {
    "first": "run 1", "after_restart": "restart", "control_no_draft": "control",
    "control_no_target_indexer": "control (no target indexer)",
    "control_no_draft_indexer": "control (no draft indexer)",
}


@click.command("demo")
@click.option("--backend", default=None,
              help="Storage backend (entry-point name). Default: the config's, else the installed default backend.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="A hicache-draft config file (TOML/JSON): backend, options, timeouts, layouts are used.")
@click.option("--root", default=None, type=click.Path(file_okay=False),
              help="Keep the demo's store in this directory (the backend's scratch options for it). "
              "Default: a temporary directory.")
@click.option("--pair", "pairs", type=click.Choice(PAIR_NAMES), multiple=True,
              help="Run only these pairs (repeatable). Default: mha, mla and dsa.")
@click.option("--prompt-tokens", type=click.IntRange(min=4), default=1000, show_default=True)
@click.option("--period", type=click.IntRange(2, 256), default=128, show_default=True,
              help="Length of the random token sequence the prompt repeats.")
@click.option("--decode-tokens", type=click.IntRange(min=2), default=64, show_default=True)
@click.option("--draft-tokens", "-k", type=click.IntRange(min=1), default=4, show_default=True,
              help="Tokens the draft proposes per verification step.")
@click.option("--page-size", type=click.IntRange(min=1), default=None, help="Tokens per page (default: config or 16).")
@click.option("--seed", type=click.IntRange(min=0), default=1, show_default=True)
@click.option("--timeout", "phase_timeout_s", type=click.FloatRange(min=1), default=300.0, show_default=True,
              help="Seconds each phase's process may take.")
@click.option("--jobs", type=click.IntRange(min=1), default=2, show_default=True,
              help="Pairs run side by side (each pair's runs stay in order).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--metrics", "show_metrics", is_flag=True, help="Also print the controller's per-pool metrics.")
def demo(
    backend: str | None, config_path: str | None, root: str | None, pairs: tuple[str, ...], prompt_tokens: int,
    period: int, decode_tokens: int, draft_tokens: int, page_size: int | None, seed: int, phase_timeout_s: float,
    jobs: int, as_json: bool, show_metrics: bool,
) -> None:
    """Restart a speculative-decoding server and see whether the draft KV came back.

    For each model pair (MHA target + EAGLE-like draft, MLA target + MTP-like draft, DSA target
    + MTP-like draft with its own indexer): run 1 prefills a long prompt, decodes and backs up its
    pages; a new process restores them and decodes again; control restarts leave out the draft
    (dense pairs), the draft indexer, or the stored target indexer (DSA). Each run is its own process.
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from hicache_draft.pools import import_torch

    import_torch()  # quietly, before the modules that need it
    from hicache_draft.demo.pairs import PairName
    from hicache_draft.demo.phases import Phase
    from hicache_draft.demo.report import render, render_metrics
    from hicache_draft.demo.runner import DemoOptions, phases, run_demo

    opts = DemoOptions(
        backend=backend, config_path=config_path, root=root,
        pairs=tuple(PairName(p) for p in pairs) or tuple(PairName),
        prompt_tokens=prompt_tokens, period=period, decode_tokens=decode_tokens, draft_tokens=draft_tokens,
        page_size=page_size, seed=seed, phase_timeout_s=phase_timeout_s, jobs=jobs,
    )
    console = Console(stderr=as_json)
    try:
        with Progress(
            SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(), console=console, transient=True,
        ) as progress:
            task = progress.add_task("starting", total=sum(len(phases(p)) for p in opts.pairs))

            def on_step(pair: PairName, phase: Phase, step: str) -> None:
                label = f"[bold]{pair.value}[/] {_PHASE_NAMES[phase.value]}: {step}"
                progress.update(task, description=label, advance=1 if step == "done" else 0)

            report = run_demo(opts, on_step)
    except (ConfigError, PluginError):
        raise  # the CLI group prints it and exits 2 (bad input)
    except HiCacheDraftError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        render(report, console)
        if show_metrics:
            render_metrics(report, console)
