"""Settings dataclasses: their checks, and the command line generated from them.

Each component owns one settings dataclass (a docstring per field). It validates its own
fields in ``__post_init__`` with ``check_fields`` (every ``float`` finite and within
float32's range, then the given rules) and raises ``ConfigError``, whose message names
the flag (``--field-name``), the value and the fix; ``pretrain_rl.py`` turns it into exit
status 2 before any process group or file is touched. A field that does something only
under a condition on other settings declares it (``applies``: ``--kl-ref-target``
applies with ``--kl-coef`` > 0); ``settings_that_do_not_apply`` refuses such a field
given with a value of its own while its condition fails, for every declared field alike.
``add_flags`` turns the fields into Megatron-LM-style flags (help text from the field
docstrings, ``--x`` / ``--no-x`` for booleans), and
``read_config_file`` reads a YAML file of flag defaults with the same types.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
import os
import typing
from collections.abc import Callable, Iterable
from typing import Any


class ConfigError(ValueError):
    """An invalid or inconsistent setting; the message starts with the flag. ``field``,
    ``value`` and ``why`` are set when one field is at fault (``reject``)."""

    field: str | None = None
    value: Any = None
    why: str = ""


def flag(field: str) -> str:
    """The command-line flag of a settings field: ``kl_target`` → ``--kl-target``."""
    return "--" + field.replace("_", "-")


def reject(field: str, value: Any, why: str) -> None:
    error = ConfigError(f"{flag(field)}={value!r}: {why}")
    error.field, error.value, error.why = field, value, why
    raise error


FLOAT32_MAX = 3.4028234663852886e38
"""Settings are applied in float32 (learning rates, coefficients, the RoPE base...)."""
SEED_LIMIT = 2**63
"""Seeds are stored as int64 (checkpoints, LoGRA's per-weight seeds)."""

Rule = tuple[str, Callable[[Any], bool], str]
"""``(field, predicate of its value, what it must be)``; a None value is not checked."""


def positive(v) -> bool:
    return v > 0


def at_least(lo) -> Callable[[Any], bool]:
    return lambda v: v >= lo


def one_of(*choices) -> Callable[[Any], bool]:
    return lambda v: v in choices


def valid_seed(v) -> bool:
    return 0 <= v < SEED_LIMIT


def check_fields(settings, rules: Iterable[Rule] = (), owner: type | None = None) -> None:
    """Every float field is finite (NaN and ±inf are never meaningful) and within float32's
    range, then each rule. ``owner``: check only the fields that dataclass declares (for a
    subclass that mixes several settings classes)."""
    for f in dataclasses.fields(owner or settings):
        value = getattr(settings, f.name)
        if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
            reject(f.name, value, "must be a finite number of float32's range (|x| <= 3.4e38)")
    for field, ok, must in rules:
        value = getattr(settings, field)
        if value is not None and not ok(value):
            reject(field, value, f"must be {must}")


@dataclasses.dataclass(frozen=True)
class AppliesWhen:
    """Field metadata of a setting that does something only when ``holds(settings)`` is
    true (``settings``: every setting by field name); ``when`` says so in words, after
    "applies" (``"with --kl-target"``, ``"to --task math"``)."""

    when: str
    holds: Callable[[dict], bool]


def applies(default: Any, when: str, holds: Callable[[dict], bool]) -> Any:
    """A settings field with ``default`` that applies only when ``holds`` (see
    ``AppliesWhen``)."""
    return dataclasses.field(default=default, metadata={"applies": AppliesWhen(when, holds)})


def settings_that_do_not_apply(sections: Iterable[type], settings: dict, given: set[str]):
    """``--flag=value: ...`` for every field of ``sections`` that was ``given`` with a value
    other than its default while the condition it declares (``applies``) fails."""
    for cls in sections:
        for f in dataclasses.fields(cls):
            rule = f.metadata.get("applies")
            value = settings[f.name]
            if rule is None or f.name not in given or value == f.default or rule.holds(settings):
                continue
            yield (
                f"{flag(f.name)}={value!r}: applies {rule.when} only (here it would do nothing); "
                "drop it"
            )


# ---------------------------------------------------------------------- the command line
def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings (the string literal after each field) of a dataclass; a generated
    one (``tasks.flags``) gives them as each field's ``metadata["doc"]``."""
    generated = {f.name: f.metadata["doc"] for f in dataclasses.fields(cls) if "doc" in f.metadata}
    if generated:
        return generated
    tree = ast.parse(inspect.getsource(cls))
    body, docs = tree.body[0].body, {}
    for node, nxt in zip(body, body[1:], strict=False):
        is_doc = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
        if isinstance(node, ast.AnnAssign) and is_doc and isinstance(nxt.value.value, str):
            docs[node.target.id] = nxt.value.value
    return docs


def _base_type(annotation):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


def help_text(text: str) -> str:
    """``text`` as an argument's help: argparse expands ``%(default)s``-style specifiers in
    every argument's help (not in a group's description), so a literal ``%`` in a field
    docstring ("under 5 % of a step") is escaped here, once, for every generated flag."""
    return text.replace("%", "%%")


def add_flags(parser: argparse.ArgumentParser, sections: dict[str, type]) -> None:
    """One argument group per settings class, one flag per field (default None: "not
    given", so that explicit flags can be told apart from defaults; a field's
    ``metadata["choices"]``, e.g. a registry's names, become the flag's choices)."""
    for section, cls in sections.items():
        group = parser.add_argument_group(section, (cls.__doc__ or "").strip() or None)
        docs = {name: help_text(doc) for name, doc in field_docs(cls).items()}
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = _base_type(hints[f.name])
            if kind is bool:  # --flag (and --no-flag when the default is on or automatic)
                action = "store_true" if f.default is False else argparse.BooleanOptionalAction
                group.add_argument(
                    flag(f.name), dest=f.name, action=action, default=None, help=docs.get(f.name)
                )
            else:
                group.add_argument(
                    flag(f.name),
                    dest=f.name,
                    type=kind,
                    default=None,
                    choices=f.metadata.get("choices"),
                    help=f"{docs.get(f.name, '')} (default: {help_text(str(f.default))})",
                )


def read_config_file(path: str, parser: argparse.ArgumentParser, sections: dict) -> dict:
    """``{field: value}`` from a YAML file whose keys are flag names (dashes or
    underscores); values are converted to the field's type as a flag's text would be."""
    import yaml

    if not os.path.isfile(path):
        parser.error(f"--config: no such file {path!r}")
    try:
        with open(path, "rb") as f:
            values = yaml.load(f, Loader=_unique_key_loader()) or {}  # noqa: S506 (safe)
    except _DuplicateKey as e:
        parser.error(f"--config: {path!r} {e}")
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        parser.error(f"--config: {path!r} is not valid YAML ({' '.join(str(e).split())})")
    if not isinstance(values, dict):
        parser.error(f"--config: {path!r} must hold a mapping of flag names to values")
    kinds = {
        f.name: _base_type(typing.get_type_hints(cls)[f.name])
        for cls in sections.values()
        for f in dataclasses.fields(cls)
    }
    out = {}
    for key, value in values.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in kinds:
            parser.error(f"--config: unknown key {key!r} in {path!r}")
        kind = kinds[name]
        if kind is int and isinstance(value, float) and not value.is_integer():
            parser.error(f"--config: {key!r} in {path!r} must be an integer, got {value!r}")
        if value is not None and not isinstance(value, kind):
            try:  # as argparse converts a flag's text (YAML reads 1e-5 as a string)
                value = kind(value) if kind is not bool else _yaml_bool(value)
            except (TypeError, ValueError):
                parser.error(
                    f"--config: {key!r} in {path!r} must be {kind.__name__}, got {value!r}"
                )
        out[name] = value
    return out


class _DuplicateKey(Exception):
    """A key given twice in a ``--config`` mapping."""


def _unique_key_loader():
    import yaml

    class Loader(yaml.SafeLoader):
        """``yaml.safe_load`` that refuses a key given twice (it keeps the last silently)."""

        def construct_mapping(self, node, deep=False):
            seen = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise _DuplicateKey(
                        f"gives {key!r} twice (lines {seen[key]} and {line}): keep one"
                    )
                seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return Loader


def _yaml_bool(value) -> bool:
    text = str(value).lower()
    if text not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(value)
    return text in ("true", "1", "yes")
