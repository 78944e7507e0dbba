"""`Timeline`: when each instruction ran on each rank — predicted or measured alike.

The simulator and the runtime tracer both produce this one type, so the same metrics and
renderers serve both and a prediction can be compared with a measurement.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

from pipedsl.errors import ValidationError
from pipedsl.ir import COMPUTE, Instr, Op
from pipedsl.limits import load_json


class Event(NamedTuple):
    """One instruction's execution interval on its rank (seconds or cost units)."""

    instr: Instr
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Timeline:
    """Per-rank events in execution order, with the metrics schedules are judged by."""

    name: str
    params: dict[str, int]
    ranks: tuple[tuple[Event, ...], ...]
    kind: str = "simulated"  # or "measured"
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @cached_property
    def start(self) -> float:
        return min((ev[0].start for ev in self.ranks if ev), default=0.0)

    @cached_property
    def makespan(self) -> float:
        """Time from the first instruction's start to the last one's end, over all ranks."""
        return max((ev[-1].end for ev in self.ranks if ev), default=self.start) - self.start

    @cached_property
    def busy(self) -> list[float]:
        """Per rank, time spent in compute ops (F, B, I, W)."""
        return [sum(e.end - e.start for e in events if e.instr.op in COMPUTE) for events in self.ranks]

    @cached_property
    def rank_spans(self) -> list[float]:
        """Per rank, the time from its first compute op's start to its last one's end: where nothing collective
        separates one step from the next, the steps overlap and the longest span is the step's time (the cost in
        the zero-bubble paper's bubble rate, Qi et al., ICLR'24, section 5)."""
        spans = []
        for events in self.ranks:
            compute = [e for e in events if e.instr.op in COMPUTE]
            spans.append(compute[-1].end - compute[0].start if compute else 0.0)
        return spans

    @cached_property
    def bubble_ratio(self) -> float:
        """1 − Σ busy / (P · makespan): the idle fraction of the ranks' time."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (self.num_ranks * self.makespan)

    @property
    def wmem(self) -> float:
        """The fraction of an activation a pending W holds, from the costs the timeline was simulated under (1:
        whole activations until W; a measured timeline's)."""
        return float(self.meta.get("cost", {}).get("wmem", 1.0))

    @cached_property
    def peak_activations(self) -> list[float]:
        """Per rank, the most stage activations alive at once: 1 from F until its B, or until its I and then
        `wmem` (`Cost.wmem`: above 1 too) until its W when split (whole numbers at wmem = 1); an overlapped pair
        F&B counts its forward's activation before its backward frees one."""
        after_i = self.wmem
        peaks: list[float] = []
        for events in self.ranks:
            live = peak = 0.0
            for e in events:
                for part in e.instr.parts:
                    op = part.op
                    if op is Op.F:
                        live += 1
                        peak = max(peak, live)
                    elif op is Op.B:
                        live -= 1
                    elif op is Op.I:
                        live -= 1 - after_i
                        peak = max(peak, live)  # a pending W may hold more than its activation did
                    elif op is Op.W:
                        live -= after_i
            peak = round(peak, 9)  # fractions summed in floating point
            peaks.append(int(peak) if peak == int(peak) else peak)
        return peaks

    def halves(self) -> Timeline:
        """This timeline with each overlapped pair F&B drawn as its forward then its backward,
        each half the pair's time (what renderers draw: a pair has no single stage or colour)."""
        if not any(e.instr.sub for events in self.ranks for e in events):
            return self
        ranks = []
        for events in self.ranks:
            out: list[Event] = []
            for e in events:
                if e.instr.sub is None:
                    out.append(e)
                    continue
                mid = (e.start + e.end) / 2
                out += [Event(e.instr.sub[0], e.start, mid), Event(e.instr.sub[1], mid, e.end)]
            ranks.append(tuple(out))
        return Timeline(self.name, dict(self.params), tuple(ranks), self.kind, dict(self.meta))

    def summary(self) -> dict[str, Any]:
        return {
            "schedule": self.name,
            "params": dict(self.params),
            "kind": self.kind,
            "makespan": self.makespan,
            "bubble_ratio": self.bubble_ratio,
            "busy": self.busy,
            "peak_activations": self.peak_activations,
        }

    # ------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.summary(),
            "meta": self.meta,
            "ranks": [[{**e.instr.to_dict(with_replica=True), "start": e.start, "end": e.end} for e in events]
                      for events in self.ranks],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: Any) -> Timeline:
        try:
            ranks = tuple(
                tuple(Event(Instr.from_dict({k: v for k, v in e.items() if k not in ("start", "end")}),
                            float(e["start"]), float(e["end"])) for e in events)
                for events in d["ranks"])
            return cls(str(d.get("schedule", "timeline")), dict(d.get("params", {})), ranks,
                       str(d.get("kind", "measured")), dict(d.get("meta", {})))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValidationError(f"not a pipedsl timeline: {err}") from None

    @classmethod
    def from_json(cls, text: str) -> Timeline:
        return cls.from_dict(load_json(text, error=ValidationError))
