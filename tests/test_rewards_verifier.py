"""The LLM verifier (TinyV modes) against a fake OpenAI-compatible server that can also fail."""

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dph_async.config.rewards import TINYV_TEMPLATE, RewardConfig
from dph_async.rewards import context, verifier
from dph_async.rewards.pool import RewardPool
from dph_async.rewards.verifier import build_prompt, parse_verdict
from dph_async.rewards.worker import ScoreRequest, score_one

QUESTION = {"question": "What is 1/2 as a decimal?"}
RIGHT = r"so \boxed{0.5}"
WRONG_BY_RULE = r"so \boxed{one half}"  # what a rule check misses and a verifier may accept


class FakeVerifier(ThreadingHTTPServer):
    """Answers chat completions with `reply`: "True", "False", text, or "500" / "hang" / "notjson"."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.reply = "True"
        self.prompts: list[str] = []
        self.models_asked = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class _Handler(BaseHTTPRequestHandler):
    server: FakeVerifier

    def log_message(self, *args):
        pass

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client gave up ("hang")
            self.wfile.write(body)

    def do_GET(self):
        self.server.models_asked += 1
        self._send(200, json.dumps({"data": [{"id": "tinyv-fake"}]}).encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["model"] == "tinyv-fake" and body["temperature"] == 0.0
        self.server.prompts.append(body["messages"][0]["content"])
        reply = self.server.reply
        if reply == "500":
            return self._send(500, b'{"error": "boom"}')
        if reply == "hang":
            time.sleep(3)
        if reply == "notjson":
            return self._send(200, b"<html>proxy error</html>")
        self._send(200, json.dumps({"choices": [{"message": {"content": reply}}]}).encode())


@pytest.fixture(scope="module")
def server():
    srv = FakeVerifier()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()


@pytest.fixture
def cfg(server, monkeypatch):
    server.reply, server.prompts[:] = "True", []
    server.models_asked = 0
    # A fresh process-global verifier: its verdict cache survives a config equal by value (as it
    # should in a worker), so without this one test's verdicts would answer another's questions.
    monkeypatch.setattr(verifier, "_verifier", None)
    config = RewardConfig()
    config.verifier.url = server.url
    config.verifier.timeout_s = 0.5
    config.verifier.retries = 1
    context.configure(config)
    yield config
    context.configure(RewardConfig())


def score(response, truth="0.5", extra=QUESTION):
    return score_one(ScoreRequest("polaris_tinyv", response, truth, extra))


@pytest.mark.parametrize(("text", "think", "verdict"), [
    ("True", False, True),
    (" false.", False, False),
    ("The answer is TRUE", False, True),
    ("maybe", False, None),
    ("<think>is it true? no</think>False", True, False),
    ("Reasoning... Answer: True", True, True),
    ("<think>true", True, None),  # never finished thinking
])
def test_parse_verdict(text, think, verdict):
    assert parse_verdict(text, think) is verdict


def test_template_placeholders_are_replaced_literally():
    prompt = build_prompt(TINYV_TEMPLATE, "Q {x}?", "{1/2}", "\\frac{1}{2}")
    assert "<question>Q {x}?</question>" in prompt
    assert "<ground_truth_answer>{1/2}</ground_truth_answer>" in prompt
    assert "<model_answer>\\frac{1}{2}</model_answer>" in prompt and "{{" not in prompt


def test_addon_asks_only_when_the_rule_says_wrong(cfg, server):
    assert score(RIGHT).correct and server.prompts == []
    result = score(WRONG_BY_RULE)
    assert (result.score, result.correct, result.status) == (1.0, True, "ok")
    assert len(server.prompts) == 1 and "<model_answer>one half</model_answer>" in server.prompts[0]
    assert "What is 1/2 as a decimal?" in server.prompts[0]
    assert "<ground_truth_answer>0.5</ground_truth_answer>" in server.prompts[0]
    server.reply = "False"
    assert (score(r"\boxed{0.7}").score, score(r"\boxed{0.7}").status) == (0.0, "ok")


def test_addon_weight(cfg):
    cfg.verifier.weight = 0.5
    result = score(WRONG_BY_RULE)
    assert (result.score, result.correct) == (0.5, False)


def test_verifier_only_and_mixed(cfg, server):
    cfg.verifier.mode = "verifier_only"
    server.reply = "False"
    assert score(RIGHT).score == 0.0  # the rule check is not consulted
    server.reply = "True"
    assert score(WRONG_BY_RULE).correct
    cfg.verifier.mode, cfg.verifier.weight = "mixed", 0.25
    server.reply = "False"
    assert score(RIGHT).score == pytest.approx(0.75)
    server.reply = "True"
    assert score(r"\boxed{0.7}").score == pytest.approx(0.25)
    both = score(r"\boxed{\frac{1}{2}}")  # a new answer: RIGHT's verdict False is cached
    assert both.score == pytest.approx(1.0) and both.correct


@pytest.mark.parametrize("reply", ["maybe so", "500", "notjson", "hang"])
def test_a_failing_verifier_is_a_status_not_a_wrong_answer(cfg, server, reply):
    server.reply = reply
    start = time.monotonic()
    result = score(WRONG_BY_RULE)
    assert (result.score, result.correct, result.status) == (0.0, False, "verifier_error")
    assert result.scorer_failed and result.detail.startswith("verifier")
    # Each attempt is bounded by the verifier timeout (0.5 s), two attempts in all.
    assert time.monotonic() - start < 2 * cfg.verifier.timeout_s + 1.0
    assert len(server.prompts) == 2


def test_a_verifier_that_is_down(cfg, closed_port):
    cfg.verifier.url = f"http://127.0.0.1:{closed_port}/v1"
    result = score(WRONG_BY_RULE)
    assert result.status == "verifier_error" and "ConnectError" in result.detail
    cfg.verifier.mode, cfg.verifier.weight = "mixed", 0.5
    assert score(RIGHT).score == pytest.approx(0.5)  # the rule check's share survives


def test_thinking_verifier_and_verdict_cache(cfg, server):
    cfg.verifier.think = True
    server.reply = "<think>they are equal</think>True"
    assert score(WRONG_BY_RULE).correct
    assert score(WRONG_BY_RULE).correct
    assert len(server.prompts) == 1  # the second verdict came from the cache
    assert server.models_asked == 1  # the model name, discovered once from /v1/models


def test_missing_question_is_a_dataset_error(cfg):
    assert score(WRONG_BY_RULE, extra={}).status == "error"


def test_verifier_runs_in_pool_workers(cfg, server):
    with RewardPool(1, 5.0, 1024, config=cfg) as pool:
        results = pool.score_many([ScoreRequest("polaris_tinyv", WRONG_BY_RULE, "0.5", QUESTION)])
    assert results[0].correct and len(server.prompts) == 1


LOCAL_ENGINE_SCRIPT = """
import os, sys
from pathlib import Path
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from dph_async.config.rewards import VerifierConfig
from dph_async.rewards.verifier import LocalVLLMVerifier, Verifier

if __name__ == "__main__":
    out = Path(sys.argv[1])
    chars = list("abcdefghijklmnopqrstuvwxyzTF0123456789 ")
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(["<pad>", "<s>", "</s>", *chars])}, "<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    # head_dim 32: the smallest the CPU attention kernels take.
    config = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(out)
    fast.save_pretrained(out)
    cfg = VerifierConfig(backend="vllm", model=str(out), max_tokens=4,
                         template="q {{QUESTION}} g {{GROUND_TRUTH_ANSWER}} a {{MODEL_ANSWER}}")
    verdict = Verifier(cfg, LocalVLLMVerifier(cfg)).judge("what", "1", "1")
    # A random model answers gibberish: the verdict must be a clean "no verdict".
    assert verdict.correct is None and "neither True nor False" in verdict.detail, verdict
    print("LOCAL-ENGINE-OK")
"""


@pytest.mark.slow
def test_local_vllm_engine_backend(tmp_path):
    """The in-process vLLM backend on a tiny random model (own process: vLLM settings stay there)."""
    script = tmp_path / "engine.py"
    script.write_text(LOCAL_ENGINE_SCRIPT)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "model")], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0 and "LOCAL-ENGINE-OK" in done.stdout, done.stderr[-3000:]
