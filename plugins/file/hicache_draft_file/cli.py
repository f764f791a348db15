"""CLI commands, published through the ``hicache_draft.commands`` entry point as ``hicache-draft file``.

Also runnable on its own: ``python -m hicache_draft_file bench``.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from hicache_draft import BackendContext, BackendSetupError


@click.group("file")
def file_group() -> None:
    """The file backend: benchmark and inspect stores."""


@file_group.command("bench")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--quick", is_flag=True, help="Fewer rounds and pages (about 10 s).")
@click.option(
    "--dir", "scratch", type=click.Path(file_okay=False, path_type=Path), default=None,
    help="Where to create the scratch store (default: the system temp dir). Removed afterwards.",
)
@click.option(
    "--settle-max", "settle_max", type=click.FloatRange(min=0), default=120.0, show_default=True,
    help="Seconds to wait at most for file creation to reach its usual speed before timing (it is slow for "
    "a while after mass deletes, such as a previous run's cleanup).",
)
def bench_cmd(as_json: bool, quick: bool, scratch: Path | None, settle_max: float) -> None:
    """Set/get GB/s (64 KiB and 1 MiB pages, batches of 128, zero-copy and generic) and existence
    µs/key, as ratios against one file per page measured in the same run; restart time."""
    from hicache_draft_file.bench import format_report, run_bench

    rep = run_bench(quick=quick, root=scratch, settle_max_s=settle_max)
    click.echo(json.dumps(rep, indent=2) if as_json else format_report(rep))


@file_group.command("stats")
@click.argument("root", type=click.Path(file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def stats_cmd(root: Path, as_json: bool) -> None:
    """Current use of the store at ROOT (opened read-only)."""
    from hicache_draft_file.backend import FileBackend
    from hicache_draft_file.options import FileOptions

    try:
        backend = FileBackend(FileOptions(root=root, read_only=True), BackendContext())
    except BackendSetupError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        use = backend.usage()
    finally:
        backend.close()
    keep = (
        "bytes", "pages", "segments", "free_files", "free_bytes", "segments_quarantined", "foreign_files",
        "unsafe_entries",
    )
    shown = {k: use[k] for k in keep}
    if as_json:
        click.echo(json.dumps(shown))
    else:
        for k, v in shown.items():
            click.echo(f"{k:>22}: {v}")
