"""`xronos plan` end to end on ProfileReport JSON files written here."""

import json
import math

import pytest

from xronos.bench.plan_speed import synthetic_report
from xronos.cli.main import main
from xronos.protocol.messages import Plan

GiB = 1024**3


def write(tmp_path, name, **kw):
    kw.setdefault("units", 8)
    kw.setdefault("num_blocks", 2)
    edits = kw.pop("edits", {})
    data = synthetic_report(kw.pop("node_id", name), **kw).model_dump(mode="json")
    data.update(edits)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.fixture
def three(tmp_path):
    return [write(tmp_path, "fast", slowness=1.0), write(tmp_path, "mid", slowness=2.0),
            write(tmp_path, "slow", slowness=4.0)]


def test_table_for_each_strategy(three, capsys):
    for strategy in ("segment", "paper", "uniform"):
        assert main(["plan", *three, "--strategy", strategy]) == 0
        out = capsys.readouterr().out
        assert (f"strategy {strategy} over 3 nodes: 8 attention units, 4096 MLP columns, 50000 vocabulary rows"
                in out)
        assert "attn (share)" in out and "mlp (share)" in out and "vocab (share)" in out
        for node in ("fast", "mid", "slow"):
            assert node in out
        assert "predicted iteration" in out and "ideal lower bound" in out and "predicted / ideal" in out
        assert "slowest node per segment: attn" in out
        assert ("proven lower bound" in out) == (strategy == "segment")
    assert main(["plan", *three]) == 0  # auto is the default: a full fine-tune over 1 Gbit/s, TP wins
    out = capsys.readouterr().out
    assert "strategy segment" in out and "candidates (auto" in out and "proven optimal (no cap binding)" in out
    assert main(["plan", *three, "--strategy", "uniform"]) == 0
    rows = [l.split() for l in capsys.readouterr().out.splitlines() if l.split()[0] in ("fast", "mid", "slow")]
    # Per node: attention units, MLP columns, vocabulary rows (each with its share).
    assert [int(r[1]) for r in rows] == [3, 3, 2]
    assert [int(r[3]) for r in rows] == [1376, 1376, 1344]  # 128 quanta of 32: 43, 43, 42
    assert [int(r[5]) for r in rows] == [16672, 16672, 16656]
    assert rows[0][2] == "(0.375)"


def test_json_is_a_plan_message(three, capsys):
    assert main(["plan", *three, "--json", "--job-id", "j1", "--bandwidth-mbps", "100",
                 "--latency-ms", "0.1", "--reserve-mb", "256", "--fit", "linear"]) == 0
    plan = Plan.model_validate_json(capsys.readouterr().out)
    assert plan.job_id == "j1" and plan.sizes.attn == 8 and plan.strategy == "segment"
    for kind in ("attn", "mlp", "vocab"):
        counts = plan.layout().counts(kind)
        assert sum(counts) == plan.sizes.total(kind) and counts[0] > counts[2]  # fast takes more
    assert plan.entries[0].memory_cap == 8 * GiB - 256 * 1024**2
    assert plan.ideal_iteration_s <= plan.predicted_iteration_s
    assert plan.comm_s > 0


def test_uniform_over_cap_is_flagged_with_exit_1(tmp_path, capsys):
    small = write(tmp_path, "small", memory_available=1 * GiB)
    big = write(tmp_path, "big", memory_available=64 * GiB)
    assert main(["plan", small, big, "--strategy", "uniform"]) == 1
    captured = capsys.readouterr()
    assert "OVER CAP" in captured.out and "['small']" in captured.err
    assert main(["plan", small, big, "--strategy", "segment"]) == 0  # routes around the small box


def test_infeasible_names_needs_and_caps(tmp_path, capsys):
    paths = [write(tmp_path, f"pi{i}", memory_available=1 * GiB) for i in range(2)]
    for strategy in ("segment", "paper"):
        assert main(["plan", *paths, "--strategy", strategy]) == 2
        err = capsys.readouterr().err
        assert err.startswith("xronos plan: error: no plan fits the memory caps")
        assert "pi0: cap 512.0 MiB; replicated" in err and "alone fits at most" in err
        assert "MLP columns" in err and "vocabulary rows" in err
        assert "each cap is the node's available memory minus reserve_mb 512 MiB" in err
    # A reserve that takes all a node has: said so, naming the node and what it has.
    assert main(["plan", *paths, "--reserve-mb", "1024"]) == 2
    err = capsys.readouterr().err
    assert "cap 0.0 MiB" in err and "the reserve takes all of it on pi0 (1,024 MiB available), pi1" in err


