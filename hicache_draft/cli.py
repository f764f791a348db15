"""The ``hicache-draft`` command: backends, check, stats, demo, bench, and commands contributed by plugins.

Exit codes: 0 ok, 2 bad input (config, unknown backend), 1 any other failure.
Plugins add subcommands through the entry-point group ``hicache_draft.commands`` (a click
command or group per entry point); a plugin whose commands fail to load is reported, not fatal.
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from hicache_draft.bench.command import bench
from hicache_draft.binding import blocked_by
from hicache_draft.capabilities import Attention, IOPath, Layout, PoolKind
from hicache_draft.config import Config, load_config
from hicache_draft.demo.command import demo
from hicache_draft.errors import ConfigError, HiCacheDraftError, PluginError
from hicache_draft.paths import plan_paths, plan_pools
from hicache_draft.plugins import discover_backends, get_backend

COMMANDS_GROUP = "hicache_draft.commands"

_err = Console(stderr=True)


def _fail(message: str, code: int) -> None:
    _err.print(f"[bold red]error:[/] {message}", highlight=False, markup=True, soft_wrap=True)
    sys.exit(code)


class _Group(click.Group):
    """Adds plugin commands lazily and maps our errors to exit codes without tracebacks."""

    _loaded = False

    def _load_plugin_commands(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for ep in entry_points(group=COMMANDS_GROUP):
            if ep.name in self.commands:
                continue
            try:
                cmd = ep.load()
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # SystemExit too: one broken plugin must not break the CLI
                _err.print(f"[yellow]warning:[/] commands of plugin {ep.name!r} failed to load: "
                           f"{type(exc).__name__}: {exc}", soft_wrap=True, markup=True, highlight=False)
                continue
            if isinstance(cmd, click.Command):
                self.add_command(cmd, ep.name)

    def list_commands(self, ctx: click.Context) -> list[str]:
        self._load_plugin_commands()
        return super().list_commands(ctx)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        self._load_plugin_commands()
        return super().get_command(ctx, cmd_name)

    def invoke(self, ctx: click.Context) -> Any:  # noqa: ANN401
        try:
            return super().invoke(ctx)
        except ConfigError as exc:
            _fail(str(exc), 2)
        except PluginError as exc:
            _fail(str(exc), 2)
        except HiCacheDraftError as exc:
            _fail(str(exc), 1)


@click.group(cls=_Group)
@click.version_option(package_name="hicache-draft")
def main() -> None:
    """Offload LLM KV-cache pages (target and speculative-decoding draft) to pluggable storage."""


def _caps_cell(caps: dict[str, Any] | None) -> str:
    if not caps:
        return "-"
    lines = []
    for pool, c in caps["pools"].items():
        zc = ",".join(c["zero_copy_layouts"]) or "none"
        generic = "yes" if c["generic"] else "no"
        limit = f" max_buffers={c['max_buffers_per_page']}" if c["max_buffers_per_page"] else ""
        lines.append(f"{pool}: {'/'.join(c['attention'])}; zero-copy: {zc}; generic: {generic}{limit}")
    lines.append(f"split_heads: {caps['split_heads']}; persistent: {caps['persistent']}")
    return "\n".join(lines)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
def backends(as_json: bool) -> None:
    """List every discovered storage backend with its capabilities (and load error, if any)."""
    found = discover_backends()
    rows = [info.as_dict() for _, info in sorted(found.items())]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    table = Table(title="hicache-draft storage backends", show_lines=True)
    for col in ("name", "distribution", "version", "capabilities", "error"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(
            str(r["name"]) + (" (default)" if r["default"] else ""), str(r["distribution"] or "-"),
            str(r["version"] or "-"),
            _caps_cell(r["capabilities"]),  # type: ignore[arg-type]
            f"[red]{r['error']}[/]" if r["error"] else "",
        )
    Console().print(table)


def check_report(config: Config) -> dict[str, Any]:
    """What ``check`` reports: the backend's declaration and each pool's path, without opening it."""
    info = get_backend(config.backend)
    assert info.capabilities is not None and info.cls is not None
    from hicache_draft.store import validate_options

    validate_options(info.name, info.cls, config.backend_options)
    plan = plan_paths(config, info.capabilities)
    detail = {name: p.as_dict() for name, p in plan_pools(config, info.capabilities).items()}
    return {
        "backend": info.name,
        "backend_default": config.backend is None,
        "distribution": info.distribution,
        "capabilities": info.capabilities.summary(),
        "pools": {str(k): {**c.as_dict(), **detail.get(k, {})} for k, c in plan.items()},
        "draft_on_miss": config.draft.on_miss.value,
        "split_factor": config.parallel.split_factor,
    }


def sglang_check_report(config: Config, extra_config: dict[str, Any]) -> dict[str, Any]:
    """What ``check --sglang-extra-config`` reports: each pool's plan as the SGLang adapter makes it
    for this deployment (backend, options and identities from the extra-config's ``hicache_draft``
    object, ranks and pool shapes from ``config``), with the adapter's own planning call."""
    from types import SimpleNamespace

    from hicache_draft.integrations.sglang_config import parse_settings, placement
    from hicache_draft.integrations.sglang_pools import legacy_draft_spec, plan_pool
    from hicache_draft.paths import pool_specs
    from hicache_draft.store import validate_options

    settings = parse_settings(extra_config)
    info = get_backend(settings.backend)
    assert info.capabilities is not None and info.cls is not None
    validate_options(info.name, info.cls, settings.backend_options)
    par, specs = config.parallel, pool_specs(config)
    kv = specs[PoolKind.KV]
    split = bool(par.tp_lcm_size and par.tp_lcm_size > par.tp_size and kv.attention is Attention.MHA
                 and kv.layout is Layout.PAGE_HEAD)  # SGLang's should_split_heads
    where = placement(SimpleNamespace(
        tp_rank=par.tp_rank, tp_size=par.tp_size, pp_rank=par.pp_rank, pp_size=par.pp_size,
        model_name=config.namespace.model, should_split_heads=split, tp_lcm_size=par.tp_lcm_size,
    ), settings)
    memory = {name: True for name in specs}
    if settings.legacy_draft_pool is not None:
        specs[PoolKind.DRAFT] = legacy_draft_spec(settings.legacy_draft_pool, kv)
        memory[PoolKind.DRAFT] = False
    plans = {}
    kv_active = True
    for name, spec in specs.items():
        plans[name] = plan = plan_pool(spec, where, info.capabilities, has_memory=memory[name], kv_active=kv_active)
        kv_active = kv_active and (name != PoolKind.KV or plan.path is not IOPath.DISABLED)
    blocked = blocked_by({n: p.spec for n, p in plans.items()},
                         {n: p.path is not IOPath.DISABLED for n, p in plans.items()},
                         {n: p.reason for n, p in plans.items()})
    pools: dict[str, Any] = {}
    for name, plan in plans.items():
        row = {**plan.as_dict(), "namespaces": list(plan.namespaces)}
        if name in blocked:
            row.update(path=IOPath.DISABLED.value, reason=blocked[name])
        pools[str(name)] = row
    return {
        "backend": info.name, "backend_default": settings.backend is None, "distribution": info.distribution,
        "capabilities": info.capabilities.summary(), "pools": pools, "sglang": True,
        "model": where.model, "draft_model": where.draft_model, "split_heads": split,
    }


