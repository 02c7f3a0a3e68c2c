"""The memory model (rlfuse/plan/memory.py) on cases computed by hand, and its hook into the placement checker."""

from dataclasses import replace

import pytest

from rlfuse.plan.check import check_placement
from rlfuse.plan.cost import KNOWN_SHAPES, MachineProfile, ModelShape, gpt2_shape
from rlfuse.plan.memory import (COMPONENTS, MemoryInputs, bytes_per_param, driver_memory, inference_activation_bytes,
                                memory_model,
                                machine_bytes, memory_table, object_store_bytes, optimizer_bytes_per_param,
                                weight_bytes, worker_memory)
from rlfuse.plan.spec import PlacementSpec, WorkerGroup

# a 2-layer GPT-2 small enough to count by hand: hidden 4, ffn 16, vocab 10, 8 positions
TINY = ModelShape("tiny", layers=2, hidden=4, heads=2, ffn=16, vocab=10, context=8)
NO_RUNTIME = MachineProfile("test", "cpu", 1, flops=1e9, decode_flops=1e9, mem_bw=1e9, layer_call_s=0.0,
                            runtime_bytes=1000, slack_fraction=0.1)


def test_parameter_counts_by_hand_and_published():
    # per layer: c_attn 4x12 + c_proj 4x4 + c_fc 4x16 + mlp.c_proj 16x4 = 192 weights, 36 biases, 2 LayerNorms 16
    assert TINY.layer_params == 192 + 36 + 16
    # token embedding 10x4 + positions 8x4 + final LayerNorm 8 (the head is tied)
    assert TINY.params == 2 * 244 + 40 + 32 + 8
    assert gpt2_shape("embedded", 4, 128, 4, 1024, 512).params == 989_952  # transformers' count of the default model
    assert KNOWN_SHAPES["llama-2-7b"].params == 6_738_415_616  # Llama-2-7B's published count
    assert KNOWN_SHAPES["llama-2-13b"].params == 13_015_864_320
    assert KNOWN_SHAPES["distilgpt2"].params == 81_912_576


def test_bytes_per_weight_by_dtype():
    assert bytes_per_param("fp32") == 4 and bytes_per_param("bf16") == 2
    assert bytes_per_param("nf4") == 0.5625  # 4 bits + one fp32 absmax per 64 weights
    assert bytes_per_param("nf4-dq") == pytest.approx((4 + 8 / 64 + 32 / (64 * 256)) / 8)  # 4.127 bits (QLoRA)
    assert optimizer_bytes_per_param("adamw") == 8
    assert optimizer_bytes_per_param("adamw8bit") == pytest.approx(2 + 8 / 2048)


def test_4bit_base_keeps_embeddings_and_head_16bit():
    llama = KNOWN_SHAPES["llama-2-7b"]
    linear = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    assert weight_bytes(llama, "nf4-dq") == pytest.approx(linear * 0.515869140625 + (6_738_415_616 - linear) * 2)
    assert 3.5e9 < weight_bytes(llama, "nf4-dq") < 4.0e9  # QLoRA's table: "base 3.5 GB"


def test_actor_worker_fp32_adamw_by_hand():
    m = MemoryInputs(TINY, train_rows=2, seq=3, score_rows=1)
    mem = worker_memory({"actor"}, m, NO_RUNTIME)
    assert mem["base"] == 568 * 4
    assert mem["gradients"] == 568 * 4
    assert mem["optimizer"] == 568 * 8
    # per layer and token: 7h + h + 2 ffn = 64 values; 6 tokens x 4 bytes x 2 layers, + fp32 logits and log-softmax
    assert mem["activations"] == 64 * 6 * 4 * 2 + 6 * 10 * 8
    assert mem["kv_cache"] == 0 and mem["adapters"] == 0
    tensors = 2272 + 2272 + 4544 + 3552
    assert mem["slack"] == pytest.approx(1000 + 0.1 * tensors)
    assert mem["total"] == pytest.approx(tensors + mem["slack"])


