"""One valid instance of every message type, for round-trip and fuzz tests (and others' unit tests)."""

from __future__ import annotations

from xronos.protocol import hastate as ha
from xronos.protocol import messages as m
from xronos.protocol.layout import Layout, Sizes

ARCH = m.ArchSpec(family="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=128, vocab_size=1000, max_positions=128, num_labels=None,
                  tie_word_embeddings=False)
CAPS = m.Capabilities(node_id="pi5-a", hostname="pi5-a.lan", arch="aarch64", cpu_model="Cortex-A76",
                      cores=4, memory_total=8 << 30, memory_available=6 << 30, torch_version="2.13.0",
                      data_host="192.168.1.20", participate=True, cpu_temp_c=51.5, sent_at=1.7e9)
RECIPE = m.Recipe(model_dir="/models/gpt2", data_path="/data/sst2.jsonl", task="classify", batch_size=8, seq_len=128,
                  lr=5e-5, epochs=1, export_dir="/out", max_grad_norm=None)
SPEC = m.JobSpec(name="sst2-ft", owner="pi5-a", recipe=RECIPE, nodes=["pi5-a", "n100"])
SIZES = Sizes(attn=12, mlp=3072, vocab=50257)
PLAN = m.Plan(job_id="j1", version=2, strategy="segment", sizes=SIZES,
              entries=[m.PlanEntry(node_id="pi5-a", rank=0, attn=4, mlp=1024, vocab=16000, predicted_compute_s=0.5,
                                   predicted_memory=1.5e9, memory_cap=6e9),
                       m.PlanEntry(node_id="n100", rank=1, attn=8, mlp=2048, vocab=34257, predicted_compute_s=0.48,
                                   predicted_memory=2.5e9, memory_cap=12e9)],
              predicted_iteration_s=0.55, ideal_iteration_s=0.5, comm_s=0.05)
LAYERS = [
    m.LayerProfile(name="emb", kind="emb", partitioned=True, segment="vocab", time_s=0.01,
                   time_samples=[(0.25, 0.003), (1.0, 0.01)], weight_bytes=1000, activation_bytes=200,
                   temp_bytes=50),
    m.LayerProfile(name="blk.attn", kind="blk", partitioned=True, segment="attn", time_s=0.1,
                   time_samples=[(0.5, 0.055), (1.0, 0.1)], weight_bytes=5 * 10**5,
                   activation_bytes=10**5, temp_bytes=10**4),
    m.LayerProfile(name="blk.mlp", kind="blk", partitioned=True, segment="mlp", time_s=0.2,
                   time_samples=[(0.25, 0.06), (0.5, 0.11), (1.0, 0.2)], weight_bytes=10**6,
                   activation_bytes=10**5, temp_bytes=10**4),
    # The block's replicated remainder (norms, residual adds): every profile has one.
    m.LayerProfile(name="blk.rest", kind="blk", partitioned=False, time_s=0.004, time_samples=[(1.0, 0.004)],
                   weight_bytes=1024, activation_bytes=4096, temp_bytes=512),
    m.LayerProfile(name="out", kind="out", partitioned=False, time_s=0.001, time_samples=[],
                   weight_bytes=500, activation_bytes=20, temp_bytes=0),
]

