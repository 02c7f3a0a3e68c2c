"""Model folders that cannot work, and sampling settings or weights that are not finite, as a new user meets them:
each is refused in one line naming the folder (or file, or flag) and the fix, before a stage trains or samples,
never trained on (exit 0) or ended in an index error."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

from rlfuse.models.tiny import make_tiny_model, tiny_tokenizer
from rlfuse import api
from rlfuse.cli import main
from rlfuse.errors import UserError
from rlfuse.models.load import load_causal_lm, load_reward_model, load_tokenizer
from rlfuse.rollout.engine import DecodeEngine, SamplingParams

TEXTS = ["the movie was good and the actors were great", "a bad film with a dull plot", "i really liked it"] * 30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", TEXTS)


def copy_without_tokenizer(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in ("config.json", "model.safetensors", "generation_config.json"):
        if (src / f).exists():
            shutil.copy(src / f, dst / f)
    return dst


def with_nan_weight(src: Path, dst: Path, tensor: str = "transformer.h.1.mlp.c_fc.weight") -> Path:
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    state[tensor][0, 0] = float("nan")
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    return err.splitlines()[-1]


# ------------------------------------------------------------------------ class 1: what a stage loads


def test_the_tiny_model_and_its_tokenizer_pass(tiny):
    tok = load_tokenizer(str(tiny))
    assert len(tok(" the movie").input_ids) > 1 and tok.pad_token_id is not None
    load_causal_lm(str(tiny))


def test_a_folder_without_tokenizer_files_is_refused_naming_it(tiny, tmp_path):
    # transformers builds a one-token tokenizer for such a folder that encodes every text to nothing; SFT and RL
    # trained on it with exit 0
    folder = copy_without_tokenizer(tiny, tmp_path / "no-tokenizer")
    with pytest.raises(UserError, match="has no tokenizer files") as e:
        load_tokenizer(str(folder))
    assert str(folder) in str(e.value) and "save_pretrained" in str(e.value)


def test_a_saved_tokenizer_that_encodes_text_to_nothing_is_refused(tiny, tmp_path):
    # what the earlier runs saved beside their model: vocab.json and merges.txt of a one-token tokenizer
    from transformers import AutoTokenizer

    folder = copy_without_tokenizer(tiny, tmp_path / "empty-tokenizer")
    AutoTokenizer.from_pretrained(folder).save_pretrained(folder)
    assert (folder / "vocab.json").is_file() or (folder / "tokenizer.json").is_file()
    with pytest.raises(UserError, match="its tokenizer .*encodes .* to nothing") as e:
        load_tokenizer(str(folder))
    assert str(folder) in str(e.value)


def test_a_tokenizer_larger_than_the_embedding_is_refused(tmp_path):
    folder = tmp_path / "small-embedding"
    tok = tiny_tokenizer(TEXTS, 400)
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=1, n_head=2)).save_pretrained(folder)
    tok.save_pretrained(folder)
    assert len(tok) > 64
    with pytest.raises(UserError, match=rf"tokenizer has {len(tok)} tokens but the model's embedding has 64 rows"):
        load_tokenizer(str(folder))


def test_nan_weights_are_refused_at_load_naming_the_file_and_tensor(tiny, tmp_path):
    folder = with_nan_weight(tiny, tmp_path / "nan")
    for load in (load_causal_lm, load_reward_model):
        with pytest.raises(UserError, match=r"weight transformer\.h\.1\.mlp\.c_fc\.weight holds NaN or inf") as e:
            load(str(folder))
        assert str(folder / "model.safetensors") in str(e.value)


def test_inf_weights_are_refused_too(tiny, tmp_path):
    folder = tmp_path / "inf"
    shutil.copytree(tiny, folder)
    state = load_file(folder / "model.safetensors")
    state["transformer.ln_f.bias"][3] = float("-inf")
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"transformer\.ln_f\.bias holds NaN or inf"):
        load_causal_lm(str(folder))


def test_sft_on_a_folder_without_tokenizer_stops_before_training(tiny, tmp_path, capsys):
    folder = copy_without_tokenizer(tiny, tmp_path / "no-tokenizer")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    code = main(["sft", f"model.name={folder}", "data.kind=jsonl", f"data.path={data}", f"run.dir={tmp_path / 'run'}",
                 "sft.steps=2", "run.quiet=true"])
    assert code == 2
    assert "has no tokenizer files" in one_line(capsys)
    assert not (tmp_path / "run" / "sft" / "model").exists()


def test_a_truncated_gguf_file_is_one_line(tmp_path):
    from rlfuse.models.gguf import local_model

    bad = tmp_path / "cut.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00\x05")  # the magic and a version, then the file ends
    with pytest.raises(UserError, match="transformers cannot read"):
        local_model(str(bad))


# ------------------------------------------------------------------------ class 4: sampling inputs, non-finite weights


@pytest.mark.parametrize("flags,named", [
    (["--temperature", "nan"], "--temperature nan"),
    (["--temperature", "inf"], "--temperature inf"),
    (["--temperature", "-1"], "--temperature -1.0"),
    (["--top-p", "nan"], "--top-p nan"),
    (["-n", "100000"], "-n 100000"),
])
def test_generate_refuses_sampling_settings_in_one_line_naming_the_flag(tiny, capsys, flags, named):
    assert main(["generate", str(tiny), "--prompt", "the movie", *flags]) == 2
    line = one_line(capsys)
    assert line.startswith(f"rlfuse generate: {named}:"), line


def test_the_api_refuses_them_before_loading_anything():
    for kwargs in ({"temperature": float("nan")}, {"temperature": float("inf")}, {"n": api.GENERATE_MAX_N + 1},
                   {"top_p": float("nan")}):
        with pytest.raises(UserError, match="e.g."):
            api.generate("/no/such/model", "hi", **kwargs)


def test_generate_from_nan_weights_is_one_line_not_an_index_error(tiny, tmp_path, capsys):
    folder = with_nan_weight(tiny, tmp_path / "nan")
    assert main(["generate", str(folder), "--prompt", "the movie"]) == 2
    assert "holds NaN or inf" in one_line(capsys)


def _engine(tiny, fast: bool = True):
    tok = load_tokenizer(str(tiny))
    model = load_causal_lm(str(tiny)).eval()
    return DecodeEngine(model, tok.eos_token_id, tokenizer=tok, fast_decode=fast), tok, model


@pytest.mark.parametrize("fast", [True, False], ids=["fast-step", "transformers-forward"])
def test_the_sampler_names_the_nan_weight_when_weights_go_bad_after_loading(tiny, fast):
    # (as an RL update could leave them): the first step's logits are NaN, the sampler draws the id past the vocabulary
    engine, tok, model = _engine(tiny, fast)
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight[0, :] = float("nan")
    with pytest.raises(UserError, match=r"logits are not finite at step 1 .*its weights hold NaN/inf \(first: "
                                        r"transformer\.h\.0\.attn\.c_attn\.weight\)"):
        list(engine.generate([tok("the movie").input_ids], 2, SamplingParams(8), seed=0))


def test_the_sampler_says_an_overflow_when_the_weights_are_finite(tiny):
    engine, tok, model = _engine(tiny)
    with torch.no_grad():
        model.transformer.ln_f.weight.fill_(3e38)  # finite, but the logits overflow to inf and softmax to NaN
    with pytest.raises(UserError, match="though its weights are finite .*the forward overflowed"):
        list(engine.generate([tok("the movie").input_ids], 1, SamplingParams(8), seed=0))


@pytest.mark.parametrize("params", [SamplingParams(8, float("nan")), SamplingParams(8, float("inf")),
                                    SamplingParams(8, 0.0), SamplingParams(8, 1.0, 0, float("nan"))],
                         ids=["nan", "inf", "zero", "top_p-nan"])
def test_the_engine_refuses_temperatures_that_are_not_finite_and_positive(tiny, params):
    engine, tok, _ = _engine(tiny)
    with pytest.raises(UserError, match="sampling: (temperature|top_p)"):
        engine.generate([tok("the movie").input_ids], 1, params, seed=0)


def test_finite_weights_sample_as_before(tiny):
    engine, tok, _ = _engine(tiny)
    samples = list(engine.generate([tok("the movie").input_ids], 3, SamplingParams(6), seed=0))
    assert len(samples) == 3 and all(0 < len(s.token_ids) <= 6 for s in samples)
    assert all(torch.isfinite(s.logprobs).all() for s in samples)


def test_generate_names_its_flag_when_new_tokens_leave_no_room_for_the_prompt(tiny, capsys):
    assert main(["generate", str(tiny), "--prompt", "the movie", "--max-new-tokens", "100000"]) == 2
    assert one_line(capsys).startswith("rlfuse generate: --max-new-tokens 100000: leaves no room for a prompt in "
                                       "the model's context of 256 tokens")


def test_an_empty_prompt_without_bos_is_one_line(tiny, tmp_path, capsys):
    # a tokenizer without BOS (Qwen's) encodes "" to no token at all: nothing to prefill
    folder = tmp_path / "no-bos"
    shutil.copytree(tiny, folder)
    tok = load_tokenizer(str(folder))
    tok.bos_token = None
    tok.save_pretrained(folder)
    assert load_tokenizer(str(folder)).bos_token_id is None
    assert main(["generate", str(folder), "--prompt", "the movie", "--prompt", "", "--max-new-tokens", "4"]) == 2
    assert one_line(capsys) == ("rlfuse generate: --prompt: prompt 2 encodes to no tokens (the tokenizer puts no BOS "
                                "in front of an empty text); give it some text")
