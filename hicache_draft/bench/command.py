"""``hicache-draft bench``: the core's benchmarks (plugins add their own, e.g. ``file bench``)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import click

from hicache_draft.errors import ConfigError


def _options(pairs: tuple[str, ...]) -> dict[str, Any] | None:
    """``KEY=VALUE`` pairs (values parsed as JSON where they parse, else kept as text), or None."""
    if not pairs:
        return None
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--option {pair!r} is not KEY=VALUE", field="backend_options")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


_backend = click.option("--backend", "backend_name", default=None,
                        help="Backend entry-point name (default: the installed default backend).")
_option = click.option("--option", "option_pairs", multiple=True, metavar="KEY=VALUE",
                       help="A backend option (repeatable); default: the backend's own scratch options.")


@click.group()
def bench() -> None:
    """Benchmarks that print ratios to a baseline measured in the same run."""


@bench.command()
@click.option("--root", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Directory (on the filesystem to measure) for the store and the ceiling files.")
@click.option("--pages", type=click.IntRange(min=1), default=None, help="Pages per step (default 384; 24 quick).")
@click.option("--quick", is_flag=True, help="A small rank (4 layers, 16-token pages) for a fast run.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="Threads of the pwritev/preadv ceiling.")
@click.option("--batch-pages", type=click.IntRange(min=1, max=4096), default=128, show_default=True,
              help="The controller's pages per storage call (config batch_pages).")
@_backend
@_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def pipeline(root: Path | None, pages: int | None, quick: bool, threads: int | None, batch_pages: int,
             backend_name: str | None, option_pairs: tuple[str, ...], as_json: bool) -> None:
    """Device pool -> host pool -> backup -> restart -> prefetch -> device, target and draft, with
    the filesystem's own ceiling; GB/s and ratios to the device-to-host copy."""
    from hicache_draft.bench.pipeline import Shape, format_report, run_pipeline

    shape = Shape.quick() if quick else Shape()
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
    rep = run_pipeline(root=root, pages=pages or (24 if quick else 384), shape=shape, backend=backend_name,
                       options=_options(option_pairs), ceiling_threads=threads, batch_pages=batch_pages)
    click.echo(json.dumps(rep.as_dict(), indent=2) if as_json else format_report(rep))
    if not all(rep.checks.values()):
        raise SystemExit(1)


@bench.command()
@click.option("--page-kib", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--pages", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=7, show_default=True)
@_backend
@_option
def verify(page_kib: int, pages: int, rounds: int, backend_name: str | None, option_pairs: tuple[str, ...]) -> None:
    """What the core's verification of restored pages costs: verified page_get against the
    backend's bare hook, same pages, same run."""
    from hicache_draft.bench.pipeline import scratch_options
    from hicache_draft.bench.verification import measure

    with tempfile.TemporaryDirectory(prefix="hicache-draft-verify-") as tmp:
        opts = _options(option_pairs)
        if opts is None:
            opts = scratch_options(backend_name, Path(tmp))
        click.echo(measure(backend_name, opts, page_bytes=page_kib << 10, pages=pages, rounds=rounds).row())


from hicache_draft.integrations.sglang_bench import sglang_command  # noqa: E402  (imports SGLang only when run)

bench.add_command(sglang_command)
