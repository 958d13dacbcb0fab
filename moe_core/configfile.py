"""What every typed run config (training, fine-tuning) does the same way: build with readable errors, load
from YAML/JSON, apply ``--set key.sub=value`` overrides, save as JSON.

A config is a pydantic model that also inherits `ConfigFile` and names its error class::

    class TrainConfig(BaseModel, ConfigFile):
        error_cls = TrainConfigError
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import types
import typing
from pathlib import Path
from typing import Any, ClassVar

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined

from moe_core.errors import MoELabError, did_you_mean

# the file a fine-tuning run saves its config as, first of all it writes into its output directory: what makes a
# directory a fine-tuning output (`moe_core.loading`) and what `moe_core.finetune.as_trained` reads back
FINETUNE_CONFIG = "finetune_config.json"

# YAML 1.1 reads on/off/yes/no as booleans; --set keeps them as words (pydantic reads them as bools anyway)
_YAML_WORDS = ("on", "off", "yes", "no", "y", "n")


class ValueSyntaxError(MoELabError):
    """A ``--set`` value that is not valid YAML (``[1,`` or ``{a: }``)."""


def parse_value(raw: str) -> Any:
    """A ``--set`` value parsed as YAML (``3``, ``1e-3``, ``true``, ``[1, 2]``), with numbers as numbers."""
    if not raw:
        return None
    try:
        value = raw if raw.lower() in _YAML_WORDS else yaml.safe_load(raw)
    except yaml.YAMLError as err:
        raise ValueSyntaxError(f"the value is not valid YAML: {' '.join(str(err).split())}") from None
    if isinstance(value, str):
        try:
            return float(value)  # YAML 1.1 reads "1e-3" as a string
        except ValueError:
            return value
    return value


def apply_override(
    data: dict[str, Any], item: str, config_cls, *, error_cls=MoELabError, hint: str = ""
) -> None:
    """Set one ``--set key.sub=value`` into ``data``, the nested dict of a ``config_cls`` (a pydantic class).

    The one ``--set`` parser: the library's configs (`ConfigFile.with_overrides`) and the flows' parameters
    (``moe-lab run --set``) both use it. The key is walked through the class's fields, so a mistyped field
    is refused here with its closest name, a section missing from ``data`` is created (pydantic fills its
    defaults), and a value is never written through. Below a dict-typed field (``model.overrides``,
    ``lora.expert_ids``) the keys are data, not fields: ``--set`` may create them and the config's own
    validation checks them. The value is parsed as YAML (`parse_value`). Errors are ``error_cls`` and name
    the item; ``hint`` ends an unknown-field one.
    """
    key, sep, raw = item.partition("=")
    parts = key.split(".")
    if not sep or not all(parts):
        raise error_cls(
            f"--set {item!r}: expected key=value with a dotted key, e.g. {_example_key(config_cls)}"
        )
    section, node = config_cls, data  # section: the class of ``node``; None below a dict-typed field
    for depth, part in enumerate(parts[:-1]):
        where = ".".join(parts[: depth + 1])
        if section is not None:
            fields = _fields(section)
            if part not in fields:
                raise error_cls(f"--set {item!r}: unknown field {where!r}{did_you_mean(part, fields)}{hint}")
            annotation = fields[part]
            section = _section_class(annotation)
            if section is None and not _is_dict(annotation):  # a value: keys under it would write through it
                raise error_cls(_not_a_section(item, where, node.get(part), part in node))
        child = node.get(part)
        if child is None and (part not in node or section is None):
            child = node[part] = {}
        if not isinstance(child, dict):
            raise error_cls(_not_a_section(item, where, child, True))
        node = child
    leaf = parts[-1]
    if section is not None and leaf not in (fields := _fields(section)):
        raise error_cls(f"--set {item!r}: unknown field {key!r}{did_you_mean(leaf, fields)}{hint}")
    try:
        node[leaf] = parse_value(raw)
    except ValueSyntaxError as err:
        raise error_cls(f"--set {item!r}: {err}") from None


def _not_a_section(item: str, where: str, value: Any, present: bool) -> str:
    shown = f" ({value!r})" if present and not isinstance(value, dict) else ""
    return (
        f"--set {item!r}: {where} is a value{shown}, not a section, so {item.partition('=')[0]} cannot be "
        f"set; set {where}=VALUE instead"
    )


def _fields(section) -> dict[str, Any]:
    """Field name -> annotation of a pydantic class or a dataclass (``ValidationConfig``)."""
    if issubclass(section, BaseModel):
        return {name: field.annotation for name, field in section.model_fields.items()}
    hints = typing.get_type_hints(section)
    return {f.name: hints.get(f.name) for f in dataclasses.fields(section)}


def _union_members(annotation) -> tuple:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _section_class(annotation):
    """The class of a section field (``TrainConfig``, ``OptimizeParams | None``, a dataclass), else None."""
    for candidate in _union_members(annotation):
        if isinstance(candidate, type) and (
            issubclass(candidate, BaseModel) or dataclasses.is_dataclass(candidate)
        ):
            return candidate
    return None


def _is_dict(annotation) -> bool:
    """A dict-typed field (``dict[str, Any]``, ``list[int] | dict[int, list[int]] | None``): free-form keys."""
    return any(c is dict or typing.get_origin(c) is dict for c in _union_members(annotation))


def _example_key(config_cls) -> str:
    """``model.preset=VALUE``: a leaf field of a config class, through its first sections (usage messages)."""
    path, section = [], config_cls
    while section is not None and (fields := _fields(section)):
        name = next((n for n, a in fields.items() if _section_class(a)), next(iter(fields)))
        path.append(name)
        section = _section_class(fields[name])
    return ".".join(path or ["field"]) + "=VALUE"


def describe_errors(model_cls, err: ValidationError) -> str:
    """A pydantic error as one line per problem, ``where: what``: an unknown field with the closest field of
    its section ("did you mean"), a missing one as "required field missing", never pydantic's URLs."""
    problems = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "<top>"
        if e.get("type") == "extra_forbidden":
            problems.append(f"{where}: unknown field{_closest_field(model_cls, e['loc'])}")
        elif e.get("type") == "missing":
            problems.append(f"{where}: required field missing")
        else:
            problems.append(f"{where}: {e['msg']}")
    return "; ".join(problems)


def _closest_field(model_cls, loc: tuple) -> str:
    model, *parents, leaf = (model_cls, *loc)
    for part in parents:
        field = getattr(model, "model_fields", {}).get(part)
        model = getattr(field, "annotation", None)
    return did_you_mean(str(leaf), getattr(model, "model_fields", {}))


def config_fields(model_cls, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """``(dotted name, type, default, help)`` for every leaf field of a pydantic config class, nested
    sections flattened (what ``--set`` takes). The help is the field's description, else the comment
    written after it in the class body."""
    comments = _field_comments(model_cls)
    rows = []
    for name, field in model_cls.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows += config_fields(annotation, prefix=f"{key}.")
            continue
        if field.is_required():
            default = "required"
        else:
            value = field.get_default(call_default_factory=True)
            default = (
                "none" if value is None or value is PydanticUndefined else json.dumps(value, default=str)
            )
        type_name = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
        type_name = type_name or str(annotation).replace("typing.", "")
        rows.append((key, type_name, default, field.description or comments.get(name, "")))
    return rows


def _field_comments(model_cls) -> dict[str, str]:
    comments = {}
    for cls in reversed(model_cls.__mro__):
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        for match in re.finditer(r"^    (\w+)\s*:[^\n#]*#\s*(.+)$", source, re.MULTILINE):
            comments[match.group(1)] = match.group(2).strip()
    return comments


def format_config_fields(model_cls, title: str) -> str:
    """The text ``--help-config`` prints: one field a line, name, type, default and help."""
    rows = config_fields(model_cls)
    width = max(len(r[0]) for r in rows) + 2
    lines = [title, ""]
    for key, type_name, default, help_text in rows:
        lines.append(f"  {key:<{width}}{type_name} = {default}" + (f"    # {help_text}" if help_text else ""))
    return "\n".join(lines)


class ConfigFile:
    error_cls: ClassVar[type[MoELabError]] = MoELabError
    config_name: ClassVar[str] = "config"  # used in messages: "training config", "fine-tuning config"
    command: ClassVar[str] = ""  # the CLI command whose --help lists the fields

    @classmethod
    def build(cls, data: dict[str, Any], where: str | None = None):
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise cls.error_cls(f"{where or cls.config_name}: {describe_errors(cls, err)}") from None

    @classmethod
    def load(cls, path: str | Path):
        """A YAML or JSON file (missing fields take defaults)."""
        path = Path(path)
        if not path.is_file():
            raise cls.error_cls(f"config file {path} not found; pass an existing YAML/JSON file to --config")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise cls.error_cls(f"config file {path} is not valid YAML/JSON: {err}") from None
        if not isinstance(data, dict):
            raise cls.error_cls(f"config file {path}: expected a mapping of fields at the top level")
        return cls.build(data, where=str(path))

    def with_overrides(self, assignments: list[str]):
        """Apply ``key.sub=value`` strings (`apply_override`); an unknown key is refused with its name."""
        data = self.model_dump()
        hint = f"; see `moe-lab {self.command} --help-config`" if self.command else ""
        for item in assignments:
            apply_override(data, item, type(self), error_cls=self.error_cls, hint=hint)
        return self.build(data, where="--set")

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")