def _extra_config(text: str) -> dict[str, Any]:
    raw = text
    if text.startswith("@"):
        try:
            raw = Path(text[1:]).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read SGLang extra-config {text[1:]!r}: {exc.strerror or exc}") from None
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"SGLang extra-config is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError("SGLang extra-config must be a JSON object")
    return data


@main.command()
@click.argument("config_path", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
@click.option("--sglang-extra-config", "sglang_extra", default=None, metavar="JSON|@FILE",
              help="Plan as the SGLang adapter would, for the --hicache-storage-backend-extra-config given "
              "(pool shapes and ranks from CONFIG_PATH).")
def check(config_path: str, as_json: bool, sglang_extra: str | None) -> None:
    """Validate CONFIG_PATH and say which I/O path each pool takes, and why (no store needed)."""
    config = load_config(config_path)
    report = check_report(config) if sglang_extra is None else sglang_check_report(config, _extra_config(sglang_extra))
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    console = Console()
    chosen = ", the installed default" if report["backend_default"] else ""
    console.print(f"config [bold]{config_path}[/] is valid; backend [bold]{report['backend']}[/] "
                  f"({report['distribution'] or 'in-process'}{chosen})", soft_wrap=True)
    table = Table(title="I/O path per pool")
    table.add_column("pool")
    table.add_column("what")
    table.add_column("path")
    table.add_column("reason", overflow="fold")
    colors = {IOPath.ZERO_COPY.value: "green", IOPath.GENERIC.value: "yellow", IOPath.DISABLED.value: "red"}
    for pool, choice in report["pools"].items():
        what = f"{choice['role']} {choice['component']}, {choice['hit_policy']}" if "role" in choice else "-"
        table.add_row(pool, what, f"[{colors[choice['path']]}]{choice['path']}[/]", choice["reason"])
    console.print(table)


@main.command()
@click.argument("target")
@click.option("--backend", "backend_name", default=None,
              help="For a store root: the backend that owns it (default: the installed default backend).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="Seconds to wait for an exporter.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def stats(ctx: click.Context, target: str, backend_name: str | None, timeout_s: float, as_json: bool) -> None:
    """Statistics of a running exporter or of a store.

    TARGET is a Prometheus exporter's URL (http://HOST:PORT/metrics, e.g. a server's
    [metrics] prometheus_port): it is scraped and its counters and latencies shown per backend,
    pool and hook. Otherwise TARGET is a store root, and the backend's own `stats` command answers
    (a plugin offers one as `hicache-draft BACKEND stats ROOT [--json]`, e.g. `hicache-draft file stats`).
    """
    if target.startswith(("http://", "https://")):
        _scrape_stats(target, timeout_s, as_json)
        return
    info = get_backend(backend_name)
    group = main.get_command(ctx, info.name)
    sub = group.get_command(ctx, "stats") if isinstance(group, click.Group) else None
    if sub is None:
        raise click.ClickException(
            f"backend {info.name!r} ({info.origin}) offers no stats command for a store root "
            f"(`hicache-draft {info.name} stats ROOT`); scrape a running exporter's URL instead"
        )
    with sub.make_context(f"hicache-draft {info.name} stats", [target, *(["--json"] if as_json else [])],
                          parent=ctx) as sub_ctx:
        sub.invoke(sub_ctx)


def _scrape_stats(url: str, timeout_s: float, as_json: bool) -> None:
    try:
        from hicache_draft.prometheus import quantile_bound, scrape
    except ImportError as exc:
        raise click.ClickException(f"reading an exporter needs prometheus-client ({exc}); "
                                   "pip install 'hicache-draft[prometheus]'") from None
    try:
        summary = scrape(url, timeout_s)
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"cannot read metrics from {url}: {exc}") from None
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    console = Console()
    if not summary["pools"] and not summary["hooks"]:
        console.print(f"{url} serves no hicache-draft series yet (no storage call has finished)", soft_wrap=True)
        return
    pools = Table(title=f"pages per backend and pool ({url})")
    pools.add_column("counter")
    for row in summary["pools"]:
        pools.add_column(f"{row['backend']} {row['pool']}", justify="right")
    names = ["written_pages", "written_bytes", "read_pages", "read_bytes", "corrupt"]
    for name in names:
        pools.add_row(name, *(str(row[name]) for row in summary["pools"]))
    for name in ("hits", "misses", "failures", "timeouts"):
        for hook in sorted({h for row in summary["pools"] for h in row[name]}):
            pools.add_row(f"{name} ({hook})", *(str(row[name].get(hook, 0)) for row in summary["pools"]))
    console.print(pools)
    calls = Table(title="calls per backend and hook")
    for col in ("backend", "hook", "ok", "timeout", "error", "mean ms", "p99 <= ms"):
        calls.add_column(col, justify="left" if col in ("backend", "hook") else "right")
    for row in summary["hooks"]:
        mean, p99 = row["mean_seconds"], quantile_bound(row["buckets"], 0.99)
        calls.add_row(
            row["backend"], row["hook"], *(str(row["calls"].get(o, 0)) for o in ("ok", "timeout", "error")),
            f"{mean * 1e3:.3f}" if mean is not None else "-",
            ("inf" if p99 == float("inf") else f"{p99 * 1e3:g}") if p99 is not None else "-",
        )
    console.print(calls)


main.add_command(demo, "demo")
main.add_command(bench, "bench")


if __name__ == "__main__":  # pragma: no cover
    main()
