"""Loaded by schemathesis (SCHEMATHESIS_HOOKS) in tests/test_openapi_contract.py: keeps each
generated request cheap to serve (a few output tokens, few choices). The bodies stay valid
under /openapi.json; only the cost of generating them changes."""
import schemathesis

LIMITS = {"max_tokens": 3, "max_completion_tokens": 3, "max_output_tokens": 3, "n": 2,
          "best_of": 2}


@schemathesis.hook
def before_call(context, case, **kwargs):
    body = case.body
    if not (isinstance(body, dict) and case.path in ("/v1/completions", "/v1/chat/completions",
                                                     "/v1/responses")):
        return
    for name, most in LIMITS.items():
        value = body.get(name)
        # 74.0 counts as an integer too (JSON Schema's rule, and the server's).
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > most:
            body[name] = most
    if case.path == "/v1/chat/completions" and body.get("max_tokens") is None \
            and body.get("max_completion_tokens") is None:
        body["max_tokens"] = LIMITS["max_tokens"]  # else: what the context leaves
    if case.path == "/v1/responses" and body.get("max_output_tokens") is None:
        body["max_output_tokens"] = LIMITS["max_output_tokens"]
    if body.get("best_of") is not None and body.get("n") is not None:
        body["best_of"] = body["n"]
