import json
import math

import re

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol_samples import SAMPLES, params_for
from xronos.protocol import messages as m
from xronos.protocol.codec import DecodeError, decode, encode
from xronos.protocol.topics import BY_KEY, ENTRIES, TopicTable

TABLE = TopicTable()


def test_every_entry_has_a_sample():
    assert set(SAMPLES) == {e.key for e in ENTRIES}


@pytest.mark.parametrize("key", sorted(SAMPLES))
def test_round_trip(key):
    msg = SAMPLES[key]
    topic = TABLE.build(key, **params_for(key))
    data = encode(msg)
    assert isinstance(data, bytes)
    back = decode(topic, data)
    assert back == msg and type(back) is type(msg)
    if BY_KEY[key].encoding == "json":
        json.loads(data)  # a person or Home Assistant can read it
    elif BY_KEY[key].encoding == "msgpack":
        assert isinstance(msgpack.unpackb(data), dict)


@pytest.mark.parametrize("action,cls", [("start", m.JobStart), ("pause", m.JobPause),
                                        ("resume", m.JobResume), ("cancel", m.JobCancel)])
def test_job_control_union(action, cls):
    topic = TABLE.build("node.control", node_id="n")
    back = decode(topic, msgpack.packb({"action": action, "job_id": "j", "plan_version": 3}))
    assert type(back) is cls and back.action == action
    with pytest.raises(DecodeError, match="action"):
        decode(topic, msgpack.packb({"action": "explode", "job_id": "j", "plan_version": 3}))


def test_reshard_order_is_bounded_and_checked():
    topic = TABLE.build("node.control", node_id="n")
    order = {"action": "reshard", "job_id": "j", "plan_version": 3, "at_step": 7, "reason": "gain 9%",
             "layout": {"attn": [2, 2], "mlp": [40, 24], "vocab": [30, 20]}}
    back = decode(topic, msgpack.packb(order))
    assert type(back) is m.JobReshard and back.layout.mlp == (40, 24) and back.at_step == 7
    with pytest.raises(DecodeError, match="layout"):  # one count per rank, for every kind
        decode(topic, msgpack.packb({**order, "layout": {"attn": [2, 2], "mlp": [64], "vocab": [30, 20]}}))
    with pytest.raises(DecodeError, match="reason"):
        decode(topic, msgpack.packb({**order, "reason": "x" * 257}))
    with pytest.raises(DecodeError, match="at_step"):
        decode(topic, msgpack.packb({**order, "at_step": -1}))


def test_a_re_split_order_carries_strict_shares():
    """A data-parallel job's re-split (`JobReshard.shares`, additive: an order without it is a TP
    re-shard as before): rows per group, each >= 0, at least one row in all, integers only. The
    group count and the sum are the node's to check against its assignment (node/agent/jobcheck.py)."""
    topic = TABLE.build("node.control", node_id="n")
    order = {"action": "reshard", "job_id": "j", "plan_version": 3, "at_step": 7, "reason": "r",
             "layout": {"attn": [12], "mlp": [100], "vocab": [37]}, "shares": [3, 0, 1]}
    back = decode(topic, msgpack.packb(order))
    assert type(back) is m.JobReshard and back.shares == [3, 0, 1]
    assert decode(topic, msgpack.packb({k: v for k, v in order.items() if k != "shares"})).shares is None
    for shares, why in (([3, -1], "shares.1"), ([0, 0], "shares: [0, 0] hold no rows"), ([], "shares"),
                        ([1.5, 2], "shares.0"), (["2", 2], "shares.0"), ([True, 3], "shares.0")):
        with pytest.raises(DecodeError, match=re.escape(why)) as err:
            decode(topic, msgpack.packb({**order, "shares": shares}))


def test_tuples_arrive_as_lists_and_still_validate_strictly():
    topic = TABLE.build("node.profile_report", node_id="pi5-a")
    obj = msgpack.unpackb(encode(SAMPLES["node.profile_report"]))
    assert isinstance(obj["layers"][0]["time_samples"][0], list)
    assert decode(topic, msgpack.packb(obj)) == SAMPLES["node.profile_report"]
    obj["layers"][0]["time_samples"][0] = [0.25, 0.1, 0.3]
    with pytest.raises(DecodeError, match="time_samples"):
        decode(topic, msgpack.packb(obj))
    obj["layers"][0]["time_samples"][0] = ["0.25", 0.1]  # strict: no string -> float coercion
    with pytest.raises(DecodeError, match="time_samples"):
        decode(topic, msgpack.packb(obj))


