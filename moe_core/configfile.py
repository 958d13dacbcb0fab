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
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<top>'}: {e['msg']}{cls._hint(e)}"
                                 for e in err.errors())
            raise cls.error_cls(f"{where or cls.config_name}: {problems}") from None

    @classmethod
    def _hint(cls, error: dict) -> str:
        """For an unknown field: the closest field of the section it was given in."""
        if error.get("type") != "extra_forbidden":
            return ""
        model, *parents, leaf = (cls, *error["loc"])
        for part in parents:
            field = getattr(model, "model_fields", {}).get(part)
            model = getattr(field, "annotation", None)
        return did_you_mean(str(leaf), getattr(model, "model_fields", {}))

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
                hint = f"; see `moe-lab {self.command} --help`" if self.command else ""
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
