"""One typed schema for a run, loaded from a YAML preset plus dotted command-line overrides.

    cfg = load_config("js_low_var", ["learner.steps=40", "replay.max_staleness=2"])

OmegaConf merges the preset and the overrides; pydantic validates the result. A wrong key or value
raises `ConfigError` naming the dotted key and what is allowed.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from dph_async.config.base import Section
from dph_async.config.loss import CriticConfig, LossConfig
from dph_async.config.replay import ReplayConfig
from dph_async.config.rewards import RewardConfig
from dph_async.errors import UserError
from dph_async.samplers import sampler

__all__ = ["ConfigError", "CriticConfig", "LossConfig", "NetConfig", "ReplayConfig", "RewardConfig", "RunConfig",
           "load_config", "presets"]



class ModelConfig(Section):
    # A Hugging Face causal-LM directory; None builds the embedded tiny Llama from `tiny_*`.
    path: str | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"
    max_model_len: int = Field(64, ge=8)
    tiny_hidden: int = Field(128, ge=16)
    tiny_layers: int = Field(2, ge=1)
    tiny_heads: int = Field(4, ge=1)


class TaskConfig(Section):
    # Training prompts: parquet in the verl/DPH-RL row format; None uses the embedded task.
    data: str | None = None
    # Test sets as name=path pairs (e.g. {"bird_dev": "data/bird_dev.parquet"}); empty = embedded splits.
    test_data: dict[str, str] = Field(default_factory=dict)
    # Which training prompts RL draws from: auto = what the objective asks for (D_exp for objectives
    # with a reference pool, every prompt otherwise, as the DPH-RL scripts do); d_exp = the prompts
    # pre-sampling left for exploration (GRPO on D_exp is the control for the DPH objectives).
    prompts: Literal["auto", "all", "d_exp"] = "auto"
    # Which embedded task runs without task.data (dph_async/tasks/catalog.py): embedded, sums of
    # five-digit sets; digit_sets, the same rules on seven-digit sets that every split shares; stride,
    # counting in steps with long-tailed answer lengths (needs sampling.max_tokens=400
    # model.max_model_len=411).
    name: Literal["embedded", "digit_sets", "stride"] = "embedded"
    # Embedded task sizes.
    num_train: int = Field(400, ge=8)
    num_test: int = Field(200, ge=8)
    # Share of the out-of-domain rule's problems (those the OOD test leaves) that the warm start
    # trains on. At 1 pi_0 is at ceiling out of domain, so OOD results cannot show a keep; below 1
    # pi_0 learns the rule partly (docs/ablations.md, Out of domain off the ceiling).
    ood_warm_share: float = Field(1.0, gt=0, le=1)

    @model_validator(mode="after")
    def _name_is_for_embedded_tasks(self) -> TaskConfig:
        if self.data is not None and self.name != "embedded":
            raise ValueError(f"task.name ({self.name}) selects an embedded task; it does not apply with task.data")
        return self


class WarmStartConfig(Section):
    """Supervised warm start of the embedded model into a base policy pi_0 (skipped with --model)."""

    enabled: bool = True
    steps: int = Field(1500, ge=0)
    batch_size: int = Field(64, ge=1)
    # The peak of a one-cycle schedule (a tenth warming up) from 20 steps; constant under 20.
    lr: float = Field(3e-3, gt=0)
    # Share of warm-start targets replaced by a well-formed wrong answer (0: short training alone
    # keeps pi_0 imperfect, and leaves prompts it always solves for D_pef).
    noise: float = Field(0.0, ge=0, lt=1)


class PresampleConfig(Section):
    """Pre-sampling: k samples per training prompt split it into D_pef (all k correct) and D_exp."""

    k: int = Field(8, ge=1)
    # A prompt joins D_pef when at least this many of its k samples are correct; None means all k.
    min_correct: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    # Which samples of a D_pef prompt become reference samples: every correct one of the k
    # (all_correct), or one fresh pi_0 sample per D_pef prompt, kept if correct (one_fresh: the
    # reference implementation's rule; its file repeated three times changes nothing here, where the
    # pool is drawn without replacement pass by pass).
    reference_rule: Literal["all_correct", "one_fresh"] = "all_correct"


class SamplingConfig(Section):
    """Training rollouts. Behaviour log-probs are those of the distribution actually sampled."""

    n: int = Field(8, ge=1)
    temperature: float = Field(1.0, gt=0)
    # Training rollouts sample the full support (top_p=1, top_k=-1) so the learner needs no mask;
    # start-up refuses anything narrower (docs/decisions.md).
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    max_tokens: int = Field(16, ge=1)


def default_actors() -> int:
    """One core for the learner, the others for actors, at most two. On 2 cores one actor beside the
    learner was 27% faster than two under the default objective and as fast under plain GRPO: a
    second actor only takes turns with the first on the same core (docs/benchmarks.md, Pipeline)."""
    return max(1, min(2, (os.cpu_count() or 1) - 1))


class ActorsConfig(Section):
    # Default: default_actors() on this machine (1 on 2 cores, 2 on more); the run's config.yaml
    # records the number used.
    num_actors: int = Field(default_factory=default_actors, ge=1)
    # Which distribution samples the responses: a name in dph_async/samplers.py's SAMPLERS (online:
    # the policy, on vLLM; ref, gshf, mixp mix in pi_0's logits and run both models with torch).
    sampler: str = "online"
    # Prompts an actor keeps in its engine at once.
    max_inflight_prompts: int = Field(16, ge=1)
    # vLLM reads this as whole GiB.
    kv_cache_gib: int = Field(1, ge=1)
    # Threads torch may use inside each actor process. More than 1 pays where actors have cores of
    # their own: beside the learner on 2 cores the embedded default ran at 0.32 s/step with 2 threads
    # against 0.27 with 1 (one run each, `bench peer`, 2026-11-26).
    threads: int = Field(1, ge=1)
    # The CPU engine's linear layers. onednn: vLLM packs each weight for oneDNN, which generates
    # faster from about 8 MiB of weights up (1.4x at 134 M parameters, one thread) but must pack again
    # on every weight load (85% of a load). torch: plain F.linear on the weights as loaded, so a load
    # is no copy (the layers view the learner's shared memory); it generates on less CPU below about
    # 8 MiB. auto: torch for weights under 8 MiB (the embedded default's 1.5 MiB), onednn above
    # (actors/engine.py, docs/decisions.md). GPUs ignore it.
    cpu_gemm: Literal["auto", "onednn", "torch"] = "auto"
    # Compile the actors' model with torch's inductor (vLLM's compile) instead of running it op by op.
    # It needs a C++ compiler (g++, or $CXX) on the actor's node. On `bench peer --user-case` it raised
    # completions/s by 8% (median of 3 alternating pairs; 10% on the embedded default earlier), for
    # about 2.5 s more per engine build with the compile cache warm and 20-25 s the first time a
    # model's shapes are compiled (docs/benchmarks.md); a kept actor pays it once. auto: compiled where
    # the node has a C++ compiler, op by op (with a warning) where not; true refuses such a node.
    compile: Literal["auto"] | bool = "auto"
    # The n completions of a prompt compute its KV once and copy it (actors/shared_prefill.py): vLLM's
    # prefix cache shares only whole blocks (32 tokens at the least on the CPU), so each completion of
    # a shorter prompt computed all of it again. On the embedded default the actor's thread then took
    # 11% less CPU per step, its model's forward 35% less (`bench peer`, docs/benchmarks.md). Off:
    # every completion computes its prompt, as vLLM does.
    share_prefill: bool = True

    @field_validator("sampler")
    @classmethod
    def _sampler(cls, name: str) -> str:
        sampler(name)  # an unknown name raises, naming the samplers there are
        return name


class LearnerConfig(Section):
    # Rollout batches to train on. Each batch is one policy version (docs/decisions.md).
    steps: int = Field(150, ge=1)
    # Prompts (GRPO groups) per rollout batch.
    groups_per_step: int = Field(16, ge=1)
    # PPO updates per batch: the batch is split into `mini_batches` parts (by groups; the reference
    # samples spread evenly), one optimizer step each, repeated for `epochs` passes (reshuffled). The
    # proximal log-probs are recorded once, before the first update, so clip and correction act.
    mini_batches: int = Field(1, ge=1)
    epochs: int = Field(1, ge=1)
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    # An update whose loss or gradient is not finite is skipped (weights and optimizer unchanged); this
    # many batches in a row with a skipped update stop the run with an error naming their sources
    # (learner/guard.py); 0 = never stop.
    max_skipped_steps: int = Field(3, ge=0)
    # ZeRO stage 0-3. Stage 3 partitions the weights too: the fused log-prob kernel gathers the LM head
    # for its forward and backward (learner/zero3.py), and published or saved weights are gathered whole.
    zero_stage: int = Field(1, ge=0, le=3)
    # ZeRO-3 keeps parameters of fewer elements than this whole on every rank (DeepSpeed's
    # stage3_param_persistence_threshold): gathering small ones costs more than holding them.
    zero3_persist_below: int = Field(100_000, ge=0)
    # Micro-batches are packed up to this many (padded) tokens.
    micro_token_budget: int = Field(4096, ge=16)
    # The n completions of a prompt share one forward pass of the prompt (its keys and values feed
    # every completion) and sit back to back in one row, up to `pack_row_tokens` response tokens per
    # row: fewer tokens through the model and none for padding, the same log-probs and gradients.
    share_prompts: bool = True
    pack_row_tokens: int = Field(256, ge=1)
    # Sequences whose advantage is 0 (a group with equal rewards) give the policy loss no gradient:
    # they count in the denominators but are not run through the model, unless a fresh-token term
    # (entropy bonus, reverse KL) needs them.
    skip_zero_advantage: bool = True
    # Every this many versions, log the gradient norm of the objective's fresh part and of its
    # reference-pool part, and their cosine (grad/*): one more backward pass on those steps; 0 = never.
    # Not with ZeRO-3, whose hooks gather the parameters for one backward pass per forward.
    diagnose_every: int = Field(0, ge=0)
    # Every this many versions, estimate KL(pi_theta || pi_0) at the sampling temperature on
    # `kl_samples` fresh responses of the current weights (kl_per_prompt to each of the batch's first
    # prompts): k1 and k3 with standard errors over prompts, kl/* (learner/kl_monitor.py); 0 = never.
    kl_every: int = Field(0, ge=0)
    kl_samples: int = Field(64, ge=2)
    kl_per_prompt: int = Field(4, ge=1)
    # Publish weights to the actors every `sync_every` optimizer steps.
    sync_every: int = Field(1, ge=1)
    # Weights travel in buckets of at most this many bytes.
    weight_bucket_mb: float = Field(32.0, gt=0)
    # How published weights reach actors: shm = through a shared-memory segment (actors on the
    # learner's host only; an error where it cannot be used), tcp = buckets over the weight socket,
    # auto = shm where the actor is on the learner's host and can open the segment, else tcp.
    weight_transport: Literal["auto", "tcp", "shm"] = "auto"
    checkpoint_every: int = Field(10, ge=0)
    # Checkpoints kept: the newest N (0 keeps all) plus `keep_versions`; older ones are deleted once a
    # new one is complete (learner/retention.py).
    keep_checkpoints: int = Field(3, ge=0)
    # Versions whose checkpoints are never deleted (an ablation sets its evaluation points here).
    keep_versions: list[int] = Field(default_factory=list)
    # Record every batch trained on (rl/<mode>/batches.rec), so that `dph-async rerun` can re-execute
    # the run, or train a counterfactual learner on the same data. It holds what the replay's log
    # holds (every group once, plus the reference samples drawn), and is never pruned.
    record_batches: bool = True
    # An emulation of a slower learner on hardware of its own (a cluster's): each step lasts at
    # least this many seconds, the learner idling the rest after training and before it publishes,
    # while the actors keep generating. So generation runs ahead of training and the staleness
    # bound binds on a host where it would not (docs/ablations.md); the idle time is logged as
    # time/padding. 0 = off. The batches, and so a rerun, are what they would be on that learner.
    min_step_seconds: float = Field(0.0, ge=0)
    threads: int = Field(1, ge=1)
    # Data-parallel DeepSpeed ranks, one process each (a core, or a device, apiece): each batch is
    # split over them with the batch's own denominators, so R ranks take the step one would. Rank 0
    # also hosts the replay and the weight server and writes the checkpoints.
    ranks: int = Field(1, ge=1)
    kernel: Literal["auto", "torch", "triton"] = "auto"
    # The CPU kernels of the model's linear layers: onednn = oneDNN's products, which use AVX-512
    # where MKL's (torch's float32 default) keep to AVX2 on AMD processors; torch = F.linear as is;
    # auto = onednn for a float32 model trained on the CPU below ZeRO-3 where torch has oneDNN, torch
    # on a GPU (learner/cpu_gemm.py). With onednn the log-prob kernel's CPU path (learner.kernel auto
    # or torch) runs the LM head's products through oneDNN as well.
    cpu_gemm: Literal["auto", "onednn", "torch"] = "auto"
    loss: LossConfig = Field(default_factory=LossConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)

    @field_validator("diagnose_every")
    @classmethod
    def _diagnose_every(cls, every: int, info: ValidationInfo) -> int:
        if every and info.data.get("zero_stage") == 3:
            raise ValueError("use 0 with learner.zero_stage=3: the diagnostic's second backward pass over one "
                             "forward finds ZeRO-3's parameters released")
        return every

    @field_validator("cpu_gemm")
    @classmethod
    def _cpu_gemm(cls, gemm: str, info: ValidationInfo) -> str:
        if gemm == "onednn" and info.data.get("zero_stage") == 3:
            raise ValueError("use torch or auto with learner.zero_stage=3: ZeRO-3 runs the linear layers through "
                             "its own function")
        return gemm

    @field_validator("critic")
    @classmethod
    def _critic(cls, critic: CriticConfig, info: ValidationInfo) -> CriticConfig:
        # The value model's gradient is not averaged over ranks: one rank trains it.
        if critic.enabled and info.data.get("ranks", 1) > 1:
            raise ValueError("a learned critic trains on one learner rank: use learner.ranks=1")
        return critic


class EvalConfig(Section):
    # Samples per test prompt for unbiased Pass@k, k = 1..k_max.
    k_max: int = Field(16, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_prompts: int | None = Field(None, ge=1)


class LauncherConfig(Section):
    # Ray cluster address; None starts a local cluster.
    address: str | None = None
    num_cpus: int | None = Field(None, ge=1)
    max_actor_restarts: int = Field(3, ge=0)
    # Keep the actors' processes, and their vLLM engines, from one RL run to the next of the same
    # invocation (the modes of --compare, an ablation's cells) when the engine settings match: a later
    # run then skips vLLM's import and engine build (about 12 s of one core here); the engine is
    # reset to pi_0 and its prefix cache to empty, so a run is the same as on a new engine.
    reuse_actors: bool = True
    # Keep the learner's process from one RL run to the next of the same invocation (one rank only):
    # a later run's learner then skips the import of torch, transformers and DeepSpeed (about 8 s of
    # one core here) and builds only its trainer, from the run's own model and settings.
    reuse_learner: bool = True
    # With `address` (a cluster that outlives this invocation): an actor kept at the end of a run also
    # outlives the invocation, for the next invocation with the same engine settings to take, so that
    # its first run skips vLLM's import and engine build too. A kept actor ends itself once no driver
    # has called it for this many seconds (a driver calls a running actor every few seconds). 0: the
    # actors end with the invocation.
    keep_actors_s: float = Field(0.0, ge=0)
    # Pin each RL run's processes on the driver's host: every actor there gets actors.threads cores of
    # its own, the learner (its ranks, the replay, the weight server) learner.ranks x learner.threads;
    # where the cores are too few, the OS places them all (dph_async/runtime/cpu_cores.py). An actor's rollout
    # loop, which sets a small run's pace, then never gives its core to the learner's other threads.
    # A run claims the cores it pins until it ends: another invocation on the host pins to the cores
    # left, or, where too few are left, says with whom it shares and leaves its processes to the OS
    # (dph_async/runtime/cpu_claims.py; the claims live in DPH_CORES_DIR, else the temporary directory).
    pin_cores: bool = True

    @field_validator("keep_actors_s")
    @classmethod
    def _pool_needs_cluster(cls, keep_s: float, info: ValidationInfo) -> float:
        if keep_s > 0 and not info.data.get("address"):
            raise ValueError("actors can outlive this invocation only on a cluster that does: set "
                             "launcher.address (a local cluster ends with the invocation)")
        if 0 < keep_s < 10:
            raise ValueError("at least 10 s: a driver tells its actors it is alive every 2 s")
        if keep_s > 0 and not info.data.get("reuse_actors", True):
            raise ValueError("launcher.keep_actors_s keeps actors for later runs: it needs launcher.reuse_actors=true")
        return keep_s


class NetConfig(Section):
    host: str = "127.0.0.1"
    # A non-loopback bind needs CURVE keys (a directory made by `dph-async keys`) or insecure=true.
    curve_keys: str | None = None
    insecure: bool = False
    # Every long-running process serves GET /health and /metrics (read-only) here; the URLs are written
    # to <run>/rl/<mode>/endpoints/*.json. Port 0: the OS chooses; N: replay N, learner N + 1, actor i
    # N + 2 + i.
    metrics: bool = True
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(0, ge=0, le=65535)
    # The replay and the weight server read their peers through a gate process (dph_async/gate.py): it
    # alone holds what libzmq buffers of a message before its last frame arrives, and is started again
    # if a peer exhausts its memory. Off, the service's own process holds that (each message then
    # costs about 0.17 ms of CPU less; docs/benchmarks.md).
    gate: bool = True
    # What a gate may allocate beyond its size at start; at least twice replay.max_group_mb (checked
    # here) and learner.weight_bucket_mb (by the weight server), so an honest message or reply of the
    # largest size always fits. It holds up to three messages from each connection while the service
    # is busy: size it for 3 x actors x the largest group (1 GiB: 226 actors sending groups of 1.5 MB at
    # once); the replay warns, and `dph-async status` flags, when the actors it sees need more.
    gate_memory_mb: float = Field(1024.0, gt=0)


class LoggingConfig(Section):
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str = "dph-async"
    run_name: str | None = None


class RunConfig(Section):
    seed: int = 0
    output_dir: str = "runs/default"
    mode: Literal["async", "sync"] = "async"
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    warmstart: WarmStartConfig = Field(default_factory=WarmStartConfig)
    presample: PresampleConfig = Field(default_factory=PresampleConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    actors: ActorsConfig = Field(default_factory=ActorsConfig)
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    rewards: RewardConfig = Field(default_factory=RewardConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    launcher: LauncherConfig = Field(default_factory=LauncherConfig)
    net: NetConfig = Field(default_factory=NetConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    @model_validator(mode="after")
    def _gate_fits_a_group(self) -> RunConfig:
        if self.net.gate and self.net.gate_memory_mb < 2 * self.replay.max_group_mb:
            raise ValueError(
                f"net.gate_memory_mb ({self.net.gate_memory_mb:g}) must be at least twice replay.max_group_mb "
                f"({self.replay.max_group_mb:g}): the gate must hold an honest group of the largest size"
            )
        return self


class ConfigError(UserError):
    """A config key or value is wrong; the message names the dotted key."""


PRESET_PACKAGE = "dph_async.presets"


def presets() -> list[str]:
    """Names of the YAML presets shipped with the package."""
    return sorted(p.name[:-5] for p in resources.files(PRESET_PACKAGE).iterdir() if p.name.endswith(".yaml"))


def _preset_text(preset: str) -> tuple[str, str]:
    """Return (source name, YAML text) for a preset name or a path to a YAML file."""
    path = Path(preset)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError(f"config file not found: {preset}")
        return str(path), path.read_text()
    file = resources.files(PRESET_PACKAGE) / f"{preset}.yaml"
    if not file.is_file():
        raise ConfigError(f"unknown preset {preset!r}; available presets: {', '.join(presets())}")
    return f"preset {preset}", file.read_text()


def _describe(err: dict[str, Any], root: type[Section]) -> str:
    key = ".".join(str(p) for p in err["loc"])
    if not key:  # a rule across sections: its message names the keys
        return err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        model: Any = root
        for part in err["loc"][:-1]:
            field = model.model_fields.get(str(part)) if hasattr(model, "model_fields") else None
            model = field.annotation if field is not None else None
        allowed = ", ".join(model.model_fields) if hasattr(model, "model_fields") else "?"
        return f"{key}: unknown key (allowed here: {allowed})"
    return f"{key}: {err['msg']} (got {err.get('input')!r})"


def _first_line(e: Exception) -> str:
    """A YAML or OmegaConf error in one line: what is wrong, without the parser's context lines."""
    problem = getattr(e, "problem", None)  # yaml's MarkedYAMLError
    return problem or (str(e).strip().splitlines() or [type(e).__name__])[0]


