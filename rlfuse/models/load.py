"""One loader for hub names and local folders: causal LMs and reward models through the Auto classes, LoRA
through peft; and one saver. Each stage writes STAGE/model (merged, plain transformers) and, with LoRA,
STAGE/adapter (on the folder the stage started from); later stages build on STAGE/model. Both load here, and so do
adapter-only folders of older runs while their base exists."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.activations import GELUTanh, NewGELUActivation

from rlfuse.config import Config, ModelConfig
from rlfuse.data.task import build_default_task
from rlfuse.errors import UserError, first_line
from rlfuse.files import atomic_path
from rlfuse.models.gguf import local_model
from rlfuse.models.quantize import conv1d_layout, fix_cpu_heap, is_quantized, keep_one_cpu_layout, quantized_load_kwargs
from rlfuse.models.weights import merged_state_dict
from rlfuse.plan.cost import ModelShape

# LoRA targets by architecture; anything else gets peft's "all-linear".
LORA_TARGETS = {
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "mistral": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


def _is_adapter(name: str) -> bool:
    return (Path(name) / "adapter_config.json").is_file()


def _adapter_config(name: str) -> dict:
    return json.loads((Path(name) / "adapter_config.json").read_text())


def _adapter_base(name: str) -> str:
    return _adapter_config(name)["base_model_name_or_path"]


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).exists()


def check_model_folder(name: str) -> None:
    """Raise a UserError naming the folder and what is wrong with it, for the faults we can see without loading:
    a missing folder, a folder that is not a saved model, an adapter whose base model is gone."""
    if not _looks_local(name):
        return  # a hub name: only loading can tell
    p = Path(name).expanduser()
    if not p.is_dir():
        raise UserError(f"model error: could not load {name!r}: no such folder; point the setting that names it "
                        "(model.name, rm.sft_path, rl.sft_path, rl.rm_path) at an existing model folder")
    if _is_adapter(name):
        base = _adapter_base(name)
        if _looks_local(base) and not Path(base).expanduser().is_dir():
            raise UserError(f"model error: could not load {name!r}: it is a LoRA adapter whose base model {base!r} "
                            "(base_model_name_or_path in its adapter_config.json) no longer exists; load the merged "
                            "model saved beside it (the stage's model/ folder), or restore that base folder")
    elif not (p / "config.json").is_file():
        raise UserError(f"model error: could not load {name!r}: the folder has no config.json (nor adapter_config.json), "
                        "so it is not a saved model; point the setting that names it at a folder written by "
                        "save_pretrained (a stage's model/ folder)")


def _load_error(name: str, e: Exception) -> UserError:
    """The folder or name, the exception's own first line, and the fix that fits it."""
    first = first_line(e, 300)
    if _looks_local(name):  # the folder is there (check_model_folder ran) but its files do not load
        fix = ("re-run the stage that wrote this folder, or point the setting that names it (model.name, rm.sft_path, "
               "rl.sft_path, rl.rm_path) at another saved model folder")
    elif re.search(r"connect|offline|resolve|Name or service|network", str(e), re.I):
        fix = ("the hub is unreachable (offline?) and the model is not in the local cache: download it where there "
               "is network (or set HF_HUB_OFFLINE=0), or set model.name to a local model folder")
    else:
        fix = "set model.name to a local model folder (with config.json) or a reachable hub name"
    return UserError(f"model error: could not load {name!r} ({type(e).__name__}: {first}); {fix}")


def load_tokenizer(name: str):
    """Right-padded tokenizer with a pad token (GPT-2's hub tokenizer has none: its EOS is used). A GGUF model
    (models/gguf.py) loads from its converted folder, here and in every loader below. A tokenizer that cannot work
    is refused before any stage trains with it (check_tokenizer)."""
    name = local_model(name)
    check_model_folder(name)
    model_name = name
    if _is_adapter(name) and not (Path(name) / "tokenizer_config.json").exists():
        name = _adapter_base(name)
    _require_tokenizer_files(name)
    try:
        tok = AutoTokenizer.from_pretrained(name)
    except Exception as e:
        raise _load_error(name, e) from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    check_tokenizer(tok, name, _embedding_rows(model_name))
    return tok


