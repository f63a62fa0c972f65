"""What a request constrains its output to: a JSON schema, any JSON object, a regex, a choice of
strings or an EBNF grammar, checked at the edge (before anything is queued).

A ``StructuredOutput`` is plain data (it travels to the engine process with the request's
SamplingParams); the engine compiles it against its tokenizer (structured/compiler.py). Checking it
here needs no tokenizer: xgrammar turns the schema, regex or grammar into its grammar form, which
fails on invalid input, and a walk of the schema refuses the keywords xgrammar would silently ignore
(an output could then break the schema while the client believes it is enforced).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextvars
import json
import threading
from dataclasses import dataclass
from typing import Any

from graphserve.errors import BadRequestError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20  # a schema, regex or grammar above 1 MiB is refused before any parsing
# JSON nesting levels of a schema (each object level with "properties" is two). OpenAI's structured outputs
# take 10 schema levels; a 200-level schema (401 JSON levels) took xgrammar 0.9 s to turn into a grammar.
MAX_SCHEMA_DEPTH = 128
MAX_SCHEMA_DEPTH_FLAG = 600  # deeper would reach Python's recursion limit in the keyword walk
CHECKED_ENTRIES = 1024  # specs whose xgrammar check result is kept (least recently used dropped first)


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on a request's grammar, and whether this thread may build one (the event loop may not)."""

    max_depth: int = MAX_SCHEMA_DEPTH
    max_chars: int = MAX_SPEC_CHARS
    build_here: bool = True
    claimed: frozenset[tuple[str, str]] = frozenset()  # specs this caller said it would check (GrammarMiss)


# GrammarLimits is frozen: sharing the default instance is safe
LIMITS: contextvars.ContextVar[GrammarLimits] = contextvars.ContextVar("grammar_limits", default=GrammarLimits())  # noqa: B039


class GrammarMiss(Exception):  # noqa: N818 - a signal to the caller, not an error
    """Raised where ``build_here`` is off and a spec is not checked yet. ``building``: the future done when
    the spec is checked; ``claimed``: the spec's key when this caller must check it (nobody else does;
    others wait on ``building`` meanwhile), None when another caller checks it now."""

    def __init__(self, building: concurrent.futures.Future, claimed: tuple[str, str] | None):
        super().__init__("grammar not checked yet")
        self.building = building
        self.claimed = claimed


_lock = threading.Lock()
_checked: collections.OrderedDict[tuple[str, str], str | None] = collections.OrderedDict()  # key -> why invalid
_building: dict[tuple[str, str], concurrent.futures.Future] = {}

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
        except RecursionError:  # past ~1000 levels Python's parser gives up
            raise BadRequestError(f"{field} nests more than {LIMITS.get().max_depth} levels deep, the limit "
                                  "(raise it with --max-schema-depth)", param=field) from None
    if not isinstance(schema, (dict, bool)):
        raise BadRequestError(f"{field} must be a JSON schema object, got {type(schema).__name__}", param=field)
    limit = LIMITS.get().max_depth
    if nesting_depth(schema, limit) > limit:
        raise BadRequestError(f"{field} nests more than {limit} levels deep, the limit "
                              "(raise it with --max-schema-depth)", param=field)
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


def nesting_depth(value: Any, stop_past: int) -> int:
    """JSON nesting levels of ``value`` (a scalar is 0), counted without recursion; stops past ``stop_past``."""
    deepest, level = 0, [value]
    while deepest <= stop_past:
        containers = [v for v in level if isinstance(v, (dict, list))]
        if not containers:
            break
        deepest += 1
        level = [x for v in containers for x in (v.values() if isinstance(v, dict) else v)]
    return deepest


def checked(c: StructuredOutput) -> StructuredOutput:
    """``c`` once xgrammar accepts it; a BadRequestError naming the field and xgrammar's reason otherwise.

    Each spec is checked once: the result is kept by (kind, spec), and a caller that finds another one
    checking the same spec waits for it. Where ``LIMITS.build_here`` is off (the event loop), a spec not
    checked yet raises GrammarMiss instead, so that the caller moves the work to a thread.
    """
    limits = LIMITS.get()
    if len(c.spec) > limits.max_chars:
        raise BadRequestError(f"{c.field} is {len(c.spec)} characters long, above the limit of {limits.max_chars} "
                              "(raise it with --max-schema-chars)", param=c.field)
    while True:
        with _lock:
            if c.key in _checked:
                _checked.move_to_end(c.key)
                reason = _checked[c.key]
                if reason is not None:
                    raise BadRequestError(f"{c.field} is invalid: {reason}", param=c.field)
                return c
            building = _building.get(c.key)
            owner = building is None or c.key in limits.claimed
            if building is None:
                building = _building[c.key] = concurrent.futures.Future()
        if not limits.build_here:
            raise GrammarMiss(building, c.key if owner else None)
        if not owner:
            concurrent.futures.wait([building])
            continue
        reason: str | None = None
        try:
            to_grammar(c)
        except (RuntimeError, ValueError) as exc:
            reason = _reason(exc)
        except BaseException:  # not a verdict on the spec (xgrammar missing): nothing is kept
            release(c.key, building)
            raise
        with _lock:
            _checked[c.key] = reason
            while len(_checked) > CHECKED_ENTRIES:
                _checked.popitem(last=False)
        release(c.key, building)


def release(key: tuple[str, str], building: concurrent.futures.Future) -> None:
    """End the check of ``key`` that ``building`` stands for (done or given up): its waiters look again."""
    with _lock:
        if _building.get(key) is building:
            del _building[key]
    if not building.done():
        building.set_result(None)


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
