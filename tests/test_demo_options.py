"""The demo's options and failure paths: clear errors, bounded waits, defaults from the config."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from pydantic import BaseModel

from hicache_draft.capabilities import Attention
from hicache_draft.cli import main
from hicache_draft.demo.pairs import identity, make_pair, make_prompt, pair_config
from hicache_draft.demo.phases import Job, Phase
from hicache_draft.demo.runner import DemoError, DemoOptions, base_config, run_job
from hicache_draft.plugins import register_backend, unregister_backend
from hicache_draft.testing import MemoryBackend


def test_unknown_backend_is_named():
    result = CliRunner().invoke(main, ["demo", "--backend", "no-such-store", "--pair", "mha"])
    assert result.exit_code == 2  # bad input
    assert "no-such-store" in result.output and "installed backends" in result.output


def test_a_bad_config_file_is_named(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("timeout_s = -1\n")
    result = CliRunner().invoke(main, ["demo", "--config", str(bad), "--pair", "mha"])
    assert result.exit_code == 2  # bad input
    assert "timeout_s" in result.output


@pytest.mark.parametrize(
    ("change", "message"),
    [({"draft_tokens": 0}, "--draft-tokens"), ({"prompt_tokens": 50, "period": 48}, "two periods"),
     ({"period": 300}, "--period")],
)
def test_impossible_sizes_are_refused(change, message):
    with pytest.raises(DemoError, match=message):
        DemoOptions(**change).validate()


def test_default_backend_gets_its_scratch_options_and_root_overrides(tmp_path):
    base, temporary = base_config(DemoOptions(environ={}), tmp_path / "scratch")
    assert base["backend"] == "file"  # the installed default, found by discovery
    assert base["backend_options"] == {"root": str(tmp_path / "scratch")}  # asked of the backend
    assert temporary
    given, temporary = base_config(DemoOptions(root=str(tmp_path / "mine"), environ={}), tmp_path / "scratch")
    assert given["backend_options"]["root"] == str(tmp_path / "mine")
    assert not temporary


def test_environment_overrides_reach_the_demo(tmp_path):
    env = {"HICACHE_DRAFT_TIMEOUT_S": "7", "HICACHE_DRAFT_BACKEND_OPTIONS__ROOT": str(tmp_path / "env")}
    base, temporary = base_config(DemoOptions(environ=env), tmp_path / "scratch")
    assert base["timeout_s"] == 7
    assert base["backend_options"]["root"] == str(tmp_path / "env")
    assert not temporary


class _NoScratch(MemoryBackend):
    """A backend that cannot make a throwaway store (the base class's answer), whatever its fields."""

    class Options(BaseModel):
        root: str  # a field called root is no longer a reason to guess


def test_the_demo_asks_the_backend_and_does_not_guess_from_a_root_field(tmp_path):
    register_backend("noscratch", _NoScratch)
    try:
        with pytest.raises(DemoError, match=r"'noscratch' offers no scratch options"):
            base_config(DemoOptions(backend="noscratch", environ={}), tmp_path / "scratch")
        cfg = tmp_path / "c.toml"
        cfg.write_text('backend = "noscratch"\n[backend_options]\nroot = "/given"\n')
        base, temporary = base_config(DemoOptions(config_path=str(cfg), environ={}), tmp_path / "scratch")
        assert base["backend_options"] == {"root": "/given"} and not temporary
    finally:
        unregister_backend("noscratch")


def test_pair_config_carries_model_identity_and_shapes():
    pair = make_pair(Attention.MLA, 2)
    on = pair_config({"backend": "file", "timeout_s": 3}, pair, 8, draft_offload=True)
    off = pair_config({"backend": "file"}, pair, 8, draft_offload=False)
    assert on.namespace.model == identity(pair.target) and on.namespace.draft_model == identity(pair.draft)
    assert on.target.latent_dim == pair.target.latent_dim and on.draft.latent_dim == pair.draft.latent_dim
    assert on.timeout_s == 3 and on.namespace.page_size == 8 and on.namespace.kv_dtype == "float32"
    assert on.draft.enabled and not off.draft.enabled
    # Another seed is another model: its pages must never be mistaken for these.
    assert identity(make_pair(Attention.MLA, 3).target) != identity(pair.target)


def test_prompt_repeats_distinct_tokens():
    prompt = make_prompt(100, 30, 4)
    assert len(set(prompt[:30])) == 30
    assert all(prompt[i] == prompt[i % 30] for i in range(100))
    with pytest.raises(ValueError, match="two periods"):
        make_prompt(40, 30, 4)


def _job(tmp_path, backend: str) -> Job:
    pair = make_pair(Attention.MHA, 1)
    cfg = pair_config({"backend": "file", "backend_options": {"root": str(tmp_path)}}, pair, 16, True)
    raw = cfg.model_dump(mode="json")
    raw["backend"] = backend
    return Job(Phase.FIRST, Attention.MHA, 1, raw, 96, 32, 8, 2)


def test_a_failing_phase_reports_the_childs_reason(tmp_path):
    with pytest.raises(DemoError, match="mha first: .*no-such-store"):
        run_job(_job(tmp_path, "no-such-store"), 120, lambda _s: None)


def test_a_phase_that_overruns_its_bound_is_stopped(tmp_path):
    with pytest.raises(DemoError, match="no result within"):
        run_job(_job(tmp_path, "file"), 0.05, lambda _s: None)


def test_pairs_are_named_and_a_job_round_trips():
    from hicache_draft.demo.command import PAIR_NAMES
    from hicache_draft.demo.pairs import PairName
    from hicache_draft.demo.runner import phases

    assert tuple(PairName) == PAIR_NAMES  # the CLI's choices, listed without importing torch
    assert DemoOptions().pairs == tuple(PairName)
    with pytest.raises(DemoError, match="--pair"):
        DemoOptions(pairs=("gqa",)).validate()
    job = Job(Phase.CONTROL_NO_DRAFT_INDEXER, PairName.DSA, 3, {"backend": "file"}, 96, 32, 8, 2)
    assert Job.from_dict(job.as_dict()) == job
    assert Job(Phase.FIRST, Attention.MLA, 1, {}, 96, 32, 8, 2).pair is PairName.MLA  # an Attention names a pair
    assert phases(PairName.DSA) == (Phase.FIRST, Phase.CONTROL_NO_TARGET_INDEXER, Phase.AFTER_RESTART,
                                    Phase.CONTROL_NO_DRAFT_INDEXER)
    assert phases(PairName.MHA) == (Phase.FIRST, Phase.AFTER_RESTART, Phase.CONTROL)
