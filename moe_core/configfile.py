"""What every typed run config (training, fine-tuning) does the same way: build with readable errors, load
from YAML/JSON, apply ``--set key.sub=value`` overrides, save as JSON.

A config is a pydantic model that also inherits `ConfigFile` and names its error class::

    class TrainConfig(BaseModel, ConfigFile):
        error_cls = TrainConfigError
        free_form_keys = (("model", "overrides"),)   # dicts whose keys --set may create
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import yaml
from pydantic import ValidationError

from moe_core.errors import MoELabError, did_you_mean

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
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

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
    import inspect
    import re

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
    free_form_keys: ClassVar[tuple[tuple[str, ...], ...]] = ()

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
        """Apply ``key.sub=value`` strings; an unknown key is refused with its name."""
        data = self.model_dump()
        for item in assignments:
            key, sep, raw = item.partition("=")
            if not sep or not key:
                raise self.error_cls(f"--set {item!r}: expected key=value, e.g. optim.lr=1e-3")
            *parents, leaf = key.split(".")
            free_form = tuple(parents) in self.free_form_keys
            node = data
            for depth, part in enumerate(parents):
                if not isinstance(node.get(part), dict):
                    if tuple(parents[: depth + 1]) not in self.free_form_keys:
                        raise self.error_cls(f"--set {item!r}: {key!r} is not a config field")
                    node[part] = {}
                node = node[part]
            if leaf not in node and not free_form:
                hint = f"; see `moe-lab {self.command} --help-config`" if self.command else ""
                raise self.error_cls(f"--set {item!r}: unknown field {key!r}{did_you_mean(leaf, node)}{hint}")
            try:
                node[leaf] = parse_value(raw)
            except ValueSyntaxError as err:
                raise self.error_cls(f"--set {item!r}: {err}") from None
        return self.build(data, where="--set")

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")
