"""Re-execute a recorded RL run's learner on its recorded batches, and compare it with the run.

The learner's trainer is built as the run built it (its config, model directory, seed and threads:
learner/recording.py wrote where they are), started from pi_0 or from one of the run's checkpoints,
and fed the recorded batches in order; no actor, engine, replay or Ray runs. After each step its
metrics are logged as the run logged them (`learner.loop.finish_metrics`), and where the run has a
checkpoint of that version the weights are compared with it; at the run's last step, with its
final model.

With the run's own config the rerun must be the run: every metric but the wall-clock ones and every
weight equal bit for bit (on the machine that ran it, with the same build). With changed learner
settings it is a counterfactual: another learner on exactly the same data, its metrics beside the
run's and the distance of its weights from the run's at every comparison point.

torch, transformers and DeepSpeed load with this module: the `rerun` command imports it when it runs,
not when the command line is parsed.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file

from dph_async.config import RunConfig, dump_config, load_config
from dph_async.errors import UserError
from dph_async.learner.loop import finish_metrics
from dph_async.learner.recording import read_batches, read_run_info
from dph_async.learner.staleness_control import StalenessController, StalenessRule
from dph_async.learner.step_diagnosis import diagnose_step
from dph_async.model_files import weight_files
from dph_async.paths import checkpoint_dir, checkpoint_weights, final_model, is_learner_checkpoint
from dph_async.pipeline.inputs import check_model_dir
from dph_async.pipeline.rerun_report import HEADLINE, RerunReport, StepComparison, WeightCheck, write_report
from dph_async.runtime.learner_trainer import build_trainer
from dph_async.safe_files import UnsafeFile, open_output, output_dir, write_output

if TYPE_CHECKING:
    from dph_async.protocol import Batch

# Metrics two executions of the same steps may disagree on: the clock's (time/* too).
WALL_CLOCK = ("learner/step_seconds", "learner/tokens_per_s")


class RerunError(UserError):
    """The run cannot be re-executed as asked (no recording, no checkpoint there, the recording starts later)."""


def _comparable(m: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in m.items() if not k.startswith("time/") and k not in WALL_CLOCK}


def _same(a: float, b: float) -> bool:
    """Bitwise, as JSON keeps a float (repr round-trips): -0.0 is not 0.0, NaN is NaN."""
    return repr(float(a)) == repr(float(b))


def compare_step(version: int, run: dict[str, float] | None, rerun: dict[str, float]) -> StepComparison:
    ours = _comparable(rerun)
    theirs = _comparable(run) if run is not None else {}
    differing = sorted(k for k in ours.keys() | theirs.keys()
                       if k not in ours or k not in theirs or not _same(ours[k], theirs[k]))
    return StepComparison(version, differing if run is not None else ["(the run logged no metrics here)"],
                          _headline(theirs), _headline(ours))


def _headline(m: dict[str, float]) -> dict[str, float]:
    return {k: m[k] for k in HEADLINE if k in m}


def compare_weights(what: str, version: int, ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]
                    ) -> WeightCheck:
    """`theirs` may hold fewer tensors (a saved model leaves out tied ones); each must be in `ours`."""
    missing = sorted(set(theirs) - set(ours))
    if missing:
        raise RerunError(f"{what}: tensors {missing[:5]} are not in the rerun's model (another architecture?)")
    equal, diff2, norm2, max_abs = True, 0.0, 0.0, 0.0
    for name, t in theirs.items():
        o = ours[name]
        equal = equal and o.dtype == t.dtype and o.shape == t.shape and torch.equal(o, t)
        d = (o.double() - t.double()) if o.shape == t.shape else torch.full((1,), math.inf, dtype=torch.float64)
        diff2 += float((d * d).sum())
        norm2 += float((t.double() ** 2).sum())
        max_abs = max(max_abs, float(d.abs().max())) if d.numel() else max_abs
    return WeightCheck(what, version, equal, math.sqrt(diff2 / norm2) if norm2 else math.sqrt(diff2), max_abs)


def saved_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors of a Hugging Face directory's safetensors files."""
    return {k: v for f in weight_files(model_dir) for k, v in load_file(f).items()}


def _run_metrics(rl_dir: Path) -> list[dict[str, float]]:
    path = rl_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    metrics = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            metrics.append(json.loads(line))
        except (ValueError, RecursionError) as e:  # a line a killed run cut short, or damage
            raise RerunError(f"{path}: line {number} is not a JSON record of a step's metrics ({e})") from None
    return metrics


def _batches(path: Path, start: int) -> Iterator[Batch]:
    """The recorded batches from version `start` on, each checked to follow the one before."""
    expected = start
    for offset, batch in read_batches(path):
        if batch.version < start:
            continue
        if batch.version != expected:
            hint = f": rerun --from {batch.version}, a checkpoint of the run" if expected == start else ""
            raise RerunError(f"{path}: the record at byte {offset} is of version {batch.version}, the learner is "
                             f"at {expected}{hint}")
        yield batch
        expected += 1


