"""The rollout engine's records, as plain picklable data: the sampling settings, a finished sample, and what an
engine has not finished (exported by one DecodeEngine, continued by another: `DecodeEngine.export_state` /
`DecodeEngine.resume`). The tail migration and multi-worker rollout move these between processes; splitting and
combining them is pure list work."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    """0 disables."""
    top_p: float = 1.0
    """1.0 disables."""
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    """Ids that end a sample as EOS does: a chat model's end-of-turn markers (data/chat.py end_of_turn_ids)."""


@dataclass(frozen=True)
class RolloutRequest:
    """What one RL iteration generates: k samples of each prompt with these sampling settings and this seed. A
    function of the iteration alone (trainers/rl.py), so an asynchronous rollout can ask for later ones ahead."""
    iteration: int
    prompts: list[list[int]]
    k: int
    params: SamplingParams
    seed: int
    draw: int = 0
    """rl.dynamic_sampling: 0 for the iteration's batch, d >= 1 for its d-th further draw of prompt groups."""
    rows: list | None = None
    """Each prompt's data row, (prompt as the data set gives it, other columns), for episodes: an environment's reset
    reads its own row even where several rows render to the same prompt (a game's hidden target). None: single-turn,
    whose reward functions look rows up by the prompt's token ids."""


@dataclass
class Sample:
    prompt_id: int
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: Tensor
    """(len(token_ids),) float32 log-probs of the sampled tokens."""
    finish_reason: str
    """eos | stop | length."""
    switch_at: int | None = None
    """Partial rollouts (asynchronous RL): the tokens from this index on were sampled by the next policy version, the
    sample having been re-prefilled under it (0: all of them); None: one version sampled every token."""
    ref_logprobs: Tensor | None = None
    """The reference policy's log-probs of token_ids, where the generation worker that decoded the sample took them
    (asynchronous RL, rollout.Scorer.reference_logprobs); None: the scorer's job."""
    sampled: list[bool] | None = None
    """Per token of token_ids, whether the policy sampled it (False: a tool's or an environment's tokens appended to
    the sequence, which the update leaves out); None: every token was sampled (a single-turn completion)."""
    episode: object = None
    """A multi-turn episode's record (rollout/episodes.py EpisodeRecord: its messages, tool calls, faults, the
    environment's reward); None: a single-turn completion."""


@dataclass
class RowState:
    """One live sample: its prompt, what it has drawn so far, and its length limit."""
    prompt_id: int
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    """Sampling log-probs of token_ids."""
    limit: int
    """The most new tokens this sample may have (max_new_tokens, or lengths(prompt_id, sample_index))."""
    stop_from: int = 0
    """Stop strings are looked for in token_ids from this index on: an episode's new turn (rollout/episodes.py),
    whose answer's text must not end it."""

    @property
    def position(self) -> int:
        """Its stream position: tokens drawn so far, so its next draw uses counter position len(token_ids)."""
        return len(self.token_ids)


@dataclass
class WaitingPrompt:
    """A prompt not yet prefilled: k samples still to start."""
    prompt_id: int
    prompt_ids: list[int]
    k: int
    limits: list[int]
    """Per sample index, as RowState.limit."""


@dataclass
class EngineState:
    """Everything one generate() call had not finished when exported. seed and params travel with the rows: the rows'
    random streams are keyed by the seed, and continuing them under another would silently change the samples."""
    seed: int
    params: SamplingParams
    rows: list[RowState] = field(default_factory=list)
    waiting: list[WaitingPrompt] = field(default_factory=list)
    finished: list[Sample] = field(default_factory=list)
    """Samples that had finished but were not yet handed out when the export came (same decode step)."""

    def split(self, parts: int) -> list[EngineState]:
        """Deal rows and waiting prompts round-robin into `parts` states (finished samples go to the first)."""
        out = [EngineState(self.seed, self.params, self.rows[i::parts], self.waiting[i::parts]) for i in range(parts)]
        out[0].finished = list(self.finished)
        return out

    @classmethod
    def combine(cls, states: list[EngineState]) -> EngineState:
        """One state holding all of them; they must share seed and sampling params."""
        first = states[0]
        for s in states[1:]:
            if (s.seed, s.params) != (first.seed, first.params):
                raise ValueError(f"cannot combine engine states with different seeds or sampling params: "
                                 f"{(first.seed, first.params)} vs {(s.seed, s.params)}")
        return cls(first.seed, first.params, [r for s in states for r in s.rows], [w for s in states for w in s.waiting],
                   [f for s in states for f in s.finished])