def test_nan_loss_survives_json():
    state = SAMPLES["job.state"].model_copy(update={"loss": float("nan")})
    back = decode(TABLE.build("job.state", job_id="j1"), encode(state))
    assert math.isnan(back.loss)


def _payload(key, mutate):
    obj = json.loads(encode(SAMPLES[key]))
    mutate(obj)
    return json.dumps(obj).encode()


CAPS_TOPIC = TABLE.build("node.capabilities", node_id="pi5-a")


@pytest.mark.parametrize("payload,reason,field,text", [
    (b"\xff\x00garbage", "bad_encoding", None, "not json"),
    (b"[1, 2]", "invalid", None, "expected an object"),
    (_payload("node.capabilities", lambda o: o.update(schema_version=3)), "schema_version",
     "schema_version", "saw schema_version 3, this build supports 2"),
    (_payload("node.capabilities", lambda o: o.update(schema_version=1)), "schema_version",
     "schema_version", "saw schema_version 1, this build supports 2 (the sender runs an older Xronos"),
    (_payload("node.capabilities", lambda o: o.update(schema_version=True)), "schema_version",
     "schema_version", "True"),
    (_payload("node.capabilities", lambda o: o.update(gpu="none")), "unknown_field", "gpu", "Extra"),
    (_payload("node.capabilities", lambda o: o.pop("cores")), "missing_field", "cores", "required"),
    (_payload("node.capabilities", lambda o: o.update(cores="4")), "invalid", "cores", "integer"),
    (_payload("node.capabilities", lambda o: o.update(participate=1)), "invalid", "participate", "boolean"),
    (b"{" + b" " * (256 * 1024) + b"}", "too_large", None, "exceeds cap 262144"),
])
def test_bad_input_names_topic_reason_and_field(payload, reason, field, text):
    with pytest.raises(DecodeError) as info:
        decode(CAPS_TOPIC, payload)
    err = info.value
    assert (err.reason, err.field) == (reason, field)
    assert CAPS_TOPIC in str(err) and text in str(err)
    assert isinstance(err, ValueError)


def test_a_validators_refusal_reads_without_pydantics_prefix():
    """A model validator's own text already says why; the codec hands it on without pydantic's
    "Value error, " in front (the text a person reads in the gateway's events and logs)."""
    topic = TABLE.build("node.profile_report", node_id="pi5-a")
    doc = SAMPLES["node.profile_report"].model_dump(mode="json")
    doc["layers"][1]["segment"] = None  # a partitioned layer without its segment kind
    with pytest.raises(DecodeError) as info:
        decode(topic, msgpack.packb(doc))
    err = info.value
    assert (err.reason, err.field) == ("invalid", "layers.1")
    assert err.detail == "segment: layer 'blk.attn' is partitioned, so its segment must be set", err.detail
    assert "Value error" not in str(err)
    doc = SAMPLES["node.profile_report"].model_dump(mode="json")
    doc["collectives"] = dict(nbytes=1024, seconds=0.001, small_bytes=1024, small_seconds=0.0005, repeats=3)
    with pytest.raises(DecodeError) as info:  # the small message is not smaller
        decode(topic, msgpack.packb(doc))
    assert info.value.field == "collectives" and info.value.detail.startswith("small_bytes: must be below nbytes")


def test_bad_msgpack_and_text_and_unknown_topic():
    with pytest.raises(DecodeError, match="not msgpack: invalid or reserved type byte$"):
        decode(TABLE.build("node.metrics", node_id="a"), b"\xc1")
    with pytest.raises(DecodeError, match="not msgpack: nested too deeply$"):  # msgpack's own limit
        decode(TABLE.build("node.metrics", node_id="a"), b"\x91" * 200_000)
    with pytest.raises(DecodeError, match="expected 'online' or 'offline'"):
        decode(TABLE.build("node.availability", node_id="a"), b"maybe")
    with pytest.raises(DecodeError) as info:
        decode("xronos/nope", b"{}")
    assert info.value.reason == "unknown_topic"


