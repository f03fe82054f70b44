"""One rank of `xronos run --rebalance`: `python -m xronos.cli.liverank CONFIG.json`.

The rank of `xronos.node.rank.localrank` with one more part, composed here because it joins two planes:
the control source `xronos.node.rank.relayout.LiveRebalance`, whose policy on rank 0 is the gateway's
`Rebalancer` over the unit cost model (a local run has no profile: speeds are learnt from the
measured per-kind compute alone) and no memory caps (a local run states none). With shares (a
data-parallel run) the control source is `LiveResplit` and the policy the gateway's `Resplitter`
over equal unit groups (no profile: each group's time per row is learnt from its measured compute;
a group with no rows is taken as fast as the measured ones until it is measured).
"""

from __future__ import annotations

from xronos.gateway.plan.dpresplit import GroupCost, Resplitter
from xronos.gateway.plan.rebalance import NO_CAP, Rebalancer
from xronos.gateway.plan.refit import unit_costs
from xronos.node.rank.dpengine import DPEngine
from xronos.node.rank.relayout import LiveRebalance, LiveResplit, unit_bytes
from xronos.node.runconfig import RunConfig
from xronos.node.rank.lifecycle import LocalFiles, MetricsFile, read_settings, run
from xronos.node.rank.spawn import main_process
from xronos.node.rank.tpengine import TPEngine


def make_policy(engine: TPEngine, world_size: int, total_steps: int | None = None) -> Rebalancer:
    """The owner's policy for the engine's model, starting from its current layout; `total_steps`:
    the run's length (its payback test weighs a move against the iterations left)."""
    model = engine.model
    return Rebalancer(engine.family.sizes(model.config), engine.layout.layout(),
                      unit_costs([f"rank{r}" for r in range(world_size)]), [NO_CAP] * world_size,
                      unit_bytes(engine.family, model.config, model.task,
                                 moments=0 if engine.lora is not None else 2), total_steps=total_steps)


def make_split_policy(engine: DPEngine, groups: int) -> Resplitter:
    """The owner's re-split policy, from the engine's current shares (the profile's rows: the batch)."""
    return Resplitter(engine.shares, sum(engine.shares), [GroupCost(1.0, 0.0)] * groups)


def main(argv: list[str]) -> int:
    cfg = read_settings(argv, RunConfig, "xronos.cli.liverank")
    if cfg.shares:
        engine: TPEngine = DPEngine()
        control = LiveResplit(engine, make_split_policy)
    else:
        engine = TPEngine()
        steps = cfg.recipe.max_steps  # `xronos run` insists on --max-steps
        control = LiveRebalance(engine, lambda e, n: make_policy(e, n, steps))
    run(cfg, engine, weights=LocalFiles(cfg.recipe.model_dir), control=control, sink=MetricsFile(progress=cfg.progress))
    return 0


if __name__ == "__main__":
    main_process(main)
