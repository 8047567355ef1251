"""Reward scoring configuration: worker pool, deadlines, scorer services, SQL sandbox and LLM verifier.

docs/rewards.md describes every reward and what each setting changes.
"""

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from dph_async.config.base import Section

# The TinyV verifier prompt (TinyV-1.5B). Placeholders are replaced literally, so braces in the
# question or answers need no escaping.
TINYV_TEMPLATE = (
    "You are an AI tasked with identifying false negatives in answer verification. A false negative "
    "occurs when a model's answer is essentially correct but is marked as incorrect due to minor "
    "discrepancies or formatting issues. Your job is to analyze the given question, ground truth answer, "
    "and model answer to determine if the model's answer is actually correct despite appearing different "
    "from the ground truth.\n\n"
    "<question>{{QUESTION}}</question>\n\n"
    "<ground_truth_answer>{{GROUND_TRUTH_ANSWER}}</ground_truth_answer>\n\n"
    "<model_answer>{{MODEL_ANSWER}}</model_answer>\n\n"
    'Return "True" if the model\'s answer is correct, otherwise return "False".'
)


class SqlRewardConfig(Section):
    """Text-to-SQL rewards (BIRD, Spider): sandboxed execution of gold and predicted queries."""

    # Directory holding the databases; a sample's db_id is looked up under it (see docs/rewards.md).
    db_root: str | None = None
    # How results are compared when neither the data_source nor the sample says: "bird" compares the
    # sets of rows, "spider" the bags of rows allowing column permutations (and row order when the gold
    # query orders).
    compare: Literal["bird", "spider"] = "bird"
    # DPH-RL's partial credit for a wrong result: 0.8 * k^2 / (gold columns * predicted columns).
    partial_credit: bool = True
    # A result with more rows is refused (predicted) or an error (gold).
    max_rows: int = Field(100_000, ge=1)
    # sqlite's SQLITE_LIMIT_LENGTH: the largest string or blob a query may build.
    max_value_bytes: int = Field(1_000_000, ge=1_000)
    # Longest predicted query accepted, in characters.
    max_sql_chars: int = Field(100_000, ge=100)
    # sqlite's hard heap limit inside each worker process.
    heap_limit_mb: int = Field(256, ge=8)
    # Gold results kept per worker process (gold queries are re-run only on a miss).
    gold_cache_size: int = Field(4096, ge=0)


class VerifierConfig(Section):
    """An LLM verifier (TinyV) that judges answers the rule check may have wrongly rejected."""

    # addon: asked only when the rule check says wrong; verifier_only: its verdict alone;
    # mixed: weight * verdict + (1 - weight) * rule check, the verifier always asked.
    mode: Literal["addon", "verifier_only", "mixed"] = "addon"
    # The verifier's share of the score (addon: score of a verifier-approved answer).
    weight: float = Field(1.0, ge=0, le=1)
    # "openai": any OpenAI-compatible server (e.g. `vllm serve`) at `url`; "vllm": a local vLLM engine
    # loading `model` inside each reward worker (use few workers).
    backend: Literal["openai", "vllm"] = "openai"
    # Base URL of the OpenAI-compatible API, e.g. http://127.0.0.1:8000/v1.
    url: str | None = None
    # Served model name (openai) or model path (vllm); None asks the server's /models for its first model.
    model: str | None = None
    # Name of the environment variable holding the API key, if the server wants one.
    api_key_env: str | None = None
    template: str = TINYV_TEMPLATE
    # What replaces {{MODEL_ANSWER}}: the extracted final answer (TinyV) or the whole response (RRM).
    answer: Literal["extracted", "response"] = "extracted"
    max_tokens: int = Field(8, ge=1)
    temperature: float = Field(0.0, ge=0)
    # Thinking verifiers: judge only the text after "</think>" (or after "Answer:").
    think: bool = False
    # Per verifier call; a call also never outlives the reward's own deadline.
    timeout_s: float = Field(5.0, gt=0)
    # Extra attempts after a failed call (connection error, 5xx, unparseable answer).
    retries: int = Field(1, ge=0)
    # Verdicts remembered per worker process, keyed by (question, ground truth, answer).
    cache_size: int = Field(4096, ge=0)


class RewardConfig(Section):
    # Worker processes per actor that score completions; each call has a deadline and can be killed.
    # Started on the first request that needs them.
    workers: int = Field(1, ge=1)
    # Score rewards registered `inline` (bounded pure functions that execute nothing from the response,
    # such as the embedded task's) in the caller's process: no worker round trip. false sends every
    # reward to the workers or scorer services.
    inline: bool = True
    timeout_s: float = Field(10.0, gt=0)
    memory_limit_mb: int = Field(1024, ge=64)
    # HTTP scorer services (`dph-async serve scorer`); empty means the local worker pool.
    scorer_urls: list[str] = Field(default_factory=list)
    # Attempts after the first when a scorer service is unreachable or overloaded (with backoff).
    client_retries: int = Field(3, ge=0)
    # Deadline of one HTTP call to a scorer service: the service answers by then, marking what it could
    # not score in time as "timeout".
    client_timeout_s: float = Field(120.0, gt=0)
    # Requests per HTTP call to a scorer service; batches are split and spread over the services.
    client_batch_size: int = Field(64, ge=1)
    # Longer responses are refused unscored (status "rejected"): they can only be hostile or runaway.
    max_response_chars: int = Field(1_000_000, ge=1_000)
    # The user's own rewards: module names, or .py files (docs/rewards.md, Plugins), imported by every
    # process that scores. A file is taken relative to the directory the config is loaded in.
    plugins: list[str] = Field(default_factory=list)
    sql: SqlRewardConfig = Field(default_factory=SqlRewardConfig)
    verifier: VerifierConfig = Field(default_factory=VerifierConfig)

    @field_validator("plugins")
    @classmethod
    def _absolute_files(cls, plugins: list[str]) -> list[str]:
        # Reward workers, Ray actors and services may run elsewhere than the directory the user typed in.
        return [str(Path(p).resolve()) if p.endswith(".py") else p for p in plugins]