# the files a tokenizer's vocabulary lives in (transformers' fast, slow BPE, WordPiece, SentencePiece, tiktoken); a
# folder with none of them loads, for a GPT-2 config, as a tokenizer of one token that encodes every text to nothing
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "tekken.json")
TOKENIZER_SAMPLE = "The quick brown fox jumps over the lazy dog. 1 2 3"
"""What check_tokenizer encodes: any tokenizer a language model can use gives it several tokens."""


def _tokenizer_fix(name: str) -> str:
    return (f"save the tokenizer of the model {name!r} was made from into it "
            f"(AutoTokenizer.from_pretrained(BASE).save_pretrained({name!r})), or point the setting that names it "
            "(model.name, rm.sft_path, rl.sft_path, rl.rm_path) at a complete model folder")


def _require_tokenizer_files(name: str) -> None:
    if not _looks_local(name):
        return  # a hub name: transformers fetches its files
    folder = Path(name).expanduser()
    if not any((folder / f).is_file() for f in TOKENIZER_FILES) and not any(folder.glob("*.tiktoken")):
        raise UserError(f"model error: {name!r} has no tokenizer files ({', '.join(TOKENIZER_FILES[:5])}, ...): "
                        f"transformers would make an empty tokenizer that encodes every text to nothing; "
                        f"{_tokenizer_fix(name)}")


def _embedding_rows(name: str) -> int | None:
    """The model's vocabulary size (its embedding's rows, config.json vocab_size), None where it cannot be read
    cheaply (loading the model then says what is wrong)."""
    try:
        config = load_model_config(name)
    except Exception:  # noqa: BLE001  (a config that does not load is the model loader's error to report)
        return None
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    rows = getattr(config, "vocab_size", None)
    return rows if isinstance(rows, int) and rows > 0 else None


def check_tokenizer(tok, name: str, embedding_rows: int | None = None) -> None:
    """A UserError in one line, naming the folder, for a tokenizer no stage can train or sample with: one that
    encodes a plain sentence to fewer than two tokens (or only to its unknown token), one with neither an EOS nor
    a pad token, or one with more tokens than the model has embedding rows (its top ids would index past them)."""
    try:
        ids = list(tok(TOKENIZER_SAMPLE, add_special_tokens=False)["input_ids"])
    except Exception as e:  # noqa: BLE001  (a broken tokenizer raises anything)
        raise UserError(f"model error: {name!r}: its tokenizer cannot encode text ({type(e).__name__}: "
                        f"{first_line(e)}); {_tokenizer_fix(name)}") from None
    unk = getattr(tok, "unk_token_id", None)
    if len(ids) < 2 or (unk is not None and all(i == unk for i in ids)):
        got = "nothing" if not ids else f"{len(ids)} token(s)" + (" all unknown" if unk is not None and
                                                                     all(i == unk for i in ids) else "")
        raise UserError(f"model error: {name!r}: its tokenizer ({len(tok)} tokens) encodes {TOKENIZER_SAMPLE!r} to "
                        f"{got}, so it cannot be trained or sampled with; {_tokenizer_fix(name)}")
    if tok.eos_token_id is None and tok.pad_token_id is None:
        raise UserError(f"model error: {name!r}: its tokenizer has no end-of-sequence token (and no pad token), so "
                        "no sample can end and no batch can be padded; set one (tokenizer.eos_token = '...') and "
                        f"save it into {name!r}")
    if embedding_rows is not None and len(tok) > embedding_rows:
        raise UserError(f"model error: {name!r}: its tokenizer has {len(tok)} tokens but the model's embedding has "
                        f"{embedding_rows} rows (config.json vocab_size), so token ids from {embedding_rows} up "
                        "index past it; use the tokenizer the model was trained with, or resize the model "
                        "(model.resize_token_embeddings(len(tokenizer))) and save both into the folder")


def load_model_config(name: str):
    """A model's transformers config (its context length, its shape) without its weights, from the same names
    load_tokenizer takes: a folder, a hub name, a GGUF model, a LoRA adapter (its base's config)."""
    name = local_model(name)
    check_model_folder(name)
    if _is_adapter(name):
        name = _adapter_base(name)
    try:
        return AutoConfig.from_pretrained(name)
    except Exception as e:
        raise _load_error(name, e) from None