SAMPLES: dict[str, object] = {
    "node.availability": m.Availability.ONLINE,
    "node.capabilities": CAPS,
    "node.profile_request": m.ProfileRequest(request_id="r1", job_id="j1", arch=ARCH, threads=None,
                                             key=m.ProfileKey(task="causal-lm", batch_size=4, seq_len=64)),
    "node.profile_report": m.ProfileReport(node_id="pi5-a", request_id="r1", job_id="j1", capabilities=CAPS,
                                           arch=ARCH, task="causal-lm", batch_size=4, seq_len=64, threads=4,
                                           sizes=ARCH.sizes(), num_blocks=2, layers=LAYERS, profile_seconds=3.5,
                                           created_at=1.7e9,
                                           settings=m.ProfileSettings(weight_decay=0.0, clip=True, lora=None)),
    "node.assignment": m.Assignment(job_id="j1", plan_version=2, node_id="n100", rank=1, world_size=2,
                                    rendezvous_host="192.168.1.20", rendezvous_port=29500, group_key="0f" * 32,
                                    layout=Layout(attn=(0, 2), mlp=(32, 96), vocab=(640, 360)),
                                    spec=SPEC, resume_step=0),
    "node.ack": m.AssignmentAck(job_id="j1", plan_version=2, node_id="n100", accepted=False,
                                reason="not enough memory"),
    "node.control": m.JobPause(job_id="j1", plan_version=2),
    "node.metrics": m.IterationMetrics(job_id="j1", plan_version=2, node_id="n100", rank=1, step=10, epoch=0,
                                       loss=2.5, compute_s=0.4, comm_s=0.05, idle_s=0.01, iteration_s=0.47,
                                       voluntary_ctx_switches=12, involuntary_ctx_switches=3, peak_rss=10**9),
    "node.error": m.ErrorResponse(code="bad_assignment", message="rank out of range", topic="xronos/x"),
    "node.inspect_request": m.InspectRequest(request_id="r2", job_id="j1", spec=SPEC),
    "node.inspect_report": m.InspectReport(node_id="pi5-a", request_id="r2", job_id="j1", ok=True, arch=ARCH,
                                           train_rows=900, eval_rows=100, total_steps=113),
    "node.job": m.NodeJobStatus(node_id="pi5-a", job_id="j1", plan_version=2, rank=0, status="running",
                                step=10, epoch=0, checkpoint_step=8, eval_metric=None, sent_at=1.7e9),
    "node.catalog": m.NodeCatalog(node_id="pi5-a", allowed_dirs=["/srv/xronos"],
                                  models=["/srv/xronos/models/qwen2.5-0.5b-instruct"],
                                  data=["/srv/xronos/data/chat.jsonl", "/srv/xronos/data/reviews.csv"],
                                  scanned_at=1.7e9),
    "node.catalog_request": m.CatalogRequest(request_id="c1"),
    "job.state": m.JobState(job_id="j1", name="sst2-ft", phase="running", step=10, total_steps=100, epoch=0,
                            loss=2.5, eval_metric=None, eval_metric_name=None, iteration_s=0.5,
                            idle_ratio={"pi5-a": 0.02}, predicted_s={"pi5-a": 0.5}, measured_s={"pi5-a": 0.52},
                            eta_s=45.0, plan=PLAN, events=["planned v2"], updated_at=1.7e9),
    "gateway.availability": m.Availability.OFFLINE,
    "gateway.request.job/submit": m.JobSubmitRequest(transaction="t1", spec=SPEC),
    "gateway.request.job/status": m.JobStatusRequest(transaction=None, job_id=None),
    "gateway.request.job/pause": m.JobPauseRequest(transaction="t2", job_id="j1"),
    "gateway.request.job/resume": m.JobResumeRequest(job_id="j1"),
    "gateway.request.job/cancel": m.JobCancelRequest(transaction="t3", job_id="j1"),
    "gateway.request.nodes/list": m.NodesListRequest(transaction="t4"),
    "gateway.request.plan/preview": m.PlanPreviewRequest(transaction="t5", spec=SPEC),
    "gateway.response": m.GatewayResponse(status="ok", data={"jobs": [{"id": "j1"}]}, transaction="t1"),
    "gateway.ha_state": ha.GatewayHAState(job_id="j1", phase="running", step=3, total_steps=9, steps="3 / 9",
                                          finish_at="2026-12-01T10:00:00+00:00", task="causal-lm",
                                          data_format="chat", lora_r=8, lora_targets="q_proj,v_proj",
                                          updated_at=1.7e9),
    "gateway.set": ha.GatewayCommand(action="start", spec="reviews"),
    "node.ha_state": ha.NodeHAState(participate=True, attn=4, attn_total=12, attn_pct=33.3, mlp_pct=30.0,
                                    vocab_pct=36.5, updated_at=1.7e9),
    "node.set": ha.NodeCommand(participate=False),
    "ha.status": ha.HAStatus.ONLINE,
}

PARAMS: dict[str, dict[str, str]] = {
    "job.state": {"job_id": "j1"},
    "gateway.response": {"name": "job/submit"},
}


def params_for(key: str) -> dict[str, str]:
    if key in PARAMS:
        return PARAMS[key]
    return {"node_id": "pi5-a"} if key.startswith("node.") else {}
