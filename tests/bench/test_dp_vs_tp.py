"""The DP-vs-TP bench's model and table (its timed run is the bench's, not a test's)."""

from __future__ import annotations

from xronos.bench.dp_vs_tp import _config, table
from xronos.node.models.registry import family_for


def test_the_bench_trains_a_qwen25_05b_shape_with_the_blocks_asked():
    config = _config(3)
    family = family_for(config)
    assert family.name == "qwen2" and config["num_hidden_layers"] == 3
    sizes = family.sizes(config)
    assert (sizes.attn, sizes.mlp, sizes.vocab) == (2, 4864, 151936)  # 2 KV-head groups, the published MLP and vocabulary
    assert config["hidden_size"] == 896 and config["tie_word_embeddings"] is True


def test_the_table_names_the_clock_link_and_load_and_gives_the_ratio():
    run = {"iteration_s": [2.0, 3.0, 4.0], "median_s": 3.0, "trained_bytes": 2 * 2**20, "buckets": [(2 * 2**20, 0.1)]}
    doc = {"lora_r": 8, "model": "qwen2.5-0.5b shape", "blocks": 6, "ranks": 2, "batch": 8, "seq": 64,
           "link": "1000.0 Mbit/s", "clock": "wall", "load_after": (4.2, 4.0, 3.9),
           "results": {"tp": dict(run, median_s=4.5), "dp": run}, "ratio_tp_over_dp": 1.5}
    text = table(doc)
    assert "clock: wall" in text and "link 1000.0 Mbit/s" in text and "load after 4.20" in text
    assert "| tp | 4.500 |" in text and "| dp | 3.000 | 2.000 3.000 4.000 |" in text
    assert "tp / dp = 1.50; DP all-reduces 2.00 MiB of adapter gradients in 1 bucket(s)" in text
