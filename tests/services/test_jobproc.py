"""The data plane of a job, without MQTT: rank processes as the node service starts them.

Ranks other than the owner are given paths that do not exist: everything they hold came over Gloo.
A pause holds every rank at the same iteration boundary; a job cut at its checkpoint and resumed
under a different plan (other ranks, another per-segment layout: heads, MLP columns and vocabulary
rows each cut differently) ends where the uninterrupted one does (equality with `xronos run` is
checked end to end, in test_e2e); a cancel stops every rank at the same boundary and leaves no
process behind.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from jobkit import job_spec, make_case, runkit, start_ranks, wait_ranks
from xronos.node.rank import messages as msg
from xronos.node.rank.checkpoint import read_meta, saved_layout
from xronos.protocol.layout import Layout

pytestmark = pytest.mark.slow


def _load(path):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(str(path))


class Ranks:
    def __init__(self, procs):
        self.procs, self.seen = procs, [[] for _ in procs]

    def pump(self, until=lambda: True, timeout=180.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, p in enumerate(self.procs):
                self.seen[i] += p.drain()
            if until():
                return
            time.sleep(0.02)
        raise TimeoutError([p.tail(800) for p in self.procs])

    def steps(self, i):
        return [e.step for e in self.seen[i] if e.kind == "metrics"]

    def send(self, order):  # the node service forwards every control; only rank 0's counts
        for p in self.procs:
            p.send(order)

    def done(self):
        return all(p.finished() for p in self.procs)


# The case's GPT-2: 12 heads, 100 MLP columns, 37 vocabulary rows. Three ranks, then four, each
# with a rank holding 0 heads but MLP columns and one holding heads but 0 vocabulary rows.
FIRST = Layout(attn=(0, 7, 5), mlp=(64, 0, 36), vocab=(32, 0, 5))
RESUMED = Layout(attn=(3, 0, 4, 5), mlp=(0, 32, 64, 4), vocab=(0, 32, 0, 5))


def test_pause_then_resume_from_checkpoint_under_another_plan(tmp_path):
    model, data = make_case(tmp_path)
    spec = job_spec(model, data, tmp_path / "export", max_steps=20, checkpoint_interval=10)
    r = Ranks(start_ranks(tmp_path, spec, FIRST))
    r.pump(lambda: len(r.steps(2)) >= 2)
    r.send(msg.Pause())
    r.pump(lambda: all(msg.Status(status="paused") in s for s in r.seen))
    held = r.steps(0)[-1]
    time.sleep(2.0)  # peers wait on the owner's heartbeat, well inside their Gloo timeout
    r.pump()
    assert held < 20 and [r.steps(i)[-1] for i in range(3)] == [held] * 3
    r.send(msg.Resume())
    r.pump(r.done)
    owner = r.seen[0]
    assert owner[0].kind == "eval" and owner[0].when == "before"
    assert r.steps(0) == list(range(1, 21))
    assert [e.step for e in owner if e.kind == "checkpoint"] == [10]
    assert owner[-1] == msg.Completed(step=20, epoch=2, export_dir=str(tmp_path / "export"))
    assert all(ev[-1].kind == "completed" for ev in r.seen)

    # The owner's consolidated checkpoint records the plan it was saved under.
    meta = read_meta(tmp_path / "ckpt")
    assert meta["step"] == 10 and saved_layout(meta) == FIRST
    assert json.loads((tmp_path / "ckpt" / "state.json").read_text())["layout"] == \
        {"attn": [0, 7, 5], "mlp": [64, 0, 36], "vocab": [32, 0, 5]}

    # Resume at the step-10 checkpoint on four ranks with another layout per kind: same end point.
    spec2 = job_spec(model, data, tmp_path / "export2", max_steps=20, checkpoint_interval=10)
    events = wait_ranks(start_ranks(tmp_path, spec2, RESUMED, resume_step=10, version=2))
    assert [e.step for e in events[0] if e.kind == "metrics"] == list(range(11, 21))
    assert [e.when for e in events[0] if e.kind == "eval"] == ["after"]  # no "before" on a resume
    max_abs, rel = runkit.compare(_load(tmp_path / "export2"), _load(tmp_path / "export"))
    assert max_abs <= 5e-4 and rel <= 1e-5


def test_cancel_stops_every_rank_at_one_boundary_and_leaves_nothing(tmp_path):
    model, data = make_case(tmp_path)
    spec = job_spec(model, data, tmp_path / "export", max_steps=100000, checkpoint_interval=100000)
    r = Ranks(start_ranks(tmp_path, spec, [4, 8]))
    r.pump(lambda: len(r.steps(1)) >= 2)
    r.send(msg.Cancel())
    r.pump(r.done)
    assert [ev[-1].kind for ev in r.seen] == ["cancelled", "cancelled"]
    assert r.steps(0)[-1] == r.steps(1)[-1]
    for p in r.procs:
        assert p.poll() == 0
        p.kill()
        with pytest.raises(ProcessLookupError):
            os.killpg(p.proc.pid, 0)  # nothing left of its process group


def test_resume_without_checkpoint_fails_cleanly(tmp_path):
    model, data = make_case(tmp_path)
    spec = job_spec(model, data, tmp_path / "export")
    events = wait_ranks(start_ranks(tmp_path, spec, [6, 6], resume_step=3), timeout=120)
    assert events[0][-1].kind == "failed" and "no checkpoint at step 3" in events[0][-1].detail
    assert events[1][-1].kind == "failed"  # the peer learns from Gloo, not by hanging


def test_resume_from_the_checkpoint_before_the_newest(tmp_path):
    """A gateway decides to recover the instant a node drops, and the owner may still finish the
    next checkpoint (its peers' slices were gathered already): the checkpoint the gateway names is
    then one behind the newest, and must still be there (kept as `<dir>.prev`). An older one is
    gone, and the owner says which steps it has."""
    model, data = make_case(tmp_path)
    spec = job_spec(model, data, tmp_path / "export", max_steps=10, checkpoint_interval=3)
    events = wait_ranks(start_ranks(tmp_path, spec, FIRST))
    assert [e.step for e in events[0] if e.kind == "checkpoint"] == [3, 6, 9]
    assert read_meta(tmp_path / "ckpt")["step"] == 9

    stale = wait_ranks(start_ranks(tmp_path, spec, [6, 6], resume_step=3, version=2), timeout=120)
    assert stale[0][-1].kind == "failed" and "no checkpoint at step 3" in stale[0][-1].detail \
        and "found steps [6, 9]" in stale[0][-1].detail, stale[0][-1]
    spec3 = job_spec(model, data, tmp_path / "export3", max_steps=10, checkpoint_interval=3)
    events = wait_ranks(start_ranks(tmp_path, spec3, RESUMED, resume_step=6, version=3))
    assert [e.step for e in events[0] if e.kind == "metrics"] == list(range(7, 11))
    max_abs, rel = runkit.compare(_load(tmp_path / "export3"), _load(tmp_path / "export"))
    assert max_abs <= 5e-4 and rel <= 1e-5


def _run_argv(spec, layout, out, extra=()):
    r = spec["recipe"]
    return runkit.run_argv(r["model_dir"], r["data_path"], r["task"], layout, out,
                           steps=r["max_steps"], lr=r["lr"], seed=r["seed"],
                           extra=("--eval-fraction", str(r["eval_fraction"]), "--dropout", "0", *extra))


def test_string_labels_reach_every_rank_and_survive_a_resume(tmp_path):
    """A headless checkpoint and labels named in the data: the owner decides the classes and
    shares them (the other ranks have no files); the export names them, equals `xronos run`, and
    a resume under another plan re-derives the same classes from the data."""
    from xronos.cli.main import main as xronos

    model = runkit.make_model(tmp_path / "model", "gpt2", "causal-lm", num_labels=2)  # no score head
    names = ["sea", "bird", "tree", "fish"]
    data = runkit.write_rows(tmp_path / "d.jsonl", [{"text": t, "label": names[i % 4]}
                                                     for i, t in enumerate(runkit.texts(40))])
    spec = job_spec(model, data, tmp_path / "export", max_steps=6, checkpoint_interval=3)
    events = wait_ranks(start_ranks(tmp_path, spec, FIRST))
    assert [ev[-1].kind for ev in events] == ["completed"] * 3, events
    first = _load(tmp_path / "export")
    assert first.config.id2label == dict(enumerate(sorted(names))) and first.config.num_labels == 4
    assert xronos(_run_argv(spec, FIRST, tmp_path / "ref")) == 0
    max_abs, rel = runkit.compare(first, _load(tmp_path / "ref"))
    assert max_abs <= 5e-4 and rel <= 1e-5

    resumed = {**spec, "recipe": {**spec["recipe"], "export_dir": str(tmp_path / "export2")}}
    events = wait_ranks(start_ranks(tmp_path, resumed, RESUMED, resume_step=3, version=2))
    assert [ev[-1].kind for ev in events] == ["completed"] * 4, events
    second = _load(tmp_path / "export2")
    assert second.config.id2label == first.config.id2label
    max_abs, rel = runkit.compare(second, first)
    assert max_abs <= 5e-4 and rel <= 1e-5


def test_a_chat_job_trains_like_xronos_run(tmp_path):
    from transformers import AutoModelForCausalLM

    from xronos.cli.main import main as xronos

    model = runkit.make_model(tmp_path / "model", "llama", "causal-lm", chat=True)
    short = [" ".join(t.split()[:4]) for t in runkit.texts(80, 1)]  # every answer starts within seq-len
    rows = [{"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": a}]}
            for t, a in zip(short[:40], short[40:])]
    data = runkit.write_rows(tmp_path / "d.jsonl", rows)
    spec = job_spec(model, data, tmp_path / "export", task="causal-lm", data_format="chat", max_steps=6,
                    checkpoint_interval=100)
    layout = Layout(attn=(0, 5, 3), mlp=(64, 0, 36), vocab=(32, 0, 11))
    events = wait_ranks(start_ranks(tmp_path, spec, layout))
    assert [ev[-1].kind for ev in events] == ["completed"] * 3, events
    assert xronos(_run_argv(spec, layout, tmp_path / "ref", ("--data-format", "chat"))) == 0
    job, ref = (AutoModelForCausalLM.from_pretrained(str(tmp_path / d)) for d in ("export", "ref"))
    max_abs, rel = runkit.compare(job, ref)
    assert max_abs <= 5e-4 and rel <= 1e-5
    assert (tmp_path / "export" / "chat_template.jinja").is_file()


# Two live re-shards ordered to the owner (as the node service forwards the gateway's JobReshard).
MOVED = (Layout(attn=(4, 4, 4), mlp=(32, 32, 36), vocab=(0, 32, 5)),
         Layout(attn=(6, 0, 6), mlp=(0, 64, 36), vocab=(32, 5, 0)))


def test_reshard_orders_move_every_rank_at_one_boundary_and_export_like_xronos_run(tmp_path):
    """The owner alone hears each order and broadcasts it: every rank moves at the same boundary
    (the first at or after `at_step`), the checkpoint after a move records the new layout, and the
    export equals `xronos run --reshard-at` at the steps the job moved (the move is exact)."""
    from xronos.cli.main import main as xronos

    model, data = make_case(tmp_path)
    spec = job_spec(model, data, tmp_path / "export", max_steps=12, checkpoint_interval=5)
    r = Ranks(start_ranks(tmp_path, spec, FIRST))

    def moves():
        return [e for e in r.seen[0] if e.kind == "resharded"]

    # A layout for another world never reaches the group: the owner says why and goes on.
    r.procs[0].send(msg.Reshard(at_step=1, layout=Layout(attn=(6, 6), mlp=(50, 50), vocab=(20, 17)),
                                reason="wrong world"))
    # A layout for this world whose counts do not fit the model passes the owner's reading but
    # is refused at the boundary by every rank alike, before anything moves; the job goes on.
    r.procs[0].send(msg.Reshard(at_step=1, layout=Layout(attn=(5, 4, 4), mlp=(32, 32, 36), vocab=(0, 32, 5)),
                                reason="wrong sums"))
    r.pump(lambda: any(e.kind == "reshard_refused" and "counts" in e.detail for e in r.seen[0]))
    r.procs[0].send(msg.Reshard(at_step=3, layout=MOVED[0], reason="first"))
    r.pump(lambda: len(moves()) == 1)
    r.procs[0].send(msg.Reshard(at_step=7, layout=MOVED[1], reason="second"))
    r.pump(r.done)
    assert all(ev[-1].kind == "completed" for ev in r.seen), [ev[-1] for ev in r.seen]
    assert [e.reason for e in moves()] == ["first", "second"]
    steps = [e.step for e in moves()]
    assert steps[0] >= 3 and steps[1] >= max(7, steps[0] + 1) and [e.layout for e in moves()] == list(MOVED)
    assert all(e.moved_bytes > 0 and e.seconds > 0 for e in moves())
    refused = [e.detail for e in r.seen[0] if e.kind == "reshard_refused"]
    assert refused[0] == "layout has 2 ranks, the job 3" and len(refused) == 2, refused
    assert refused[1].startswith("re-shard at step ") and "attn: counts [5, 4, 4] sum to 13" in refused[1], refused
    assert all(r.steps(i) == list(range(1, 13)) for i in range(3))
    meta = read_meta(tmp_path / "ckpt")  # the last checkpoint (step 10): the layout it ran under then
    assert meta["step"] == 10 and saved_layout(meta) == (MOVED[1] if steps[1] < 10 else MOVED[0])

    at = [a for s, x in zip(steps, MOVED) for a in ("--reshard-at", f"{s}:{x.to_text()}")]
    assert xronos(_run_argv(spec, FIRST, tmp_path / "ref", tuple(at))) == 0
    max_abs, rel = runkit.compare(_load(tmp_path / "export"), _load(tmp_path / "ref"))
    assert max_abs <= 5e-4 and rel <= 1e-5
