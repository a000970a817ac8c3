"""MTPStats: the counters of one generation (cycles, drafts accepted at each
position, a grammar's forced drafts), as the API, the CLIs and the server's
`usage.mtp` report them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class MTPStats:
    """Counters of one generation. Acceptance at position i is the fraction of
    cycles that drafted a token at position i and had it accepted."""

    cycles: int = 0
    emitted: int = 0
    drafted_at: List[int] = field(default_factory=list)
    accepted_at: List[int] = field(default_factory=list)
    forced: int = 0  # drafts a grammar forced (they take the head's place)
    jumps: int = 0  # cycles that verified a forced run alone (no head draft)
    # drafts that were the row's context run (context_draft.py), and those kept
    context_drafted: int = 0
    context_accepted: int = 0

    def record(self, depth: int, accepted: int):
        self.cycles += 1
        self.emitted += accepted + 1
        while len(self.drafted_at) < depth:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(depth):
            self.drafted_at[i] += 1
            self.accepted_at[i] += int(i < accepted)

    def add(self, other: "MTPStats"):
        """Add another generation's counters to these (benches pool runs)."""
        self.cycles += other.cycles
        self.emitted += other.emitted
        self.forced += other.forced
        self.jumps += other.jumps
        self.context_drafted += other.context_drafted
        self.context_accepted += other.context_accepted
        for i, (d, a) in enumerate(zip(other.drafted_at, other.accepted_at)):
            while len(self.drafted_at) <= i:
                self.drafted_at.append(0)
                self.accepted_at.append(0)
            self.drafted_at[i] += d
            self.accepted_at[i] += a

    @property
    def drafted(self) -> int:
        return sum(self.drafted_at)

    @property
    def accepted(self) -> int:
        return sum(self.accepted_at)

    @property
    def acceptance(self) -> List[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def tokens_per_cycle(self) -> float:
        return self.emitted / self.cycles if self.cycles else 0.0

    def usage(self) -> dict:
        """As the server reports them (`usage.mtp`; a grammar's forced drafts
        and the runs verified alone when it forced any)."""
        out = {"drafted": self.drafted, "accepted": self.accepted,
               "acceptance": [round(a, 4) for a in self.acceptance],
               "tokens_per_cycle": round(self.tokens_per_cycle, 4), "cycles": self.cycles}
        if self.forced:
            out.update(forced=self.forced, jumps=self.jumps)
        if self.context_drafted:
            out.update(context_drafted=self.context_drafted,
                       context_accepted=self.context_accepted)
        return out
