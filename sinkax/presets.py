"""Cost presets of the *emulated* discrete accelerator (``sinkax.pjrt.use_emulated``).

A preset is a launch cost per executable launch and a latency + bandwidth per transfer in each
direction. The emulator computes at this CPU's speed: figures measured on it are *emulated*
figures, never GPU or Ascend ones. Sources of the numbers are in ``docs/plugin.md``.

>>> PRESETS["pcie4-x16"].transfer_s("h2d", 25_000_000)  # 25 MB over ~25 GB/s, plus latency
0.00101
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Literal


@dataclasses.dataclass(frozen=True)
class Preset:
    """The costs one emulated device charges; all zero: interactions are only counted."""

    name: str
    launch_s: float = 0.0
    h2d_latency_s: float = 0.0
    h2d_bytes_per_s: float = 0.0  # 0: no per-byte cost
    d2h_latency_s: float = 0.0
    d2h_bytes_per_s: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self)[1:6]:
            value = getattr(self, field.name)
            number = isinstance(value, numbers.Real) and not isinstance(value, bool)
            if not (number and 0 <= value < math.inf):
                unit = "bytes per second, 0 for no per-byte cost" if "bytes" in field.name else "s"
                raise ValueError(
                    f"Preset {self.name!r}: {field.name} must be a finite number >= 0 ({unit}), "
                    f"got {value!r}."
                )
            object.__setattr__(self, field.name, float(value))  # (a numpy scalar, an int)

    def transfer_s(self, direction: Literal["h2d", "d2h"], nbytes: int) -> float:
        """What one transfer of ``nbytes`` costs in ``direction``."""
        latency, rate = (
            (self.h2d_latency_s, self.h2d_bytes_per_s)
            if direction == "h2d"
            else (self.d2h_latency_s, self.d2h_bytes_per_s)
        )
        return latency + (nbytes / rate if rate else 0.0)


def symmetric(
    name: str, launch_s: float, latency_s: float, bytes_per_s: float, source: str
) -> Preset:
    """A :class:`Preset` whose link costs the same both ways."""
    return Preset(name, launch_s, latency_s, bytes_per_s, latency_s, bytes_per_s, source)


_PCIE4 = "PCIe 4.0 x16: 31.5 GB/s raw per direction, ~25 GB/s measured with pinned host memory"

PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset("counting", source="no costs: the plugin only counts (overhead measurement)"),
        symmetric("pcie4-x16", 10e-6, 10e-6, 25e9, f"a discrete GPU on {_PCIE4}; 10 us a launch"),
        symmetric(
            "pcie5-x16", 5e-6, 8e-6, 50e9, "a discrete GPU on PCIe 5.0 x16: 63 GB/s raw, ~50 used"
        ),
        symmetric(
            "ascend910-pcie4",
            20e-6,
            15e-6,
            25e9,
            f"an Ascend 910-class card (Atlas 300T) on {_PCIE4}; launch and latency assumed",
        ),
    )
}


def preset(name_or_preset: str | Preset) -> Preset:
    """The preset named, or the :class:`Preset` given; a clear error for an unknown name."""
    if isinstance(name_or_preset, Preset):
        return name_or_preset
    if not isinstance(name_or_preset, str) or name_or_preset not in PRESETS:
        raise ValueError(
            f"Unknown emulated-device preset {name_or_preset!r}; known: {sorted(PRESETS)}, "
            "or pass a sinkax.presets.Preset(...) of your own."
        )
    return PRESETS[name_or_preset]
