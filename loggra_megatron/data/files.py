"""Prompt data files (``--data-path``, ``--eval-data-path``): JSONL and Parquet, read with
pyarrow, given as one file, a directory of shards or a glob.

Each row needs a prompt column (``--prompt-key``, default ``prompt``: a non-empty string, or
a list of chat messages ``{"role", "content"}`` as verl's Parquet files hold) and an answer
column (``--answer-key``, default ``answer``: a string or a number). A ``metadata`` column
(an object) and every other column reach the reward function as metadata (a ``null``
value is dropped: in a columnar file it marks a key the row does not have). A chat prompt
needs a user message. A malformed row raises ``DatasetFormatError`` naming
``file:line`` (JSONL) or ``file: row N`` (Parquet, 1-based). pyarrow reads a JSONL column
with one type: a column (also a nested one, ``metadata.x``) that mixes numbers and strings
is refused at the first line that changes it (quote the numbers). Rows of any length are
read (pyarrow's block size follows the longest line), and integers keep every digit in
every column, metadata included (pyarrow reads a column that mixes integers and decimals, or
exceeds int64, as doubles).
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
    sorted) or a glob. Raises ``FileNotFoundError`` when there are none, or when the
    directory holds a directory named like a data file."""
    if os.path.isdir(spec):
        files = sorted(os.path.join(spec, f) for f in os.listdir(spec) if f.endswith(FORMATS))
        for path in files:
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"{path!r} is a directory, not a data file; point the flag at it (or at "
                    "its files) instead"
                )
    elif os.path.isfile(spec):
        files = [spec]
    else:
        files = sorted(f for f in glob.glob(spec) if os.path.isfile(f))
    if not files:
        raise FileNotFoundError(f"{spec!r}: no JSONL or Parquet files (a file, directory or glob)")
    return files


def read_examples(
    spec: str,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    locations: list[str] | None = None,
) -> list[dict]:
    """Validated examples ``{"prompt", "answer", "metadata"}`` of every file of ``spec``;
    ``locations``, if given, gets each one's ``file:line`` (``file: row N``)."""
    examples = []
    for path in data_files(spec):
        rows, where = _read_rows(path, answer_key)
        for i, row in enumerate(rows):
            examples.append(
                example_from_row(row, prompt_key, answer_key, lambda i=i, w=where: w(i))
            )
            if locations is not None:
                locations.append(where(i))
    if not examples:
        raise DatasetFormatError(f"{spec}: no examples")
    return examples


def _read_rows(path: str, answer_key: str):
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

    lines, longest = _nonblank_lines(path)
    block = max(pj.ReadOptions().block_size, 2 * longest)  # a row never straddles two blocks
    try:
        table = pj.read_json(path, read_options=pj.ReadOptions(block_size=block))
        rows = table.to_pylist()
    except (pa.ArrowInvalid, UnicodeDecodeError) as e:
        raise DatasetFormatError(_diagnose_jsonl(path, str(e))) from None
    if any(_has_floats(field.type) for field in table.schema):
        _exact_integers(path, rows)
    return rows, lambda i: f"{path}:{lines[i]}"


def _nonblank_lines(path: str) -> tuple[list[int], int]:
    """The numbers of the non-blank lines, and the longest line's length in bytes."""
    numbers, longest = [], 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            longest = max(longest, len(raw))
            if raw.strip():
                numbers.append(n)
    return numbers, longest


def _has_floats(arrow_type) -> bool:
    """Whether a column of ``arrow_type`` holds doubles, at any depth of its structs."""
    import pyarrow as pa

    if pa.types.is_struct(arrow_type):
        return any(_has_floats(arrow_type.field(i).type) for i in range(arrow_type.num_fields))
    return pa.types.is_floating(arrow_type)


def _exact_integers(path: str, rows: list[dict]) -> None:
    """Put back the integers that pyarrow read as doubles (2^53 + 1 would lose its last
    digit), in every column and nested object (answers and metadata alike), read from the
    text with ``json``."""
    with open(path, "rb") as f:
        records = (json.loads(raw) for raw in f if raw.strip())
        for row, record in zip(rows, records, strict=True):
            if isinstance(record, dict):
                _restore_integers(row, record)


def _restore_integers(row: dict, record: dict) -> None:
    for key, value in record.items():
        current = row.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and isinstance(current, float):
            row[key] = value
        elif isinstance(value, dict) and isinstance(current, dict):
            _restore_integers(current, value)


def _diagnose_jsonl(path: str, arrow_message: str) -> str:
    """``file:line: why`` of the first line pyarrow could not read (a second, plain pass)."""
    conflict = re.search(r"Column\(/([^)]+)\) changed from (\w+) to (\w+)", arrow_message)
    column = conflict.group(1).split("/") if conflict else []
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
            value = _nested(record, column) if conflict else _MISSING
            if value is not _MISSING:
                kind = _json_type(value)
                first_type = first_type or kind
                if kind != first_type:
                    return (
                        f"{path}:{n}: column {'.'.join(column)!r} changed from {first_type} "
                        f"to {kind} (each column needs one type; quote numbers as strings)"
                    )
    return f"{path}: {arrow_message}"


_MISSING = object()


def _nested(record: dict, keys: list[str]):
    """``record[k1][k2]...``, or ``_MISSING`` where a level lacks the key."""
    for key in keys:
        if not isinstance(record, dict) or key not in record:
            return _MISSING
        record = record[key]
    return record


def _json_type(value) -> str:
    return {
        bool: "boolean",
        int: "number",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
        type(None): "null",
    }[type(value)]


def example_from_row(row: dict, prompt_key: str, answer_key: str, where) -> dict:
    """The validated example ``{"prompt", "answer", "metadata"}`` of one row; ``where()``
    names the row in an error."""
    missing = [k for k in (prompt_key, answer_key) if row.get(k) is None]
    if missing:
        raise DatasetFormatError(
            f"{where()}: missing required field(s) {missing} (has "
            f"{sorted(k for k, v in row.items() if v is not None)}); each row needs "
            f"{prompt_key!r} and {answer_key!r} (--prompt-key, --answer-key)"
        )
    prompt, answer = row[prompt_key], row[answer_key]
    _check_prompt(prompt, prompt_key, where)
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise DatasetFormatError(
            f"{where()}: {answer_key!r} must be a string or a number, got {answer!r}"
        )
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
    ok = (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in prompt
        )
    )
    if not ok:
        raise DatasetFormatError(
            f"{where()}: {key!r} must be a non-empty string or a list of chat messages "
            f"{{'role': ..., 'content': ...}}, got {prompt!r}"
        )
    if not any(m["role"] == "user" for m in prompt):
        raise DatasetFormatError(
            f"{where()}: {key!r} has no user message (roles {[m['role'] for m in prompt]}); a "
            "chat prompt needs the question as a user turn"
        )