def test_a_lora_micro_batch_is_charged_the_profiles_measured_line():
    # a profile measures what a LoRA training micro-batch holds resident (the C heap's fragments in it) as a line over
    # the activations counted: the actor's become that line, the allocator slack stays on the count
    counted = 64 * 6 * 4 * 2 + 6 * 10 * 8  # as in test_actor_worker_fp32_adamw_by_hand
    lora = MemoryInputs(TINY, lora_rank=2, train_rows=2, seq=3, score_rows=1, lean_activations=True)
    lined = replace(NO_RUNTIME, lora_train_resident_bytes=500, lora_train_ratio=1.5, shape=TINY.key)
    plain, charged = worker_memory({"actor"}, lora, NO_RUNTIME), worker_memory({"actor"}, lora, lined)
    assert plain["activations"] == counted and charged["activations"] == 500 + 1.5 * counted
    assert charged["slack"] == plain["slack"]
    assert charged["total"] == pytest.approx(plain["total"] + 500 + 0.5 * counted)
    # full fine-tuning keeps the count (the line is measured through adapters), and a line under the count never
    # lowers it
    assert worker_memory({"actor"}, replace(lora, lora_rank=0), lined)["activations"] == counted
    below = replace(NO_RUNTIME, lora_train_ratio=0.5, shape=TINY.key)
    assert worker_memory({"actor"}, lora, below)["activations"] == counted
    # where the micro-batch is unlike the profiled ones, the count: another shape's profile, checkpointing, a 4-bit
    # base, transformers' own activations
    assert worker_memory({"actor"}, lora, replace(lined, shape="other"))["activations"] == counted
    for unlike in (dict(checkpointing=True), dict(weight_dtype="nf4"), dict(lean_activations=False)):
        inputs = replace(lora, **unlike)
        assert worker_memory({"actor"}, inputs, lined) == worker_memory({"actor"}, inputs, NO_RUNTIME), unlike
    # an FSDP rank's update charges the line too, its slack on the count as well
    fsdp = worker_memory({"actor"}, replace(lora, fsdp=2), lined)
    assert fsdp["activations"] == 500 + 1.5 * counted


def test_a_released_reference_counts_in_the_scoring_phase_alone():
    # rl.release_reference: the reference (568 fp32 weights) is resident while scoring, not in the update
    roles = {"actor", "generator", "reference"}
    kept = worker_memory(roles, MemoryInputs(TINY, train_rows=1, seq=3, score_rows=1), NO_RUNTIME)
    released = worker_memory(roles, MemoryInputs(TINY, train_rows=1, seq=3, score_rows=1, release_reference=True),
                             NO_RUNTIME)
    assert kept["base"] == 2 * 568 * 4 and released["base"] == 568 * 4
    train = 64 * 3 * 4 * 2 + 3 * 10 * 8  # the update's activations: 3 tokens (as in the test above)
    score = inference_activation_bytes(TINY, 3, 4.0, True)  # one row of 3 tokens scored
    assert kept["activations"] == max(train, score) == train
    assert released["activations"] == score + 568 * 4  # the scoring phase, reference resident, is now the peak
    assert released["total"] < kept["total"]
    # a scoring worker without the actor never updates, so never releases
    alone = MemoryInputs(TINY, seq=3, score_rows=1, release_reference=True)
    assert worker_memory({"reference"}, alone, NO_RUNTIME)["base"] == 568 * 4


def test_checkpointing_keeps_layer_inputs_and_one_layer():
    m = MemoryInputs(TINY, train_rows=2, seq=3, score_rows=1, checkpointing=True)
    # 2 layers x h=4 x 6 tokens x 4 bytes + one layer's 64 x 6 x 4 + logits 480
    assert worker_memory({"actor"}, m, NO_RUNTIME)["activations"] == 2 * 4 * 6 * 4 + 64 * 6 * 4 + 480


