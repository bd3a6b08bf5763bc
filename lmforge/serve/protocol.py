"""The OpenAI request bodies the server accepts, and its error object.

Bodies are validated strictly (a string where a number belongs is a 400, not a silent conversion),
with OpenAI's ranges (penalties in [-2, 2], a logit_bias in [-100, 100], top_logprobs in [0, 20]);
fields OpenAI defines that change nothing here (`user` ...) are accepted, and those that would
change the answer but are not implemented (`suffix`, the deprecated `functions`) are
refused by name rather than ignored, vLLM's extensions of that kind (`bad_words`, `prompt_logprobs`,
guided decoding, the chat template's `chat_template`, `add_generation_prompt: false`,
`continue_final_message` ...) too. Other unknown fields are ignored, as OpenAI-compatible servers
do, with a warning in the server's log naming them (and the parameter a mistyped one was likely
meant to be). A top-level `null` means the field's default, as OpenAI's schema has it; the server
may take its sampling defaults from the model folder (`lmforge serve --generation-config`), which a
request's own fields override. Extensions beyond OpenAI's schema: `top_k` (-1 or 0: off, as in
vLLM), `repetition_penalty` (as in vLLM and TGI), vLLM's `min_p`, `min_tokens`, `stop_token_ids`,
`ignore_eos`, `include_stop_str_in_output` (the stop string that ended a choice kept in its text; on
chat only a request's own `stop` strings, not those the chat format adds) and
`max_completion_tokens` on completions too.
"""

from __future__ import annotations

import logging
import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

