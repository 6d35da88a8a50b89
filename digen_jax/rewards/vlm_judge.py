"""A vision-language model as judge, behind an OpenAI-compatible chat completions endpoint.

Each image is one request (`POST <url>`, e.g. `http://host:8000/v1/chat/completions` of vLLM,
SGLang, TGI or a hosted API):

    {"model": "<model>",
     "messages": [{"role": "system", "content": "<system_prompt>"},          # when given
                  {"role": "user", "content": [
                      {"type": "text", "text": "<rubric with {prompt} filled in>"},
                      {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}]}],
     "max_tokens": <max_tokens>, "temperature": <temperature>}

The score is parsed from the first choice's message: `<think>...</think>` blocks are dropped
(an unclosed one to the end of the answer, which `max_tokens` cut off),
then the first match of `score_regex` (its first group if it has one) must be a number in
[`min_score`, `max_score`]; it is the reward as it stands (no rescaling: weights do that).
An answer without one is malformed: it is retried like a timeout, and after `retries` retries
the call raises `RemoteRewardError` with one line quoting the answer and naming the option
`score_regex`. Transport, timeouts, backoff, concurrency and TLS are `RemoteScorer`'s.

The API key is read from the environment variable the option `api_key_env` names and sent as
`Authorization: Bearer <key>`; it is never an option itself, so it is never in a config, a log
or an error message.
"""
from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Mapping, Sequence

import numpy as np

from digen_jax.rewards.registry import RewardFn, register_reward
from digen_jax.rewards.remote import RemoteScorer, encode_image

DEFAULT_RUBRIC = (
    'This image was generated from the prompt: "{prompt}". Rate how faithfully it follows the '
    "prompt and how good it looks, from 0 (unrelated or broken) to 10 (faithful and flawless). "
    "Answer with the number only."
)
DEFAULT_SCORE_REGEX = r"[-+]?\d+(?:\.\d+)?"
# A reasoning block, or an unclosed one running to the end (an answer cut off by max_tokens).
_THINKING = re.compile(r"<think>.*?(?:</think>|\Z)", re.DOTALL)


