"""`tm-slurm rehearse`'s comparison on hand-made final states (export.Exported's contract: step,
tensors by name, the plain state), its likely causes, its options and its plan; no process runs."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tm_slurm import config as cfgmod
from tm_slurm.cli import build_parser
from tm_slurm.demo import Job
from tm_slurm.export import Exported
from tm_slurm.messages import StateManifest
from tm_slurm.rehearse import (MAX_NAMES, RANDOMNESS, Interruption, Outcome, Run, Stop, compare,
                               first_loss_difference, forwarded, likely_cause, losses, plan, too_short,
                               verdict)


DRAIN = Interruption("drain", "node1", 20)


def state(**changes) -> Exported:
    """A BatchNorm model's state after 40 steps of AdamW under a LambdaLR; `changes`: name -> tensor."""
    g = torch.Generator().manual_seed(0)
    t = {"model.lin.weight": torch.randn(4, 3, generator=g), "model.lin.bias": torch.randn(4, generator=g),
         "model.bn.running_mean": torch.randn(4, generator=g), "model.bn.running_var": torch.rand(4, generator=g),
         "model.bn.num_batches_tracked": torch.tensor(40),
         "opt.0.exp_avg": torch.randn(4, 3, generator=g), "opt.0.step": torch.tensor(40.0)}
    t.update(changes)
    plain = StateManifest(40, (), ({"lr": 3e-3, "betas": (0.9, 0.999)},), {},
                          {"last_epoch": 40, "_step_count": 41, "base_lrs": [3e-3]}, {"seen": 40})
    return Exported(40, t, plain)


def groups(diffs) -> set[str]:
    return {d.group for d in diffs}


def test_identical_states_say_bit_identical_and_what_was_compared():
    ref = state()
    diffs = compare(ref, state())
    assert diffs == []
    assert verdict("drain", diffs, ref, DRAIN, None, False) == [
        "drain: bit-identical: parameters, buffers, optimizer, scheduler, script state (7 tensors)"]


def test_comparison_is_bitwise_nans_alike_and_a_negative_zero_not():
    nan = torch.tensor([float("nan"), 1.0, 0.0, 0.0])
    assert compare(state(**{"model.lin.bias": nan}), state(**{"model.lin.bias": nan.clone()})) == []
    negative_zero = torch.tensor([float("nan"), 1.0, 0.0, -0.0])
    (d,) = compare(state(**{"model.lin.bias": nan}), state(**{"model.lin.bias": negative_zero}))
    assert d.name == "model.lin.bias" and d.group == "parameters"


def test_differing_parameters_are_named_with_their_largest_difference_and_blamed_on_randomness():
    ref = state()
    run = state(**{"model.lin.weight": ref.tensors["model.lin.weight"] + 0.25,
                   "opt.0.exp_avg": ref.tensors["opt.0.exp_avg"] * 2})
    diffs = compare(ref, run)
    assert [(d.group, d.name) for d in diffs] == [("parameters", "model.lin.weight"), ("optimizer", "opt.0.exp_avg")]
    assert diffs[0].detail == "max |diff| 0.25"
    lines = verdict("kill", diffs, ref, Interruption("kill", "node2", 12), None, False)
    assert lines[0] == "kill: DIFFERS from the undisturbed run (2 of 7 tensors)"
    assert lines[1] == "  parameters: model.lin.weight (max |diff| 0.25)"
    assert lines[2].startswith("  optimizer: opt.0.exp_avg (max |diff| ")
    assert lines[3].startswith("  losses: none reported")
    assert lines[4] == "  likely cause: " + RANDOMNESS


def test_only_buffers_differing_means_buffers_updated_outside_a_committed_step():
    ref = state()
    diffs = compare(ref, state(**{"model.bn.running_mean": ref.tensors["model.bn.running_mean"] * 0.9,
                                  "model.bn.num_batches_tracked": torch.tensor(41)}))
    assert [(d.group, d.name) for d in diffs] == [("buffers", "model.bn.running_mean"),
                                                  ("buffers", "model.bn.num_batches_tracked")]
    assert likely_cause(groups(diffs)).startswith("buffers updated outside a committed step")


