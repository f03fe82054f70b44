"""Live re-sharding in real Gloo worlds of 2, 3 and 4 processes: after the move, every rank's
weights and AdamW moments are exactly what building at the new layout from the unsharded state
gives, and the next step is bit-identical to that freshly built model's (reshard_worker.py). Some
cases move in one exchange, the others one tensor per exchange (the old parts freed as they go)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tp_world import run_world

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import runkit  # noqa: E402

from xronos.protocol.layout import Layout  # noqa: E402

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("reshard_worker.py")


def L(attn, mlp, vocab) -> dict:
    return Layout(attn=attn, mlp=mlp, vocab=vocab).model_dump(mode="json")


# Models from runkit.make_model: 12 heads (6 KV heads for LLaMA GQA and Qwen), 100 MLP columns,
# the vocabulary padded to 64 rows. Each pair moves every kind, to and from ranks holding 0.
WORLDS = {
    2: [("gpt2", "causal-lm", {}, L((12, 0), (100, 0), (64, 0)), L((0, 12), (30, 70), (0, 64))),
        ("roberta", "classify", {}, L((5, 7), (50, 50), (32, 32)), L((11, 1), (1, 99), (64, 0)))],
    3: [("bert", "classify", {}, L((4, 4, 4), (34, 33, 33), (22, 21, 21)), L((0, 9, 3), (0, 64, 36), (0, 32, 32))),
        ("llama", "causal-lm", {"gqa": True}, L((0, 2, 4), (64, 32, 4), (64, 0, 0)),
         L((3, 3, 0), (4, 32, 64), (0, 0, 64)))],
    4: [("gpt2", "classify", {}, L((0, 6, 2, 4), (64, 0, 32, 4), (32, 0, 16, 16)),
         L((4, 2, 6, 0), (0, 4, 64, 32), (0, 64, 0, 0))),
        ("qwen3", "causal-lm", {}, L((1, 2, 3, 0), (25, 25, 25, 25), (0, 100, 129, 0)),
         L((0, 0, 0, 6), (100, 0, 0, 0), (229, 0, 0, 0))),
        # LoRA: the frozen base moves without moments, the adapters' sharded halves with theirs
        ("llama", "classify", {"gqa": True, "lora_r": 4}, L((0, 2, 1, 3), (40, 0, 30, 30), (10, 10, 10, 8)),
         L((3, 0, 3, 0), (0, 70, 0, 30), (0, 0, 38, 0)))],
}


@pytest.mark.parametrize("world", list(WORLDS))
def test_live_reshard_equals_building_at_the_new_layout(world, tmp_path):
    cases = []
    for i, (family, task, kw, old, new) in enumerate(WORLDS[world]):
        kw = dict(kw)
        lora_r = kw.pop("lora_r", None)
        vocab = {} if family == "qwen3" or lora_r else {"vocab_size": 64}
        ckpt = runkit.make_model(tmp_path / f"m{i}", family, task, **kw, **vocab)
        cases.append(dict(name=f"{family}-{task}{'-lora' if lora_r else ''}", ckpt=str(ckpt), task=task, old=old,
                          new=new, lora_r=lora_r, batched=i % 2 == 1 or bool(lora_r)))
    run_world(WORKER, world, {"cases": cases}, tmp_path / "world", timeout=400)
    for c in cases:
        infos = [json.loads((tmp_path / "world" / f"ok-{c['name']}-{r}.json").read_text()) for r in range(world)]
        assert infos[0]["moved"] > 0