@pytest.mark.parametrize("kw, other_kw, needle", [
    ({}, dict(batch_size=4), "b.json: field batch_size"),
    ({}, dict(hidden=512), "b.json: field arch.hidden_size"),
    ({}, dict(node_id="a"), "b.json: field node_id: duplicate node id 'a'"),
    ({}, dict(edits={"schema_version": 7}), "b.json: field schema_version: unknown schema version 7"),
    ({}, dict(edits={"units": 0}), "b.json: field units"),
    ({}, dict(edits={"profile_seconds": -1.0}), "b.json: field profile_seconds"),
])
def test_bad_input_names_file_and_field(tmp_path, capsys, kw, other_kw, needle):
    paths = [write(tmp_path, "a", **kw), write(tmp_path, "b", **other_kw)]
    assert main(["plan", *paths]) == 2
    assert needle in capsys.readouterr().err


def test_job_shape_checked(tmp_path, capsys):
    paths = [write(tmp_path, "a"), write(tmp_path, "b", batch_size=4)]
    assert main(["plan", paths[0], "--batch-size", "8", "--seq-len", "32"]) == 0
    capsys.readouterr()
    assert main(["plan", paths[1], "--batch-size", "8"]) == 2
    assert "b.json: field batch_size: node b was profiled at batch_size 4, but the job runs 8" in capsys.readouterr().err
    assert main(["plan", paths[0], "--seq-len", "64"]) == 2
    assert "a.json: field seq_len" in capsys.readouterr().err


LORA = {"weight_decay": 0.0, "clip": True, "lora": {"r": 8, "targets": None, "dropout": 0.0}}
FULL = {"weight_decay": 0.0, "clip": True, "lora": None}


def test_profiles_of_different_job_settings_refused(tmp_path, capsys):
    """A LoRA profile and a full fine-tune's hold different memory (no AdamW state on a frozen
    base) and time: one plan is of one job's settings. An older file (no settings) beside a newer
    one cannot be told apart; two LoRA files plan."""
    lora = write(tmp_path, "a", edits={"settings": LORA})
    full = write(tmp_path, "b", edits={"settings": FULL})
    old = write(tmp_path, "c")  # synthetic reports record no settings, as an older Xronos's
    assert main(["plan", lora, full]) == 2
    assert ("b.json: field settings.lora: node b was profiled at lora None (full fine-tuning), but "
            f"{lora} at LoRA rank 8; one plan needs profiles taken under one job's settings") in capsys.readouterr().err
    assert main(["plan", lora, old]) == 2
    assert "c.json: field settings: node c's profile does not record the job settings" in capsys.readouterr().err
    assert main(["plan", lora, write(tmp_path, "d", edits={"settings": LORA}), "--export-merged"]) == 0
    capsys.readouterr()
    # --export-merged (LoRA's merged model) over a full fine-tune's profile plans another job
    assert main(["plan", full, "--export-merged"]) == 2
    assert "b.json: field settings.lora: --export-merged is for LoRA profiles" in capsys.readouterr().err


def test_missing_segment_names_file_and_field(tmp_path, capsys):
    path = write(tmp_path, "a")
    data = json.loads(open(path).read())
    data["layers"] = [lay for lay in data["layers"] if lay["segment"] != "attn"]
    open(path, "w").write(json.dumps(data))
    assert main(["plan", path]) == 2
    assert "a.json: field layers: no partitioned layer of segment 'attn'" in capsys.readouterr().err


def test_nan_time_names_file_and_field(tmp_path, capsys):
    path = write(tmp_path, "a")
    data = json.loads(open(path).read())
    data["layers"][1]["time_s"] = math.nan
    open(path, "w").write(json.dumps(data))
    assert main(["plan", path]) == 2
    assert "a.json: field layers[1].time_s" in capsys.readouterr().err


