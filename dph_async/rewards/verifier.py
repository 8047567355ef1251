"""An LLM verifier (TinyV): asks a model whether an answer matches the ground truth, reads True/False.

Backends share one method, `complete(prompt, timeout_s) -> str`:
- `OpenAIVerifier`: any OpenAI-compatible chat-completions server (`vllm serve <model>`), over HTTP;
- `LocalVLLMVerifier`: a vLLM engine inside the reward worker process (no server to run, but every
  worker loads the model: use one worker, and a memory limit that fits the model).
The prompt is the configured template with {{QUESTION}}, {{GROUND_TRUTH_ANSWER}} and {{MODEL_ANSWER}}
replaced, sent as one user message. A verifier that is down, slow or answers neither True nor False
gives a verdict of None, which the rewards report as status "verifier_error", never as "wrong".
"""

from __future__ import annotations

import os
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import httpx

from dph_async.config.rewards import VerifierConfig
from dph_async.rewards import context

_WORD = re.compile(r"\b(true|false)\b", re.IGNORECASE)


class VerifierUnavailable(RuntimeError):
    """The verifier could not be asked (connection, HTTP error, timeout, malformed reply)."""


class VerifierBackend(Protocol):
    def complete(self, prompt: str, timeout_s: float) -> str: ...


@dataclass(frozen=True)
class Verdict:
    correct: bool | None  # None: no usable verdict
    detail: str = ""


def build_prompt(template: str, question: str, ground_truth: str, answer: str) -> str:
    return (template.replace("{{QUESTION}}", question)
            .replace("{{GROUND_TRUTH_ANSWER}}", ground_truth)
            .replace("{{MODEL_ANSWER}}", answer))


def parse_verdict(text: str, think: bool) -> bool | None:
    """True/False from the verifier's reply (its first "true" or "false" word); None if neither.

    A thinking verifier is judged on what follows its reasoning ("</think>" or "Answer:"); a reply
    that never finishes reasoning has no verdict.
    """
    if think:
        for marker in ("</think>", "Answer:"):
            if marker in text:
                text = text.rsplit(marker, 1)[1]
                break
        else:
            return None
    found = _WORD.search(text)
    return None if found is None else found.group(1).lower() == "true"


class OpenAIVerifier:
    """Chat completions from an OpenAI-compatible server at `cfg.url` (e.g. http://127.0.0.1:8000/v1)."""

    def __init__(self, cfg: VerifierConfig) -> None:
        if not cfg.url:
            raise ValueError("rewards.verifier.url is not set (an OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1)")
        self.cfg = cfg
        headers = {}
        if cfg.api_key_env:
            headers["Authorization"] = f"Bearer {os.environ.get(cfg.api_key_env, '')}"
        self._http = httpx.Client(base_url=cfg.url.rstrip("/"), headers=headers)
        self._model = cfg.model

    def _request(self, path: str, timeout_s: float, body: dict | None = None) -> dict:
        """GET `path`, or POST `body` to it; the reply's JSON object."""
        try:
            reply = (self._http.post(path, json=body, timeout=timeout_s) if body is not None
                     else self._http.get(path, timeout=timeout_s))
            reply.raise_for_status()
            data = reply.json()
        except (httpx.HTTPError, ValueError) as e:
            raise VerifierUnavailable(f"{path}: {type(e).__name__}: {e}"[:300]) from e
        if not isinstance(data, dict):
            raise VerifierUnavailable(f"{path}: reply is not a JSON object")
        return data

    def _model_name(self, timeout_s: float) -> str:
        if self._model is None:
            try:
                self._model = str(self._request("/models", timeout_s)["data"][0]["id"])
            except (KeyError, IndexError, TypeError) as e:
                raise VerifierUnavailable("/models: no model listed") from e
        return self._model

    def complete(self, prompt: str, timeout_s: float) -> str:
        body = {
            "model": self._model_name(timeout_s),
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": self.cfg.max_tokens,
            "temperature": self.cfg.temperature,
            "top_p": 1.0,
        }
        data = self._request("/chat/completions", timeout_s, body)
        try:
            content = data["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError) as e:
            raise VerifierUnavailable("/chat/completions: reply has no choices[0].message.content") from e
        if not isinstance(content, str):
            raise VerifierUnavailable("/chat/completions: message content is not text")
        return content


class LocalVLLMVerifier:
    """A vLLM engine in this process, loading `cfg.model` on first use.

    The engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) because reward workers may not have
    children; it cannot be interrupted, so its deadline is the pool's kill of the whole worker.
    """

    def __init__(self, cfg: VerifierConfig) -> None:
        if not cfg.model:
            raise ValueError("rewards.verifier.model must name a model directory for backend=vllm")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # heavy (vLLM, about 8 CPU-s): this backend's only; every scorer imports this module
        from vllm import LLM, SamplingParams

        self._llm = LLM(model=cfg.model, enforce_eager=True)
        self._params = SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens)

    def complete(self, prompt: str, timeout_s: float) -> str:
        outputs = self._llm.chat([[{"role": "user", "content": prompt}]], self._params, use_tqdm=False)
        return outputs[0].outputs[0].text


class Verifier:
    """Judges answers with a backend: retries, a deadline within the reward's own, a verdict cache."""

    def __init__(self, cfg: VerifierConfig, backend: VerifierBackend) -> None:
        self.cfg = cfg
        self.backend = backend
        self._cache: OrderedDict[str, bool] = OrderedDict()

    def judge(self, question: str, ground_truth: str, answer: str) -> Verdict:
        prompt = build_prompt(self.cfg.template, question, ground_truth, answer)
        if prompt in self._cache:
            self._cache.move_to_end(prompt)
            return Verdict(self._cache[prompt], "cached")
        problem = ""
        for attempt in range(self.cfg.retries + 1):
            timeout_s = min(self.cfg.timeout_s, context.time_left())
            if timeout_s <= 0.01:
                return Verdict(None, f"verifier: no time left ({problem or 'deadline reached'})")
            try:
                text = self.backend.complete(prompt, timeout_s)
            except VerifierUnavailable as e:
                problem = str(e)
                if attempt < self.cfg.retries:
                    time.sleep(min(0.05 * 2**attempt, context.time_left() / 4))
                continue
            verdict = parse_verdict(text, self.cfg.think)
            if verdict is not None:
                self._remember(prompt, verdict)
                return Verdict(verdict)
            problem = f"reply is neither True nor False: {text[:80]!r}"
        return Verdict(None, f"verifier: {problem}")

    def _remember(self, prompt: str, verdict: bool) -> None:
        if self.cfg.cache_size == 0:
            return
        self._cache[prompt] = verdict
        if len(self._cache) > self.cfg.cache_size:
            self._cache.popitem(last=False)


_verifier: Verifier | None = None


def get_verifier() -> Verifier:
    """This process's verifier, built from the reward config on first use."""
    global _verifier
    cfg = context.config().verifier
    if _verifier is None or _verifier.cfg != cfg:
        backend: VerifierBackend = OpenAIVerifier(cfg) if cfg.backend == "openai" else LocalVLLMVerifier(cfg)
        _verifier = Verifier(cfg, backend)
    return _verifier
