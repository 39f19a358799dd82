"""`tm-slurm bench --slurmctld`'s reading of sdiag (bench/slurmctld.py); the measurement itself
needs a Slurm where `sdiag -r` is allowed and runs as a benchmark, not a test."""
from tm_slurm.bench.slurmctld import cases, parse_sdiag, per_minute

SDIAG = """*******************************************************
sdiag output at Sat Dec 05 10:20:01 2026 (1796300401)
Remote Procedure Call statistics by message type
\tREQUEST_NODE_INFO                       ( 2007) count:57     ave_time:691    total_time:39421
\tREQUEST_STATS_INFO                      ( 2035) count:1      ave_time:192    total_time:192
\tMESSAGE_NODE_REGISTRATION_STATUS        ( 1002) count:64     ave_time:4763   total_time:304849

Remote Procedure Call statistics by user
\troot            (       0) count:122    ave_time:2822   total_time:344462
"""


def test_sdiag_rpcs_by_type_without_its_own_request():
    got = parse_sdiag(SDIAG)
    assert got == {"REQUEST_NODE_INFO": (57, 39421), "MESSAGE_NODE_REGISTRATION_STATUS": (64, 304849)}
    m = per_minute(got, 30.0)
    assert m["rpcs_per_min"] == 242.0 and m["by_type"]["REQUEST_NODE_INFO"] == {"rpcs": 114.0, "time_us": 78842}


def test_the_no_backoff_cases_pin_every_interval():
    c = {x.name: x for x in cases((1, 30))}
    assert c["tm_slurm, every 30 s"].sets == ("slurm.poll_interval_s=30", "slurm.poll_max_interval_s=30",
                                             "slurm.reservation_poll_s=30")
    assert [x.kind for x in c.values()] == ["idle", "plain", "tm", "tm", "tm"]
