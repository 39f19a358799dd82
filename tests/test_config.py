import pytest

from tm_slurm import config as C


def test_defaults_are_valid():
    cfg = C.load(None)
    assert cfg.layout.world == 1 and cfg.timeouts.heartbeat_timeout_s > cfg.timeouts.heartbeat_interval_s


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("layout: {dp: 2, pp: 2}\ntimeouts:\n  heartbeat_timeout_s: 3\n")
    cfg = C.load(p, {"standby.count": 2, "layout.tp": "1"})
    assert (cfg.layout.dp, cfg.layout.pp, cfg.layout.tp, cfg.standby.count) == (2, 2, 1, 2)
    assert cfg.timeouts.heartbeat_timeout_s == 3.0


def test_unknown_key_lists_valid_keys(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("layout: {dp: 2, pipeline: 2}\n")
    with pytest.raises(C.ConfigError) as e:
        C.load(p)
    msg = str(e.value)
    assert "'pipeline'" in msg and "layout" in msg and "dp, pp, tp, ranks_per_node" in msg


def test_unknown_top_level_key(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("standbys: 1\n")
    with pytest.raises(C.ConfigError, match="valid keys: layout, timeouts, standby"):
        C.load(p)


@pytest.mark.parametrize("text,needle", [
    ("layout: {dp: two}", "layout.dp must be an integer"),
    ("layout: [1, 2]", "layout must be a mapping"),
    ("standby: {sandbox: maybe}", "standby.sandbox must be true or false"),
    ("standby: {when_exhausted: pray}", "standby.when_exhausted must be one of wait, shrink, checkpoint_exit"),
    ("layout: {ranks_per_node: 2, tp: 4}", "multiple of layout.tp"),
    ("layout: {dp: 3, dp_shard: 2}", "must be a multiple of layout.dp_shard"),
    ("- 1\n- 2", "mapping at the top level"),
    ("layout: {dp: [", "not valid YAML"),
])
def test_bad_values(tmp_path, text, needle):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(C.ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        C.load(p)


def test_timeouts_order_is_checked():
    with pytest.raises(C.ConfigError) as e:
        C.load(None, {"timeouts.heartbeat_timeout_s": 60})
    assert "heartbeat_timeout_s (60.0) must be smaller than timeouts.collective_timeout_s" in str(e.value)
    with pytest.raises(C.ConfigError, match="must be > 0"):
        C.load(None, {"timeouts.fence_grace_s": 0})
    with pytest.raises(C.ConfigError, match=r"reach_timeout_s \(300.0\) must be smaller than timeouts.admit"):
        C.load(None, {"timeouts.reach_timeout_s": 300})


def test_node_counts():
    cfg = C.load(None, {"layout.dp": 2, "layout.pp": 2})
    cfg.check_nodes(5, 1)
    with pytest.raises(C.ConfigError, match=r"needs 4 active nodes, plus 1 standby = 5 nodes, but 4 were given"):
        cfg.check_nodes(4, 1)
    with pytest.raises(C.ConfigError, match="3 standbys requested but the allocation has only 2 nodes"):
        cfg.check_nodes(2, 3)


def test_roundtrip_dict():
    cfg = C.load(None, {"layout.dp": 4, "slurm.srun_args": "--exclusive --mem=0"})
    assert C.from_dict(C.to_dict(cfg)) == cfg
    assert cfg.slurm.srun_args == ("--exclusive", "--mem=0")


def test_parse_override():
    assert C.parse_override("a.b=3") == ("a.b", 3)
    assert C.parse_override("a=true") == ("a", True)
    with pytest.raises(C.ConfigError):
        C.parse_override("novalue")


def test_example_config_loads():
    from pathlib import Path
    cfg = C.load(Path(__file__).parent.parent / "sbatch" / "example.yaml")
    assert cfg.layout.world == 4 and cfg.standby.count == 1


BAD_RUNS = [
    (["--set", "timeouts.heartbeat_timeout_s=nan"], "timeouts.heartbeat_timeout_s must be a finite number"),
    (["--set", "timeouts.vote_timeout_s=inf"], "timeouts.vote_timeout_s must be a finite number"),
    (["--set", "timeouts.fence_grace_s=-1"], "timeouts.fence_grace_s must be > 0"),
    (["--set", "comm.gloo_threads=0"], "comm.gloo_threads must be >= 1, got 0"),
    (["--set", "straggler.window_steps=0"], "straggler.window_steps must be >= 1, got 0"),
    (["--set", "slurm.poll_interval_s=-0.5"], "slurm.poll_interval_s must be > 0, got -0.5"),
    (["--set", "standby.wait_s=-inf"], "standby.wait_s must be a finite number"),
    (["--set", "straggler.margin=0"], "straggler.margin must be > 0, got 0.0"),
    (["--set", "checkpoint.keep=0"], "checkpoint.keep must be >= 1, got 0"),
    (["--set", "seed=-3"], "seed must be >= 0, got -3"),
    (["--set", "output.ranks=first"], "output.ranks must be a rank, a list of ranks"),
]


@pytest.mark.parametrize("local,extra,needle", [
    ("4+-1", [], "--local expects ACTIVE+STANDBY with ACTIVE >= 1 and STANDBY >= 0"),
    ("0+1", [], "ACTIVE >= 1"),
    ("x+1", [], "got 'x+1'"),
    *[("4+1", e, n) for e, n in BAD_RUNS]])
def test_tm_slurm_run_refuses_a_bad_value_before_anything_starts(tmp_path, monkeypatch, capsys, local, extra, needle):
    from tm_slurm.cli import build_parser
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["run", "--local", local, *extra, "--", "python", "-c", "pass"])
    rc = args.fn(args)        # what `tm-slurm run` calls, after main's faulthandler set-up
    assert rc == 2 and needle in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []          # no job directory, nothing started


@pytest.mark.parametrize("value,ranks", [(0, "0"), ("0", "0"), ("8,0", "0,8"), ([8, 0, 0], "0,8"),
                                         ("0 4", "0,4"), ("ALL", "all"), ("none", "none")])
def test_output_ranks_take_a_rank_a_list_all_or_none(value, ranks):
    cfg = C.load(None, {"layout.dp": 16, "output.ranks": value})
    assert cfg.output.ranks == ranks and C.from_dict(C.to_dict(cfg)) == cfg
    assert C.load(None).output.ranks == "0"          # rank 0's output by default, as torchrun


@pytest.mark.parametrize("value", [True, -1, "x", [], "", 1.5, None, "0,a", [0, True]])
def test_output_ranks_refuse_what_is_no_rank(value):
    with pytest.raises(C.ConfigError, match="output.ranks must be a rank, a list of ranks"):
        C.load(None, {"layout.dp": 16, "output.ranks": value})


def test_output_ranks_within_the_layout():
    with pytest.raises(C.ConfigError, match=r"output.ranks names rank 4, but the layout's ranks are 0..3"):
        C.load(None, {"layout.dp": 4, "output.ranks": "0,4"})
    with pytest.raises(C.ConfigError, match="unknown key.*'rank'.*valid keys: ranks"):
        C.load(None, {"output.rank": 0})
