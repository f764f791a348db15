"""The demo's report: one JSON-ready dict per pair, and the table people read."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from hicache_draft.config import Config
from hicache_draft.demo.pairs import Pair, identity
from hicache_draft.demo.phases import Phase
from hicache_draft.metrics import metrics_table

ROW_ORDER = (Phase.AFTER_RESTART, Phase.CONTROL, Phase.CONTROL_NO_DRAFT_INDEXER, Phase.CONTROL_NO_TARGET_INDEXER)
"""The order of a pair's rows in the table: the full restore, then its controls."""

ROW_LABELS = {
    Phase.AFTER_RESTART: "all restored",
    Phase.CONTROL: "no draft offload",
    Phase.CONTROL_NO_DRAFT_INDEXER: "no draft indexer",
    Phase.CONTROL_NO_TARGET_INDEXER: "no target indexer",
}
"""What each restart leaves out (the controls) or not."""


def pair_report(pair: Pair, config: Config, results: dict[Phase, dict[str, Any]]) -> dict[str, Any]:
    """Merge the runs of one pair into its report item (``config``: the full restart's)."""
    first, after = results[Phase.FIRST], results[Phase.AFTER_RESTART]
    restarts = [ph for ph in ROW_ORDER if ph in results]
    checks = dict(after["check"])
    same_as_first = after["next_logits_sha256"] == first["next_logits_sha256"]
    return {
        "name": pair.name.value,
        "attention": pair.attention.value,
        "pair": pair.label,
        "target_model": identity(pair.target),
        "draft_model": identity(pair.draft),
        "target_layout": config.target.layout.value,
        "draft_layout": config.draft_layout.value,
        "pools": list(after["restored_pages"]),
        "pages_backed_up": first["pages_backed_up"],
        "restored_pages": after["restored_pages"],
        "prefill_tokens_skipped": after["prefill_tokens_skipped"],
        "prefill_tokens_computed": after["prefill_tokens_computed"],
        "accept_length": {ph.value: results[ph]["accept_length"] for ph in (Phase.FIRST, *restarts)},
        "verify_steps": {ph.value: results[ph]["verify_steps"] for ph in (Phase.FIRST, *restarts)},
        "restarts": {
            ph.value: {
                "restored_pages": results[ph]["restored_pages"],
                "hit": results[ph]["hit"],
                "prefill_tokens_skipped": results[ph]["prefill_tokens_skipped"],
                "accept_length": results[ph]["accept_length"],
            }
            for ph in restarts
        },
        "same_tokens": all(results[ph]["generated"] == first["generated"] for ph in restarts),
        "logits_match": all(checks.values()),
        "checks": checks,
        "logits_match_first_run": same_as_first,
        "io_paths": after["io_paths"],
        "metrics": {ph.value: results[ph].get("metrics", {}) for ph in (Phase.FIRST, *restarts)},
    }


def _ok(flag: bool) -> str:
    return "[green]yes[/]" if flag else "[red]NO[/]"


def render_metrics(report: dict[str, Any], console: Console) -> None:
    """The controller's per-pool metrics of every run (``--metrics``)."""
    for p in report["pairs"]:
        for run, snap in p["metrics"].items():
            if snap:
                console.print(metrics_table(snap, title=f"{p['name']} {run.replace('_', ' ')}: offload metrics"))


def _pages(p: dict[str, Any], restored: dict[str, int]) -> str:
    """Restored pages of every pool of the pair, in the pair's pool order; '-' for a pool the run's
    config did not have."""
    return "/".join(str(restored[name]) if name in restored else "-" for name in p["pools"])


def render(report: dict[str, Any], console: Console) -> None:
    """Print the results table (one row per restart of each pair) and what the columns mean."""
    table = Table(title="speculative decoding across a restart", pad_edge=False)
    first = "pair: restart"
    for col in (first, "restored\npages", "prefill\ntokens\nskipped", "accept\nlen\nrun 1", "accept\nlen\nrestart",
                "logits ==\nrecompute"):
        table.add_column(col, justify="left" if col == first else "right", no_wrap=col == first)
    for p in report["pairs"]:
        acc = p["accept_length"]
        for phase in ROW_ORDER:
            run = p["restarts"].get(phase.value)
            if run is None:
                continue
            control = phase is not Phase.AFTER_RESTART
            got = f"{run['accept_length']:.2f}"
            table.add_row(
                f"{p['name']}: {ROW_LABELS[phase]}",
                _pages(p, run["restored_pages"]),
                str(run["prefill_tokens_skipped"]),
                f"{acc['first']:.2f}",
                f"[yellow]{got}[/]" if control else got,
                "-" if control else _ok(p["logits_match"]),
            )
    console.print(table)
    k = report["draft_tokens"]
    console.print(
        f"backend [bold]{report['backend']}[/], page size {report['page_size']}, prompt {report['prompt_tokens']} "
        f"tokens, {report['decode_tokens']} decoded, k = {k} draft tokens per step.\n"
        f"accept len: tokens emitted per verification step, bonus included (1 to {k + 1}). Every run is a new "
        f"process. restored pages: kv/draft, for dsa kv/draft/indexer/draft_indexer ('-': not in that run's "
        f"config)."
    )
    for p in report["pairs"]:
        paths = ", ".join(f"{pool} {c['path']}" for pool, c in p["io_paths"].items())
        console.print(
            f"[bold]{p['name']}[/] ({p['pair']}): I/O paths {paths}; same tokens in all runs: "
            f"{_ok(p['same_tokens'])}; restored logits == run 1's (another process): "
            f"{_ok(p['logits_match_first_run'])}"
        )
        for phase, run in p["restarts"].items():
            if run["prefill_tokens_skipped"] == 0 and any(run["hit"].values()):
                stored = ", ".join(f"{pool} {n}" for pool, n in run["hit"].items())
                console.print(
                    f"  {ROW_LABELS[Phase(phase)]}: stored prefix per pool {stored}: a pool every page of "
                    f"the prefix needs is missing, so the hit is 0 and the whole prompt was prefilled"
                )
    if not report["persistent"]:
        console.print(f"[yellow]backend {report['backend']!r} does not declare persistence: a restart may "
                      f"find nothing[/]")
