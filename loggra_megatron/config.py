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
``read_config_file`` reads a YAML file of flag defaults with the same types: each flag once
(``lr`` and ``--lr`` are one), a YAML boolean or null only where the flag takes one, and any
problem of the file one line naming its line and key (exit 2).
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


def chosen_section(
    name: str,
    choices: dict[str, type],
    chosen: str,
    *,
    doc: str,
    module: str,
    base: type | None = None,
    requires: AppliesWhen | None = None,
    inherit: bool = False,
    namespace: dict | None = None,
) -> type:
    """A settings dataclass ``name`` (defined as ``module.name``) gathering the fields of
    ``base`` and of each class of ``choices`` (``{value of the setting chosen: the settings
    class that choice declares}``). A field applies when ``chosen`` is a choice that declares
    it, ``requires`` holds and so does the field's own ``applies`` rule (words joined: "to
    --optimizer loggra --loggra-sketch gradient with --loggra-projection range_finder"); a
    field several choices declare appears once. ``base``'s fields keep their own rules.
    ``__post_init__`` runs ``base``'s and constructs each choice's class from its fields, so
    each declaration validates its own. ``inherit``: the section also subclasses the
    choices' classes (their methods), ``base`` always."""
    declared: dict[str, dict] = {}  # field name -> its field, type, doc and choices
    for choice, cls in choices.items():
        docs, hints = field_docs(cls), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            entry = declared.setdefault(
                f.name, {"field": f, "type": hints[f.name], "doc": docs[f.name], "choices": []}
            )
            entry["choices"].append(choice)
    fields = []
    if base is not None:
        docs, hints = field_docs(base), typing.get_type_hints(base)
        for f in dataclasses.fields(base):
            metadata = {**f.metadata, "doc": docs[f.name]}
            fields.append(
                (f.name, hints[f.name], dataclasses.field(default=f.default, metadata=metadata))
            )
    for field_name, entry in declared.items():
        rule = _chosen_rule(chosen, tuple(entry["choices"]), requires, entry["field"])
        doc = f"{entry['doc']} {flag(chosen)} {', '.join(entry['choices'])} only."
        field = dataclasses.field(
            default=entry["field"].default, metadata={"applies": rule, "doc": doc}
        )
        fields.append((field_name, entry["type"], field))
    classes = list(dict.fromkeys(choices.values()))

    def __post_init__(self):
        if base is not None and hasattr(base, "__post_init__"):
            base.__post_init__(self)
        for cls in classes:  # each declaration validates its own fields
            cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})

    bases = (*reversed(classes), base) if inherit else (base,)
    namespace = {**(namespace or {}), "__post_init__": __post_init__, "__doc__": doc}
    namespace["__module__"] = module
    bases = tuple(b for b in bases if b is not None)
    return dataclasses.make_dataclass(name, fields, bases=bases, namespace=namespace)


def _chosen_rule(chosen: str, names: tuple, requires, field) -> AppliesWhen:
    """The ``applies`` rule of a field that choices ``names`` of setting ``chosen`` declare."""
    own = field.metadata.get("applies")
    when = f"to {requires.when + ' ' if requires else ''}{flag(chosen)} {' or '.join(names)}"

    def holds(s: dict) -> bool:
        if s[chosen] not in names or (requires and not requires.holds(s)):
            return False
        return own is None or own.holds(s)

    return AppliesWhen(f"{when} {own.when}" if own else when, holds)


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


def read_config_file(
    path: str,
    parser: argparse.ArgumentParser,
    sections: dict,
    renamed: dict[str, str] | None = None,
) -> dict:
    """``{field: value}`` from a YAML file whose keys are flag names (dashes or underscores,
    each flag once); values are converted to the field's type as a flag's text would be.
    ``renamed``: ``{old flag: new flag}``, hinted as on the command line. Any problem exits
    with status 2 and one line naming the file, the line and the key."""
    if not os.path.isfile(path):
        _refuse(parser, f"no such file {path!r}")
    fields = {
        f.name: typing.get_type_hints(cls)[f.name]
        for cls in sections.values()
        for f in dataclasses.fields(cls)
    }
    try:
        return _read_yaml(path, fields, renamed or {})
    except _AtLine as e:
        _refuse(parser, f"{path}:{e.line}: {e}")


