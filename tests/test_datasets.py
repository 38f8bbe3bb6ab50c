"""Dataset files with verl-style fields: loading, errors that name the field, file and line, scoring."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from quads.tasks import DatasetTask, get_task, load_dataset
from quads.tasks.datasets import extract_answer, math_score

RECORDS = [
    {"prompt": [{"role": "user", "content": "What is 2+3?"}], "data_source": "gsm8k",
     "reward_model": {"ground_truth": "5", "style": "rule"}, "extra_info": {"index": 0}},
    {"prompt": "Q: 3+4*5=\n", "ground_truth": 23, "data_source": "arithmetic"},
    {"prompt": "Half of 1?", "answer": "1/2"},
]


def _write_jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_jsonl_and_parquet_load_the_same(tmp_path):
    a = load_dataset(_write_jsonl(tmp_path / "d.jsonl", RECORDS))
    pq.write_table(pa.Table.from_pylist(RECORDS[:1] * 2), tmp_path / "d.parquet")
    b = load_dataset(tmp_path / "d.parquet")
    assert [(e.prompt, e.answer, e.data_source) for e in a] == [
        ("What is 2+3?", "5", "gsm8k"), ("Q: 3+4*5=\n", "23", "arithmetic"), ("Half of 1?", "1/2", "math")]
    assert a[0].meta["messages"][0]["role"] == "user" and a[0].meta["index"] == 0
    assert [(e.prompt, e.answer, e.data_source) for e in b] == [(a[0].prompt, "5", "gsm8k")] * 2


@pytest.mark.parametrize("record,match", [
    ({"ground_truth": "1"}, "line 2: missing field 'prompt'"),
    ({"prompt": "x"}, r"line 2: missing the reference answer: none of the fields \['reward_model.ground_truth'"),
    ({"prompt": 5, "answer": "1"}, "line 2: field 'prompt' must be a string"),
    ({"prompt": [{"role": "user"}], "answer": "1"}, "line 2: prompt message 0 needs"),
])
def test_missing_fields_name_field_file_and_line(tmp_path, record, match):
    path = _write_jsonl(tmp_path / "bad.jsonl", [RECORDS[1], record])
    with pytest.raises(ValueError, match=match) as err:
        load_dataset(path)
    assert "bad.jsonl" in str(err.value)


def test_parquet_error_names_row(tmp_path):
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}]),
                   tmp_path / "p.parquet")
    with pytest.raises(ValueError, match=r"p.parquet row 1: missing the reference answer"):
        load_dataset(tmp_path / "p.parquet")


def test_bad_json_and_format(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{oops\n')
    with pytest.raises(ValueError, match="x.jsonl line 2: not valid JSON"):
        load_dataset(tmp_path / "x.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported dataset format"):
        load_dataset(tmp_path / "x.csv")
    with pytest.raises(ValueError, match="does not exist"):
        load_dataset(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("response,answer,correct", [
    ("so \\boxed{5}", "5", True), ("#### 1,000", "1000", True), ("The answer is 0.5.", "1/2", True),
    ("#7", "5", False), ("no answer here", "5", False), ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True),
    ("#", "5", False),
])
def test_math_answer_check(response, answer, correct):
    from quads.tasks import Example

    s = math_score(Example("q", answer, "math", {}), response)
    assert s.correct is correct, (response, s)


def test_extract_answer_order():
    assert extract_answer("#3 then \\boxed{4}") == "4"
    assert extract_answer("x #12 y") == "12"
    assert extract_answer("nothing") is None


def test_dataset_task_splits_and_verifier_by_data_source(tmp_path):
    records = [{"prompt": f"Q: {i}+1=\n", "answer": str(i + 1), "data_source": "arithmetic"} for i in range(200)]
    path = _write_jsonl(tmp_path / "arith.jsonl", records)
    task = get_task("dataset", path=path)
    assert isinstance(task, DatasetTask)
    train, test = task.examples("train"), task.examples("test")
    assert len(train) + len(test) == 200 and 5 <= len(test) <= 40
    assert {e.prompt for e in train}.isdisjoint({e.prompt for e in test})
    ex = test[0]
    assert task.score(ex, f"#{ex.answer}").correct
    assert task.score(ex, "#-1").reason.startswith("wrong answer")
    assert task.score(ex, "no marker").reason.startswith("no final answer marker")  # arithmetic verifier
