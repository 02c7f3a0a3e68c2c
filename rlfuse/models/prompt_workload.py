"""What the RL stage will feed the rollout engine, measured before a run, for the placement planner: the run's
prompts loaded, rendered and encoded as trainers/rl.py build_prompts does (the policy's tokenizer with
data.chat_template, cut to the prompt budget the model's context leaves), drawn into iterations as the run draws
them (data/curriculum.py uniform_indices, from run.seed).

The planner (plan/planner.py) is pure and loads neither data nor a tokenizer, so `rlfuse plan` and
placement.strategy=auto measure here and pass the numbers down (problem_from_config's prompt_tokens and
prompt_lengths). Without them it assumes a table value per data kind: 32 tokens for hh-rlhf's chat prompts, which run
to ~100-160 with SmolLM2's template, and one prompt length per iteration.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from rlfuse.config import Config
from rlfuse.data.chat import set_chat_template
from rlfuse.data.curriculum import uniform_indices
from rlfuse.data.prompts import encode_prompts, model_context, prompt_budget
from rlfuse.data.stages import rl_prompts
from rlfuse.errors import UserError, first_line
from rlfuse.models.load import load_model_config, load_tokenizer, resolve_base_model
from rlfuse.plan.planner import table_prompt_tokens
from rlfuse.plan.resolve import resolve

MAX_PROMPTS = 256
"""Prompts encoded at most: the batches of the run's first iterations (a chat template renders a prompt in about a
millisecond, so this stays well under a second)."""


@dataclass(frozen=True)
class PromptWorkload:
    """The prompts of a run's first iterations as the rollout engine gets them."""
    tokens: float
    """Mean prompt tokens (BOS and the chat template's turn headers included, cut to the budget)."""
    distinct: float
    """Mean number of distinct prompt lengths among an iteration's rl.prompts_per_iter prompts: the engine prefills
    each length in a call of its own."""
    prompts: int
    """Prompts measured (the batches of `iterations` iterations)."""
    iterations: int
    per_iteration: int
    cut: int
    """Of them, prompts cut to the budget."""
    budget: int
    data: str
    """Which data: data.kind and its file."""
    longest: int = 0
    """The longest of them (cut to the budget): a micro-batch holding it sets the memory peak."""

    def planner_inputs(self) -> dict:
        """problem_from_config's keyword arguments."""
        return {"prompt_tokens": self.tokens, "prompt_lengths": self.distinct, "prompt_longest": self.longest}

    def describe(self) -> str:
        cut = f", {self.cut} cut to the {self.budget}-token budget" if self.cut else ""
        return (f"{self.tokens:.1f} tokens on average (longest {self.longest}) over {self.prompts} prompts of "
                f"{self.data} (the batches of {self.iterations} iteration(s)){cut}, {self.distinct:.1f} distinct lengths per iteration of "
                f"{self.per_iteration}, measured with the model's tokenizer")


def iteration_batches(num_prompts: int, per_iteration: int, iterations: int, seed: int) -> list[list[int]]:
    """The prompt indices of the run's first iterations, as many as make MAX_PROMPTS prompts (at least one
    iteration): the same draws as the run's (rl.curriculum=none; a curriculum draws by difficulty, known only
    once the policy has scored the prompts)."""
    measured = max(1, min(iterations, MAX_PROMPTS // max(1, per_iteration)))
    return [uniform_indices(num_prompts, it, per_iteration, seed) for it in range(measured)]


def mean_tokens_and_distinct(batches: list[list[int]]) -> tuple[float, float]:
    """(mean length over every prompt of the batches, mean number of distinct lengths in a batch) of batches of
    prompt lengths."""
    return (statistics.mean(n for b in batches for n in b), statistics.mean(len(set(b)) for b in batches))


def policy_source(cfg: Config, log=print) -> tuple[str, object]:
    """(folder or hub name whose tokenizer and context the RL stage will use, the embedded task or None):
    rl.sft_path, else the run folder's sft/model once SFT wrote it, else the base model SFT starts from (SFT saves
    that tokenizer with its model). The task only for synthetic data, whose prompts come from it (as train_rl)."""
    written = Path(cfg.run.dir) / "sft" / "model" if cfg.run.dir else None
    sft = cfg.rl.sft_path or (str(written) if written is not None and written.is_dir() else None)
    synthetic = cfg.data.kind == "synthetic"
    if sft and not synthetic:
        return sft, None
    base, task = resolve_base_model(cfg, log)
    return sft or base, task if synthetic else None


def measure_prompts(cfg: Config, log=print) -> PromptWorkload:
    """The RL stage's prompts of `cfg`, encoded as the run will encode them. Raises what loading them raises."""
    source, task = policy_source(cfg, log)
    tok = load_tokenizer(source)
    set_chat_template(tok, cfg.data.chat_template)
    budget = prompt_budget(cfg.rl, model_context(load_model_config(source)))
    train, _ = rl_prompts(cfg, task, log)
    batches = iteration_batches(len(train), cfg.rl.prompts_per_iter, cfg.rl.iterations, cfg.run.seed)
    used = sorted({i for b in batches for i in b})
    ids, cut = encode_prompts(tok, [train[i] for i in used], budget)
    length = dict(zip(used, map(len, ids)))
    tokens, distinct = mean_tokens_and_distinct([[length[i] for i in b] for b in batches])
    data = cfg.data.kind + (f" ({Path(cfg.data.path).name})" if cfg.data.path else "")
    return PromptWorkload(tokens, distinct, sum(map(len, batches)), len(batches), cfg.rl.prompts_per_iter, cut,
                          budget, data, max(length.values()))


def planner_prompt_inputs(cfg: Config, log=print) -> tuple[dict, str]:
    """(problem_from_config's prompt_tokens and prompt_lengths as measured, the line saying where they came from).
    Prompts that cannot be measured (a hub model offline, a missing file) give ({}, a line saying the planner takes
    its table's numbers), never a traceback: the plan is a prediction, and goes on without them."""
    try:
        measured = measure_prompts(cfg, log)
    except Exception as e:  # whatever failed to load costs the prediction its measured prompts only; the line says what
        why = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {first_line(e)}"  # ours: one line already
        return {}, (f"prompts: not measured ({why}); the planner assumes "
                    f"{table_prompt_tokens(cfg.data.kind):g} tokens per prompt (its table for data.kind="
                    f"{cfg.data.kind}) and one prompt length per iteration")
    return measured.planner_inputs(), f"prompts: {measured.describe()}"


def resolve_measured(cfg: Config, log=print) -> Config:
    """plan.resolve(cfg), an auto placement planned on the run's own prompts (one log line says where their
    numbers came from); a config with its placement given is resolved as it is, with nothing loaded."""
    if cfg.placement.strategy != "auto":
        return resolve(cfg, log)
    say = log or (lambda _: None)  # resolve's log may be None; the loaders' is not
    inputs, line = planner_prompt_inputs(cfg, say)
    say(f"[plan] {line}")
    return resolve(cfg, log, **inputs)