def _refuse(parser: argparse.ArgumentParser, message: str) -> None:
    """Exit 2 with one line (no usage: the problem is in the file, not the command line)."""
    parser.exit(2, f"{parser.prog}: error: --config: {' '.join(message.split())}\n")


class _AtLine(Exception):
    """A problem of the ``--config`` file at (1-based) ``line``."""

    def __init__(self, line: int, message: str):
        super().__init__(message)
        self.line = line


def _read_yaml(path: str, fields: dict[str, Any], renamed: dict[str, str]) -> dict:
    """The file composed into nodes (which know their line), then each value constructed."""
    import yaml

    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise _AtLine(data[: e.start].count(b"\n") + 1, "is not UTF-8 text") from None
    try:
        loader = yaml.SafeLoader(text)
    except yaml.reader.ReaderError as e:  # a control character
        line = text[: e.position].count("\n") + 1
        raise _AtLine(line, f"is not valid YAML: {e.reason} ({chr(e.character)!r})") from None
    try:
        root = loader.get_single_node()
        if root is None:  # an empty file
            return {}
        if not isinstance(root, yaml.MappingNode):
            raise _AtLine(_line(root), "must hold a mapping of flag names to values")
        out, seen = {}, {}
        for key_node, value_node in root.value:
            name, key = _config_key(key_node, fields, renamed, seen)
            out[name] = _config_value(key, value_node, fields[name], loader)
        return out
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise _AtLine(mark.line + 1, f"is not valid YAML: {e.problem}") from None
    finally:
        loader.dispose()


def _line(node) -> int:
    return node.start_mark.line + 1


def _config_key(node, fields: dict, renamed: dict[str, str], seen: dict) -> tuple[str, str]:
    """``(field, key as written)`` of a key node; ``seen``: ``{field: (key, line)}`` so far."""
    import yaml

    line = _line(node)
    if not isinstance(node, yaml.ScalarNode):
        kind = "sequence" if isinstance(node, yaml.SequenceNode) else "mapping"
        raise _AtLine(line, f"a key must be a flag name, got a {kind}")
    key = node.value
    name = key.lstrip("-").replace("-", "_")
    if flag(name) in renamed:
        raise _AtLine(line, f"{key!r} was renamed {renamed[flag(name)]}")
    if name not in fields:
        raise _AtLine(line, f"unknown key {key!r}: no flag {flag(name)} (see --help)")
    if name in seen:
        first, first_line = seen[name]
        if first == key:
            raise _AtLine(line, f"gives {key!r} twice (lines {first_line} and {line}): keep one")
        raise _AtLine(
            line,
            f"gives {first!r} (line {first_line}) and {key!r} (line {line}), both "
            f"{flag(name)}: keep one",
        )
    seen[name] = (key, line)
    return name, key


_KIND_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}


def _config_value(key: str, node, hint, loader) -> Any:
    """The value of ``node`` as the type ``hint`` of its field, as argparse converts a flag's
    text (YAML 1.1 reads 1e-5 as text); a boolean, null, list or mapping where the field
    takes none is refused."""
    kind, optional = _base_type(hint), type(None) in typing.get_args(hint)

    def wrong(got: str) -> _AtLine:
        must = _KIND_NAMES.get(kind, kind.__name__) + (" or null" if optional else "")
        return _AtLine(_line(node), f"{key!r} must be {must}, got {got}")

    try:
        value = loader.construct_object(node, deep=True)
    except (TypeError, ValueError):  # a tag its text does not fit: !!float abc
        raise wrong(repr(node.value)) from None
    if value is None:
        if optional:
            return None
        raise wrong("null; drop the key for the default")
    if isinstance(value, bool) and kind is not bool:
        raise wrong(
            f"the YAML boolean {node.value!r} (yes/no/on/off/true/false); quote it, or give "
            f"{_KIND_NAMES.get(kind, kind.__name__)}"
        )
    if not isinstance(value, int | float | str):
        raise wrong(f"a {type(value).__name__}")
    if isinstance(value, kind):
        return value
    if kind is int and isinstance(value, float) and not value.is_integer():
        raise wrong(repr(node.value))
    try:
        return kind(value) if kind is not bool else _yaml_bool(value)
    except (TypeError, ValueError):
        raise wrong(repr(node.value)) from None


def _yaml_bool(value) -> bool:
    text = str(value).lower()
    if text not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(value)
    return text in ("true", "1", "yes")