def resolve_base_model(cfg: Config, log=print):
    """(model name or folder, embedded task or None). The embedded task is built and cached on first use; a GGUF
    model is converted once into its cached folder, which the stages then name as their base."""
    task = None
    if cfg.data.kind == "synthetic" or cfg.model.name == "embedded":
        task = build_default_task(cfg.data.num_reviews, cfg.run.seed, cfg.model.n_layer, cfg.model.n_embd,
                                  cfg.model.n_head, log=log)
    name = str(task.model_dir) if cfg.model.name == "embedded" else local_model(cfg.model.name, cfg.model.gguf_file, log)
    return name, task


def lora_targets(model, cfg: ModelConfig):
    if cfg.lora_targets:
        return list(cfg.lora_targets)
    return LORA_TARGETS.get(getattr(model.config, "model_type", ""), "all-linear")


def apply_lora(model, cfg: ModelConfig, task_type: str = "CAUSAL_LM", extra_trainable: list[str] | None = None):
    from peft import get_peft_model  # deferred: peft (and the bitsandbytes it imports) costs 2.5 s and 50 MiB in
    # every process, Ray worker and command, and only LoRA runs use it
    return fused_lora(get_peft_model(model, lora_config(model, cfg, task_type, extra_trainable)))


def fused_lora(peft_model):
    """peft_model with its plain LoRA linears computing the adapter's product in place (models/lora_linear.py)."""
    from rlfuse.models.lora_linear import fuse_lora_linears  # deferred with peft, which it imports: see apply_lora

    fuse_lora_linears(peft_model)
    return peft_model


def lora_config(model, cfg: ModelConfig, task_type: str | None = "CAUSAL_LM", extra_trainable: list[str] | None = None):
    """The run's LoRA settings for `model`. GPT-2's Conv1D stores weights (in, out) (peft's fan_in_fan_out), except
    once quantised: bitsandbytes layers are Linear, (out, in)."""
    from peft import LoraConfig  # deferred: see apply_lora

    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, target_modules=lora_targets(model, cfg),
                      task_type=task_type, modules_to_save=extra_trainable,
                      fan_in_fan_out=conv1d_layout(model) and not is_quantized(model))


