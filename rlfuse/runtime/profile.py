"""`rlfuse plan --profile`: measure this machine's rates (a MachineProfile) in well under a minute, and find the
profile file later.

The rates are fitted from a few timings of a GPT-2 of the policy's own shape with random weights (the default shape
when the policy is over 200 M parameters on CPU), run the way the RL loop runs it: the rollout engine's decode steps
at 1, 8 and 32 rows (fixed cost per step and cost per row), its prefill of prompts of many lengths against one (cost
per prefill call), transformers' forward at three batch sizes (fixed cost per call and FLOP/s), a backward (its
ratio to the forward; its page faults timed apart), the same through unmerged LoRA adapters (a frozen base), an
AdamW step, a tensor copy (bandwidth), a fresh mapping's page faults, a state-dict serialisation (what a weight sync
through Ray's object store costs per byte), the driver's advantages, what a LoRA training micro-batch holds
resident; then the overheads of a run on two Ray workers (profile_ray.py). Where the file goes and how the planner
reads it back: rlfuse/plan/profiles.py.
"""

from __future__ import annotations

import io
import mmap
import os
import statistics
import time
from pathlib import Path

import psutil
import torch
from transformers import GPT2Config, GPT2ForSequenceClassification

from rlfuse.config import ModelConfig, RLConfig
from rlfuse.learn.advantages import compute_advantages
from rlfuse.learn.batches import minibatches
from rlfuse.learn.optim import build_adamw
from rlfuse.metrics.flops import fastest_seconds, measure_matmul_rate
from rlfuse.metrics.memory import minor_faults, peak_rise
from rlfuse.models.forward import collate, response_logprobs
from rlfuse.models.heads import ValueModel
from rlfuse.models.lean import enable_lean_activations
from rlfuse.models.load import apply_lora, model_of_shape
from rlfuse.models.quantize import fix_cpu_heap
from rlfuse.models.rewards import reward_model_fn
from rlfuse.plan.cost import PAGE_BYTES, GiB, MachineProfile, ModelShape, gpt2_shape
from rlfuse.plan.memory import train_activation_bytes
from rlfuse.plan.profiles import BUILTIN_OVERHEADS, BUSY_CORES, GPU_OVERHEADS, RAY_WORKER_BYTES, SYNC_LATENCY_S
from rlfuse.rollout.engine import DecodeEngine, Sample, SamplingParams
from rlfuse.rollout.score import Scorer
from rlfuse.runtime.probe import fake_experience, spread

PASSES = 3
"""Times the profile takes every timing in its own process; the rates are fitted to each timing's fastest."""
CONTENTION_WARMUP, CONTENTION_CALLS = 6, 15
"""The contention probe's untimed calls, then its timed ones (one_pass)."""
FAULT_PROBE_BYTES = 16 << 20
"""The fresh anonymous mapping the profile writes to time a page fault (fault_s): 4096 pages."""
PROFILE_LORA_R = 16
"""LoRA rank of the profile's adapted copy: its per-layer cost is the adapters' ops, which a rank of 8-64 barely
changes at these widths (the shipped real-model configs train r = 16)."""


def cpu_sample() -> tuple[float, float, float]:
    """(seconds every core of the machine spent busy, seconds this process spent on a core, wall seconds), now: two
    samples give the cores other work kept busy between them (other_cores)."""
    s, own = psutil.cpu_times(), psutil.Process().cpu_times()
    # guest time is counted in user time already; steal is time the hypervisor gave to other guests
    not_busy = s.idle + sum(getattr(s, k, 0.0) for k in ("iowait", "guest", "guest_nice"))
    return sum(s) - not_busy, own.user + own.system, time.perf_counter()