log = logging.getLogger(__name__)
MAX_STOP_STRINGS = 16
# The parts of a validation error's location that name a type pydantic tried (a union's branches),
# not a field.
_TYPE_TAG = re.compile(
    r"^(str|int|float|bool|none|(list|dict|literal|tagged-union|function-[\w-]+)\[.*\])$"
)
# vLLM's request fields that change the answer, which this server does not do: refused by name when
# set.
VLLM_UNSUPPORTED = (
    "use_beam_search",
    "prompt_logprobs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "logits_processors",
    "allowed_token_ids",
    "bad_words",
    "truncate_prompt_tokens",
    "prompt_embeds",
)
# Those of vLLM's chat route: they change the prompt the chat template renders.
VLLM_CHAT_UNSUPPORTED = (
    "chat_template",
    "chat_template_kwargs",
    "continue_final_message",
    "documents",
)
# A vLLM field set to one of these asks for nothing: accepted.
_OFF = (None, False, 0, "", [], {})
# torch.Generator.manual_seed takes [-2**63, 2**64); a request's choices use seed, seed + 1, ...
# seed + n - 1.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# top_logprobs (chat) and logprobs (completions): OpenAI's chat limit, vLLM's max_logprobs
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 64
# What str.splitlines() breaks at, the other C0/C1 control characters (a terminal's escape
# sequences), and lone surrogates (UTF-8 has no bytes for them: the answer could not be written).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def one_line(text: str) -> str:
    """`text` with line breaks, control characters and lone surrogates written as escapes (\\n, \\x1b, \\ud800):
    a message quoting what a client sent stays one line, in the answer and in a log."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}} with an
    HTTP status; the message one line (one_line)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        message = one_line(message)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class _Body(BaseModel):
    # allow_inf_nan=False: Python's json reads NaN and Infinity, which compare false with every
    # bound. Unknown fields are kept aside (model_extra) for unsupported() to look at, and otherwise
    # ignored.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    # read from model_extra: refused unless _OFF
    vllm_refused: ClassVar[tuple[str, ...]] = VLLM_UNSUPPORTED

    model: str | None = None  # left out or "": the model served, as in vLLM
    # 0: only with echo on completions (the prompt scored, nothing new)
    max_tokens: int | None = Field(None, ge=0)
    # OpenAI's newer name for max_tokens; wins over it
    max_completion_tokens: int | None = Field(None, ge=1)
    # The defaults below are OpenAI's; a field a request leaves out takes the server's (sampling_of)
    # where it has one.
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # below 1e-5 greedy (sampling.SAMPLING_EPS)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # -1, 0 or None = off
    # any: a score it overflows is made safe (sampling.py)
    repetition_penalty: float = Field(1.0, gt=0.0)
    n: int = Field(1, ge=1)  # prompts x n is capped by the server's --max-choices
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)  # a list after validation
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # vLLM's: 0 = off
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)  # OpenAI's ranges
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # token id (a string, as JSON keys are) -> bias in [-100, 100]
    logit_bias: dict[str, float] | None = None
    # vLLM's: eos and stop_token_ids masked until this many are generated
    min_tokens: int = Field(0, ge=0)
    # vLLM's: more ids that end it
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False  # vLLM's: eos does not end the completion
    user: str | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's: special tokens the model writes are left out of the text
    skip_special_tokens: bool = True
    # vLLM's: the stop string that ended a choice stays in its text
    include_stop_str_in_output: bool = False
    # vLLM's: only requests with the same salt share prefix-cache blocks (a tenant's own)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        return None if v in (-1, 0) else v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if not v:
            return None
        bias = {}
        for key, value in v.items():
            if not key.isascii() or not key.isdigit():
                raise ValueError(
                    f"keys must be token ids written as integers, got '{one_line(key)}'"
                )
            if not -100 <= value <= 100:
                raise ValueError(f"the bias of token {key} is {value}: each must be in [-100, 100]")
            bias[int(key)] = value
        return bias

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return [s for s in stops if s]

    def unsupported(self) -> list[str]:
        """Fields set to something this server does not do."""
        extra = self.model_extra or {}
        return [name for name in self.vllm_refused if extra.get(name) not in _OFF]

    def requested_tokens(self) -> tuple[int | None, str]:
        """(the tokens asked for, the field that asked): max_completion_tokens where given, as
        OpenAI reads both."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    # the prompt in front of the text (and its tokens' logprobs in front of the completion's)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # 0: the chosen tokens' own only
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported() + [name for name in ("suffix",) if getattr(self, name)]
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
            # escaped here: pydantic cannot carry a lone surrogate in an error's message
            # (UnicodeEncodeError)
            raise ValueError(f"this server reads text only, not '{one_line(v)}' content parts")
        return v


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    # a JSON text, as OpenAI sends it (an object is taken too)
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(BaseModel):
    """A call an assistant message made (lmforge.serve.tools renders it)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


# OpenAI's function names (dots: vLLM's too)
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def check_tool(tool: Any) -> dict:
    """A `tools` entry, {"type": "function", "function": {"name", "description", "parameters"}},
    kept as sent (the chat template renders it, key order included); a ValueError naming what
    is wrong."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ValueError('each tool must be {"type": "function", "function": {...}}')
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError('each tool needs "function": {"name": ..., "parameters": {...}}')
    if not FUNCTION_NAME.match(fn["name"]):
        raise ValueError(
            f"the function name '{one_line(fn['name'][:80])}' is not 1-64 letters, digits, _ . -"
        )
    if not isinstance(fn.get("description", ""), str):
        raise ValueError(f"the description of '{fn['name']}' must be a string")
    if not isinstance(fn.get("parameters", {}), dict):
        raise ValueError(f"the parameters of '{fn['name']}' must be a JSON Schema object")
    return tool


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: dict[str, str]  # {"name": ...}


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool result's: the call it answers
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content)
        return self.content or ""


class ChatRequest(_Body):
    vllm_refused: ClassVar[tuple[str, ...]] = (*VLLM_UNSUPPORTED, *VLLM_CHAT_UNSUPPORTED)
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    # needs logprobs: true, as OpenAI has it
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None  # lmforge.serve.tools; check_tool

    functions: list[Any] | None = None  # OpenAI's deprecated form of tools
    # "auto" where tools are given; "none" and "auto" ask for nothing without tools
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # false: at most one call
    function_call: str | dict[str, Any] | None = None
    echo: bool = False  # vLLM's: the last message's text before the reply
    # vLLM's: false renders the messages without the assistant's turn opened
    add_generation_prompt: bool = True

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        return [check_tool(t) for t in v] if v else None

    def unsupported(self) -> list[str]:
        bad = super().unsupported() + [
            name for name in ("functions", "echo") if getattr(self, name)
        ]
        bad += ["function_call"] if self.function_call not in (None, "none", "auto") else []
        return bad + ([] if self.add_generation_prompt else ["add_generation_prompt"])


