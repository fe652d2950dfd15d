"""Prompt data files (``--data-path``, ``--eval-data-path``): JSONL and Parquet, read with
pyarrow, given as one file, a directory of shards or a glob.

Each row needs a prompt column (``--prompt-key``, default ``prompt``: a non-empty string, or
a list of chat messages ``{"role", "content"}`` as verl's Parquet files hold) and an answer
column (``--answer-key``, default ``answer``: a string or a number). A ``metadata`` column
(an object) and every other column reach the reward function as metadata (a ``null``
value is dropped: in a columnar file it marks a key the row does not have). A malformed row
raises :class:`DatasetFormatError` naming ``file:line`` (JSONL) or ``file: row N`` (Parquet,
1-based). pyarrow reads a JSONL column with one type: an ``answer`` column that mixes
numbers and strings is refused at the first line that changes it (quote the numbers).
"""

from __future__ import annotations

import glob
import json
import math
import os
import re

FORMATS = (".jsonl", ".json", ".parquet")


class DatasetFormatError(ValueError):
    """A malformed prompt dataset; the message starts with ``file:line:`` or ``file: row N:``."""


def data_files(spec: str) -> list[str]:
    """The files of ``spec``: a file, a directory (its ``*.jsonl``/``*.json``/``*.parquet``,
    sorted) or a glob. Raises ``FileNotFoundError`` when there are none."""
    if os.path.isdir(spec):
        files = sorted(os.path.join(spec, f) for f in os.listdir(spec) if f.endswith(FORMATS))
    elif os.path.isfile(spec):
        files = [spec]
    else:
        files = sorted(f for f in glob.glob(spec) if os.path.isfile(f))
    if not files:
        raise FileNotFoundError(f"{spec!r}: no JSONL or Parquet files (a file, directory or glob)")
    return files


def read_examples(spec: str, prompt_key: str = "prompt", answer_key: str = "answer") -> list[dict]:
    """Validated examples ``{"prompt", "answer", "metadata"}`` of every file of ``spec``."""
    examples = []
    for path in data_files(spec):
        rows, where = _read_rows(path)
        for i, row in enumerate(rows):
            examples.append(example_from_row(row, prompt_key, answer_key, lambda i=i, w=where: w(i)))
    if not examples:
        raise DatasetFormatError(f"{spec}: no examples")
    return examples


def _read_rows(path: str):
    """``(rows, where)``: the file's rows as dicts, and ``where(i)`` naming row ``i``."""
    import pyarrow as pa

    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise DatasetFormatError(f"{path}: not a readable Parquet file ({e})") from None
        return rows, lambda i: f"{path}: row {i + 1}"
    import pyarrow.json as pj

    try:
        rows = pj.read_json(path).to_pylist()
    except (pa.ArrowInvalid, UnicodeDecodeError) as e:
        raise DatasetFormatError(_diagnose_jsonl(path, str(e))) from None
    lines = _nonblank_lines(path)
    return rows, lambda i: f"{path}:{lines[i]}"


def _nonblank_lines(path: str) -> list[int]:
    with open(path, "rb") as f:
        return [n for n, raw in enumerate(f, start=1) if raw.strip()]


def _diagnose_jsonl(path: str, arrow_message: str) -> str:
    """``file:line: why`` of the first line pyarrow could not read (a second, plain pass)."""
    conflict = re.search(r"Column\(/(\w+)\) changed from (\w+) to (\w+)", arrow_message)
    first_type = None
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return f"{path}:{n}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})"
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                return f"{path}:{n}: invalid JSON: {e.msg}"
            if not isinstance(record, dict):
                return f"{path}:{n}: expected a JSON object, got {type(record).__name__}"
            if conflict and conflict.group(1) in record:
                kind = _json_type(record[conflict.group(1)])
                first_type = first_type or kind
                if kind != first_type:
                    return (f"{path}:{n}: column {conflict.group(1)!r} changed from {first_type} "
                            f"to {kind} (each column needs one type; quote numbers as strings)")  # fmt: skip
    return f"{path}: {arrow_message}"


def _json_type(value) -> str:
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}[type(value)]  # fmt: skip


def example_from_row(row: dict, prompt_key: str, answer_key: str, where) -> dict:
    """The validated example ``{"prompt", "answer", "metadata"}`` of one row; ``where()``
    names the row in an error."""
    missing = [k for k in (prompt_key, answer_key) if row.get(k) is None]
    if missing:
        raise DatasetFormatError(
            f"{where()}: missing required field(s) {missing} (have {sorted(row)}); each row needs "
            f"{prompt_key!r} and {answer_key!r} (--prompt-key, --answer-key)"
        )
    prompt, answer = row[prompt_key], row[answer_key]
    _check_prompt(prompt, prompt_key, where)
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise DatasetFormatError(f"{where()}: {answer_key!r} must be a string or a number, got {answer!r}")
    if isinstance(answer, float) and not math.isfinite(answer):
        raise DatasetFormatError(f"{where()}: {answer_key!r} must be finite, got {answer!r}")
    if isinstance(answer, str) and not answer.strip():
        raise DatasetFormatError(f"{where()}: {answer_key!r} is empty")
    if isinstance(answer, float) and answer.is_integer():
        answer = int(answer)  # pyarrow reads a column of 12 and -1.5 as doubles: 12 stays "12"
    metadata = row.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise DatasetFormatError(f"{where()}: 'metadata' must be an object, got {metadata!r}")
    extra = {k: v for k, v in row.items() if k not in (prompt_key, answer_key, "metadata")}
    # a columnar file has every key in every row: None marks one the row did not have
    merged = {k: v for k, v in {**extra, **(metadata or {})}.items() if v is not None}
    return {"prompt": prompt, "answer": str(answer), "metadata": merged}


def _check_prompt(prompt, key: str, where) -> None:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DatasetFormatError(f"{where()}: {key!r} is empty")
        return
    ok = isinstance(prompt, list) and prompt and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in prompt
    )  # fmt: skip
    if not ok:
        raise DatasetFormatError(
            f"{where()}: {key!r} must be a non-empty string or a list of chat messages "
            f"{{'role': ..., 'content': ...}}, got {prompt!r}"
        )
