"""Cluster datasets from the Hugging Face hub: DAPO-Math-17K (training) and AIME-2024 (validation).

These are the papers' data (docs/design/methods.md section 1: Qwen3-8B on DAPO-Math-17K, validated on AIME-2024). They are
read from local files when ``path`` is given (a file or a directory of files), otherwise downloaded once into the
hub cache with ``huggingface_hub.snapshot_download`` (clusters; never in tests or on the CPU stack, whose data is
offline). Accepted file formats: ``.parquet`` (needs pyarrow), ``.jsonl``, ``.json`` (a list of records). The
record layouts understood (verl/DAPO and flat): :func:`problem_from_record`; DAPO's instruction wrapper is removed
and exact (question, answer) duplicates are dropped.

Every loader returns :class:`~nemo_rl_spec.data.interfaces.MathProblem` dicts in file order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable

from nemo_rl_spec.data.interfaces import MathProblem

DAPO_MATH_17K = "dapo_math_17k"
AIME_2024 = "aime_2024"
DAPO_MATH_17K_REPO = "BytedTsinghua-SIA/DAPO-Math-17k"
AIME_2024_REPO = "HuggingFaceH4/aime_2024"
DATA_SUFFIXES = (".parquet", ".jsonl", ".json")
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """All records of a data file, or of every data file under a directory (sorted by relative path).

    Raises:
        FileNotFoundError: ``path`` does not exist, or a directory holds no .parquet/.jsonl/.json file.
        ValueError: unsupported suffix, or a malformed JSON line (file and line named).
        ModuleNotFoundError: a .parquet file without pyarrow installed.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in DATA_SUFFIXES and ".cache" not in p.parts)
        if not files:
            raise FileNotFoundError(f"no {'/'.join(DATA_SUFFIXES)} files under {path}")
        return [record for f in files for record in read_records(f)]
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # lazy: pyarrow only for hub parquet files
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(f"reading {path} needs pyarrow: pip install pyarrow") from exc
        return pq.read_table(path).to_pylist()
    if path.suffix == ".jsonl":
        records = []
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{lineno}: not a JSON object: {exc}") from None
        return records
    if path.suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
        return data
    raise ValueError(f"{path}: unsupported data file type {path.suffix!r} (use {', '.join(DATA_SUFFIXES)})")


def download(
    repo_id: str,
    allow_patterns: Iterable[str] = ("*.parquet", "*.jsonl", "*.json"),
    cache_dir: str | Path | None = None,
    revision: str | None = None,
) -> Path:
    """Download (or find in the hub cache) a dataset repository's data files; the local snapshot directory.

    With ``HF_HUB_OFFLINE=1`` only the cache is used. Raises whatever ``huggingface_hub`` raises when the files
    are neither cached nor reachable, with the repository named.
    """
    from huggingface_hub import snapshot_download  # lazy: only the explicit download path

    try:
        return Path(
            snapshot_download(
                repo_id=repo_id,
                repo_type="dataset",
                allow_patterns=list(allow_patterns),
                cache_dir=cache_dir,
                revision=revision,
            )
        )
    except Exception as exc:
        raise RuntimeError(
            f"could not get dataset {repo_id} from the hub or its cache ({type(exc).__name__}: {exc}); download it "
            f"where the hub is reachable (huggingface-cli download --repo-type dataset {repo_id} --local-dir DIR) "
            f"and set the recipe's data path to DIR"
        ) from exc


def _first(record: dict[str, Any], keys: tuple[str, ...], where: str) -> Any:
    for key in keys:
        if record.get(key) is not None:
            return record[key]
    raise ValueError(f"{where}: none of the fields {list(keys)} in record with keys {sorted(record)}")


def _strip_dapo_instruction(text: str) -> str:
    """The problem inside DAPO's "Solve ... Answer: $Answer ... Remember ..." wrapper (unchanged if absent)."""
    text = text.strip()
    if text.startswith(DAPO_PREFIX.strip()):
        text = text[len(DAPO_PREFIX.strip()) :]
    if text.endswith(DAPO_SUFFIX.strip()):
        text = text[: -len(DAPO_SUFFIX.strip())]
    return text.strip()


