"""The paper's device sets (Table IV, §V-A3) as relative CPU shares and memory caps on one machine.

Speed ratios (per-thread fp32 training speed, Raspberry Pi 5 = 1.0):
- Raspberry Pi 5, Cortex-A76 @ 2.4 GHz: 1.0, the reference.
- Orange Pi 5+, RK3588 (A76 @ 2.4 GHz + A55): 1.0 — the same A76 core at the same clock as the Pi 5,
  and one thread per rank runs on an A76; we do not invent a difference Table IV does not show.
- ASUS MiniPC, Intel N100 @ 3.4 GHz: 1.5. From the paper's own Fig. 4: under uniform TP with two
  Pi 5s the MiniPC idles 34% (GPT-2-Medium) and 23% (RoBERTa-Base) of each iteration, i.e. it is
  1/(1-0.34) = 1.52x and 1/(1-0.23) = 1.30x faster; we take the GPT-2 figure, the larger model.
  It matches the clock ratio 3.4/2.4 = 1.42 plus the N100's wider AVX2 path.
- LattePanda Mu, Intel N100 @ 3.4 GHz: 1.35. Same chip as the MiniPC, but the Mu is a compute
  module in a small enclosure running at a lower sustained power limit, so it is set ~10% below
  the MiniPC — an assumption (the paper gives no separate measurement), stated as such.

One speed unit is `PI5_SHARE` = 0.30 of a core in every scenario, so a "Pi 5" rank is equally fast
everywhere and iteration times are comparable across scenarios; Set-C, the largest, then needs
5.85 x 0.30 = 1.755 cores, within the 1.8 that leaves this 2-core machine some headroom for Gloo's
threads and the harness. Every rank runs one compute thread.

Memory: a cell keeps only part of the model (`--blocks`), so the devices' memory is scaled by the
same fraction, `mem_scale` = parameters kept / parameters of the full model
(`workloads.kept_fraction`; the default, "kept"). What is scaled is the part of the RAM a model can
use: each rank's process needs `RUNTIME_RESERVE` (Python, torch, Gloo buffers) whatever the model,
so the cap is `RUNTIME_RESERVE + mem_scale x (RAM - RUNTIME_RESERVE)`, and the planners, which
predict the model's memory only, plan against `mem_scale x (RAM - RUNTIME_RESERVE)`. A cell then
binds memory exactly when the full model would on the real devices (to the accuracy of the model's
memory being proportional to its parameters, which weights, gradients and AdamW state are). The cap
is enforced with the cgroup memory controller; a plan that needs more is shown as infeasible and
not run.
"""

from __future__ import annotations

from dataclasses import dataclass

PI5_SHARE = 0.30  # cores per unit of speed
KEPT = "kept"  # mem_scale: the fraction of the model's parameters a cell keeps (workloads.kept_fraction)
DEFAULT_MEM_SCALE = KEPT
GIB = 1 << 30
# Bytes a rank process needs before any model tensor: Python, torch, transformers, Gloo buffers.
# Not scaled with the model; subtracted from each cap before planning (the cost model predicts the
# model's memory only).
RUNTIME_RESERVE = 450 << 20


@dataclass(frozen=True)
class Device:
    name: str
    cpu: str
    speed: float  # relative to a Raspberry Pi 5
    memory_gb: int


PI5 = Device("Raspberry Pi 5", "ARM Cortex-A76 2.4 GHz", 1.0, 8)
OPI5P = Device("Orange Pi 5+", "ARM A76/A55 2.4/1.8 GHz", 1.0, 16)
LATTE = Device("LattePanda Mu", "Intel N100 3.4 GHz (module)", 1.35, 8)
MINIPC = Device("ASUS MiniPC", "Intel N100 3.4 GHz", 1.5, 16)


@dataclass(frozen=True)
class Scenario:
    name: str
    devices: tuple[Device, ...]
    note: str

    @property
    def n(self) -> int:
        return len(self.devices)

    def shares(self, unit: float = PI5_SHARE) -> list[float]:
        """CPU share (cores) per rank, rank order = device order."""
        return [round(d.speed * unit, 4) for d in self.devices]

    def memory_caps(self, scale: float | None) -> list[int | None]:
        """Memory cap (bytes) per rank: RUNTIME_RESERVE + scale x (RAM - RUNTIME_RESERVE); None for
        all when scale is None (no caps). `scale` is a number here (resolve "kept" first)."""
        if scale is None:
            return [None] * self.n
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= 1:
            raise ValueError(f"mem_scale must be a number in (0, 1], got {scale!r}")
        return [int(RUNTIME_RESERVE + scale * (d.memory_gb * GIB - RUNTIME_RESERVE)) for d in self.devices]

    def ideal_ratio_to_uniform(self) -> float:
        """N·min(s)/Σs: the best iteration-time ratio perfect balancing can reach vs uniform TP."""
        speeds = [d.speed for d in self.devices]
        return self.n * min(speeds) / sum(speeds)

    def describe(self) -> str:
        return ", ".join(f"{d.name} ({d.speed:g}x, {s:g} core)"
                         for d, s in zip(self.devices, self.shares()))


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("set-a", (MINIPC, PI5, PI5), "Set-A: one ASUS MiniPC, two Raspberry Pi 5"),
        Scenario("set-b", (LATTE, OPI5P, PI5, PI5),
                 "Set-B: LattePanda Mu, Orange Pi 5+, two Raspberry Pi 5"),
        Scenario("set-c", (MINIPC, LATTE, PI5, OPI5P, OPI5P),
                 "Set-C: ASUS MiniPC, LattePanda Mu, Raspberry Pi 5, two Orange Pi 5+"),
        # Four equal boxes: 16 heads and most MLP widths divide 4, so transformers' own TP can run.
        Scenario("homo", (PI5, PI5, PI5, PI5), "Homogeneous control: four Raspberry Pi 5"),
    )
}


def get_scenario(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}") from None