def test_size_cap_is_configurable_and_checked_before_parsing():
    topic = TABLE.build("node.metrics", node_id="a")
    data = encode(SAMPLES["node.metrics"])
    with pytest.raises(DecodeError) as info:
        decode(topic, data, max_bytes=len(data) - 1)
    assert info.value.reason == "too_large"
    with pytest.raises(DecodeError) as info:  # not even valid msgpack: the cap is checked first
        decode(topic, b"\xc1" * 100, max_bytes=10)
    assert info.value.reason == "too_large"
    with pytest.raises(ValueError, match="exceeds cap"):
        encode(SAMPLES["node.metrics"], max_bytes=10)


def test_transaction_recovered_from_bad_request():
    topic = TABLE.build("gateway.request.job/pause")
    with pytest.raises(DecodeError) as info:
        decode(topic, b'{"transaction": "abc", "job_id": 5}')
    assert info.value.transaction == "abc" and info.value.field == "job_id"


def test_semantic_validators():
    with pytest.raises(ValueError, match="epochs/max_steps"):
        m.Recipe(model_dir="d", data_path="p", task="classify", batch_size=1, seq_len=8, lr=1e-3, export_dir="e")
    with pytest.raises(ValueError, match="layout: 3 ranks for world_size 2"):
        m.Assignment.model_validate({**SAMPLES["node.assignment"].model_dump(),
                                     "layout": {"attn": [0, 1, 1], "mlp": [0, 64, 64], "vocab": [1, 1, 998]}})
    with pytest.raises(ValueError, match="samples"):
        m.LayerProfile(name="b", kind="blk", partitioned=True, segment="mlp", time_s=1.0, time_samples=[(1.0, 1.0)],
                       weight_bytes=1, activation_bytes=1, temp_bytes=1)


# --- fuzzing: nothing but DecodeError, ever --------------------------------------------------

TOPICS = [TABLE.build(k, **params_for(k)) for k in sorted(SAMPLES)]
ENCODED = [encode(SAMPLES[k]) for k in sorted(SAMPLES)]
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decode_or_decode_error(topic, payload):
    try:
        decode(topic, payload)
    except DecodeError:
        pass


@FUZZ
@given(st.sampled_from(TOPICS), st.binary(max_size=512))
def test_fuzz_random_bytes(topic, payload):
    _decode_or_decode_error(topic, payload)


@FUZZ
@given(st.integers(0, len(TOPICS) - 1), st.data())
def test_fuzz_byte_mutations(i, data):
    raw = bytearray(ENCODED[i])
    for _ in range(data.draw(st.integers(1, 8))):
        op = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        pos = data.draw(st.integers(0, max(len(raw) - 1, 0)))
        if op == "flip" and raw:
            raw[pos] ^= data.draw(st.integers(1, 255))
        elif op == "insert":
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and raw:
            del raw[pos]
        elif op == "truncate":
            del raw[pos:]
    _decode_or_decode_error(TOPICS[i], bytes(raw))


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=10),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=10,
)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


@FUZZ
@given(st.integers(0, len(TOPICS) - 1), st.data())
def test_fuzz_structural_mutations(i, data):
    """Replace or drop a random field deep inside a valid message, re-encode in the topic's encoding."""
    topic, raw = TOPICS[i], ENCODED[i]
    entry = TABLE.match(topic)[0]
    if entry.encoding == "text":
        return
    obj = json.loads(raw) if entry.encoding == "json" else msgpack.unpackb(raw)
    path = data.draw(st.sampled_from(list(_paths(obj))[1:]))
    parent = obj
    for p in path[:-1]:
        parent = parent[p]
    if data.draw(st.booleans()) and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(JSONISH)
    payload = json.dumps(obj).encode() if entry.encoding == "json" else msgpack.packb(obj)
    _decode_or_decode_error(topic, payload)


def test_an_assignment_of_the_head_tied_schema_is_refused_by_name():
    """Schema 1 carried `units` (one list of heads); schema 2 carries the per-segment layout."""
    import msgpack

    old = json.loads(SAMPLES["node.assignment"].model_dump_json())
    old.pop("layout")
    old.update(schema_version=1, units=[4, 8])
    topic = TABLE.build("node.assignment", node_id="n100")
    with pytest.raises(DecodeError) as info:
        decode(topic, msgpack.packb(old))
    assert info.value.field == "schema_version" and "older Xronos" in str(info.value)
