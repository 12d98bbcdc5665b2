"""Request bodies of the OpenAI endpoints (pydantic), and the compatibility choices they encode.

Every parameter of the OpenAI API is accepted by name. Those qspec implements: model (optional,
as in vLLM and llama-server: the one model this server serves when left out), logprobs and
top_logprobs (not streamed), echo (completions: the prompt's text and token
logprobs before the answer's; max_tokens 0 with it scores the prompt alone),
messages / prompt, max_tokens (max_completion_tokens), temperature, top_p, seed, stop, stream,
stream_options.include_usage, n = 1. The others are accepted at their neutral value (what
leaves the output unchanged: penalties 0, logprobs off, no tools ...) and refused with 400 at
any other, rather than silently ignored. A name the OpenAI API does not have is refused as
OpenAI does ("Unrecognized request argument supplied").
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Unimplemented OpenAI parameters and the values that ask for nothing we lack.
NEUTRAL = {
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "parallel_tool_calls": (None, True, False),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
}
IGNORED = ("user", "metadata", "store", "service_tier")  # bookkeeping: no effect on the output


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0)
    stop: list[str] = Field(default_factory=list)  # a string, a list of up to 4, or null
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n = 1 is supported (one choice per request)")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v):
        return [] if v is None else [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: list[str]) -> list[str]:
        if len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return [s for s in v if s]

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _null_is_default(cls, v, info):
        return {"temperature": 1.0, "top_p": 1.0}[info.field_name] if v is None else v

    def check_extras(self) -> None:
        """Refuse unknown parameters and unimplemented ones at a non-neutral value."""
        for name, value in (self.model_extra or {}).items():
            if name in IGNORED:
                continue
            if name not in NEUTRAL:
                raise ValueError(f"Unrecognized request argument supplied: {name}")
            if value not in NEUTRAL[name]:
                raise ValueError(f"'{name}' is not supported by this server; leave it out")
        if self.top_wanted is not None and self.stream:
            raise ValueError("logprobs are not streamed by this server: send them with stream false")

    @property
    def top_wanted(self) -> int | None:
        """Alternatives per token when the reply carries logprobs, else None."""
        return None

    @property
    def new_tokens_cap(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # e.g. "name": bookkeeping, not rendered

    # "developer" is OpenAI's newer name for the system role: rendered as "system"
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]

    def as_template_message(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def top_wanted(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    prompt: Union[str, list[int]]
    # OpenAI's default for /v1/completions; chat completions default to the rest of the context
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=5)  # OpenAI's legacy form: the alternatives wanted
    echo: bool | None = False  # the prompt before the answer (its token logprobs too)

    @property
    def top_wanted(self) -> int | None:
        return self.logprobs

    @model_validator(mode="after")
    def _zero_only_with_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 (no completion) needs echo: true")
        return self

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v):
        """OpenAI's batch forms, a list of strings or of token lists, with one prompt in it (as
        LangChain sends them) are that prompt; more than one is refused, not half-answered."""
        if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
            if len(v) > 1:
                raise ValueError(f"a list of {len(v)} prompts; this server takes one prompt a request "
                                 "(send them as separate requests: they are batched)")
            return v[0]
        if not isinstance(v, (str, list)):
            raise ValueError("expected a string or a list of token ids")
        return v

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v):
        if not v:
            raise ValueError("the prompt is empty")
        return v