def parse(model: type[BaseModel], data: Any) -> Any:
    """Validate a JSON value as `model`, or raise a 400 APIError naming the first bad field."""
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(data).__name__}")
    # null: the field's default, as OpenAI's schema reads it
    data = {k: v for k, v in data.items() if v is not None}
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        # A union's branches each fail; the one that reached into the value says what is wrong with
        # it.
        err = max(errors, key=lambda x: (x["type"] == "value_error", len(x["loc"])))
        param = ".".join(str(x) for x in err["loc"] if not _TYPE_TAG.match(str(x)))
        reason = err["msg"].removeprefix("Value error, ")
        message = (
            f"'{param}' is required"
            if err["type"] == "missing"
            else f"invalid value for '{param}': {reason}"
        )
        raise APIError(400, message, param=param or None) from None
    bad = body.unsupported() if isinstance(body, _Body) else []
    if bad:
        raise APIError(
            400,
            f"'{bad[0]}' is not supported by this server: leave it out",
            param=bad[0],
            code="unsupported_parameter",
        )
    warn_ignored(body, getattr(body, "vllm_refused", ()))
    return body


def warn_ignored(
    body: BaseModel, read: tuple[str, ...] = (), where: str = "request fields"
) -> None:
    """As vLLM does: a field the body does not define is answered as absent, but a mistyped
    `max_token` should not pass unseen: the log names it, and the parameter it resembles."""
    ignored = [k for k in (body.model_extra or {}) if k not in read]
    if ignored:
        from lmforge.config import closest

        log.warning(
            "%s ignored (not parameters this server reads): %s",
            where,
            ", ".join(f"'{k}'{closest(k, type(body).model_fields)}" for k in ignored),
        )


class TGIParameters(BaseModel):
    """`parameters` of Hugging Face's text-generation container (TGI), which SageMaker's LLM
    images run."""

    # others: warn_ignored
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    max_new_tokens: int | None = Field(None, ge=1)
    # TGI samples when this or any of temperature, top_k, top_p asks to (sampling())
    do_sample: bool = False
    temperature: float | None = Field(None, gt=0.0)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    # OpenAI's, as on /v1 (penalties.py): over the output tokens' counts
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)  # not TGI's: /v1's, taken here too
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    return_full_text: bool = False
    details: bool = False
    # TGI's, which change the answer and are not done here: refused by name when set
    # (unsupported()).
    typical_p: float | None = None
    truncate: int | None = None
    best_of: int | None = None
    watermark: bool = False
    decoder_input_details: bool = False
    top_n_tokens: int | None = None
    grammar: Any = None  # {"type": "json" | "regex", "value": ...}
    # a LoRA adapter TGI loaded beside the model; `serve --lora` merges one in
    adapter_id: str | None = None

    def sampling(self) -> bool:
        """TGI's rule: do_sample, or a temperature, top_k or top_p that changes the distribution."""
        return (
            self.do_sample
            or (self.temperature is not None and self.temperature != 1.0)
            or bool(self.top_k)
            or (self.top_p is not None and self.top_p < 1.0)
        )

    def unsupported(self) -> list[str]:
        return (
            [
                name
                for name in (
                    "typical_p",
                    "truncate",
                    "watermark",
                    "decoder_input_details",
                    "top_n_tokens",
                    "adapter_id",
                )
                if getattr(self, name)
            ]
            + (["grammar"] if self.grammar is not None else [])
            + (["best_of"] if self.best_of not in (None, 1) else [])
        )


class TGIRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    inputs: str | list[str]
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: bool = False  # TGI's server-sent events: not on /invocations here (refused by name)