def test_lean_activations_keep_two_of_a_swiglu_mlps_four_ffn_tensors():
    gated = ModelShape("tiny-llama", layers=2, hidden=4, heads=2, ffn=16, vocab=10, context=8, gated=True)
    per_token = {lean: worker_memory({"actor"}, MemoryInputs(gated, train_rows=2, seq=3, score_rows=1,
                                                               lean_activations=lean), NO_RUNTIME)["activations"]
                 for lean in (False, True)}
    # 2 layers x 6 tokens x 4 bytes x (2 of the 4 ffn = 16 wide tensors dropped); the logits (480) alike
    assert per_token[False] - per_token[True] == 2 * 6 * 4 * 2 * 16
    for dtype, dropped in (("fp32", 2), ("nf4-dq", 1)):  # a quantised base's LoRA down projection keeps the product
        lora = {lean: worker_memory({"actor"}, MemoryInputs(gated, train_rows=2, seq=3, score_rows=1, lora_rank=2,
                                                             weight_dtype=dtype, lean_activations=lean),
                                    NO_RUNTIME)["activations"] for lean in (False, True)}
        assert lora[False] - lora[True] == 2 * 6 * 4 * dropped * 16
    gpt2 = [worker_memory({"actor"}, MemoryInputs(TINY, train_rows=2, seq=3, score_rows=1, lean_activations=lean),
                          NO_RUNTIME)["activations"] for lean in (False, True)]
    assert gpt2[0] == gpt2[1]  # no SwiGLU: nothing changes


def test_kv_cache_rows_by_length():
    m = MemoryInputs(TINY, seq=3, kv_rows=5, score_rows=1)
    # keys and values x 2 layers x 4 dims x 4 bytes = 64 bytes per token; 5 rows x 3 tokens
    assert worker_memory({"generator"}, m, NO_RUNTIME)["kv_cache"] == 5 * 3 * 64


def test_a_weight_sync_through_the_object_store_stays_in_the_sender_and_the_receiver():
    # the object store's pages stay mapped once touched (SmolLM2 on separated 1+1: 513 MiB of RssShmem in the
    # training and the decoding worker from the first sync on): the actor's fp32 weights, 568 x 4 bytes, in both
    m = MemoryInputs(TINY, seq=3, kv_rows=5, score_rows=1)
    separated = [("actor", "reference", "reward"), ("generator",)]
    assert object_store_bytes(separated[0], separated, m, "cpu") == 568 * 4
    assert object_store_bytes(separated[1], separated, m, "cpu") == 568 * 4
    flattened = [("actor", "generator", "reference", "reward")]  # the generator copies the actor in place
    assert object_store_bytes(flattened[0], flattened, m, "cpu") == 0
    assert object_store_bytes(separated[0], separated, m, "cuda") == 0  # host memory, not the device's
    # rollout.weight_sync=adapters: only the adapters go (LoRA r2 on the 4 matrices of 2 layers, fp32)
    lora = MemoryInputs(TINY, seq=3, kv_rows=5, score_rows=1, lora_rank=2, sync_adapters=True)
    lora_params = 2 * ((4 + 12) + (4 + 4) + (4 + 16) + (16 + 4)) * 2
    assert object_store_bytes(separated[1], separated, lora, "cpu") == lora_params * 4
    # PPO with the critic trained beside the actor and scored elsewhere: its weights go too, whether it has its own
    # body or is the actor's with a value head (rl.critic_init=actor: no critic shape of its own)
    apart = [("actor", "critic"), ("generator", "reference", "reward")]
    for ppo in (MemoryInputs(TINY, critic=TINY, seq=3, kv_rows=5, score_rows=1), m):
        assert object_store_bytes(apart[0], apart, ppo, "cpu") == 2 * 568 * 4
        assert object_store_bytes(apart[1], apart, ppo, "cpu") == 2 * 568 * 4
    # charged to the weights, whole pages: no allocator slack on them, no sharding
    plain, synced = (worker_memory({"generator"}, replace(m, store_bytes=b, shard=2), NO_RUNTIME) for b in (0, 8))
    assert synced["base"] == plain["base"] + 8 and synced["total"] == pytest.approx(plain["total"] + 8)


