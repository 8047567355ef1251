"""The same GRPO work through TRL's `GRPOTrainer`, with per-phase times; run by `dph-async bench peer`
with the Python of its own virtual environment (the project pins a transformers that TRL does not
accept), so this file imports nothing of the project but the embedded tasks' rewards (standard
library only):

    .cache/peer-trl/bin/python dph_async/tools/bench/peer_trl.py SPEC.json PROMPTS.json OUT.json

TRL's configuration matches the work: per step `prompts_per_step` prompts x `n` completions
(per_device_train_batch_size = prompts x n, one generation per step), HF `generate` (use_vllm=False)
at the temperature over the full vocabulary (top_k=0, top_p=1), at most `max_tokens` new tokens,
fp32 (bf16=False), AdamW at a constant lr, beta=0 (no reference model), num_iterations=1, rewards
scaled by the group's std (scale_rewards="group", as the project's GRPO), gradient clipping at
`grad_clip`, and no gradient checkpointing (GRPOConfig's default is on: it runs every forward again in
the backward to save activation memory, which these models do not need; neither does the project's
learner nor the loop). TRL aggregates the loss with its default `loss_type` (recorded in the output: "dapo",
the token mean over the batch, as the project's token-mean).

With `save_every` in the spec (`dph-async bench tta`), the weights are kept every that many steps
and at the last as model directories (the model's own files with the step's weights), and every
step records `wall`: seconds since its first step began (generation first), less the writing.

Phases per step: generate (TRL's `_generate_single_turn`), reward (`_calculate_rewards`), forward
(`compute_loss`), backward (the rest of `training_step`), optimizer (clipping, step, zero_grad).
"""

from __future__ import annotations

import time

T_START = time.time()

import json  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

# Not this file's folder (its kernels.py would shadow the name transformers probes), and of the
# checkout only the `dph_async` directory, through a link: the project is not installed in TRL's
# environment, and the checkout's root holds a `kernels/` directory that transformers would take for
# Hugging Face's package.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

_LINK = Path(tempfile.mkdtemp(prefix="peer-trl-"))
(_LINK / "dph_async").symlink_to(Path(__file__).resolve().parents[2])
sys.path.append(str(_LINK))
from dph_async.tasks import embedded, stride  # noqa: E402  (standard library only)

REWARDS = {source: task.score for task in (embedded, stride) for source in (task.IN_DOMAIN, task.OUT_OF_DOMAIN)}
PHASES = ("generate", "reward", "forward", "backward", "optimizer")


def reward(prompts, completions, data_source, ground_truth, **_) -> list[float]:
    return [REWARDS[ds](c, json.loads(gt), {}).score for c, ds, gt in zip(completions, data_source, ground_truth,
                                                                          strict=True)]


