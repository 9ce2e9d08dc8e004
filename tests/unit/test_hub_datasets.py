"""DAPO-Math-17K / AIME-2024 loaders on small local files in the published layouts (never the hub)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_rl_spec.data import hub_datasets as hd
from nemo_rl_spec.data.hub_datasets import (
    AIME_2024_REPO,
    DAPO_MATH_17K_REPO,
    DAPO_PREFIX,
    DAPO_SUFFIX,
    load_aime_2024,
    load_dapo_math_17k,
    problem_from_record,
    read_records,
)

# Made-up problems in DAPO's verl layout; answers checked by hand: 2^10 = 1024 = 7*146 + 2; 3+4+5 = 12;
# gcd(84, 120) = 12.
DAPO_PROBLEMS = [
    ("What is the remainder when $2^{10}$ is divided by $7$?", "2"),
    ("Compute $3+4+5$.", "12"),
    ("Find $\\gcd(84, 120)$.", "12"),
]


def dapo_record(question: str, answer: str, index: int) -> dict:
    return {
        "data_source": "math_dapo",
        "prompt": [{"content": DAPO_PREFIX + question + DAPO_SUFFIX, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": f"uid-{index}"},
    }


def dapo_records() -> list[dict]:
    """The published file repeats problems: here 0, 1, 0, 2, 1 -> 3 distinct, in first-seen order 0, 1, 2."""
    order = [0, 1, 0, 2, 1]
    return [dapo_record(*DAPO_PROBLEMS[k], index=i) for i, k in enumerate(order)]


AIME_RECORDS = [  # HuggingFaceH4/aime_2024 columns; made-up statements
    {
        "id": 60,
        "problem": "Let $x = 5$. Find $x^2 + 1$.",
        "solution": "25 + 1",
        "answer": "26",
        "url": "https://example.invalid/1",
        "year": "2024",
    },
    {
        "id": 61,
        "problem": "How many positive divisors does $36$ have?",
        "solution": "(2+1)(2+1)",
        "answer": "9",
        "url": "https://example.invalid/2",
        "year": "2024",
    },
]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_parquet(path: Path, records: list[dict]) -> Path:
    pa = pytest.importorskip("pyarrow", reason="pyarrow not installed: parquet layout not testable here")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def never_download(repo_id: str) -> Path:
    raise AssertionError(f"tried to download {repo_id}")


def test_dapo_jsonl_strips_instruction_and_drops_repeats(tmp_path):
    path = write_jsonl(tmp_path / "dapo-math-17k.jsonl", dapo_records())
    problems = load_dapo_math_17k(path, downloader=never_download)
    assert problems == [{"question": q, "answer": a, "source": "dapo_math_17k"} for q, a in DAPO_PROBLEMS]


def test_dapo_keep_repeats_and_max_samples_counts_distinct(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", dapo_records())
    assert [p["answer"] for p in load_dapo_math_17k(path, dedup=False, downloader=never_download)] == [
        "2",
        "12",
        "2",
        "12",
        "12",
    ]
    first_two = load_dapo_math_17k(path, max_samples=2, downloader=never_download)
    assert [p["question"] for p in first_two] == [DAPO_PROBLEMS[0][0], DAPO_PROBLEMS[1][0]]
    with pytest.raises(ValueError, match="max_samples must be >= 1"):
        load_dapo_math_17k(path, max_samples=0)


def test_dapo_parquet_with_nested_columns_matches_jsonl(tmp_path):
    records = dapo_records()
    from_parquet = load_dapo_math_17k(
        write_parquet(tmp_path / "dapo-math-17k.parquet", records), downloader=never_download
    )
    from_jsonl = load_dapo_math_17k(write_jsonl(tmp_path / "dapo.jsonl", records), downloader=never_download)
    assert from_parquet == from_jsonl and len(from_parquet) == 3


def test_aime_flat_layout_jsonl_and_parquet(tmp_path):
    expected = [
        {"question": "Let $x = 5$. Find $x^2 + 1$.", "answer": "26", "source": "aime_2024"},
        {"question": "How many positive divisors does $36$ have?", "answer": "9", "source": "aime_2024"},
    ]
    assert load_aime_2024(write_jsonl(tmp_path / "aime.jsonl", AIME_RECORDS), downloader=never_download) == expected
    data = tmp_path / "snapshot" / "data"
    data.mkdir(parents=True)
    write_parquet(data / "train-00000-of-00001.parquet", AIME_RECORDS)
    assert load_aime_2024(tmp_path / "snapshot", downloader=never_download) == expected


def test_aime_in_verl_layout_with_integer_answers(tmp_path):
    # BytedTsinghua-SIA/AIME-2024 style: verl layout, each problem repeated; ground truth may be an int
    rec = dapo_record("Find $2 \\cdot 21$.", "42", 0)
    rec["reward_model"]["ground_truth"] = 42
    problems = load_aime_2024(write_jsonl(tmp_path / "aime.jsonl", [rec] * 32), downloader=never_download)
    assert problems == [{"question": "Find $2 \\cdot 21$.", "answer": "42", "source": "aime_2024"}]


def test_directory_reads_every_file_in_sorted_order(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", [dapo_record(*DAPO_PROBLEMS[2], index=2)])
    write_jsonl(tmp_path / "a.jsonl", [dapo_record(*DAPO_PROBLEMS[0], index=0)])
    (tmp_path / "c.json").write_text(json.dumps([dapo_record(*DAPO_PROBLEMS[1], index=1)]))
    (tmp_path / "README.md").write_text("not data")
    assert [p["answer"] for p in load_dapo_math_17k(tmp_path, downloader=never_download)] == ["2", "12", "12"]


def test_hub_path_calls_downloader_with_repo(tmp_path):
    write_jsonl(tmp_path / "dapo.jsonl", dapo_records())
    calls = []

    def fake_download(repo_id):
        calls.append(repo_id)
        return tmp_path

    assert len(load_dapo_math_17k(downloader=fake_download)) == 3
    assert len(load_aime_2024(downloader=fake_download)) == 3
    assert calls == [DAPO_MATH_17K_REPO, AIME_2024_REPO]


def test_download_uses_snapshot_download_for_a_dataset_repo(tmp_path, monkeypatch):
    import huggingface_hub

    seen = {}

    def fake_snapshot_download(**kwargs):
        seen.update(kwargs)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert hd.download(AIME_2024_REPO) == tmp_path
    assert seen["repo_id"] == AIME_2024_REPO and seen["repo_type"] == "dataset"
    assert "*.parquet" in seen["allow_patterns"]

    def offline(**kwargs):
        raise OSError("offline and not cached")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(RuntimeError, match=f"could not get dataset {DAPO_MATH_17K_REPO}.*offline and not cached"):
        load_dapo_math_17k()


def test_strip_leaves_unwrapped_text_alone():
    rec = {
        "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": " What is 1+1? "}],
        "reward_model": {"ground_truth": " 2 "},
    }
    assert problem_from_record(rec, "x") == {"question": "What is 1+1?", "answer": "2", "source": "x"}


@pytest.mark.parametrize(
    "record, match",
    [
        ({"question_text": "q", "answer": "1"}, "none of the fields"),
        ({"problem": "q"}, "none of the fields"),
        ({"problem": "   ", "answer": "1"}, "empty question or answer"),
        ({"prompt": [{"role": "assistant", "content": "x"}], "reward_model": {"ground_truth": "1"}}, "without a user"),
        ({"prompt": "q", "reward_model": {"style": "rule"}}, "empty question or answer"),
    ],
)
def test_bad_records_are_named(record, match):
    with pytest.raises(ValueError, match=match):
        problem_from_record(record, "dapo_math_17k", where="f.jsonl record 3")


def test_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "q", "answer": "1"}\n{not json\n')
    with pytest.raises(ValueError, match=f"{bad}:2: not a JSON object"):
        read_records(bad)
    with pytest.raises(FileNotFoundError, match="dataset file not found"):
        read_records(tmp_path / "missing.parquet")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported data file type '.csv'"):
        read_records(tmp_path / "x.csv")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no .parquet/.jsonl/.json files"):
        load_aime_2024(empty, downloader=never_download)
    (tmp_path / "obj.json").write_text('{"problem": "q"}')
    with pytest.raises(ValueError, match="expected a JSON list"):
        read_records(tmp_path / "obj.json")