def test_the_memory_hook_charges_the_weight_sync_where_the_generator_sits_apart():
    from rlfuse.config import load_config
    from rlfuse.plan.roles import derive_roles

    roles = derive_roles(load_config(None, []))
    m = MemoryInputs(TINY, critic=TINY, reward=TINY, train_rows=2, seq=3, score_rows=1)
    memory_of = memory_model(m, NO_RUNTIME, samples=8, max_rows=4)
    rest = tuple(r for r in roles.names if r != "generator")
    separated = PlacementSpec("separated", (WorkerGroup("train", 1, rest), WorkerGroup("generate", 1, ("generator",))))
    alone = PlacementSpec("separated", (WorkerGroup("train", 1, rest),))  # the same group with no one to send to
    assert memory_of(separated.groups[0], separated) == pytest.approx(memory_of(alone.groups[0], alone) + 568 * 4, abs=1)
    # on a GPU worker the store's pages are host memory, not the device's its budget is
    on_gpu = PlacementSpec("separated", (WorkerGroup("train", 1, rest, gpus_per_worker=1),
                                         WorkerGroup("generate", 1, ("generator",), gpus_per_worker=1)))
    assert memory_of(on_gpu.groups[0], on_gpu) == memory_of(alone.groups[0], alone)
    # the machine holds the pages once, however many workers count them in their RSS
    per_worker = memory_of(separated.groups[0], separated) + memory_of(separated.groups[1], separated)
    assert machine_bytes(separated, memory_of, m) == pytest.approx(per_worker - 568 * 4, abs=2)
    # the driver's final pull reuses those pages; only where it pulls more (or no sync passed the store) it adds
    assert machine_bytes(separated, memory_of, m, pulled=100) == machine_bytes(separated, memory_of, m)
    assert machine_bytes(separated, memory_of, m, pulled=568 * 4 + 50) == pytest.approx(per_worker - 568 * 4 + 50, abs=2)


def test_the_driver_adds_the_pages_it_writes_and_an_evaluation():
    # full fine-tuning: the trained actor pulled back over its file-mapped weights (568 fp32 parameters)
    m = MemoryInputs(TINY, seq=3, score_rows=1)
    assert driver_memory(m, eval_rows=0) == 568 * 4
    # an evaluation of 5 rows: their KV cache (2 layers x keys and values x 4 wide x 4 bytes = 64 per token, 3
    # tokens each) and a log-prob pass over all 5 (the evaluation scores 32 at a time, whatever the run's
    # score_rows)
    assert driver_memory(m, eval_rows=5) == 568 * 4 + 5 * 3 * 64 + inference_activation_bytes(TINY, 15, 4.0, True)
    assert driver_memory(m, eval_rows=40) == 568 * 4 + 40 * 3 * 64 + inference_activation_bytes(TINY, 96, 4.0, True)
    # LoRA: the adapters, and the generator's copy the first evaluation writes, with the merged weights built beside
    # it for the copy; on a shared base the engine decodes the base with the adapters: the adapters alone
    lora = replace(m, lora_rank=2)
    adapters = TINY.lora_params(2) * 4
    assert driver_memory(lora, eval_rows=0) == adapters + 2 * 568 * 4
    assert driver_memory(replace(lora, shared_base=True, weight_dtype="nf4"), eval_rows=0) == adapters


def test_a_decoding_worker_merging_the_adapters_holds_the_base_they_merge_on():
    # rollout.weight_sync=adapters (LoRA): the SFT model with the adapter stays beside the engine's copy, kept; no
    # whole received copy passes through
    merged = MemoryInputs(TINY, seq=3, kv_rows=5, score_rows=1, lora_rank=2)
    adapters = MemoryInputs(TINY, seq=3, kv_rows=5, score_rows=1, lora_rank=2, sync_adapters=True)
    lora_params = 2 * ((4 + 12) + (4 + 4) + (4 + 16) + (16 + 4)) * 2
    a, b = worker_memory({"generator"}, merged, NO_RUNTIME), worker_memory({"generator"}, adapters, NO_RUNTIME)
    assert b["base"] == a["base"] + 568 * 4 and b["adapters"] == a["adapters"] + lora_params * 4
    separated = [("actor",), ("generator",)]  # what passes through the object store: the adapters alone
    assert object_store_bytes({"generator"}, separated, merged, "cpu") == 568 * 4
    assert object_store_bytes({"generator"}, separated, adapters, "cpu") == lora_params * 4