class TimedGRPO(GRPOTrainer):
    """GRPOTrainer with wall-clock times of its phases, per optimizer step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.phase = dict.fromkeys(PHASES, 0.0)
        self._inside = 0.0

    def _timed(self, name: str, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.phase[name] += time.perf_counter() - start

    def _generate_single_turn(self, *args, **kwargs):
        return self._timed("generate", super()._generate_single_turn, *args, **kwargs)

    def _calculate_rewards(self, *args, **kwargs):
        return self._timed("reward", super()._calculate_rewards, *args, **kwargs)

    def compute_loss(self, *args, **kwargs):
        return self._timed("forward", super().compute_loss, *args, **kwargs)

    def training_step(self, *args, **kwargs):
        before = sum(self.phase.values())
        start = time.perf_counter()
        out = super().training_step(*args, **kwargs)
        self.phase["backward"] += time.perf_counter() - start - (sum(self.phase.values()) - before)
        self._inside = time.perf_counter()
        return out


class StepTimer(TrainerCallback):
    def __init__(self) -> None:
        self.trainer: TimedGRPO | None = None
        self.steps: list[dict] = []
        self.first_step: float | None = None
        self.clock0: float | None = None  # perf_counter at the first step's start
        self.paused = 0.0  # seconds spent keeping weights: not the run's

    def on_step_begin(self, args, state, control, **kwargs):
        self.first_step = self.first_step or time.time()
        self.start, self.cpu = time.perf_counter(), time.process_time()
        self.clock0 = self.clock0 or self.start
        self.trainer.phase = dict.fromkeys(PHASES, 0.0)

    def on_step_end(self, args, state, control, **kwargs):
        end = time.perf_counter()
        t = self.trainer
        t.phase["optimizer"] = end - t._inside
        metrics = t._metrics["train"]
        self.steps.append({"step_s": end - self.start, **t.phase,
                           "completions": t.args.per_device_train_batch_size,
                           "tokens": round(metrics["completions/mean_length"][-1] *
                                           t.args.per_device_train_batch_size),
                           "reward_mean": float(metrics["reward"][-1]), "cpu_s": time.process_time() - self.cpu,
                           "wall": end - self.clock0 - self.paused})


class Saver(TrainerCallback):
    """Keeps the weights every `every` steps and at the last, as `<root>/v<step>`: the model's
    directory with the step's weights (what the project's evaluator loads); the time it takes goes to
    the timer's pause. After StepTimer in the callbacks, so a step's `wall` is taken first. The
    weights are written by `save_pretrained` (tied embeddings kept under the names loaders read),
    beside the model's own config and tokenizer, which the evaluator then reads as pi_0's."""

    def __init__(self, timer: StepTimer, every: int, model_dir: Path, root: Path) -> None:
        self.timer, self.every, self.model_dir, self.root = timer, every, model_dir, root

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if step % self.every and step != args.max_steps:
            return
        start = time.perf_counter()
        out = self.root / f"v{step}"
        weights = ("*.safetensors", "*.safetensors.index.json", "*.bin")
        shutil.copytree(self.model_dir, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(*weights))
        with tempfile.TemporaryDirectory(dir=self.root) as tmp:
            self.timer.trainer.model.save_pretrained(tmp, safe_serialization=True)
            for f in Path(tmp).iterdir():
                if f.name.endswith((".safetensors", ".safetensors.index.json")):
                    shutil.move(f, out / f.name)
        self.timer.paused += time.perf_counter() - start


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    prompts = json.loads(Path(sys.argv[2]).read_text())
    out = Path(sys.argv[3])
    tok = AutoTokenizer.from_pretrained(spec["model"])
    texts = [tok.decode(p["ids"], skip_special_tokens=False) for p in prompts]
    same_ids = all(tok(text=t)["input_ids"] == p["ids"] for t, p in zip(texts, prompts, strict=True))
    unknown = sorted({p["data_source"] for p in prompts} - REWARDS.keys())
    if unknown:
        raise SystemExit(f"no reward for data_source {unknown} in the peer environment (only the embedded tasks')")
    rows = [{"prompt": t, "data_source": p["data_source"], "ground_truth": json.dumps(p["ground_truth"])}
            for t, p in zip(texts, prompts, strict=True)]
    data = Dataset.from_list(rows)
    batch = spec["prompts_per_step"] * spec["n"]
    args = GRPOConfig(
        output_dir=str(out.parent / "trl-output"), use_vllm=False, bf16=False, use_cpu=True,
        per_device_train_batch_size=batch, gradient_accumulation_steps=1, num_generations=spec["n"],
        max_completion_length=spec["max_tokens"], temperature=spec["temperature"], top_p=1.0, top_k=0,
        learning_rate=spec["lr"], lr_scheduler_type="constant", weight_decay=spec["weight_decay"],
        max_grad_norm=spec["grad_clip"], beta=0.0, num_iterations=1, scale_rewards="group",
        max_steps=spec["steps"], seed=spec["seed"], logging_steps=10**9, save_strategy="no", report_to="none",
        disable_tqdm=True, gradient_checkpointing=False,
    )
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, use_safetensors=True)
    timer = StepTimer()
    callbacks = [timer]
    if spec.get("save_every"):
        callbacks.append(Saver(timer, spec["save_every"], Path(spec["model"]), Path(spec["save_dir"])))
    trainer = TimedGRPO(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok,
                        callbacks=callbacks)
    timer.trainer = trainer
    trainer.train()
    out.write_text(json.dumps({"system": "trl", "threads": torch.get_num_threads(), "loss_type": args.loss_type,
                               "gradient_checkpointing": args.gradient_checkpointing,
                               "prompt_ids_match": same_ids, "startup_s": timer.first_step - T_START,
                               "steps": timer.steps,
                               "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


if __name__ == "__main__":
    main()
