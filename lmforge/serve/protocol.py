"""The OpenAI request bodies the server accepts, and its error object.

Bodies are validated strictly (a string where a number belongs is a 400, not a silent conversion);
fields OpenAI defines that change nothing here (`user`, `logprobs: null` ...) are accepted, and
those that would change the answer but are not implemented (`logprobs`, `echo`, penalties, `suffix`)
are refused by name rather than ignored, vLLM's extensions of that kind (`min_tokens`, `ignore_eos`, guided
decoding, `response_format` other than text) too. Other unknown fields are ignored, as OpenAI-compatible servers do,
with a warning in the server's log naming them (and the parameter a mistyped one was likely meant to be).
A top-level `null` means the field's default, as OpenAI's schema has it. Extensions beyond OpenAI's schema: `top_k`
(-1 or 0: off, as in vLLM) and `repetition_penalty` (as in vLLM and TGI).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

log = logging.getLogger(__name__)
MAX_STOP_STRINGS = 16
# The parts of a validation error's location that name a type pydantic tried (a union's branches), not a field.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|(list|dict|literal|tagged-union|function-[\w-]+)\[.*\])$")
# vLLM's request fields that change the answer, which this server does not do: refused by name when set.
VLLM_UNSUPPORTED = ("min_tokens", "ignore_eos", "use_beam_search", "prompt_logprobs", "guided_json", "guided_regex",
                    "guided_choice", "guided_grammar", "structured_outputs", "logits_processors")
# torch.Generator.manual_seed takes [-2**63, 2**64); a request's choices use seed, seed + 1, ... seed + n - 1.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    # allow_inf_nan=False: Python's json reads NaN and Infinity, which compare false with every bound. Unknown fields
    # are kept aside (model_extra) for unsupported() to look at, and otherwise ignored.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    model: str | None = None  # left out or "": the model served, as in vLLM
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # -1, 0 or None = off
    repetition_penalty: float = Field(1.0, gt=0.0)
    n: int = Field(1, ge=1)  # prompts x n is capped by the server's --max-choices
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)  # a list after validation
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    skip_special_tokens: bool = True  # vLLM's: special tokens the model writes are left out of the text

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        return None if v in (-1, 0) else v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return [s for s in stops if s]

    def unsupported(self) -> list[str]:
        """Fields set to something this server does not do."""
        bad = [name for name in ("frequency_penalty", "presence_penalty") if getattr(self, name)]
        bad += ["logit_bias"] if self.logit_bias else []
        if self.response_format and self.response_format.get("type", "text") != "text":
            bad.append("response_format")
        extra = self.model_extra or {}
        return bad + [name for name in VLLM_UNSUPPORTED if extra.get(name) not in (None, False, 0, [], {})]

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported() + [name for name in ("echo", "logprobs", "suffix") if getattr(self, name)]
        return bad + (["best_of"] if self.best_of not in (None, self.n) else [])

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: str
    text: str | None = None

    @field_validator("type")
    @classmethod
    def _text_only(cls, v):
        if v != "text":
            raise ValueError(f"this server reads text only, not '{v}' content parts")
        return v


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content)
        return self.content or ""


class ChatRequest(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None

    def unsupported(self) -> list[str]:
        return super().unsupported() + [name for name in ("logprobs", "top_logprobs", "tools") if getattr(self, name)]


def parse(model: type[BaseModel], data: Any) -> Any:
    """Validate a JSON value as `model`, or raise a 400 APIError naming the first bad field."""
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(data).__name__}")
    data = {k: v for k, v in data.items() if v is not None}  # null: the field's default, as OpenAI's schema reads it
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        # A union's branches each fail; the one that reached into the value says what is wrong with it.
        err = max(errors, key=lambda x: (x["type"] == "value_error", len(x["loc"])))
        param = ".".join(str(x) for x in err["loc"] if not _TYPE_TAG.match(str(x)))
        reason = err["msg"].removeprefix("Value error, ")
        message = f"'{param}' is required" if err["type"] == "missing" else f"invalid value for '{param}': {reason}"
        raise APIError(400, message, param=param or None) from None
    bad = body.unsupported() if isinstance(body, _Body) else []
    if bad:
        raise APIError(400, f"'{bad[0]}' is not supported by this server: leave it out", param=bad[0],
                       code="unsupported_parameter")
    ignored = [k for k in (getattr(body, "model_extra", None) or {}) if k not in VLLM_UNSUPPORTED]
    if ignored:  # as vLLM does: answered, but a mistyped `max_token` should not pass unseen
        from lmforge.config import closest

        log.warning("request fields ignored (not parameters this server reads): %s", ", ".join(
            f"'{k}'{closest(k, type(body).model_fields)}" for k in ignored))
    return body


class TGIParameters(BaseModel):
    """`parameters` of Hugging Face's text-generation container (TGI), which SageMaker's LLM images run."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    max_new_tokens: int | None = Field(None, ge=1)
    do_sample: bool = False  # TGI samples when this or any of temperature, top_k, top_p asks to (sampling())
    temperature: float | None = Field(None, gt=0.0)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    return_full_text: bool = False
    details: bool = False
    # TGI's, which change the answer and are not done here: refused by name when set (unsupported()).
    typical_p: float | None = None
    truncate: int | None = None
    best_of: int | None = None
    watermark: bool = False
    decoder_input_details: bool = False
    top_n_tokens: int | None = None

    def sampling(self) -> bool:
        """TGI's rule: do_sample, or a temperature, top_k or top_p that changes the distribution."""
        return self.do_sample or (self.temperature is not None and self.temperature != 1.0) or bool(self.top_k) \
            or (self.top_p is not None and self.top_p < 1.0)

    def unsupported(self) -> list[str]:
        return [name for name in ("typical_p", "truncate", "watermark", "decoder_input_details", "top_n_tokens")
                if getattr(self, name)] + (["best_of"] if self.best_of not in (None, 1) else [])


class TGIRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    inputs: str | list[str]
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: bool = False  # TGI's server-sent events: not on /invocations here (refused by name)