def fuse_activations(model):
    """Swap transformers' `gelu_new` (tanh-GELU written as five tensor ops, each saving its input for backward) for
    torch's fused tanh-GELU: the same function (to 3e-7), one kernel forward and backward, and one saved tensor
    instead of five per MLP. Only modules change; the saved config and weights do not. Returns the model."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, NewGELUActivation):
                setattr(module, name, GELUTanh())
    return model


def load_causal_lm(name: str, cfg: ModelConfig | None = None, trainable_lora: bool | None = None,
                   precision: str = "auto", device="cpu"):
    """AutoModelForCausalLM from a hub name or folder; a saved peft adapter loads onto its base.
    With cfg.lora (and a plain model) fresh adapters are added. With cfg.quantization the base is quantised while it
    loads, onto `device` (precision: run.precision, the quantised layers' compute dtype); otherwise it loads on the
    CPU and the caller moves it."""
    name = local_model(name)
    check_model_folder(name)
    quant = quantized_load_kwargs(cfg.quantization if cfg is not None else "none", precision, device)
    fix_cpu_heap(device)
    try:
        if _is_adapter(name):
            from peft import AutoPeftModelForCausalLM  # deferred: see apply_lora

            model = fused_lora(AutoPeftModelForCausalLM.from_pretrained(name, is_trainable=bool(trainable_lora)))
        else:
            model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, **quant)
    except Exception as e:
        raise _load_error(name, e) from None
    check_finite_weights(model, name)
    fuse_activations(keep_one_cpu_layout(model))
    if cfg is not None and cfg.lora and not _is_adapter(name):
        model = apply_lora(model, cfg)
    return model


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def first_nonfinite_weight(model) -> str | None:
    """The name of the first floating-point parameter holding a NaN or an infinity, None if all are finite.
    Summed in float64 (no finite fp32 sum overflows there; NaN and inf propagate), so no (numel,) mask is allocated.
    Quantised (integer) storage and meta tensors are skipped. note: one device-to-host sync per parameter."""
    for n, p in model.named_parameters():
        if p.dtype not in FLOAT_DTYPES or p.is_meta or p.numel() == 0:
            continue
        total = p.detach().sum(dtype=torch.float64) if p.device.type != "mps" else p.detach().float().sum()
        if not torch.isfinite(total):
            return n
    return None


def _weights_file(name: str, tensor: str) -> str:
    """The file of folder `name` that holds `tensor` (the shard its index names), for an error to point at."""
    folder = Path(name).expanduser()
    if not _looks_local(name) or not folder.is_dir():
        return name
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (folder / index).is_file():
            with_prefix = json.loads((folder / index).read_text()).get("weight_map", {})
            short = tensor.split(".", 1)[-1]
            shard = with_prefix.get(tensor) or next((f for k, f in with_prefix.items() if k.endswith(short)), None)
            if shard:
                return str(folder / shard)
    for f in ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin"):
        if (folder / f).is_file():
            return str(folder / f)
    return name


_FINITE_CHECKED: set = set()
"""Weight files already checked in this process (folder, file names, sizes, times): RL loads one folder for up to
four roles, and each check is a pass over every weight."""


def _weights_key(name: str):
    folder = Path(name).expanduser()
    if not _looks_local(name) or not folder.is_dir():
        return None
    files = sorted(f for f in folder.iterdir() if f.suffix in (".safetensors", ".bin", ".pt"))
    return (str(folder.resolve()), tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))


def check_finite_weights(model, name: str) -> None:
    """A UserError naming the folder's weight file and the first tensor that holds NaN or inf: such a model's every
    logit is NaN, and sampling from it (or training it) cannot work."""
    key = _weights_key(name)
    if key is not None and key in _FINITE_CHECKED:
        return
    bad = first_nonfinite_weight(model)
    if bad is not None:
        raise UserError(f"model error: {_weights_file(name, bad)}: weight {bad} holds NaN or inf values, so every "
                        "output of the model would be NaN; re-run the stage that wrote it (a diverged run: lower the "
                        "learning rate), or point the setting that names it (model.name, rm.sft_path, rl.sft_path, "
                        "rl.rm_path) at another model folder")
    if key is not None:
        _FINITE_CHECKED.add(key)


def load_reward_model(name: str, cfg: ModelConfig | None = None, pad_token_id: int | None = None,
                      precision: str = "auto", device="cpu"):
    """Scalar-head model (AutoModelForSequenceClassification, one label) on a causal LM backbone. The score is
    read at the rightmost token that is not the pad id (transformers' pooling ignores the attention mask), so the pad
    id must be set in its config; with pad id = EOS id that is the last text token before the trailing EOS.

    `name`: a plain folder or hub name (a saved reward model, or a causal LM such as an SFT stage's merged model/,
    which gets a fresh head), or a saved reward-model adapter. An adapter-only SFT folder from an older rlfuse is
    merged in memory and its body copied into the reward model, so no temporary folder is ever referenced.
    cfg.quantization, precision and device: as in load_causal_lm."""
    name = local_model(name)
    check_model_folder(name)
    quant = quantized_load_kwargs(cfg.quantization if cfg is not None else "none", precision, device)
    fix_cpu_heap(device)
    adapter_task = _adapter_config(name).get("task_type") if _is_adapter(name) else None
    try:
        if adapter_task == "SEQ_CLS":  # a saved reward model with LoRA
            from peft import AutoPeftModelForSequenceClassification  # deferred: see apply_lora

            model = fused_lora(AutoPeftModelForSequenceClassification.from_pretrained(name, num_labels=1))
        elif adapter_task is not None:  # an older adapter-only SFT folder as backbone
            lm = load_causal_lm(name).merge_and_unload()
            model = AutoModelForSequenceClassification.from_pretrained(_adapter_base(name), num_labels=1,
                                                                       dtype=torch.float32)
            body = lambda m: getattr(m, m.base_model_prefix)
            body(model).load_state_dict(body(lm).state_dict())
        else:
            model = AutoModelForSequenceClassification.from_pretrained(name, num_labels=1, dtype=torch.float32, **quant)
    except UserError:
        raise
    except Exception as e:
        raise _load_error(name, e) from None
    check_finite_weights(model, name)
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    fuse_activations(keep_one_cpu_layout(model))
    if cfg is not None and cfg.lora and adapter_task != "SEQ_CLS":
        model = apply_lora(model, cfg, task_type="SEQ_CLS", extra_trainable=["score"])
    return model


# ---------------------------------------------------------------------------------------------- saving


def _write_atomically(out: Path, write) -> Path:
    """write(folder) into a temporary folder, then rename it over `out`: a crash leaves the previous folder whole."""
    with atomic_path(out) as tmp:
        try:
            write(tmp)
        except Exception as e:  # safetensors reports a failed write (disk full) as its own error with the OS's number
            if (number := re.search(r"os error (\d+)", str(e))) and not isinstance(e, OSError):
                code = int(number.group(1))
                raise OSError(code, os.strerror(code), str(out)) from e
            raise
    return out


def save_trained_model(model, tokenizer, stage_dir: str | Path, base: str) -> Path:
    """Save a stage's trained model so that it reloads as what was trained; returns stage_dir/model.

    - stage_dir/model: a plain transformers folder with LoRA merged in (AutoModelForCausalLM or
      AutoModelForSequenceClassification loads it without peft), tokenizer beside it, pad_token_id in its config.
    - stage_dir/adapter (peft models only): the adapter, its base_model_name_or_path set to `base`, the folder or hub
      name the stage started from (it must outlive the run), so PeftModel.from_pretrained(Auto...(base), adapter)
      gives the same model. A stale adapter/ from an earlier run without LoRA is removed.
    The in-memory model is not changed (see merged_state_dict)."""
    stage_dir = Path(stage_dir)
    stage_dir.mkdir(parents=True, exist_ok=True)
    if Path(base).exists():  # a folder: absolute, so the adapter loads from any working directory
        base = str(Path(base).resolve())
    plain = model.get_base_model() if hasattr(model, "peft_config") else model

    def write_model(folder: Path):
        if is_quantized(plain):  # the merged weights are full precision: a plain folder, no quantization_config
            save_plain(plain.config, merged_state_dict(model), folder)
        else:
            plain.save_pretrained(folder, state_dict=merged_state_dict(model))
        tokenizer.save_pretrained(folder)
        cfg_path = folder / "config.json"
        config = json.loads(cfg_path.read_text())
        if config.get("pad_token_id") is None and tokenizer.pad_token_id is not None:
            config["pad_token_id"] = tokenizer.pad_token_id  # the reward model reads its score at the last non-pad
            cfg_path.write_text(json.dumps(config, indent=2))

    def write_adapter(folder: Path):
        model.save_pretrained(folder, selected_adapters=[model.active_adapter])  # a shared base holds other roles' too
        tokenizer.save_pretrained(folder)
        cfg_path = folder / "adapter_config.json"
        config = json.loads(cfg_path.read_text()) | {"base_model_name_or_path": str(base)}
        cfg_path.write_text(json.dumps(config, indent=2))

    model_dir = _write_atomically(stage_dir / "model", write_model)
    if hasattr(model, "peft_config"):
        _write_atomically(stage_dir / "adapter", write_adapter)
    else:
        shutil.rmtree(stage_dir / "adapter", ignore_errors=True)
    return model_dir


def save_plain(config, state: dict, folder: Path) -> None:
    """A plain transformers folder from a config and full-precision tensors (a quantised model's merged weights):
    the config without its quantization_config, the tensors as model.safetensors."""
    folder.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)
    save_file({k: (v.float() if v.is_floating_point() else v).detach().cpu().contiguous() for k, v in state.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})


def model_of_shape(shape: ModelShape, device: str):
    """A causal LM of `shape` with seeded random weights (GPT-2, or Llama for a gated shape): what the machine profile
    times in place of the policy itself."""
    torch.manual_seed(0)
    if shape.gated:
        cfg = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                          num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                          num_key_value_heads=shape.kv_heads or shape.heads, max_position_embeddings=shape.context,
                          bos_token_id=0, eos_token_id=0, pad_token_id=0)
        return LlamaForCausalLM(cfg).to(device)
    cfg = GPT2Config(vocab_size=shape.vocab, n_positions=shape.context, n_embd=shape.hidden, n_layer=shape.layers,
                     n_head=shape.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0, pad_token_id=0)
    return GPT2LMHeadModel(cfg).to(device)
