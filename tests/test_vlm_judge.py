"""The `vlm_judge` reward against an OpenAI-compatible chat completions server on loopback: a
tiny ASGI app served by uvicorn that reads the image back out of the request's data URL and
answers in the chat completions format (or malformed, or too late)."""
import asyncio
import base64
import io
import json
import socket
import threading

import numpy as np
import pytest
from PIL import Image

from digen_jax.rewards import RemoteRewardError, get_reward, vlm_judge

uvicorn = pytest.importorskip("uvicorn", reason="uvicorn is in requirements.txt")  # the server side only


class ChatServer:
    """Serves `/v1/chat/completions` in a thread: `answer(payload, image)` (async) gives the
    message text, or a whole answer dict; every request is kept as (path, headers, payload)."""

    def __init__(self, answer):
        self.answer, self.requests = answer, []
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}/v1/chat/completions"
        config = uvicorn.Config(self.app, interface="asgi3", lifespan="off", loop="asyncio", log_config=None,
                                access_log=False, timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)

    async def app(self, scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        payload = json.loads(body)
        self.requests.append((scope["path"], dict(scope["headers"]), payload))
        url = payload["messages"][-1]["content"][1]["image_url"]["url"]
        image = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))
        reply = await self.answer(payload, image)
        if isinstance(reply, str):
            reply = {"id": "x", "object": "chat.completion",
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]}
        data = json.dumps(reply).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    def __enter__(self):
        self.thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[self.socket]), daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)
        self.socket.close()


def _images():
    """Three flat images of known brightness (PNG carries them exactly)."""
    return np.stack([np.full((8, 12, 3), v, np.uint8) for v in (51, 102, 255)])


def test_judge_sends_image_rubric_and_key_and_parses_scores(monkeypatch):
    async def brightness(payload, image):  # the "judge": mean pixel / 25.5, after some reasoning
        return f"<think>Looks like a 3, or 12.</think>Score: {image.mean() / 25.5:.3f}"

    monkeypatch.setenv("VLM_TEST_KEY", "sk-test-123")
    with ChatServer(brightness) as server:
        judge = get_reward("vlm_judge", url=server.url, model="judge-7b", api_key_env="VLM_TEST_KEY",
                           system_prompt="You are strict.", rubric="Prompt: {prompt}. Score 0-10.",
                           max_concurrency=2)
        got = judge(_images(), ["a red cat", "a dog {x}", "sky"], [{}] * 3)
    np.testing.assert_allclose(got, [2.0, 4.0, 10.0], atol=1e-3)
    assert got.dtype == np.float32 and got.shape == (3,)
    assert len(server.requests) == 3
    texts = set()
    for path, headers, payload in server.requests:
        assert path == "/v1/chat/completions" and headers[b"authorization"] == b"Bearer sk-test-123"
        assert payload["model"] == "judge-7b" and payload["temperature"] == 0.0 and payload["max_tokens"] == 64
        system, user = payload["messages"]
        assert system == {"role": "system", "content": "You are strict."} and user["role"] == "user"
        texts.add(user["content"][0]["text"])
        assert user["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")
    assert texts == {"Prompt: a red cat. Score 0-10.", "Prompt: a dog {x}. Score 0-10.", "Prompt: sky. Score 0-10."}


def test_score_regex_groups_and_ranges():
    judge = vlm_judge.VLMJudge("http://127.0.0.1:1/v1/chat/completions", model="m",
                               score_regex=r"Rating:\s*(\d+)/5", min_score=1, max_score=5)
    assert judge.parse_score("Step 1 of 3. Rating: 4/5") == 4.0
    with pytest.raises(ValueError, match="holds no score"):  # cut off while reasoning: no score, not its 3
        judge.parse_score("Rating: <think>Rating: 3/5 maybe, but")
    with pytest.raises(ValueError, match=r"outside \[min_score, max_score\] = \[1.0, 5.0\]"):
        judge.parse_score("Rating: 7/5")
    parts = json.dumps({"choices": [{"message": {"content": [{"type": "text", "text": "Rating: 2/5"}]}}]})
    assert judge.parse_answer(parts.encode(), 1).tolist() == [2.0]
    with pytest.raises(ValueError, match=r"choices\[0\]\.message\.content"):
        judge.parse_answer(b'{"error": "overloaded"}', 1)


def test_unparseable_answer_is_retried_then_one_line_names_score_regex(monkeypatch):
    async def chatty(payload, image):
        return "What a lovely picture!\nI would not change a thing."

    waits = []
    monkeypatch.setenv("VLM_TEST_KEY", "sk-secret-456")
    with ChatServer(chatty) as server:
        judge = get_reward("vlm_judge", url=server.url, model="m", api_key_env="VLM_TEST_KEY", retries=2,
                           backoff=0.5, sleep=waits.append)
        with pytest.raises(RemoteRewardError) as failure:
            judge(_images()[:1], ["a cat"], [{}])
    message = str(failure.value)
    assert "\n" not in message and "score_regex=" in message and "What a lovely picture" in message
    assert "sk-secret-456" not in message
    assert len(server.requests) == 3 and waits == [0.5, 1.0]


def test_slow_judge_times_out_retries_then_fails():
    async def slow(payload, image):
        await asyncio.sleep(1.5)
        return "7"

    waits = []
    with ChatServer(slow) as server:
        judge = get_reward("vlm_judge", url=server.url, model="m", timeout=0.3, retries=1, backoff=0.1,
                           sleep=waits.append)
        with pytest.raises(RemoteRewardError, match=r"after 2 attempt\(s\) \(timeout 0.3s, retries 1\).*TimeoutError"):
            judge(_images()[:1], ["a cat"], [{}])
    assert len(server.requests) == 2 and waits == [0.1]


@pytest.mark.parametrize("options,match", [
    ({}, "needs the options url and model"),
    ({"model": "m", "token": "sk-x"}, "has no option token: the API key comes from the environment"),
    ({"model": "m", "api_key_env": "VLM_TEST_UNSET_KEY"}, r"api_key_env names \$VLM_TEST_UNSET_KEY, which is not set"),
    ({"model": "m", "rubric": "Judge {image}"}, "option rubric must be a str.format template"),
    ({"model": "m", "score_regex": "(unclosed"}, "option score_regex='\\(unclosed' is not a regular expression"),
    ({"model": "m", "min_score": 5, "max_score": 5}, "min_score < max_score"),
    ({"model": "m", "timeout": 0}, "option timeout must be > 0"),
])
def test_bad_options_name_themselves(options, match, monkeypatch):
    monkeypatch.delenv("VLM_TEST_UNSET_KEY", raising=False)
    url = {} if not options else {"url": "http://127.0.0.1:1/v1/chat/completions"}
    with pytest.raises(ValueError, match=match):
        get_reward("vlm_judge", **url, **options)