def _learner_config(rl_dir: Path, overrides: list[str]) -> tuple[RunConfig, bool]:
    """The run's learner config with `overrides`, and whether they changed it."""
    info = read_run_info(rl_dir)
    original = load_config(str(info.config))
    cfg = load_config(str(info.config), overrides)
    if cfg.learner.ranks != 1:
        raise RerunError(f"the run's learner has {cfg.learner.ranks} ranks; a rerun trains on one: add "
                         "learner.ranks=1 (a counterfactual then: the reduction order differs)")
    return cfg, cfg.model_dump() != original.model_dump()


class Rerun:
    """One re-execution: the trainer, the controller of auto staleness, and what is compared."""

    def __init__(self, rl_dir: Path, out: Path, overrides: list[str], start: int) -> None:
        self.rl_dir, self.out = rl_dir, out
        self.info = read_run_info(rl_dir)
        if not self.info.recording.is_file():
            raise RerunError(f"{self.info.recording} not found: the run recorded no batches "
                             "(learner.record_batches was off)")
        self.cfg, counterfactual = _learner_config(rl_dir, overrides)
        tag = checkpoint_dir(rl_dir) / f"v{start}"
        if start and not is_learner_checkpoint(tag):
            raise RerunError(f"{tag}: no checkpoint of version {start} (--from names one of the run's checkpoints)")
        self.report = RerunReport(str(rl_dir), str(out), overrides, counterfactual, start, start, "")
        # recording.json names the model, and a run directory may be a stranger's: a missing directory or
        # pickled weights are one error here, not transformers' traceback from inside build_trainer.
        check_model_dir(self.info.model_dir, f"{rl_dir / 'recording.json'}: model_dir")
        self.trainer, self.tokenizer = build_trainer(self.cfg, str(self.info.model_dir), None)
        replay = self.cfg.replay
        self.staleness = StalenessController(StalenessRule.of(replay)) if replay.auto_staleness else None
        if start:
            try:
                state = self.trainer.load(checkpoint_dir(rl_dir), f"v{start}")
            except BaseException:
                self.trainer.close()
                raise
            if self.staleness is not None and "staleness" in state:
                self.staleness = StalenessController.from_state(self.staleness.rule, state["staleness"])

    def run(self, until: int | None, diagnose: int | None, top_tokens: int) -> RerunReport:
        output_dir(self.out.parent, self.out)  # the command checked the way down from the run (output_path)
        write_output(self.out / "learner_config.yaml", dump_config(self.cfg))
        original = _run_metrics(self.rl_dir)
        trainer, report = self.trainer, self.report
        report.stopped = f"the recording ends at version {report.start}"
        with open_output(self.out / "metrics.jsonl") as log:
            for batch in _batches(self.info.recording, report.start):
                if until is not None and trainer.version >= until:
                    report.stopped = f"--until {until}"
                    break
                if diagnose == trainer.version:
                    found = diagnose_step(trainer, batch, top_tokens)
                    write_output(self.out / f"diagnose_v{diagnose}.json", json.dumps(asdict(found), indent=1))
                m = trainer.train_step(batch)
                finish_metrics(m, batch, self.staleness)
                log.write(json.dumps(m) + "\n")
                log.flush()
                v = trainer.version
                report.steps.append(compare_step(v, original[v - 1] if v <= len(original) else None, m))
                self._check_checkpoint(v)
                report.end = v
                report.stopped = f"the recording ends at version {v}"
        self._check_final(len(original))
        if report.counterfactual:
            self._save_final()
        return report

    def _save_final(self) -> None:
        """final_model/ written into a new directory, then put in place: Hugging Face's writers follow
        links, and one planted in an earlier final_model/ would send the weights elsewhere."""
        target = final_model(self.out)
        if os.path.islink(target):
            raise UnsafeFile(f"{target}: a symbolic link, where the rerun's final model belongs; not followed")
        fresh = Path(tempfile.mkdtemp(prefix=".final_model-", dir=self.out))
        try:
            self.trainer.save_pretrained(str(fresh))
            self.tokenizer.save_pretrained(str(fresh))
        except BaseException:
            shutil.rmtree(fresh, ignore_errors=True)
            raise
        if target.is_dir():
            shutil.rmtree(target)  # an earlier rerun's
        target.unlink(missing_ok=True)  # or a file of that name
        os.rename(fresh, target)

    def _check_checkpoint(self, version: int) -> None:
        tag = checkpoint_dir(self.rl_dir) / f"v{version}"
        if is_learner_checkpoint(tag):
            self.report.weights.append(compare_weights(f"checkpoint v{version}", version, self.trainer.whole_state(),
                                                       checkpoint_weights(tag)))

    def _check_final(self, run_steps: int) -> None:
        """At the run's last step, its final model (written when its learner finished)."""
        saved = final_model(self.rl_dir)
        if self.report.end == run_steps and (saved / "config.json").is_file():
            self.report.weights.append(compare_weights("final model", run_steps, self.trainer.whole_state(),
                                                       saved_weights(saved)))

    def close(self) -> None:
        self.trainer.close()


def rerun(rl_dir: Path, out: Path, overrides: list[str], *, start: int = 0, until: int | None = None,
          diagnose: int | None = None, top_tokens: int = 20) -> RerunReport:
    """Re-execute the recorded run in `rl_dir` (module docstring); the report is also written to `out`."""
    job = Rerun(rl_dir, out, overrides, start)
    try:
        report = job.run(until, diagnose, top_tokens)
    finally:
        job.close()
    write_report(report, out)
    return report