def test_shared_prompts_shrink_training_activations():
    # rl.share_prompt: a sequence costs train_seq tokens in a training pass (its prompt's share) instead of seq
    whole = MemoryInputs(TINY, train_rows=2, seq=3, score_rows=1)
    shared = MemoryInputs(TINY, train_rows=2, seq=3, score_rows=1, train_seq=1.5)
    assert worker_memory({"actor"}, whole, NO_RUNTIME)["activations"] == 64 * 6 * 4 * 2 + 6 * 10 * 8
    assert worker_memory({"actor"}, shared, NO_RUNTIME)["activations"] == 64 * 3 * 4 * 2 + 3 * 10 * 8


def test_lora_reference_shares_the_actor_and_only_adapters_train():
    lora = MemoryInputs(TINY, lora_rank=2, train_rows=1, seq=1, score_rows=1)
    full = MemoryInputs(TINY, train_rows=1, seq=1, score_rows=1)
    adapters = 2 * ((4 + 12) + (4 + 4) + (4 + 16) + (16 + 4)) * 2  # (in + out) x r per linear, 2 layers
    with_lora = worker_memory({"actor", "reference"}, lora, NO_RUNTIME)
    assert with_lora["base"] == 568 * 4  # one frozen copy serves actor and reference
    assert with_lora["adapters"] == adapters * 4
    assert with_lora["gradients"] == adapters * 4 and with_lora["optimizer"] == adapters * 8
    assert worker_memory({"actor", "reference"}, full, NO_RUNTIME)["base"] == 2 * 568 * 4  # trained + frozen copy


def test_full_fine_tuning_decodes_the_actor_in_place():
    # the generator beside the actor is the actor itself in full fine-tuning; with LoRA it is a merged copy, and a
    # worker that only decodes always holds its own
    full = MemoryInputs(TINY, train_rows=1, seq=1, score_rows=1)
    lora = MemoryInputs(TINY, lora_rank=2, train_rows=1, seq=1, score_rows=1)
    both = {"actor", "generator", "reference"}
    base = lambda roles, m: worker_memory(roles, m, NO_RUNTIME)["base"]
    assert base(both, full) == base(both - {"generator"}, full)
    assert base(both, lora) == base(both - {"generator"}, lora) + 568 * 4
    assert worker_memory({"generator"}, full, NO_RUNTIME)["base"] == 568 * 4


def test_shared_4bit_base_counts_one_base_for_every_policy_role():
    m = MemoryInputs(TINY, weight_dtype="nf4-dq", lora_rank=2, shared_base=True, train_rows=1, seq=1, score_rows=1)
    one = worker_memory({"actor"}, m, NO_RUNTIME)["base"]
    assert worker_memory({"actor", "generator", "reference"}, m, NO_RUNTIME)["base"] == one == weight_bytes(TINY, "nf4-dq")


def test_sharding_divides_states_not_activations():
    m = MemoryInputs(TINY, train_rows=2, seq=3, score_rows=1)
    one, four = worker_memory({"actor"}, m, NO_RUNTIME), worker_memory({"actor"}, MemoryInputs(
        TINY, train_rows=2, seq=3, score_rows=1, shard=4), NO_RUNTIME)
    for k in ("base", "gradients", "optimizer"):
        assert four[k] == one[k] / 4
    assert four["activations"] == one["activations"]