def test_bad_options_and_missing_files(tmp_path, capsys):
    path = write(tmp_path, "a")
    assert main(["plan", path, "--bandwidth-mbps", "0"]) == 2
    assert "--bandwidth-mbps" in capsys.readouterr().err
    assert main(["plan", path, "--reserve-mb", "-5"]) == 2
    assert "--reserve-mb" in capsys.readouterr().err
    assert main(["plan", path, "--job-id", "j1"]) == 2  # would be ignored without --json
    assert "--job-id names the job in the --json output" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "nope.json")]) == 2
    assert "nope.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # zero profiles: argparse refuses (nargs="+")
        main(["plan"])


def test_a_profile_whose_time_falls_with_width_is_planned_with_a_warning(tmp_path, capsys):
    path = write(tmp_path, "a")
    data = json.loads(open(path).read())
    i = next(i for i, lay in enumerate(data["layers"]) if lay["partitioned"] and lay["segment"] == "attn")
    data["layers"][i]["time_samples"] = [[0.25, 0.02], [0.5, 0.012], [1.0, 0.01]]
    open(path, "w").write(json.dumps(data))
    assert main(["plan", path, write(tmp_path, "b")]) == 0
    err = capsys.readouterr().err
    assert "xronos plan: warning: " in err and "a.json: node a: layer" in err and "at share 1" in err
    assert "b.json" not in err


def lora_profile(tmp_path, name, **kw):
    """A LoRA-like profile: the base frozen (M_w its weights alone), the head trained."""
    data = json.loads(open(write(tmp_path, name, **kw)).read())
    for lay in data["layers"]:
        lay["param_bytes"] = lay["weight_bytes"] // 4 if lay["name"] == "head" else lay["weight_bytes"]
    (tmp_path / f"{name}.json").write_text(json.dumps(data))
    return str(tmp_path / f"{name}.json")


def test_auto_prints_the_candidates_side_by_side_and_why_the_winner_won(tmp_path, capsys):
    paths = [lora_profile(tmp_path, f"n{i}", slowness=1 + 0.5 * i) for i in range(4)]
    assert main(["plan", *paths, "--strategy", "auto", "--bandwidth-mbps", "100"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("strategy dp over 4 nodes: 4 data-parallel groups of TP 1; 8 attention units")
    rows = [l.split() for l in out.splitlines() if l.split() and l.split()[0] in ("n0", "n1", "n2", "n3")]
    assert [r[0] for r in rows] == ["n0", "n1", "n2", "n3"] and sum(int(r[2]) for r in rows) == 8
    assert all(r[3:6] == ["8", "4096", "50000"] for r in rows)  # every node holds the whole model
    assert "predicted iteration" in out and "what backward does not hide of the gradient all-reduce" in out
    table = out.split("candidates (auto: the fastest that fits; a tie goes to segment):\n", 1)[1]
    head, seg, dp, mesh, why = table.strip().splitlines()
    assert "iteration s" in head and "compute s" in head and "comm s" in head and "worst memory / cap MiB" in head
    assert seg.startswith("   segment (TP over 4)") and dp.startswith("*  dp (4 replicas)")
    assert mesh.startswith("   mesh 2x2 (2 groups of TP 2)") and all(r.endswith("yes") for r in (seg, dp, mesh))
    assert why.startswith("chosen: dp (4 replicas) is the fastest that fits") and "segment (TP over 4)" in why
    # --json: the protocol Plan with the batch shares
    assert main(["plan", *paths, "--bandwidth-mbps", "100", "--json"]) == 0
    plan = Plan.model_validate_json(capsys.readouterr().out)
    assert plan.strategy == "dp" and sum(plan.shares) == 8 and plan.tp_size == 1
    # a forced dp over the caps: refused naming each node's need and cap
    small = [lora_profile(tmp_path, f"s{i}", memory_available=1024**3) for i in range(2)]
    assert main(["plan", *small, "--strategy", "dp"]) == 2
    err = capsys.readouterr().err
    assert "data parallelism does not fit: every node holds a whole replica; s0 needs" in err
    assert "cap 512 MiB (over); s1 needs" in err


def test_a_reader_that_goes_away_is_no_traceback(three):
    """`xronos plan ... | head -1`: the pipe closes early; the command ends quietly with 141 (as a
    shell reports SIGPIPE), not with a BrokenPipeError traceback (a real process, a real pipe)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "xronos.cli.main", "plan", *three], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader goes away before the plan is printed (the command imports for ~1 s)
    _, err = proc.communicate(timeout=120)
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err
    assert proc.returncode == 141
