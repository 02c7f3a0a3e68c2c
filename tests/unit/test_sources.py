import gzip
import json

import pytest

from helpers import HH_JSONL, IMDB_CSV
from rlfuse.config import load_config
from rlfuse.data.sources import hh_messages, hh_pairs, imdb_reviews, read_records, split_hh
from rlfuse.data.stages import preference_pairs, rl_prompts, sft_examples
from rlfuse.errors import DataError

needs_imdb = pytest.mark.skipif(not IMDB_CSV.exists(), reason=f"shared data file {IMDB_CSV} not present")
needs_hh = pytest.mark.skipif(not HH_JSONL.exists(), reason=f"shared data file {HH_JSONL} not present")


def cfg_for(kind, path, *extra):
    return load_config(None, [f"data.kind={kind}", f"data.path={path}", *extra])


def test_empty_file(tmp_path):
    p = tmp_path / "empty.csv"
    p.write_text("")
    with pytest.raises(DataError, match="file is empty"):
        read_records(p)


def test_header_only_csv_has_no_rows(tmp_path):
    p = tmp_path / "h.csv"
    p.write_text("review,sentiment\n")
    with pytest.raises(DataError, match="no rows"):
        imdb_reviews(cfg_for("imdb", p))


def test_missing_column_names_it_and_the_fix(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text("text,stars\nhello,5\n")
    with pytest.raises(DataError) as err:
        imdb_reviews(cfg_for("imdb", p))
    assert "missing column 'label'" in str(err.value) and "data.label_column" in str(err.value)


def test_non_utf8_names_the_line(tmp_path):
    p = tmp_path / "latin.csv"
    p.write_bytes(b"review,sentiment\ngood film,positive\ncaf\xe9 scene,negative\n")
    with pytest.raises(DataError, match=r"not UTF-8 .*line 3"):
        read_records(p)


def test_bad_json_line(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"chosen": "a", "rejected": "b"}\n{oops\n')
    with pytest.raises(DataError, match="line 2 is not valid JSON"):
        read_records(p)


def test_empty_text_rows_are_skipped_and_counted(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text('review,sentiment\ngood,positive\n"",negative\n  ,positive\nbad,negative\n')
    logs = []
    rows = imdb_reviews(cfg_for("imdb", p), log=logs.append)
    assert rows == [("good", 1), ("bad", 0)]
    assert any("skipped 2 rows" in line for line in logs)


def test_all_empty_is_an_error(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"chosen": "", "rejected": ""}\n')
    with pytest.raises(DataError, match="no usable rows"):
        hh_pairs(cfg_for("hh_rlhf", p))


def test_generic_jsonl_with_column_mapping(tmp_path):
    p = tmp_path / "x.jsonl.gz"
    rows = [{"q": f"question {i}", "a": f"answer {i}", "good": "yes", "bad": "no"} for i in range(30)]
    p.write_bytes(gzip.compress("\n".join(json.dumps(r) for r in rows).encode()))
    cfg = cfg_for("jsonl", p, "data.prompt_column=q", "data.response_column=a", "data.chosen_column=good",
                  "data.rejected_column=bad")
    train, held = sft_examples(cfg, None)
    assert len(train) + len(held) == 30 and train[0].prompt.startswith("question")
    pairs, _ = preference_pairs(cfg, None)
    assert pairs[0].chosen == "yes" and pairs[0].rejected == "no"
    prompts, _ = rl_prompts(cfg, None)
    assert all(p.startswith("question") for p in prompts)


def test_generic_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "x.parquet"
    pq.write_table(pa.table({"body": ["one text", "two text", "three"]}), p)
    train, held = sft_examples(cfg_for("parquet", p, "data.text_column=body"), None)
    assert sorted(e.response for e in train + held) == ["one text", "three", "two text"]


def test_split_hh():
    assert split_hh("\n\nHuman: hi\n\nAssistant: hello\n\nHuman: bye\n\nAssistant: ciao") == (
        "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: bye\n\nAssistant:", "ciao")


def test_hh_transcripts_as_chat_messages():
    prompt, reply = split_hh("\n\nHuman: hi\n\nAssistant: hello\n\nHuman: bye\n\nAssistant: ciao")
    assert hh_messages(prompt) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                                   {"role": "user", "content": "bye"}]
    assert reply == "ciao"


@needs_hh
def test_real_hh_rlhf_as_conversations():
    """data.conversational: the same pairs, each a user/assistant message list ending on the user's turn, and one
    assistant reply each (what a chat model's template renders)."""
    pairs = hh_pairs(cfg_for("hh_rlhf", HH_JSONL, "data.conversational=true"))
    plain = hh_pairs(cfg_for("hh_rlhf", HH_JSONL))
    assert len(pairs) == len(plain) >= 1700
    for p, q in zip(pairs[:100], plain[:100]):
        assert p.prompt[-1]["role"] == "user" and [m["role"] for m in p.prompt[::2]] == ["user"] * len(p.prompt[::2])
        assert p.chosen == [{"role": "assistant", "content": q.chosen}] and p.rejected[0]["content"] == q.rejected


@needs_imdb
def test_real_imdb_csv():
    rows = imdb_reviews(cfg_for("imdb", IMDB_CSV))
    assert len(rows) >= 1900 and {y for _, y in rows} == {0, 1}
    assert all("<br" not in t for t, _ in rows)
    pairs, held = preference_pairs(cfg_for("imdb", IMDB_CSV, "rm.num_pairs=100"), None)
    assert len(pairs) == 100 and len(held) >= 64


@needs_hh
def test_real_hh_rlhf_jsonl_gz():
    pairs = hh_pairs(cfg_for("hh_rlhf", HH_JSONL))
    assert len(pairs) >= 1700
    assert all(p.prompt.endswith("Assistant:") and p.chosen != p.rejected for p in pairs[:100])


def _hh_file(tmp_path, n_usable):
    """hh-rlhf rows: n_usable usable ones, plus one whose chosen equals its rejected (not usable)."""
    rows = [{"chosen": f"\n\nHuman: q{i}\n\nAssistant: yes {i}", "rejected": f"\n\nHuman: q{i}\n\nAssistant: no {i}"}
            for i in range(n_usable)]
    rows.append({"chosen": "\n\nHuman: same\n\nAssistant: same", "rejected": "\n\nHuman: same\n\nAssistant: same"})
    p = tmp_path / "hh.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows))
    return cfg_for("hh_rlhf", p)


@pytest.mark.parametrize("stage", [sft_examples, preference_pairs, rl_prompts])
def test_too_few_usable_rows_is_a_data_error_with_the_count(tmp_path, stage):
    with pytest.raises(DataError, match="no usable rows"):
        stage(_hh_file(tmp_path, 0), None)
    with pytest.raises(DataError) as err:
        stage(_hh_file(tmp_path, 1), None)
    msg = str(err.value)
    assert "hh.jsonl" in msg and "1 usable" in msg and "at least 2" in msg and "one to train on" in msg
    train, held = stage(_hh_file(tmp_path, 2), None)  # two rows: one to train on, one held out
    assert len(train) == 1 and len(held) == 1


def test_one_usable_imdb_review_is_a_data_error(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text('review,sentiment\ngood film,positive\n"",negative\nfine,unknown\n')
    for stage in (sft_examples, preference_pairs, rl_prompts):
        with pytest.raises(DataError, match=r"x\.csv: 1 usable .*at least 2"):
            stage(cfg_for("imdb", p), None)


def test_split_holdout_always_leaves_one_to_train_on():
    from rlfuse.data.sources import split_holdout

    assert [len(s) for s in split_holdout([1, 2], 0.49, 0)] == [1, 1]
    assert [len(s) for s in split_holdout(list(range(100)), 0.05, 0)] == [95, 5]
    with pytest.raises(DataError, match="0 usable rows"):
        split_holdout([], 0.05, 0)
