"""``hicache-draft mooncake``: ``up`` (a local store for development and demos) and ``bench``.

Published through the entry-point group ``hicache_draft.commands``; also runnable as
``python -m hicache_draft_mooncake.cli``.
"""

from __future__ import annotations

import json
import signal
import threading
from types import FrameType

import click

from hicache_draft_mooncake.service import MooncakeService, ServiceError

QUICK_PAGES, QUICK_ROUNDS = 8, 2

_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """``"64KiB"`` / ``"1MiB"`` / ``"4096"`` -> bytes."""
    raw = text.strip().lower().replace(" ", "")
    num = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(num):]
    if not num.isdigit() or unit not in _UNITS:
        raise click.BadParameter(f"{text!r} is not a size like 4096, 64KiB or 1GiB")
    return int(num) * _UNITS[unit]


def render_config(svc: MooncakeService) -> str:
    """The TOML to paste into a hicache-draft config file."""
    opts = svc.backend_options()
    lines = ['backend = "mooncake"', "", "[backend_options]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in opts.items()]
    lines.append("# same host only: shared-memory client mode (5-10x faster than loopback TCP here)")
    lines.append(f'# shm_client_address = "{svc.holder_address}"')
    return "\n".join(lines)


@click.group("mooncake")
def mooncake() -> None:
    """The Mooncake backend: run a local store, benchmark it."""


@mooncake.command("up")
@click.option("--segment-size", default="1GiB", show_default=True, help="memory the segment holder offers")
@click.option("--workdir", type=click.Path(file_okay=False), default=None, help="where logs go (default: a temp dir)")
def up(segment_size: str, workdir: str | None) -> None:
    """Start mooncake_master + a mooncake_client segment holder on free 127.0.0.1 ports, print the
    config to use, and stay in the foreground until Ctrl-C (then stop both by pid)."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        svc = MooncakeService.start(workdir, segment_size=parse_size(segment_size))
    except ServiceError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        assert svc.master is not None and svc.holder is not None
        click.echo(
            f"# mooncake_master pid {svc.master.pid}, mooncake_client pid {svc.holder.pid}, logs in {svc.workdir}"
        )
        click.echo(render_config(svc))
        click.echo("# running; Ctrl-C to stop", err=True)
        while not stop.wait(0.5):
            for proc in (svc.master, svc.holder):
                if not proc.alive():
                    raise click.ClickException(f"{proc.name} exited ({proc.popen.returncode}); log {proc.log_path}")
    finally:
        svc.stop()
        click.echo("# stopped", err=True)


@mooncake.command("bench")
@click.option("--mode", "modes", multiple=True, type=click.Choice(["tcp", "shm"]), default=("tcp", "shm"),
              show_default=True)
@click.option("--page-size", "page_sizes", multiple=True, default=("64KiB", "1MiB"), show_default=True)
@click.option("--pages", default=128, show_default=True, help="pages per batch")
@click.option("--rounds", default=7, show_default=True, help="rounds per row (medians of per-round ratios)")
@click.option("--quick", is_flag=True, help=f"CI mode: {QUICK_PAGES} pages, {QUICK_ROUNDS} rounds (checks, not speed)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON document instead of a table")
def bench(modes: tuple[str, ...], page_sizes: tuple[str, ...], pages: int, rounds: int, quick: bool,
          as_json: bool) -> None:
    """Set/get GB/s, existence cost and the issue's goals: the plugin vs MooncakeStore's calls and
    object layout, same store, same pages, same run. Starts and stops its own local store; exits 1
    when a check (every call OK, every get byte-exact, ...) is broken."""
    from hicache_draft_mooncake import bench as b

    if quick:
        pages, rounds = QUICK_PAGES, QUICK_ROUNDS
    sizes = [parse_size(s) for s in page_sizes]
    if not as_json:
        click.echo(b.HEADER)
    report = b.run(list(modes), sizes, pages, rounds, echo=(lambda _s: None) if as_json else click.echo)
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2))
    if not all(report.checks.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    mooncake()
