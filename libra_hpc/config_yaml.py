"""How every config file of the project is read: strict YAML (YAML 1.2 numbers, a key
given twice refused) and the base of every schema section (unknown keys and wrong types
refused, field docstrings kept as the reference documentation)."""

from __future__ import annotations

import re
import typing
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict


class DuplicateKeyError(yaml.YAMLError):
    """A YAML mapping gives the same key twice. YAML leaves this to the reader and PyYAML
    keeps the last value without a word, so a file that sets ``every_steps`` twice would run
    with whichever came last; refused instead. ``problems`` has one line per repeat."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 numbers: ``2:00:00`` stays a string (YAML 1.1 reads it as
    the base-60 number 7200, which would wreck Slurm time limits) and ``1e-5`` is a float
    (YAML 1.1 wants ``1.0e-5``). A key given twice in one mapping is refused
    (:class:`DuplicateKeyError`)."""

    def construct_document(self, node):
        problems: list[str] = []
        self._find_duplicates(node, [], problems)
        if problems:
            raise DuplicateKeyError(problems)
        return super().construct_document(node)

    def _find_duplicates(self, node, path: list[str], problems: list[str]) -> None:
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._find_duplicates(item, [*path, str(i)], problems)
        elif isinstance(node, yaml.MappingNode):
            first: dict[Any, int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: explicit keys may override it
                    continue
                key = self.construct_object(key_node, deep=True) if isinstance(key_node, yaml.ScalarNode) else None
                if isinstance(key, typing.Hashable) and key is not None:
                    line = key_node.start_mark.line + 1
                    if key in first:
                        dotted = ".".join([*path, str(key)])
                        problems.append(f"{dotted}: the key {str(key)!r} is given twice (lines {first[key]} and "
                                        f"{line}); a repeated key would silently replace the first value, keep one")
                    else:
                        first[key] = line
                    self._find_duplicates(value_node, [*path, str(key)], problems)
                else:
                    self._find_duplicates(value_node, path, problems)


_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?(?:0|[1-9][0-9_]*)|0x[0-9a-fA-F_]+|0o[0-7_]+)$"), list("-+0123456789")
)
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9][0-9_]*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+.0123456789"),
)


def parse_yaml(text: str):
    """YAML as every config file of the project is read (see _YamlLoader): YAML 1.2
    numbers, a key given twice refused. Raises yaml.YAMLError (DuplicateKeyError for a
    repeated key)."""
    return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 - a SafeLoader subclass


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True)
