"""What one generation measured: its token counts and times, and the MTP rounds' statistics.
Plain dataclasses, below both the engines (which fill them) and the gate (which reads them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MTPStats:
    """Round statistics of one MTP generation (its rounds may differ in size, up to
    ``block_size``, where the block adapts to the acceptance)."""

    block_size: int  # the largest block a round may have
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    examined: int = 0  # drafts the verify looked at: the accepted, and a round's first rejected
    emitted: int = 0  # tokens emitted by rounds (accepted drafts + one target token each)
    accepted_at: list[int] = field(default_factory=list)  # per draft position
    drafted_at: list[int] = field(default_factory=list)  # per draft position
    accept_histogram: list[int] = field(default_factory=list)  # rounds by accepted count 0..k
    rounds_by_block: dict[int, int] = field(default_factory=dict)
    draft_s: float = 0.0
    verify_s: float = 0.0  # from the drafts' submission to the accepted count, of which
    verify_build_s: float = 0.0  # building the verify's graph (the rest: waiting for it)
    rollback_s: float = 0.0

    def __post_init__(self) -> None:
        k = self.block_size - 1
        self.accepted_at = self.accepted_at or [0] * k
        self.drafted_at = self.drafted_at or [0] * k
        self.accept_histogram = self.accept_histogram or [0] * (k + 1)

    def record(self, n_drafted: int, n_accepted: int) -> None:
        self.rounds += 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        self.examined += n_accepted + (n_accepted < n_drafted)
        self.emitted += n_accepted + 1
        self.accept_histogram[n_accepted] += 1
        block = n_drafted + 1
        self.rounds_by_block[block] = self.rounds_by_block.get(block, 0) + 1
        for i in range(n_drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < n_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Of the rounds that drafted position i, the share that accepted it."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at,
                                                    strict=True)]  # fmt: skip

    @property
    def tokens_per_verify(self) -> float:
        return self.emitted / self.rounds if self.rounds else 0.0


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prompt_s: float = 0.0
    generation_tokens: int = 0
    generation_s: float = 0.0
    peak_memory_gb: float = 0.0
    mtp: MTPStats | None = None

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s else 0.0

    @property
    def generation_tps(self) -> float:
        return self.generation_tokens / self.generation_s if self.generation_s else 0.0