def test_fsdp_rank_by_hand_at_its_larger_phase():
    # rl.train_parallel=fsdp on 2 ranks, the tiny actor (568 weights: 2 blocks of 244, a root of 80 with the tied
    # head). Update: shards of weights 1136 B, gradients 1136, AdamW 2272, the root's 320 and one block's 976 gathered,
    # the training activations 3552 (as test_actor_worker_fp32_adamw_by_hand). Rollout: the whole weights 2272
    # gathered beside the shards, AdamW's shards, a scoring forward's 1008 (3 tokens: 64 x 3 x 4 + logits 240).
    m = MemoryInputs(TINY, train_rows=2, seq=3, score_rows=1, fsdp=2)
    mem = worker_memory({"actor"}, m, NO_RUNTIME)
    assert mem["base"] == 1136 + 320 + 976 and mem["gradients"] == 1136 and mem["optimizer"] == 2272
    assert mem["activations"] == 3552 and mem["kv_cache"] == 0
    tensors = 2432 + 1136 + 2272 + 3552
    assert mem["total"] == pytest.approx(tensors + 1000 + 0.1 * tensors)
    ddp = worker_memory({"actor"}, MemoryInputs(TINY, train_rows=2, seq=3, score_rows=1), NO_RUNTIME)
    assert mem["total"] < ddp["total"]
    # decoding 64 rows of 8 tokens makes the rollout the larger phase: whole weights, no gradients, the KV cache
    decoding = MemoryInputs(TINY, train_rows=2, seq=8, score_rows=1, kv_rows=64, fsdp=2)
    roll = worker_memory({"actor", "generator"}, decoding, NO_RUNTIME)
    assert roll["base"] == 2272 + 1136 and roll["gradients"] == 0 and roll["kv_cache"] == 64 * 8 * 2 * 2 * 4 * 4
    # the frozen reference is sharded too: its half (1136 B) beside the update's shards
    with_ref = worker_memory({"actor", "reference"}, m, NO_RUNTIME)
    assert with_ref["base"] == mem["base"] + 568 * 4 // 2
    # rl.release_reference maps a replicated reference; sharded, it changes nothing (it once took the reference
    # out of the whole worker's weights and the shards out again: SmolLM2 math predicted 1839 MiB, ran 2890)
    assert worker_memory({"actor", "reference"}, replace(m, release_reference=True), NO_RUNTIME) == with_ref
    # a rank that decodes and scores with a separate critic gathers the actor alone for the rollout (reference and
    # critic later, one at a time): whole actor 2272 beside the shards of actor, critic and reference (3 x 1136)
    flattened = MemoryInputs(TINY, critic=TINY, train_rows=2, seq=8, score_rows=1, kv_rows=64, fsdp=2)
    roll = worker_memory({"actor", "generator", "reference", "critic"}, flattened, NO_RUNTIME)
    assert roll["kv_cache"] > 0 and roll["base"] == 2272 + 3 * 1136
    # a rank that scores but does not decode (separated) needs no whole actor: its weights leave it a tensor at a
    # time, and its larger phase is a deferred pass or the update, with no KV cache
    scoring = worker_memory({"actor", "reference", "critic"}, flattened, NO_RUNTIME)
    assert scoring["kv_cache"] == 0 and scoring["total"] < roll["total"]


def test_memory_hook_rejects_a_group_over_budget():
    from rlfuse.config import load_config
    from rlfuse.plan.roles import derive_roles

    roles = derive_roles(load_config(None, []))
    m = MemoryInputs(TINY, critic=TINY, reward=TINY, train_rows=2, seq=3, score_rows=1)
    memory_of = memory_model(m, NO_RUNTIME, samples=8, max_rows=4)
    spec = PlacementSpec("flattened", (WorkerGroup("all", 2, roles.names),))
    need = memory_of(spec.groups[0], spec)
    assert need == int(worker_memory(roles.names, MemoryInputs(TINY, critic=TINY, reward=TINY, train_rows=2, seq=3,
                                                                score_rows=1, kv_rows=4), NO_RUNTIME)["total"])
    assert check_placement(spec, roles, memory_of=memory_of, memory_budget=need) == []
    problems = check_placement(spec, roles, memory_of=memory_of, memory_budget=need - 1)
    assert len(problems) == 1 and "group 'all'" in problems[0] and "exceeds" in problems[0]


def test_memory_table_has_every_component():
    table = memory_table({"w0": worker_memory({"actor"}, MemoryInputs(TINY), NO_RUNTIME)}, unit=1, unit_name="bytes")
    header = table.splitlines()[1]
    assert all(c in header for c in COMPONENTS)


def test_config_memory_budget_runs_the_checker_hook():
    from rlfuse.config import load_config
    from rlfuse.errors import ConfigError
    from rlfuse.plan.resolve import resolve

    resolve(load_config(None, ["placement.strategy=flattened", "placement.memory_per_worker_gb=4"]))
    with pytest.raises(ConfigError, match="group 'all': predicted .* exceeds the 0.10 GiB budget"):
        resolve(load_config(None, ["placement.strategy=flattened", "placement.memory_per_worker_gb=0.1"]))