def problem_from_record(record: dict[str, Any], source: str, where: str = "record") -> MathProblem:
    """One :class:`MathProblem` from a verl/DAPO or a flat record.

    Record layouts understood (both datasets are published in one of these):

    - verl/DAPO layout (``BytedTsinghua-SIA/DAPO-Math-17k``, ``BytedTsinghua-SIA/AIME-2024``)::

          {"data_source": "math_dapo",
           "prompt": [{"role": "user", "content": "Solve the following math problem step by step. The last line of
                       your response should be of the form Answer: $Answer ... \\n\\n<problem>\\n\\nRemember to put
                       your answer on its own line after \\"Answer:\\"."}],
           "ability": "MATH", "reward_model": {"ground_truth": "34", "style": "rule-lighteval/MATH_v2"},
           "extra_info": {"index": "..."}}

      The DAPO instruction wrapper is removed (this project asks for ``\\boxed{}`` in ``data.system_prompt``); the
      published DAPO file repeats each problem many times, so exact (question, answer) duplicates are dropped.
    - flat layout (``HuggingFaceH4/aime_2024``: id, problem, solution, answer, url, year): ``problem`` (or
      ``question``/``Problem``) and ``answer`` (or ``Answer``).

    Raises:
        ValueError: no question or no answer field, an empty question/answer, or a chat prompt without a user turn.
    """
    if "reward_model" in record and "prompt" in record:
        prompt = record["prompt"]
        if isinstance(prompt, str):
            question = prompt
        else:
            users = [m.get("content", "") for m in prompt if m.get("role") == "user"]
            if not users:
                raise ValueError(f"{where}: chat prompt without a user message")
            question = users[-1]
        reward_model = record["reward_model"]
        if isinstance(reward_model, str):
            reward_model = json.loads(reward_model)
        answer = reward_model.get("ground_truth")
    else:
        question = _first(record, ("problem", "question", "Problem", "Question"), where)
        answer = _first(record, ("answer", "Answer", "ground_truth"), where)
    question = _strip_dapo_instruction(str(question))
    answer = str(answer).strip() if answer is not None else ""
    if not question or not answer:
        raise ValueError(f"{where}: empty question or answer (question={question[:60]!r}, answer={answer!r})")
    return MathProblem(question=question, answer=answer, source=source)


def _load(
    path: str | Path | None,
    repo_id: str,
    source: str,
    max_samples: int | None,
    dedup: bool,
    downloader: Callable[[str], Path],
) -> list[MathProblem]:
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be >= 1 or None, got {max_samples}")
    root = Path(path) if path is not None else downloader(repo_id)
    problems, seen = [], set()
    for i, record in enumerate(read_records(root)):
        problem = problem_from_record(record, source, where=f"{root} record {i}")
        key = (problem["question"], problem["answer"])
        if dedup and key in seen:
            continue
        seen.add(key)
        problems.append(problem)
        if max_samples is not None and len(problems) == max_samples:
            break
    if not problems:
        raise ValueError(f"{root}: no problems")
    return problems


def load_dapo_math_17k(
    path: str | Path | None = None,
    max_samples: int | None = None,
    dedup: bool = True,
    repo_id: str = DAPO_MATH_17K_REPO,
    downloader: Callable[[str], Path] = download,
) -> list[MathProblem]:
    """DAPO-Math-17K training problems (17,917 distinct after dropping the published file's repeats).

    Args:
        path: a local .parquet/.jsonl/.json file or directory in one of the accepted layouts; None downloads
            ``repo_id`` from the hub (or reads it from the hub cache).
        max_samples: keep the first ``max_samples`` distinct problems (file order); None keeps all.
        dedup: drop exact (question, answer) repeats.
        downloader: ``repo_id -> local directory`` (tests inject one; never called when ``path`` is given).

    Returns:
        list of :class:`MathProblem` with ``source`` = "dapo_math_17k"; ``question`` is the bare problem (the DAPO
        "Answer: $Answer" instruction removed), ``answer`` the ground truth string.

    Raises:
        FileNotFoundError, ValueError, ModuleNotFoundError: see :func:`read_records` and
        :func:`problem_from_record`; RuntimeError from :func:`download`.
    """
    return _load(path, repo_id, DAPO_MATH_17K, max_samples, dedup, downloader)


def load_aime_2024(
    path: str | Path | None = None,
    max_samples: int | None = None,
    dedup: bool = True,
    repo_id: str = AIME_2024_REPO,
    downloader: Callable[[str], Path] = download,
) -> list[MathProblem]:
    """The 30 AIME-2024 problems (AIME I and II) for validation; same arguments as :func:`load_dapo_math_17k`.

    Returns:
        list of :class:`MathProblem` with ``source`` = "aime_2024" and the integer answer as a string.
    """
    return _load(path, repo_id, AIME_2024, max_samples, dedup, downloader)


LOADERS: dict[str, Callable[..., list[MathProblem]]] = {DAPO_MATH_17K: load_dapo_math_17k, AIME_2024: load_aime_2024}
