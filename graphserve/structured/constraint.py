"""What a request constrains its output to: a JSON schema, any JSON object, a regex, a choice of
strings or an EBNF grammar, checked at the edge (before anything is queued).

A ``StructuredOutput`` is plain data (it travels to the engine process with the request's
SamplingParams); the engine compiles it against its tokenizer (structured/compiler.py). Checking it
here needs no tokenizer: xgrammar turns the schema, regex or grammar into its grammar form, which
fails on invalid input, and a walk of the schema refuses the keywords xgrammar would silently ignore
(an output could then break the schema while the client believes it is enforced).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from graphserve.errors import BadRequestError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20  # a schema, regex or grammar above 1 MiB is refused before any parsing

# Keywords xgrammar 0.2 parses but does not enforce: an output may violate them.
UNSUPPORTED_SCHEMA_KEYWORDS = frozenset({
    "not", "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies", "uniqueItems",
    "contains", "minContains", "maxContains", "propertyNames",
})
# Keywords whose value is a schema, a list of schemas or a map of name -> schema (where the walk descends).
_SUBSCHEMA = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


@dataclass(frozen=True)
class StructuredOutput:
    """``kind``: one of KINDS; ``spec``: the schema (JSON text), regex, grammar or, for a choice,
    a JSON list of the strings; ``field``: the request field it came from (named in errors)."""

    kind: str
    spec: str
    field: str = "structured_output"

    @property
    def key(self) -> tuple[str, str]:
        """The compile cache's key: equal specs share one compiled grammar."""
        return self.kind, self.spec

    def choices(self) -> list[str]:
        return json.loads(self.spec)


def json_schema(schema: Any, field: str) -> StructuredOutput:
    """A JSON schema given as a dict or as JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise BadRequestError(f"{field} is not valid JSON: {exc}", param=field) from exc
    if not isinstance(schema, (dict, bool)):
        raise BadRequestError(f"{field} must be a JSON schema object, got {type(schema).__name__}", param=field)
    _check_keywords(schema, field, "#")
    return checked(StructuredOutput("json_schema", json.dumps(schema, ensure_ascii=False), field))


def json_object(field: str) -> StructuredOutput:
    return StructuredOutput("json_object", "", field)


def regex(pattern: Any, field: str) -> StructuredOutput:
    if not isinstance(pattern, str) or not pattern:
        raise BadRequestError(f"{field} must be a non-empty regular expression string", param=field)
    return checked(StructuredOutput("regex", pattern, field))


def choice(options: Any, field: str) -> StructuredOutput:
    if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
        raise BadRequestError(f"{field} must be a non-empty list of non-empty strings", param=field)
    return checked(StructuredOutput("choice", json.dumps(options, ensure_ascii=False), field))


def grammar(ebnf: Any, field: str) -> StructuredOutput:
    if not isinstance(ebnf, str) or not ebnf.strip():
        raise BadRequestError(f"{field} must be a non-empty EBNF grammar string", param=field)
    return checked(StructuredOutput("grammar", ebnf, field))


def choice_grammar(options: list[str]) -> str:
    """EBNF whose language is exactly ``options``: each one a string literal (JSON escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


def to_grammar(c: StructuredOutput) -> Any:
    """The xgrammar Grammar of ``c`` (raises xgrammar's error on invalid input)."""
    try:
        import xgrammar as xgr
    except ImportError as exc:
        raise BadRequestError(f"{c.field} needs structured output, which this server cannot serve: the xgrammar "
                              "package is not installed (pip install xgrammar==0.2.9)", param=c.field) from exc

    if c.kind == "json_schema":
        return _json_grammar(xgr.Grammar.from_json_schema(c.spec, any_whitespace=False, strict_mode=True))
    if c.kind == "json_object":
        return _json_grammar(xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False,
                                                          strict_mode=False))
    if c.kind == "regex":
        return xgr.Grammar.from_regex(c.spec)
    if c.kind == "choice":
        return xgr.Grammar.from_ebnf(choice_grammar(c.choices()))
    if c.kind == "grammar":
        return xgr.Grammar.from_ebnf(c.spec)
    raise ValueError(f"unknown structured output kind {c.kind!r}")


# xgrammar 0.2.9 writes the characters of a length-bounded string as [^"\\\r\n], which lets control
# characters (U+0000-U+001F other than CR/LF) through unescaped: invalid JSON that strict parsers refuse.
# Its unbounded strings exclude them; the bounded ones are given the same class.
_LAX_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\]'


def _json_grammar(g: Any) -> Any:
    import xgrammar as xgr

    text = str(g)
    if _LAX_STRING_CHAR not in text:
        return g
    return xgr.Grammar.from_ebnf(text.replace(_LAX_STRING_CHAR, _JSON_STRING_CHAR))


def checked(c: StructuredOutput) -> StructuredOutput:
    """``c`` once xgrammar accepts it; a BadRequestError naming the field and xgrammar's reason otherwise."""
    if len(c.spec) > MAX_SPEC_CHARS:
        raise BadRequestError(f"{c.field} is {len(c.spec)} characters long, above the limit of {MAX_SPEC_CHARS}",
                              param=c.field)
    try:
        to_grammar(c)
    except (RuntimeError, ValueError) as exc:
        raise BadRequestError(f"{c.field} is invalid: {_reason(exc)}", param=c.field) from exc
    return c


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location prefix ("[time] file.cc:123: ")."""
    text = str(exc).strip()
    head, sep, rest = text.partition(": ")
    if sep and ".cc:" in head:
        text = rest
    return text.splitlines()[0] if text else type(exc).__name__


def _check_keywords(schema: Any, field: str, path: str) -> None:
    if not isinstance(schema, dict):
        return
    for key in schema:
        if key in UNSUPPORTED_SCHEMA_KEYWORDS:
            raise BadRequestError(
                f"{field} uses the JSON schema keyword {key!r} at {path}, which structured output cannot enforce "
                f"(unsupported: {', '.join(sorted(UNSUPPORTED_SCHEMA_KEYWORDS))})", param=field)
    for key in _SUBSCHEMA:
        if isinstance(schema.get(key), dict):
            _check_keywords(schema[key], field, f"{path}/{key}")
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                _check_keywords(sub, field, f"{path}/{key}/{i}")
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                _check_keywords(sub, field, f"{path}/{key}/{name}")