def test_only_the_scheduler_differing_names_its_values_and_sched_step():
    ref = state()
    stepped = {**ref.plain.scheduler, "last_epoch": 41, "_step_count": 42}
    run = replace(ref, plain=replace(ref.plain, scheduler=stepped))
    diffs = compare(ref, run)
    assert [(d.group, d.name, d.detail) for d in diffs] == [("scheduler", "scheduler.last_epoch", "40 != 41"),
                                                           ("scheduler", "scheduler._step_count", "41 != 42")]
    assert likely_cause(groups(diffs)).startswith("scheduler stepped outside opt.step()")
    assert "0 of 7 tensors, 2 other values" in verdict("drain", diffs, ref, DRAIN, None, False)[0]


def test_plain_optimizer_values_script_state_and_the_step_are_compared():
    ref = state()
    run = replace(ref, step=39, plain=replace(ref.plain, param_groups=({"lr": 1e-3, "betas": (0.9, 0.999)},),
                                              extra={"seen": 39}))
    assert [(d.group, d.name) for d in compare(ref, run)] == [
        ("step", "step"), ("optimizer", "param_groups[0].lr"), ("script state", "extra.seen")]
    assert likely_cause({"script state"}).startswith("the script's registered state")
    assert likely_cause({"step", "parameters"}).startswith("the runs ended at different steps")


def test_pipeline_stages_names_and_plain_states_are_each_compared():
    one = state()
    ref = Exported(40, {f"pp{k}.{n}": t for k in (0, 1) for n, t in one.tensors.items()}, one.plain,
                   (one.plain, one.plain))
    later = replace(one.plain, scheduler={**one.plain.scheduler, "last_epoch": 41})
    run = replace(ref, tensors={**ref.tensors, "pp1.opt.0.exp_avg": torch.zeros(4, 3)}, stages=(one.plain, later))
    assert [(d.group, d.name) for d in compare(ref, run)] == [("optimizer", "pp1.opt.0.exp_avg"),
                                                             ("scheduler", "pp1.scheduler.last_epoch")]


def test_a_tensor_of_another_shape_dtype_or_missing_is_a_difference():
    ref = state()
    run = state(**{"model.lin.bias": torch.zeros(5), "opt.0.step": torch.tensor(40, dtype=torch.int64)})
    del run.tensors["model.bn.running_var"]
    run.tensors["model.extra"] = torch.zeros(1)
    assert [(d.name, d.detail) for d in compare(ref, run)] == [
        ("model.lin.bias", "torch.float32 (4,) != torch.float32 (5,)"),
        ("model.bn.running_var", "only in the undisturbed run"),
        ("opt.0.step", "torch.float32 () != torch.int64 ()"),
        ("model.extra", "only in the interrupted run")]


def test_at_most_max_names_are_shown_per_part():
    ref = state(**{f"model.l{i}.weight": torch.zeros(2) for i in range(MAX_NAMES + 3)})
    run = state(**{f"model.l{i}.weight": torch.ones(2) for i in range(MAX_NAMES + 3)})
    (line,) = [x for x in verdict("drain", compare(ref, run), ref, DRAIN, None, False) if "parameters:" in x]
    assert line.count("(max |diff| 1)") == MAX_NAMES and line.endswith(", and 3 more")


