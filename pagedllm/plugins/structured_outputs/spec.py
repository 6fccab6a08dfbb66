"""One request's constraint in a canonical, hashable form: what a backend compiles and what
the compile cache is keyed by.

`CompileSpec.from_params` folds the engine-wide options (`--structured-outputs-config`)
into the request's own (`StructuredOutputsParams`), parses JSON texts once and applies the
schema rewrite every backend shares (closed objects, below), so two requests that mean the
same constraint share one compiled grammar and every backend sees the same schema.

Objects are closed: an object schema that does not say `additionalProperties` gets only
its listed properties, on every backend. That is what vLLM's default backend (xgrammar, in
strict mode) and outlines do and what OpenAI's strict structured outputs require; without
it a small model fills its budget with invented keys. The output is still valid under the
schema; a schema that wants extra keys says `"additionalProperties": true` (or a schema),
which is honoured. vLLM's `disable_additional_properties` (which closes guidance's objects
in vLLM) is accepted and is what happens anyway.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

PREFIX = "SamplingParams.structured_outputs: "
DESCRIPTIONS = {"json": "json schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
                "grammar": "grammar", "structural_tag": "structural_tag"}


@dataclass(frozen=True)
class CompileSpec:
    """kind: a StructuredOutputsParams field name; text: its canonical text (a JSON schema
    or structural tag as JSON text, a choice list as a JSON array, a regex or grammar as
    given, "" for json_object); disable_any_whitespace: compact JSON (no whitespace between
    tokens, "," and ":" separators); whitespace_pattern: the regex JSON whitespace must match
    (backends that support it), None for the library's default."""

    kind: str
    text: str
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    @property
    def description(self) -> str:
        return DESCRIPTIONS[self.kind]

    def value(self) -> Any:
        """The parsed spec: a dict (json, structural_tag), a list (choice), else the text."""
        return json.loads(self.text) if self.kind in ("json", "choice", "structural_tag") else self.text

    @classmethod
    def from_params(cls, params: Any, options: Mapping[str, Any]) -> "CompileSpec":
        """The spec of a `StructuredOutputsParams`, with engine options (a request's True
        wins over the engine's False, never the other way). ValueError for a spec that is
        not even well formed (JSON text that does not parse)."""
        kind = params.kind
        compact = bool(params.disable_any_whitespace or options.get("disable_any_whitespace"))
        pattern = params.whitespace_pattern if kind in ("json", "json_object") else None
        if kind == "json":
            schema = close_objects(_parse_json(params.json, "json"))
            text = json.dumps(schema, ensure_ascii=False)
        elif kind == "json_object":
            text = ""
        elif kind == "choice":
            text = json.dumps(list(params.choice), ensure_ascii=False)
        elif kind == "structural_tag":
            text = json.dumps(normalize_structural_tag(params.structural_tag), ensure_ascii=False)
        else:
            text = params.spec
        return cls(kind, text, compact and kind in ("json", "json_object"), pattern)


def _parse_json(value: Any, field: str) -> Any:
    if isinstance(value, (dict, bool)):
        return value
    try:
        return json.loads(value)
    except (TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{PREFIX}{field} is not valid JSON: {exc}") from None


def close_objects(schema: Any) -> Any:
    """A copy of `schema` where every object schema that does not say otherwise has
    `additionalProperties: false`: the output then has only the listed properties,
    whichever backend compiles it."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: close_objects(v) for k, v in schema.items()}
    is_object = out.get("type") == "object" or (isinstance(out.get("type"), list) and "object" in out["type"]) \
        or "properties" in out
    if is_object and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def normalize_structural_tag(value: Any) -> dict:
    """A structural tag in xgrammar's format, `{"type": "structural_tag", "format": {...}}`.
    The legacy form vLLM and OpenAI-style clients send, `{"type": "structural_tag",
    "structures": [{"begin", "schema", "end"}], "triggers": [...]}`, becomes its
    `triggered_tags` equivalent: free text, in which each trigger starts one of the tags
    whose begin it prefixes, the tag's content matching its JSON schema."""
    tag = _parse_json(value, "structural_tag")
    if not isinstance(tag, dict):
        raise ValueError(f"{PREFIX}structural_tag must be a JSON object")
    if "structures" in tag:
        structures, triggers = tag.get("structures"), tag.get("triggers")
        if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers:
            raise ValueError(f"{PREFIX}structural_tag needs non-empty lists \"structures\" and \"triggers\"")
        tags = []
        for s in structures:
            if not isinstance(s, dict) or not {"begin", "end"} <= set(s) or not isinstance(s["begin"], str):
                raise ValueError(f"{PREFIX}structural_tag structures need \"begin\", \"schema\" and \"end\"; "
                                 f"got {s!r}")
            if not any(s["begin"].startswith(t) for t in triggers):
                raise ValueError(f"{PREFIX}structural_tag begin {s['begin']!r} starts with none of the "
                                 f"triggers {triggers}")
            schema = _parse_json(s.get("schema", {}), "structural_tag schema") if "schema" in s else {}
            tags.append({"type": "tag", "begin": s["begin"], "end": s["end"],
                         "content": {"type": "json_schema", "json_schema": schema}})
        return {"type": "structural_tag",
                "format": {"type": "triggered_tags", "triggers": list(triggers), "tags": tags}}
    if isinstance(tag.get("format"), dict):
        return {"type": "structural_tag", "format": tag["format"]}
    raise ValueError(f"{PREFIX}structural_tag must be {{\"type\": \"structural_tag\", \"format\": {{...}}}} "
                     "(xgrammar's format) or the legacy {\"structures\": [{\"begin\", \"schema\", \"end\"}], "
                     "\"triggers\": [...]}")