def load_config(preset: str = "default", overrides: list[str] | None = None) -> RunConfig:
    """Load a preset (a name from `presets()` or a YAML path), apply dotted `key=value` overrides, validate."""
    source, text = _preset_text(preset)
    _check_overrides(overrides)
    try:
        base = OmegaConf.create(text or "{}")
    except (OmegaConfBaseException, yaml.YAMLError) as e:
        raise ConfigError(f"{source}: {_first_line(e)}") from None
    except AssertionError:  # OmegaConf's answer to a YAML document that is a lone number
        base = None
    if not isinstance(base, DictConfig):  # a list or a value: merging it raised TypeError, or the above
        raise ConfigError(f"{source}: not a mapping of settings (its top level is a list or a single value)")
    return _merged(source, base, overrides)


def with_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """`cfg` with more dotted `key=value` overrides, validated: the same as loading its preset with the
    overrides it was loaded with followed by these (a sweep's cells, without parsing the preset again)."""
    _check_overrides(overrides)
    return _merged("the base config", OmegaConf.create(cfg.model_dump(mode="json")), overrides)


def _check_overrides(overrides: list[str] | None) -> None:
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. learner.steps=40)")
        try:
            OmegaConf.from_dotlist([item])
        except (OmegaConfBaseException, yaml.YAMLError) as e:
            raise ConfigError(f"override {item!r}: not a valid value ({_first_line(e)})") from None


def _merged(source: str, base: DictConfig, overrides: list[str] | None) -> RunConfig:
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides or [])))
        data = OmegaConf.to_container(merged, resolve=True)
    except (OmegaConfBaseException, yaml.YAMLError) as e:
        raise ConfigError(f"{source}: {_first_line(e)}") from None
    try:
        return RunConfig.model_validate(data or {})
    except ValidationError as e:
        lines = [_describe(err, RunConfig) for err in e.errors()]
        if len(lines) == 1:  # the usual case: one line, naming the key
            raise ConfigError(f"{lines[0]} ({source})") from None
        raise ConfigError(f"invalid config ({source}):\n  " + "\n  ".join(lines)) from None


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML, as written next to every run."""
    return OmegaConf.to_yaml(OmegaConf.create(cfg.model_dump(mode="json")))
