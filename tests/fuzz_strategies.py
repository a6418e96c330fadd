"""Hypothesis strategies for fuzzing the HTTP API: request bodies drawn from the server's own
OpenAPI schemas (serving.openai.openapi), hostile values, mutations of valid bodies, and raw
requests (methods, paths, content types, byte-level bodies)."""
from __future__ import annotations

import json

from hypothesis import strategies as st

SMALL = 3  # longest list drawn from a schema: keeps each request cheap to serve

# Fields whose valid values can make a request expensive (many choices, long outputs).
CHEAP = {"max_tokens": st.integers(1, 2), "max_completion_tokens": st.integers(1, 2),
         "n": st.integers(1, 2), "best_of": st.integers(1, 2)}


def from_schema(schema: dict, overrides: dict | None = None) -> st.SearchStrategy:
    """Values valid under the JSON Schema subset serving.openai.openapi writes."""
    overrides = CHEAP if overrides is None else overrides
    if schema.get("type") == "object":  # its anyOf/allOf rules tie fields: not drawn here
        return _object(schema, overrides)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, overrides) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):  # {"type": ["boolean", "null"]}
        return st.one_of([from_schema({**schema, "type": k}, overrides) for k in kind])
    if kind == "null" or kind is None:
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        lo = schema.get("exclusiveMinimum", schema.get("minimum"))
        return st.floats(lo, schema["maximum"], exclude_min="exclusiveMinimum" in schema)
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=40)
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), overrides),
                        min_size=schema.get("minItems", 0),
                        max_size=min(schema.get("maxItems", SMALL), SMALL))
    assert kind == "object", schema
    return _object(schema, overrides)


def _object(schema: dict, overrides: dict) -> st.SearchStrategy:
    names = schema.get("propertyNames")
    if names is not None and "pattern" in names:  # a map: logit_bias
        keys = st.from_regex(names["pattern"], fullmatch=True)
        return st.dictionaries(keys, from_schema(schema["additionalProperties"], overrides),
                               max_size=3)
    if names is not None:  # keyword arguments (chat_template_kwargs): any keys but these
        reserved = set(names["not"]["enum"])
        keys = st.text(max_size=12).filter(lambda k: k not in reserved)
        values = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8))
        return st.dictionaries(keys, values, max_size=3)
    props = schema.get("properties", {})

    def field(name):
        return overrides[name] if name in overrides else from_schema(props[name], overrides)
    required = set(schema.get("required", []))
    return st.fixed_dictionaries({k: field(k) for k in props if k in required},
                                 optional={k: field(k) for k in props if k not in required})


# -- hostile values --------------------------------------------------------------------------

HOSTILE_STRINGS = ["", " ", "\x00", "\ud800", "a\udfffb", "\ud83d", "²", "٣", "1_0", " 7 ",
                   "NaN", "-1", "1e400", "\u202e", "💥" * 20, "<|im_end|>", "x" * 30000,
                   "word " * 3000, "9" * 5000, "gpt-4"]
HOSTILE_INTS = [-(2 ** 64), -(2 ** 63), -(2 ** 31), -1, 0, 2 ** 31, 2 ** 63, 2 ** 64, 10 ** 30,
                49151, 49152]


# Every field of every route gets each of these in turn (tests/test_fuzz_api.py).
SWEEP = [None, True, False, 0, 1, -1, 3, 2 ** 31, 2 ** 63, 2 ** 64, -(2 ** 63) - 1, 10 ** 30,
         1.5, -0.0, 1e308, float("nan"), float("inf"), float("-inf"), "", "1", "\ud800",
         "a\udfffb", "²", " 7 ", "x" * 30000, [], [[]], [-1], [1.0], [True], ["a", 1],
         [2 ** 63], {}, {"1": 1e308}, {"²": 1}, {"9" * 5000: 1}, {"role": "user"}]
AUTHORIZATIONS = [b"", b"Bearer", b"Bearer ", b"Basic abc", b"Bearer \xff\xfe",
                  b"Bearer " + b"\x80" * 10, "Bearer ключ".encode(), b"Bearer " + b"k" * 6000,
                  b"Bearer a b c", "Bearer 🔑".encode()]  # control bytes: MALFORMED


def _deep(depth: int, leaf) -> object:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


scalars = st.one_of(
    st.none(), st.booleans(), st.sampled_from(HOSTILE_INTS), st.integers(-10, 3),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(HOSTILE_STRINGS),
    st.text(max_size=20))
hostile = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=8)
hostile = st.one_of(hostile, st.builds(_deep, st.sampled_from([50, 500, 5000]), scalars),
                    st.just([[]]), st.just([-1]), st.just([1.0]), st.just([True]),
                    st.just(["a", 1]), st.just([2 ** 63]), st.just({"1": 1e308}))


@st.composite
def mutated(draw, valid: st.SearchStrategy, fields: list[str]) -> object:
    """A valid body with one to three fields set to hostile values or dropped, or at
    times no object at all."""
    body = draw(valid)
    if draw(st.integers(0, 19)) == 0:
        return draw(hostile)  # a list, a string, null, ... instead of an object
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(fields) | st.text(max_size=10))
        if name in body and draw(st.booleans()):
            del body[name]
        else:
            body[name] = draw(hostile)
    return body


def encode(body) -> bytes:
    """JSON as a lax client writes it: NaN and Infinity literals, lone surrogates escaped;
    a value nested too deeply for json.dumps goes out hand-written."""
    try:
        return json.dumps(body).encode()
    except RecursionError:
        return b'{"prompt": ' + b"[" * 5000 + b"1" + b"]" * 5000 + b"}"


# -- raw requests ----------------------------------------------------------------------------

METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
PATHS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/models",
         "/v1/models/x", "/health", "/metrics", "/openapi.json", "/", "/v1/completions/",
         "/v1/../health", "/%ff%fe", "/v1/models/%00", "/v1/models/" + "a" * 3000]
CONTENT_TYPES = [None, "application/json", "application/json; charset=latin-1", "text/plain",
                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 "application/octet-stream", "image/png", "json", "*/*"]
VALID = b'{"prompt": "Hello", "max_tokens": 2}'
RAW_BODIES = [b"", b"{", b"[1, 2]", b"null", b'"x"', b"1" * 5000, b"NaN", b"\xef\xbb\xbf" + VALID,
              b"\xff\xfe\xfd", VALID[:17], VALID.replace(b"Hello", b"He\xffllo"),
              VALID.replace(b"Hello", b"\\ud800"), VALID.replace(b"2}", b"2, }"),
              b"[" * 100000, b'{"prompt": "a"' + b', "x": 1' * 20000 + b"}",
              b'{"prompt": "Hi", "prompt": 5, "max_tokens": 2}', VALID]


@st.composite
def raw_requests(draw) -> tuple[str, str, dict, bytes]:
    headers = {}
    content_type = draw(st.sampled_from(CONTENT_TYPES))
    if content_type:
        headers["Content-Type"] = content_type
    body = draw(st.sampled_from(RAW_BODIES) | st.binary(max_size=64))
    return draw(st.sampled_from(METHODS)), draw(st.sampled_from(PATHS)), headers, body