def other_cores(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """Cores that work other than this process kept busy on average between two cpu_sample()s."""
    busy, own, wall = (b - a for a, b in zip(before, after))
    return max(0.0, (busy - own) / max(wall, 1e-9))


def _worker_runtime_bytes() -> float:
    """Resident memory of a worker before any model: this process, which has imported what a worker computes with
    (torch, transformers' model classes, rlfuse's models, rollout and learn: this module's imports), plus what Ray's
    own worker runtime adds (RAY_WORKER_BYTES, measured against a process with the same imports)."""
    return psutil.Process().memory_info().rss + RAY_WORKER_BYTES


def profile_contention(per_pass: list[float], others: float) -> float:
    """The contention the rates are divided by, from each pass's: their median where other work kept more than
    BUSY_CORES busy over the profile (a shared machine: what a run will share too), else the least of them. On an
    idle machine a pass's figure is the machine's own jitter: an idle VM's passes measured 1.15, 1.21 and 1.04
    (2026-11-28, other work 0.00 cores), and the median of another profile's (1.23, other work 0.02) put the math
    config's full fine-tuning training 38% over its runs (11-15% without it)."""
    return statistics.median(per_pass) if others > BUSY_CORES else min(per_pass)


def _fit(times: dict) -> tuple[float, float]:
    """Least-squares line through {rows: seconds}: (seconds at 0 rows, seconds per row), both kept positive."""
    xs, ys = list(times), list(times.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, 1e-9)
    return max(my - slope * mx, 1e-7), slope


def _fault_seconds(repeats: int = 27) -> float:
    """Seconds per page fault: a fresh 16 MiB anonymous mapping written once against the same bytes written into it
    again, per fault counted (ru_minflt), the fastest of `repeats`. The mapping is made here (mmap), not by the
    allocator: with glibc's threshold fixed a 16 MiB tensor is a mapping of its own too, unless a free chunk of the
    heap fits it and faults fewer pages, and such calls said nothing of a fault's cost (a profile's fastest-of-9 landed
    on one and put a fault at 0.23 us against 2.2-2.4; in another no call faulted its pages and fault_s came out 0,
    pricing no faults). 0 where faults are not counted per 4 KiB page (no getrusage, transparent huge pages)."""
    pages = FAULT_PROBE_BYTES // PAGE_BYTES
    best = float("inf")
    for _ in range(repeats):
        with mmap.mmap(-1, FAULT_PROBE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as mapping:
            fresh = torch.frombuffer(mapping, dtype=torch.float32)
            t = time.perf_counter()
            faults = minor_faults(lambda: fresh.fill_(1.0))
            seconds = time.perf_counter() - t
            t = time.perf_counter()
            fresh.fill_(2.0)
            written = time.perf_counter() - t
            del fresh  # the buffer's export must end before the mapping closes
        if faults >= 0.9 * pages:
            best = min(best, (seconds - written) / faults)
    return max(0.0, best) if best < float("inf") else 0.0


def measure_profile(shape: ModelShape | None = None, threads: int = 1, device: str | None = None,
                    log=print, ray: bool = True) -> MachineProfile:
    """Time the pieces and fit the rates (see the module docstring). `threads`: torch threads, a worker's
    cpus_per_worker. device: cpu | cuda (default cuda when present). ray: also measure the overheads of a run on
    Ray workers (profile_ray.py: round trips, gloo all-reduce, the training micro-batch's fixed cost); without
    it (or without Ray installed) those fields keep the built-in profile's values."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(max(1, threads))
    heap_fixed = fix_cpu_heap(device)  # the C heap as a run's first model load sets it: timings and memory see it
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    shape = shape or gpt2_shape("embedded", 4, 128, 4, 1024, 512)
    if device == "cpu" and shape.params > 200e6:
        log(f"[profile] {shape.name} has {shape.params / 1e6:.0f} M parameters: profiling the default shape instead")
        shape = gpt2_shape("embedded", 4, 128, 4, 1024, 512)
    t_start = time.perf_counter()
    torch.set_grad_enabled(True)
    x = torch.randn(256, 256, device=device, requires_grad=True)
    (x @ x).sum().backward()  # thread pools and allocator up before anything is timed
    runtime = _worker_runtime_bytes() if device == "cpu" else 0.5 * GiB
    model = model_of_shape(shape, device)
    # LoRA on every linear of a second copy (get_peft_model wraps the model it is given, so not the plain one)
    adapted = apply_lora(model_of_shape(shape, device), ModelConfig(lora=True, lora_r=PROFILE_LORA_R,
                                                                    lora_alpha=2 * PROFILE_LORA_R)).train()
    n_params = sum(p.numel() for p in model.parameters())
    wbytes = 4.0 * n_params
    # PASSES passes, each rate fitted in the last from the fastest of every pass's timings of each point (one pass
    # has a few repeats per point, and on a jittery VM its fits swung by half between profiles an hour apart: the
    # fixed cost per layer of a training call 0.99 ms, then 2.0 ms, the backward's ratio 1.9, then 2.7)
    fastest: dict = {}

    def timed(key: str, fn, repeats: int) -> float:
        fastest[key] = min(fastest.get(key, float("inf")), fastest_seconds(fn, repeats, sync))
        return fastest[key]

    def timed_less_faults(key: str, fn, repeats: int) -> float:
        """As timed, each call less its own page faults' time: calls of one size fault different counts (free heap
        chunks serve some of their large tensors; SmolLM2's LoRA forward + backward over 16 x 32 tokens faulted
        409k-580k pages a call), so a count taken on another call than the fastest moved the fitted rates."""
        def once() -> float:
            t = time.perf_counter()
            faults = minor_faults(fn)
            sync()
            return time.perf_counter() - t - fault_s * faults

        fn()
        sync()
        fastest[key] = min(fastest.get(key, float("inf")), min(once() for _ in range(repeats)))
        return max(1e-6, fastest[key])

    def one_pass() -> dict:
        """Every rate measured in this process, once, by its MachineProfile field (and the contention)."""
        # bandwidth at the model's own size: on CPU a small model's weights stream from cache, not DRAM
        big = torch.empty(max(int(wbytes // 4), 2**18), device=device)
        t_copy = timed("copy", lambda: big.clone(), 9)
        mem_bw = 2 * big.numel() * 4 / t_copy  # read + write
        # decode: per-step cost at 1, 8 and 32 rows (random weights, EOS off: every row runs to the limit); then a
        # rollout whose 32 samples end one per step, to find what each finished sample costs besides its steps
        # (prefill share, retiring its row, handing it out)
        engine = DecodeEngine(model.eval(), eos_token_id=-1, max_rows=64)
        steps = 24
        params = SamplingParams(max_new_tokens=steps)
        prompts = [[1 + (i % 7), 2, 3, 4, 5, 6] for i in range(32)]
        decode = {}
        with torch.no_grad():
            for rows in (1, 8, 32):
                run = lambda: list(engine.generate(prompts[:rows], 1, params, seed=0))
                decode[rows] = timed(f"decode{rows}", run, 3) / steps
            staggered = timed("staggered", lambda: list(engine.generate(prompts, 1, SamplingParams(max_new_tokens=32),
                                                                       seed=0, lengths=lambda pid, j: pid + 1)), 3)
            # prefill: 16 prompts of 15 lengths against 16 of one length, the same tokens, one token each; every extra
            # length is a prefill call of its own (then each call's KV cache merged into the batch's buffer)
            varied = [[1] * n for n in (*range(2, 17), 9)]
            one_token = SamplingParams(max_new_tokens=1)
            t_varied = timed("varied", lambda: list(engine.generate(varied, 1, one_token, seed=0)), 5)
            t_same = timed("same", lambda: list(engine.generate([[1] * 9] * 16, 1, one_token, seed=0)), 5)
        fixed, per_row = _fit(decode)
        decode_layer_call = max(1e-7, (fixed - wbytes / mem_bw) / shape.layers)
        decode_flops = shape.forward_flops(1, 6 + steps / 2) / per_row
        steps_only = sum(fixed + per_row * (32 - t) for t in range(32))
        decode_sample_s = max(0.0, (staggered - steps_only) / 32)
        # forward at three batch sizes of RL-like sequences (32 tokens) -> fixed cost per call and FLOP/s; then the
        # backward's ratio to the forward, with a log-softmax loss as the policy loss has
        seq = 32
        ids = {b: torch.randint(0, shape.vocab, (b, seq), device=device) for b in (2, 8, 16)}
        model.train()
        fwd = {}
        one_token = torch.ones(1, 1, dtype=torch.long, device=device)
        with torch.no_grad():
            for b in ids:
                fwd[b] = timed(f"forward{b}", lambda: model(input_ids=ids[b]).logits, 5)
            # the fixed cost per call straight from a one-token forward: the intercept of the fit above is the
            # difference of noisy timings, and on a busy machine it can land at or under zero
            t_one = timed("forward_one", lambda: model(input_ids=one_token).logits, 9)
        _, per_row = _fit(fwd)
        # the slope between three noisy timings can come out near 0 on a busy machine (once: 4.5e15 FLOP/s); a model's
        # forward never outruns a bare matrix multiply on the same cores

        fastest["matmul_rate"] = max(fastest.get("matmul_rate", 0.0), measure_matmul_rate(device, n=512))
        flops = min(shape.forward_flops(seq, seq / 2) / per_row, fastest["matmul_rate"])
        # a decode row's slope is fitted from step times nearly flat in rows on small models: noise can put it near 0
        # and the rate at 1e14+; one token per row never runs at a higher FLOP rate than a batched forward does
        decode_flops = min(decode_flops, flops)
        call = max(1e-7, (t_one - shape.forward_flops(1, 1) / flops - wbytes / mem_bw) / shape.layers)
        prefill_call_s = max(0.0, (t_varied - t_same) / 14 - shape.layers * call - wbytes / mem_bw)

        score_call_s = _score_call_seconds(model, shape, device, timed, shape.layers * call + wbytes / mem_bw,
                                           flops)

        # contention: the same call's mean over its fastest, repeated; on a shared machine the rates above (fitted
        # from fastest timings) are what a process gets alone, and the run will get about 1 / contention of them.
        # After a few calls untimed: on a 2-core Xeon VM (2026-11-28) a 16 x 32-token forward of SmolLM2's shape took
        # 1.8-2.0 s for its first 6 calls in a fresh process, then 1.43-1.51 s steadily (mean over fastest 1.17 with
        # them, 1.01-1.04 without): the probe is for sharing, not a process's first calls
        times = []
        with torch.no_grad():
            for _ in range(CONTENTION_WARMUP):
                model(input_ids=ids[16])
            sync()
            for _ in range(CONTENTION_CALLS):
                t = time.perf_counter()
                model(input_ids=ids[16])
                sync()
                times.append(time.perf_counter() - t)
        contention = max(1.0, sum(times) / len(times) / min(times))

        def fwd_bwd(net, b: int):
            net(input_ids=ids[b]).logits.float().log_softmax(-1)[..., 0].mean().backward()

        # the training timings less their page faults' time (counted, at fault_s each): the rates are the compute's,
        # and the planner adds the faults of each micro-batch's own size (cost.mapped_train_bytes), which step up
        # where a width's tensors reach glibc's threshold (on SmolLM2's shape between these timings' 256 and 512
        # tokens: fitted through them, the step would raise the rate per token of every size)
        fb = {b: timed_less_faults(f"train{b}", lambda: fwd_bwd(model, b), 5) for b in ids}
        fixed_fb, per_row_fb = _fit(fb)
        bwd_ratio = max(0.5, per_row_fb / per_row - 1)  # marginal: per row of the forward + backward over the forward
        train_call = max(1e-7, (fixed_fb - (1 + bwd_ratio) * wbytes / mem_bw) / shape.layers)
        # the same through unmerged LoRA adapters: their fixed cost per layer in a forward (the shared base decodes
        # and scores through them), and forward + backward with the base frozen (no weight gradients of the base,
        # the adapters' own ops in both directions)
        with torch.no_grad():
            t_one_lora = timed("forward_one_lora", lambda: adapted(input_ids=one_token).logits, 9)
            fwd_lora = {b: timed(f"forward_lora{b}", lambda: adapted(input_ids=ids[b]).logits, 5) for b in ids}
        lora_call = max(0.0, (t_one_lora - t_one) / shape.layers)
        lora_fwd = max(1.0, _fit(fwd_lora)[1] / per_row)  # adapters add work per token, never take it away
        fb_lora = {b: timed_less_faults(f"train_lora{b}", lambda: fwd_bwd(adapted, b), 5) for b in ids}
        fixed_lora, per_row_lora = _fit(fb_lora)
        lora_bwd = max(0.2, per_row_lora / per_row - 1)
        lora_train_call = max(1e-7, (fixed_lora - (1 + lora_bwd) * wbytes / mem_bw) / shape.layers)
        opt = build_adamw(model, 1e-6, 0.0)  # the trainers' own optimiser (fused where torch can)
        t_opt = timed("adamw", opt.step, 3)
        optimizer_bytes_s = 16 * n_params / t_opt
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}

        def serialise():
            buf = io.BytesIO()
            torch.save(state, buf)
            buf.seek(0)
            torch.load(buf)

        sync_bytes_s = wbytes / timed("serialise", serialise, 3)
        return {"flops": flops, "decode_flops": decode_flops, "mem_bw": mem_bw, "layer_call_s": call,
                "decode_layer_call_s": decode_layer_call, "decode_sample_s": decode_sample_s,
                "score_call_s": score_call_s, "prefill_call_s": prefill_call_s, "train_layer_call_s": train_call,
                "bwd_ratio": bwd_ratio, "lora_layer_call_s": lora_call, "lora_fwd_ratio": lora_fwd,
                "lora_train_layer_call_s": lora_train_call, "lora_bwd_ratio": lora_bwd,
                "optimizer_bytes_s": optimizer_bytes_s, "sync_bytes_s": sync_bytes_s, "fault_s": fault_s,
                "contention": contention}

    measured_on_ray = ray and device == "cpu"
    # a line per pass: on 2 cores SmolLM2-135M's passes take minutes each (19 minutes in all with the Ray part)
    log(f"[profile] timing {shape.name} ({n_params / 1e6:.0f} M parameters) on {device}, {threads} thread(s): "
        f"{PASSES} passes{', then the overheads of 2 Ray workers' if measured_on_ray else ''}")
    # once for the whole profile, so that every pass takes the same price off its training timings
    fault_s = _fault_seconds() if heap_fixed else 0.0
    if heap_fixed and fault_s == 0.0:
        log("[profile] WARNING: page faults could not be timed (a fresh mapping's faults were not counted one per "
            "4 KiB page: transparent huge pages set to always?): fault_s 0, so plans price no page faults")
    before = cpu_sample()
    passes = []
    for i in range(PASSES):
        t_pass = time.perf_counter()
        passes.append(one_pass())
        log(f"[profile] pass {i + 1}/{PASSES} in {time.perf_counter() - t_pass:.0f} s")
    others = other_cores(before, cpu_sample())
    lora_resident, lora_ratio = _lora_train_line(adapted, shape, device)
    log(f"[profile] a LoRA training micro-batch holds {lora_resident / 2**20:.0f} MiB + {lora_ratio:.2f} x the "
        f"activations the memory model counts")
    rates = dict(passes[-1])
    contention = profile_contention([r["contention"] for r in passes], others)
    per_pass = ", ".join(f"{r['contention']:.2f}" for r in passes)
    log(f"[profile] contention per pass (mean over fastest of {CONTENTION_CALLS} forwards): {per_pass}; "
        f"{contention:.2f} taken (other work on the cores: {others:.2f})")
    del rates["contention"]
    # how far the fits moved from pass to pass: the rate that moved most (a zero, a term that measured nothing, aside)
    widest, widest_spread = max(((k, spread([r[k] for r in passes])) for k in rates
                                 if statistics.median(r[k] for r in passes) > 0), key=lambda kv: kv[1])
    driver_s = _driver_seconds(shape.vocab)
    overheads = {}
    if measured_on_ray:
        overheads = _ray_overheads(shape, threads, log)
    memory = (torch.cuda.get_device_properties(0).total_memory if device == "cuda"
              else psutil.virtual_memory().total)
    name = torch.cuda.get_device_name(0) if device == "cuda" else f"{_cpu_name()}, {threads} thread(s) per worker"
    elapsed = time.perf_counter() - t_start
    busy = (f"; BUSY: other work kept {others:.1f} cores busy while the rates were timed: profile again on a quieter "
            f"machine" if others > BUSY_CORES else f"; other work on the cores: {others:.2f} of them")
    faults = f"; a page fault {fault_s * 1e6:.2f} us" if fault_s else ""
    log(f"[profile] {name}: {elapsed:.1f} s on {shape.name} ({n_params / 1e6:.2f} M parameters){busy}{faults}")
    return MachineProfile(
        name=name, device=device, threads=threads, **rates, sync_latency_s=SYNC_LATENCY_S, ray_call_s=driver_s,
        **((BUILTIN_OVERHEADS if device == "cpu" else GPU_OVERHEADS) | overheads),
        memory_bytes=float(memory), runtime_bytes=float(runtime), slack_fraction=0.1, other_cores=others, shape=shape.key,
        lora_train_resident_bytes=lora_resident, lora_train_ratio=lora_ratio,
        source=f"rlfuse plan --profile, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {shape.name}, "
               f"load average {os.getloadavg()[0]:.1f}, other work {others:.2f} cores, contention {contention:.2f} "
               f"(rates divided by it), each "
               f"rate fitted to the fastest of {PASSES} passes' timings (moved most over the passes: {widest}, "
               f"{widest_spread * 100:.0f}%)"
    ).slowed(contention)


LINE_PROMPT, LINE_ANSWER = 144, 48
"""Tokens of the longest sequence of the micro-batches _lora_train_line measures: an RLHF chat prompt and its
answer."""


def _lora_train_line(adapted, shape: ModelShape, device: str) -> tuple[float, float]:
    """(bytes, ratio): what one training micro-batch through LoRA adapters (the policy loss's own path:
    response_logprobs and its backward, lean activations as a run's default) raises the process's peak by, at 2 and
    4 rows, as a line over the activations the memory model counts for it (train_activation_bytes), the adapters'
    gradients left out (the model counts them apart). Two sizes RLHF micro-batches take, which on SmolLM2 fall either
    side of glibc's fixed mmap threshold (models/quantize.py: 2 rows' hidden states come from the heap, whose
    fragments cost more over what is counted than 4 rows' mapped apart: python -m bench.heap): a line through 8
    rows as well follows the large micro-batches and falls under the small ones smollm2_hh trains. Memory does not
    jitter as timings do: measured once, after the passes (the lean layers it installs are the last thing `adapted`
    runs)."""
    enable_lean_activations(adapted)
    gen = torch.Generator().manual_seed(0)
    grads = sum(p.numel() * p.element_size() for p in adapted.parameters() if p.requires_grad)
    seq = min(LINE_PROMPT + LINE_ANSWER, shape.context)  # a small test model's context is shorter
    answer = seq * LINE_ANSWER // (LINE_PROMPT + LINE_ANSWER)
    prompt = seq - answer
    step = max(0, min(7, (prompt - 1) // 3))  # 4 rows' prompts keep at least a token on a short context
    rise = {}
    for rows in (2, 2, 4):  # the first once unmeasured: the lean layers' first pass allocates what later ones reuse
        # prompts of different lengths padded to the longest, as a run's are (with padding the attention takes its
        # masked path: equal lengths held less)
        prompts = [torch.randint(1, shape.vocab, (prompt - step * i,), generator=gen).tolist() for i in range(rows)]
        answers = torch.randint(1, shape.vocab, (rows, answer), generator=gen).tolist()
        mb = collate(prompts, answers, 0, device)
        adapted.zero_grad(set_to_none=True)
        counted = train_activation_bytes(shape, rows * seq, 4.0, False, True, lean=True)
        rise[counted] = peak_rise(lambda: response_logprobs(adapted, mb).sum().backward(), device) - grads
    adapted.zero_grad(set_to_none=True)
    resident, ratio = _fit(rise)
    return (resident, ratio) if resident > 1.0 else (0.0, ratio)


def _score_call_seconds(model, shape: ModelShape, device: str, timed, forward_fixed_s: float,
                        flops: float) -> float:
    """What a scoring call costs beyond its forwards: the Scorer on one sample of 4 + 16 tokens with the reference
    (this model), a reward model and a critic on its body (rollout/score.py: sorting, collating, the reward's
    input, gathering log-probs and values, the scored samples), less three forwards at the fitted rates."""
    rm = GPT2ForSequenceClassification(GPT2Config(
        vocab_size=shape.vocab, n_positions=shape.context, n_embd=shape.hidden, n_layer=shape.layers,
        n_head=shape.heads, num_labels=1, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).to(device)
    scorer = Scorer(reward_model_fn(rm.eval(), 0, 0), 0, ref=model, critic=ValueModel.from_reward_model(rm).eval())
    one = [Sample(0, 0, [1, 2, 3, 4], list(range(5, 21)), torch.zeros(16), "eos")]
    t = timed("score", lambda: scorer.score(one), 9)
    return max(0.0, t - 3 * (forward_fixed_s + shape.forward_flops(20, 10) / flops))


def _driver_seconds(vocab: int, samples: int = 32) -> float:
    """The RL driver's own work per iteration between its calls to workers: advantages and mini-batch order over an
    iteration's experience (trainers/rl.py steps 3 and 4), timed on a made-up one of `samples` samples."""
    rl, exp = RLConfig(), fake_experience(samples, vocab)
    return fastest_seconds(lambda: (compute_advantages(exp, rl, 0.1), minibatches(len(exp), rl, 0, 0)), 9, lambda: None)


def _ray_overheads(shape: ModelShape, threads: int, log) -> dict:
    """profile_ray.measure_ray_overheads, or {} (built-in values, said in one line) where Ray is missing or fails
    to start on this machine: the rest of the profile still holds."""
    try:
        from rlfuse.runtime.profile_ray import measure_ray_overheads  # Ray (an optional install): only here

        return measure_ray_overheads(shape, threads, log)
    except ImportError as e:
        if e.name != "ray" and not str(e.name).startswith("ray."):
            raise
        log("[profile] Ray is not installed: Ray overheads from the built-in profile")
    except Exception as e:  # noqa: BLE001  (Ray's start can fail many ways: ports, /dev/shm, a stale session)
        log(f"[profile] Ray overheads not measured ({type(e).__name__}: {str(e)[:120]}); built-in values used")
    return {}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"
