"""The demo's report: one JSON-ready dict per pair, and the table people read."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from hicache_draft.capabilities import PoolKind
from hicache_draft.config import Config
from hicache_draft.demo.pairs import Pair, identity
from hicache_draft.demo.phases import Phase
from hicache_draft.metrics import metrics_table


def pair_report(pair: Pair, config: Config, results: dict[Phase, dict[str, Any]]) -> dict[str, Any]:
    """Merge the three phases of one pair into its report item."""
    first, after, control = results[Phase.FIRST], results[Phase.AFTER_RESTART], results[Phase.CONTROL]
    checks = dict(after["check"])
    same_as_first = after["next_logits_sha256"] == first["next_logits_sha256"]
    return {
        "attention": pair.attention.value,
        "pair": pair.label,
        "target_model": identity(pair.target),
        "draft_model": identity(pair.draft),
        "target_layout": config.target.layout.value,
        "draft_layout": config.draft_layout.value,
        "pages_backed_up": first["pages_backed_up"],
        "restored_pages": after["restored_pages"],
        "prefill_tokens_skipped": after["prefill_tokens_skipped"],
        "prefill_tokens_computed": after["prefill_tokens_computed"],
        "accept_length": {
            "first": first["accept_length"],
            "after_restart": after["accept_length"],
            "control_no_draft": control["accept_length"],
        },
        "verify_steps": {
            "first": first["verify_steps"],
            "after_restart": after["verify_steps"],
            "control_no_draft": control["verify_steps"],
        },
        "control_restored_pages": control["restored_pages"],
        "same_tokens": first["generated"] == after["generated"] == control["generated"],
        "logits_match": all(checks.values()),
        "checks": checks,
        "logits_match_first_run": same_as_first,
        "io_paths": after["io_paths"],
        "metrics": {
            "first": first.get("metrics", {}),
            "after_restart": after.get("metrics", {}),
            "control_no_draft": control.get("metrics", {}),
        },
    }


def _ok(flag: bool) -> str:
    return "[green]yes[/]" if flag else "[red]NO[/]"


def render_metrics(report: dict[str, Any], console: Console) -> None:
    """The controller's per-pool metrics of every run (``--metrics``)."""
    for p in report["pairs"]:
        for run, snap in p["metrics"].items():
            if snap:
                console.print(metrics_table(snap, title=f"{p['attention']} {run.replace('_', ' ')}: offload metrics"))


def render(report: dict[str, Any], console: Console) -> None:
    """Print the results table and a few lines on what the columns mean."""
    table = Table(title="speculative decoding across a restart")
    for col in ("pair", "restored pages\nkv / draft", "prefill tokens\nskipped", "accept len\nrun 1",
                "accept len\nrestart", "accept len\ncontrol", "logits ==\nrecompute"):
        table.add_column(col, justify="left" if col == "pair" else "right")
    for p in report["pairs"]:
        acc = p["accept_length"]
        r = p["restored_pages"]
        table.add_row(
            p["attention"],
            f"{r[PoolKind.KV.value]} / {r[PoolKind.DRAFT.value]}",
            str(p["prefill_tokens_skipped"]),
            f"{acc['first']:.2f}",
            f"{acc['after_restart']:.2f}",
            f"[yellow]{acc['control_no_draft']:.2f}[/]",
            _ok(p["logits_match"]),
        )
    console.print(table)
    k = report["draft_tokens"]
    console.print(
        f"backend [bold]{report['backend']}[/], page size {report['page_size']}, prompt {report['prompt_tokens']} "
        f"tokens, {report['decode_tokens']} decoded, k = {k} draft tokens per step.\n"
        f"accept len: tokens emitted per verification step, bonus included (1 to {k + 1}). "
        f"restart: a new process restores target and draft KV; control: a new process with draft offload off."
    )
    for p in report["pairs"]:
        paths = ", ".join(f"{pool} {c['path']}" for pool, c in p["io_paths"].items())
        console.print(
            f"[bold]{p['attention']}[/] ({p['pair']}): I/O paths {paths}; same tokens in all runs: "
            f"{_ok(p['same_tokens'])}; restored logits == run 1's (another process): "
            f"{_ok(p['logits_match_first_run'])}"
        )
    if not report["persistent"]:
        console.print(f"[yellow]backend {report['backend']!r} does not declare persistence: a restart may "
                      f"find nothing[/]")