def test_losses_that_part_before_the_interruption_mean_the_script_is_not_deterministic_alone():
    ref, run = {0: 2.0, 1: 1.5, 2: 1.2, 30: 0.5}, {0: 2.0, 1: 1.5, 2: 1.3, 30: 0.6}
    assert first_loss_difference(ref, run) == 2
    assert first_loss_difference(ref, {**ref, 31: 9.0}) is None
    cause = likely_cause({"parameters"}, 2, DRAIN)
    assert cause.startswith("the script is not deterministic even undisturbed (its losses differ from "
                            "step 2, before the drain at step 20)")
    assert likely_cause({"parameters"}, 25, DRAIN) == RANDOMNESS
    lines = verdict("drain", compare(state(), state(**{"model.lin.bias": torch.zeros(4)})), state(), DRAIN, 25, True)
    assert "  losses: the first to differ is step 25's, 5 step(s) after the drain (step 20)" in lines
    lines = verdict("drain", compare(state(), state(**{"model.lin.bias": torch.zeros(4)})), state(), DRAIN, None, True)
    assert "  losses: every step's is the same in both runs" in lines


def test_losses_take_the_last_line_of_a_step_done_again(tmp_path):
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(d) + "\n" for d in [
        {"step": 4, "wall": 1.0, "loss": 2.0}, {"step": 5, "wall": 2.0, "loss": 1.0},
        {"step": 5, "wall": 3.0, "loss": 1.5}, {"step": 6, "wall": 4.0, "loss": None}]))
    assert losses(tmp_path) == {4: 2.0, 5: 1.5}


def test_rehearse_hands_runs_options_on_but_its_own():
    args = build_parser().parse_args(["rehearse", "--local", "2+2", "--config", "c.yaml", "--dp", "2", "--set",
                                      "a=1", "--set", "b=2", "--job-id", "r1", "--resume", "--", "python", "t.py"])
    assert forwarded(args) == ["--config", "c.yaml", "--set", "a=1", "--set", "b=2", "--dp", "2",
                               "--resume", "latest"]


def test_a_kill_waits_for_a_checkpoint_when_no_other_node_holds_the_killed_nodes_state():
    ddp = cfgmod.load(None, {"layout.dp": 2, "layout.pp": 1})
    drain, kill, ref = plan(ddp, 2, 1)
    assert (drain.local, drain.actions, kill.actions, kill.checkpoint_every) == ("2+1", [(3, "drain", "node1")],
                                                                               [(3, "kill", "node2")], 0)
    assert (ref.local, ref.actions, ref.sets) == ("2+0", [], ["standby.count=0"])
    fsdp = {"layout.dp": 2, "layout.pp": 1, "layout.dp_shard": 2}
    with pytest.raises(Stop) as e:
        plan(cfgmod.load(None, fsdp), 2, 1)
    assert e.value.outcome == Outcome.USAGE and "checkpoint.every_steps=N" in str(e.value)
    _, kill, _ = plan(cfgmod.load(None, {**fsdp, "checkpoint.every_steps": 20}), 2, 1)
    assert callable(kill.actions[0][0]) and kill.checkpoint_every == 20


def test_a_run_too_short_for_its_standbys_says_how_many_steps_would_do(tmp_path: Path):
    job = tmp_path / "drain"
    job.mkdir()
    (job / "steps.jsonl").write_text("".join(json.dumps({"step": s, "wall": 100.0 + s / 2, "loss": None,
                                                         "dur_s": 0.5}) + "\n" for s in range(12)))
    (job / "events.jsonl").write_text(json.dumps({"kind": "node_ready", "node": "node1", "ts": 99.0}) + "\n")
    run = Run("drain", "2+1", [(3, "drain", "node1")], [])
    run.job = Job(job, [], run.actions)
    # never warm in the run's 5.5 s: twice that and SLACK_S more, at 0.5 s a step
    assert too_short(run) == ("the drain run ended after 12 steps, before it could drain node1: its standbys "
                              "were not warm yet (a standby first rehearses the script in a sandbox); run at "
                              "least 35 steps")
    with open(job / "events.jsonl", "a") as f:
        f.write(json.dumps({"kind": "node_ready", "node": "node3", "ts": 104.8}) + "\n")
    assert too_short(run).endswith("its standbys were warm from step 10, 2 step(s) (0.7 s) before its end; "
                                   "run at least 23 steps")