class VLMJudge(RemoteScorer):
    """Scores images by asking a chat model (module docstring); one request per image.

    Args:
      url: the chat completions endpoint, e.g. 'http://127.0.0.1:8000/v1/chat/completions'.
      model: the served model's name (the request's "model").
      rubric: the user message, a `str.format` template whose only field is `{prompt}`.
      system_prompt: an optional system message.
      score_regex: where the score is in the answer (first match; its first group if any).
      min_score, max_score: the range a parsed score must lie in.
      max_tokens, temperature: sampling settings of the request.
      api_key_env: the environment variable holding the API key (none: no Authorization header).
      **options: `RemoteScorer`'s (timeout, retries, backoff, max_backoff, max_concurrency,
        image_format, jpeg_quality, max_answer_bytes, allow_insecure, ca_file, sleep).
    """

    def __init__(
        self,
        url: str,
        *,
        model: str,
        rubric: str = DEFAULT_RUBRIC,
        system_prompt: str | None = None,
        score_regex: str = DEFAULT_SCORE_REGEX,
        min_score: float = 0.0,
        max_score: float = 10.0,
        max_tokens: int = 64,
        temperature: float = 0.0,
        api_key_env: str | None = None,
        **options: Any,
    ):
        for given in ("token", "token_env", "batch_size"):
            if given in options:
                raise ValueError(f"reward 'vlm_judge' has no option {given}: the API key comes from the environment "
                                 "variable the option api_key_env names, and each image is one request")
        if not isinstance(model, str) or not model:
            raise ValueError(f"reward 'vlm_judge' option model must name the served model, got {model!r}")
        try:
            rubric.format(prompt="")
        except (AttributeError, IndexError, KeyError, ValueError) as e:
            raise ValueError(f"reward 'vlm_judge' option rubric must be a str.format template whose only field is "
                             f"{{prompt}} (write other braces as {{{{ }}}}): {type(e).__name__}: {e}") from None
        try:
            self.score_pattern = re.compile(score_regex)
        except (re.error, TypeError) as e:
            raise ValueError(f"reward 'vlm_judge' option score_regex={score_regex!r} is not a regular expression: "
                             f"{e}") from None
        bounds = (min_score, max_score)
        if not all(isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b) for b in bounds) \
                or not min_score < max_score:
            raise ValueError(f"reward 'vlm_judge' options min_score < max_score must be finite numbers, "
                             f"got {min_score!r}, {max_score!r}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"reward 'vlm_judge' option max_tokens must be an integer >= 1, got {max_tokens!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
            raise ValueError(f"reward 'vlm_judge' option temperature must be a number >= 0, got {temperature!r}")
        if api_key_env is not None and not os.environ.get(api_key_env):
            raise ValueError(f"reward 'vlm_judge' option api_key_env names ${api_key_env}, which is not set; "
                             "export the API key there, or drop the option for a server without one")
        super().__init__(url, token_env=api_key_env, batch_size=1, **options)
        self.model, self.rubric, self.system_prompt = model, rubric, system_prompt
        self.score_regex, self.min_score, self.max_score = score_regex, float(min_score), float(max_score)
        self.max_tokens, self.temperature = max_tokens, float(temperature)

    def chat_request(self, image: np.ndarray, prompt: str) -> bytes:
        """The chat completions request judging one (H, W, 3) uint8 image."""
        encoded = encode_image(image, self.image_format, self.jpeg_quality)
        content = [
            {"type": "text", "text": self.rubric.format(prompt=prompt)},
            {"type": "image_url", "image_url": {"url": f"data:image/{encoded['format']};base64,{encoded['data']}"}},
        ]
        messages = [{"role": "user", "content": content}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        payload = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                   "temperature": self.temperature}
        return json.dumps(payload).encode("utf-8")

    def request_bodies(self, pixels: np.ndarray, prompts: Sequence[str],
                       metadata: Sequence[Mapping[str, Any]]) -> list[tuple[bytes, int]]:
        return [(self.chat_request(image, str(prompt)), 1) for image, prompt in zip(pixels, prompts)]

    def parse_answer(self, answer: bytes, expected: int) -> np.ndarray:
        return np.asarray([self.parse_score(answer_text(answer))], np.float32)

    def parse_score(self, text: str) -> float:
        """The score in a chat answer's text; ValueError (one line, naming score_regex) if none."""
        visible = _THINKING.sub("", text)
        match = self.score_pattern.search(visible)
        quoted = repr(visible.strip()[:200])
        if match is None:
            raise ValueError(f"answer {quoted} holds no score: nothing matches the reward option "
                             f"score_regex={self.score_regex!r} (make the rubric ask for the number, or set score_regex)")
        found = match.group(1) if self.score_pattern.groups else match.group(0)
        try:
            score = float(found)
        except (TypeError, ValueError):
            raise ValueError(f"answer {quoted}: score_regex={self.score_regex!r} matched {found!r}, "
                             "not a number") from None
        if not self.min_score <= score <= self.max_score:
            raise ValueError(f"answer {quoted}: score {score} is outside [min_score, max_score] = "
                             f"[{self.min_score}, {self.max_score}]")
        return score


def answer_text(answer: bytes) -> str:
    """The first choice's message text of a chat completions answer (content as a string or a
    list of text parts); ValueError describing a body that is not one."""
    try:
        payload = json.loads(answer)
        content = payload["choices"][0]["message"]["content"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, IndexError, TypeError):
        raise ValueError(f"not a chat completions answer (choices[0].message.content): {answer[:200]!r}") from None
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    if not isinstance(content, str):
        raise ValueError(f"choices[0].message.content is {type(content).__name__}, not text")
    return content


@register_reward("vlm_judge")
def vlm_judge(url: str | None = None, model: str | None = None, **options: Any) -> RewardFn:
    """A VLM judge behind an OpenAI-compatible chat completions endpoint (module docstring).

    Options: url, model (both required), rubric, system_prompt, score_regex, min_score,
    max_score, max_tokens, temperature, api_key_env, and `RemoteScorer`'s timeout, retries,
    backoff, max_backoff, max_concurrency, image_format, jpeg_quality, max_answer_bytes,
    allow_insecure, ca_file.
    """
    if url is None or model is None:
        raise ValueError(
            "reward 'vlm_judge' needs the options url and model, e.g. reward options {'vlm_judge': {'url': "
            "'http://host:8000/v1/chat/completions', 'model': 'Qwen/Qwen2.5-VL-7B-Instruct', 'api_key_env': 'VLM_KEY'}}"
        )
    return VLMJudge(url, model=model, **options)
