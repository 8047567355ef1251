"""The weight analysis against closed forms: principal angles of constructed subspaces, spectra of
constructed matrices and of their difference, the update's energy split, the recovery replacements;
reading Hugging Face directories, learner checkpoints and run directories; `dph-async analyze` end to
end on tiny models whose one changed matrix is rotated by a known angle; the recovery experiment's
models in closed form and `dph-async recover` end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dph_async.cli.main import main as cli
from dph_async.config import ModelConfig
from dph_async.paths import MODEL_STATES
from dph_async.runtime.evaluate import load_results
from dph_async.state_file import save_state
from dph_async.tasks.embedded import ALPHABET
from dph_async.tasks.tiny_model import build_tiny_llama, build_tokenizer, save_model
from dph_async.tools.analyze.checkpoints import Checkpoint, WeightReader, common_matrices, default_out, describe, expand
from dph_async.tools.analyze.recover import Recovery, select, write_recovered
from dph_async.tools.analyze.svd import compare, principal_angles, replace_top_k, svd64

F64 = torch.float64


def orthogonal(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(n, n, generator=g, dtype=F64))[0]


def plane_rotation(a: torch.Tensor, b: torch.Tensor, theta: float) -> torch.Tensor:
    """The rotation by theta in the plane of the orthonormal vectors a, b (a -> cos a + sin b), identity
    on the rest."""
    n = a.numel()
    c, s = math.cos(theta), math.sin(theta)
    return (torch.eye(n, dtype=F64) + (c - 1) * (torch.outer(a, a) + torch.outer(b, b))
            + s * (torch.outer(b, a) - torch.outer(a, b)))


def test_principal_angles_of_subspaces_rotated_by_known_angles():
    q = orthogonal(12, 0)
    theta = torch.tensor([0.0, 1e-7, 0.3, math.pi / 4, 1.2, math.pi / 2], dtype=F64)
    k = len(theta)
    a = q[:, :k]
    b = q[:, :k] * torch.cos(theta) + q[:, k:2 * k] * torch.sin(theta)
    # Another basis of the same subspaces: the angles belong to the subspaces, not to the bases.
    got = principal_angles(a @ orthogonal(k, 1), b @ orthogonal(k, 2))
    # 1e-7 is below what arccos can resolve in float64 (~1e-8): the sine branch must give it.
    torch.testing.assert_close(got, theta, rtol=1e-9, atol=1e-13)
    assert torch.all(principal_angles(a, a) < 1e-14)
    with pytest.raises(ValueError, match="same shape"):
        principal_angles(a, b[:, :2])


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_svd64_recovers_a_constructed_spectrum(dtype):
    s = torch.tensor([9.0, 4.0, 2.5, 1.0, 0.125], dtype=F64)
    w = orthogonal(7, 3)[:, :5] @ torch.diag(s) @ orthogonal(5, 4).T
    out = svd64(w.to(dtype))
    assert out.s.dtype == F64 and out.u.dtype == F64
    torch.testing.assert_close(out.s, s, rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=0)
    torch.testing.assert_close(out.matrix(), w.to(dtype).to(F64), rtol=0, atol=1e-12)


def test_difference_spectra_in_closed_form():
    u, v = orthogonal(6, 5), orthogonal(6, 6)
    s_b = torch.tensor([6.0, 5.0, 4.0, 3.0, 2.0, 1.0], dtype=F64)
    s_t = torch.tensor([6.5, 4.0, 4.0, 3.5, 1.0, 1.0], dtype=F64)
    b, t = u @ torch.diag(s_b) @ v.T, u @ torch.diag(s_t) @ v.T
    # Shared singular vectors: the difference's singular values are |s_t - s_b|, sorted.
    expected = torch.sort((s_t - s_b).abs(), descending=True).values
    torch.testing.assert_close(torch.linalg.svdvals(t - b), expected, rtol=0, atol=1e-12)
    # A plane rotation R: R - I has singular values 2 sin(theta/2) twice, then zeros.
    theta = 0.7
    r = plane_rotation(u[:, 0], u[:, 1], theta)
    d = torch.linalg.svdvals(r - torch.eye(6, dtype=F64))
    torch.testing.assert_close(d, torch.tensor([2 * math.sin(theta / 2)] * 2 + [0.0] * 4, dtype=F64),
                               rtol=0, atol=1e-12)


def test_compare_a_rotated_matrix_in_closed_form():
    """T = R B, R a rotation by theta in the plane of B's first two left singular vectors (e1, e2)."""
    theta = 0.4
    s = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0], dtype=F64)
    b = torch.diag(s)
    e = torch.eye(5, dtype=F64)
    t = plane_rotation(e[0], e[1], theta) @ b
    bs, ts = svd64(b), svd64(t)
    d = torch.linalg.svdvals(t - b)
    one = compare(b, bs, t, ts, d, 1)
    assert one.angles_left == pytest.approx([math.degrees(theta)], abs=1e-10)  # e1 turned by theta
    assert one.angles_right == pytest.approx([0.0], abs=1e-10)
    two = compare(b, bs, t, ts, d, 2)
    assert two.angles_left == pytest.approx([0.0, 0.0], abs=1e-6)  # span(e1, e2) is kept
    assert two.sv_rel_change == pytest.approx([0.0, 0.0], abs=1e-12)  # a rotation keeps singular values
    # D = (R - I) B lives in rows and columns 1-2: all of it inside the base's top-2 subspaces; the
    # diagonal of (R - I)[:2, :2] diag(5, 4) carries a share (1 - cos)^2 / ((1 - cos)^2 + sin^2) = sin^2(theta/2).
    assert two.delta_in_base_topk == pytest.approx(1.0, abs=1e-12)
    assert two.delta_diag_base_topk == pytest.approx(math.sin(theta / 2) ** 2, abs=1e-12)
    # sigma(D) = 2 sin(theta/2) (5, 4): stable rank (25 + 16) / 25, top-1 share 25 / 41.
    assert one.delta_stable_rank == pytest.approx(41 / 25, rel=1e-12)
    assert one.delta_topk_share == pytest.approx(25 / 41, rel=1e-12)
    assert one.rel_change == pytest.approx(2 * math.sin(theta / 2) * math.sqrt(41 / 55), rel=1e-12)
    same = compare(b, bs, b.clone(), bs, torch.zeros(5, dtype=F64), 2)
    assert same.rel_change == 0 and same.delta_stable_rank == 0 and same.delta_in_base_topk == 0


def test_replacements_in_closed_form():
    u, v = orthogonal(6, 7)[:, :4], orthogonal(4, 8)
    s_b = torch.tensor([8.0, 5.0, 3.0, 1.0], dtype=F64)
    s_t = torch.tensor([9.0, 4.0, 2.0, 0.5], dtype=F64)
    b, t = u @ torch.diag(s_b) @ v.T, u @ torch.diag(s_t) @ v.T
    bs, ts = svd64(b), svd64(t)
    torch.testing.assert_close(replace_top_k(bs, t, ts, 0, "triplets"), t, rtol=0, atol=1e-12)
    torch.testing.assert_close(replace_top_k(bs, t, ts, 4, "triplets"), b, rtol=0, atol=1e-12)
    # Shared directions: restoring the directions changes nothing, restoring values gives the base's top-k.
    torch.testing.assert_close(replace_top_k(bs, t, ts, 2, "directions"), t, rtol=0, atol=1e-12)
    mixed = u @ torch.diag(torch.cat([s_b[:2], s_t[2:]])) @ v.T
    torch.testing.assert_close(replace_top_k(bs, t, ts, 2, "values"), mixed, rtol=0, atol=1e-12)
    # A rotated matrix T = R B keeps B's singular values: restoring values changes nothing, restoring
    # all directions gives B, restoring the first one gives T - R u1 s1 v1^T + u1 s1 v1^T.
    r = plane_rotation(u[:, 0], u[:, 2], 0.5)
    t = r @ b
    ts = svd64(t)
    torch.testing.assert_close(replace_top_k(bs, t, ts, 4, "values"), t, rtol=0, atol=1e-12)
    torch.testing.assert_close(replace_top_k(bs, t, ts, 4, "directions"), b, rtol=0, atol=1e-12)
    first = 8.0 * torch.outer(u[:, 0], v[:, 0])
    torch.testing.assert_close(replace_top_k(bs, t, ts, 1, "directions"), t - r @ first + first, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="unknown replacement"):
        replace_top_k(bs, t, ts, 1, "rows")


def test_describe_names_layers_and_types():
    cases = {
        "model.layers.3.self_attn.q_proj.weight": (3, "q", "attention"),
        "model.layers.0.mlp.down_proj.weight": (0, "down", "mlp"),
        "model.embed_tokens.weight": (None, "embed", "embedding"),
        "lm_head.weight": (None, "head", "head"),
        "transformer.h.11.attn.c_attn.weight": (11, "qkv", "attention"),
        "transformer.h.2.mlp.c_proj.weight": (2, "down", "mlp"),
        "model.layers.1.router.weight": (1, "router", "other"),
    }
    for name, want in cases.items():
        info = describe(name)
        assert (info.layer, info.type, info.group) == want, name


def tiny(seed: int, hidden: int = 32, max_model_len: int = 32):
    tok = build_tokenizer(ALPHABET)
    cfg = ModelConfig(tiny_hidden=hidden, tiny_layers=2, tiny_heads=2, max_model_len=max_model_len)
    return build_tiny_llama(cfg, len(tok), seed), tok


ROTATED = "model.layers.1.self_attn.q_proj.weight"


def rotate_matrix(model, name: str, theta: float) -> None:
    """Turn the matrix's first left singular vector by theta towards its last: W -> R W."""
    w = dict(model.named_parameters())[name]
    s = svd64(w)
    w.data.copy_((plane_rotation(s.u[:, 0], s.u[:, -1], theta) @ w.data.to(F64)).to(w.dtype))


@pytest.fixture
def models(tmp_path):
    """A base, one checkpoint whose ROTATED matrix is turned by 10 degrees (HF directory), one by 20
    degrees (as a learner checkpoint), all other weights equal."""
    model, tok = tiny(0)
    base = save_model(model, tok, tmp_path / "run" / "base_model")
    (tmp_path / "run" / "config.yaml").write_text("{}\n")
    rl = tmp_path / "run" / "rl" / "grpo"
    rotate_matrix(model, ROTATED, math.radians(10))
    t1 = save_model(model, tok, tmp_path / "t1")
    rotate_matrix(model, ROTATED, math.radians(10))
    v20 = rl / "checkpoints" / "v20"
    v20.mkdir(parents=True)
    save_state({"module": model.state_dict(), "version": 20}, v20 / MODEL_STATES)
    rotate_matrix(model, ROTATED, math.radians(10))
    save_model(model, tok, rl / "final_model")
    return base, t1, rl


def test_readers_expand_run_directories_and_agree(models):
    base, t1, rl = models
    (rl / "checkpoints" / "v3").mkdir()  # numeric order, not lexical: v3 < v20
    save_state({"module": {}}, rl / "checkpoints" / "v3" / MODEL_STATES)
    assert [c.label for c in expand(rl)] == ["grpo/v3", "grpo/v20", "grpo/final"]
    assert [c.label for c in expand(rl / "checkpoints" / "v20")] == ["grpo/v20"]
    assert [c.label for c in expand(rl / "final_model")] == ["grpo"]
    with pytest.raises(FileNotFoundError, match="not a Hugging Face model directory"):
        expand(rl / "checkpoints")
    assert default_out([rl / "final_model"], "analysis") == base.parent / "analysis" / "grpo"
    assert default_out([t1], "analysis") == Path("runs/analysis/t1")
    with WeightReader(expand(base)[0]) as hf, WeightReader(expand(rl / "checkpoints" / "v20")[0]) as ds:
        names = hf.matrices()
        assert ROTATED in names and "model.embed_tokens.weight" in names and "lm_head.weight" in names
        assert all(len(hf.shape(n)) == 2 for n in names) and "model.norm.weight" not in names
        assert [m.name for m in common_matrices(hf, [ds])] == names
        other = "model.layers.0.mlp.up_proj.weight"
        torch.testing.assert_close(hf.get(other), ds.get(other), rtol=0, atol=0)


def test_reads_the_learners_own_checkpoint(tmp_path, monkeypatch):
    """A checkpoint the learner writes (DeepSpeed's model states, with its optimizer and client state
    beside the weights) is read with weights_only loading, and holds the learner's weights."""
    from dph_async.config import LearnerConfig
    from dph_async.config.loss import LossConfig
    from dph_async.learner.trainer import Trainer

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions"))
    model, tok = tiny(0)
    base = save_model(model, tok, tmp_path / "base_model")
    trainer = Trainer(str(base), LearnerConfig(zero_stage=0, loss=LossConfig(objective="grpo")), temperature=1.0,
                      dtype="float32", pad_id=0, max_response_tokens=8)
    rotate_matrix(trainer.module, ROTATED, math.radians(15))
    run = tmp_path / "rl" / "grpo"
    trainer.save(run / "checkpoints", {"replay": "x", "metrics": 0})
    [ckpt] = expand(run)
    assert ckpt.deepspeed and ckpt.label == "grpo/v0"
    weights = dict(trainer.module.named_parameters())
    with WeightReader(expand(base)[0]) as b, WeightReader(ckpt) as t:
        assert [m.name for m in common_matrices(b, [t])] == b.matrices()
        for name in b.matrices():
            torch.testing.assert_close(t.get(name), weights[name].detach(), rtol=0, atol=0)
        s = svd64(b.get(ROTATED))
        stats = compare(b.get(ROTATED), s.top(2), t.get(ROTATED), svd64(t.get(ROTATED)),
                        torch.linalg.svdvals(t.get(ROTATED).to(F64) - b.get(ROTATED).to(F64)), 2)
    # u1 turned by 15 degrees towards u_last: one angle of the top-2 left subspaces is 15 degrees.
    assert stats.angles_left == pytest.approx([0, 15], abs=1e-3)


@pytest.mark.slow
def test_analyze_command_end_to_end(models, tmp_path):
    base, t1, rl = models
    out = tmp_path / "analysis"
    assert cli(["analyze", str(base), str(t1), str(rl / "checkpoints" / "v20"), "--top-k", "4", "-o", str(out)]) == 0
    data = json.loads((out / "analysis.json").read_text())
    assert data["top_k"] == 4 and data["base"]["path"] == str(base)
    assert [c["label"] for c in data["checkpoints"]] == ["t1", "grpo/v20"]
    with WeightReader(expand(base)[0]) as r:
        names = r.matrices()
    assert len(data["matrices"]) == 2 * len(names)
    fields = {"checkpoint", "name", "layer", "type", "group", "shape", "k", "rel_change", "angles_left",
              "angles_right", "sv_rel_change", "delta_in_base_topk", "delta_diag_base_topk", "delta_stable_rank",
              "delta_topk_share"}
    spectra = np.load(out / "spectra.npz")
    for m in data["matrices"]:
        assert set(m) == fields
        assert len(m["angles_left"]) == len(m["angles_right"]) == m["k"] == min(4, *m["shape"])
        assert len(spectra[f"base::{m['name']}"]) == len(spectra[f"{m['checkpoint']}::{m['name']}::trained"]) \
            == min(m["shape"])
        if m["name"] != ROTATED:  # untouched: no change anywhere
            assert m["rel_change"] == 0 and max(m["angles_left"] + m["angles_right"]) < 1e-5
            continue
        # u1 turned by 10 (20) degrees towards u_last, outside the top-4: one angle of the top-4 left
        # subspaces is 10 (20) degrees; rows are untouched, singular values kept.
        theta = 10.0 if m["checkpoint"] == "t1" else 20.0
        assert m["angles_left"] == pytest.approx([0, 0, 0, theta], abs=1e-3)
        assert m["angles_right"] == pytest.approx([0] * 4, abs=1e-3)
        assert m["sv_rel_change"] == pytest.approx([0] * 4, abs=1e-5)
        # D = (R - I) W: singular values 2 sin(theta/2) (s_1, s_last), then zeros.
        s = spectra[f"base::{m['name']}"]
        d = spectra[f"{m['checkpoint']}::{m['name']}::delta"]
        want = 2 * math.sin(math.radians(theta) / 2) * np.array([s[0], s[-1]])
        np.testing.assert_allclose(d[:2], want, rtol=1e-4)
        assert d[2] < 1e-5 * d[0]
    by_type = {(s["checkpoint"], s["type"]): s for s in data["by_type"]}
    q = by_type["grpo/v20", "q"]
    assert q["matrices"] == 2 and q["angle_max"] == pytest.approx(20, abs=1e-3)
    assert by_type["t1", "v"]["angle_max"] < 1e-5
    for plot in data["plots"]:
        assert (out / plot).stat().st_size > 1000, plot
    assert {Path(p).name for p in data["plots"]} >= {"spectra.png", "angles.png", "trajectory.png"}
    md = (out / "analysis.md").read_text()
    assert "## Trajectory" in md and "| q |" in md
    # A bad path is one clear error, not a traceback.
    assert cli(["analyze", str(base), str(tmp_path / "nowhere")]) == 2


def test_recovered_model_directory_in_closed_form(models, tmp_path):
    base, _, rl = models
    trained = rl / "final_model"  # ROTATED turned by 30 degrees, everything else equal to the base
    with WeightReader(expand(base)[0]) as b, WeightReader(Checkpoint("t", trained)) as t:
        matrices = select(list(common_matrices(b, [t])), ["attention"])
        assert {m.type for m in matrices} == {"q", "k", "v", "o"}
        with pytest.raises(ValueError, match="no matrix of type or group"):
            select(matrices, ["attn"])
        svds = {m.name: (svd64(b.get(m.name)).top(32), svd64(t.get(m.name)).top(32)) for m in matrices}
        full = write_recovered(b, t, svds, Recovery("triplets", 32), tmp_path / "triplets")
        kept = write_recovered(b, t, svds, Recovery("values", 4), tmp_path / "values")
    assert full.update_kept == pytest.approx(0, abs=1e-6)  # the base's matrices back
    assert kept.update_kept == pytest.approx(1, abs=1e-6)  # a rotation keeps the singular values
    from transformers import AutoModelForCausalLM

    restored = AutoModelForCausalLM.from_pretrained(tmp_path / "triplets")
    with WeightReader(expand(base)[0]) as b:
        for name, p in restored.state_dict().items():
            torch.testing.assert_close(p, b.get(name), rtol=0, atol=1e-5)
    assert (tmp_path / "triplets" / "tokenizer.json").is_file()
    assert json.loads((tmp_path / "values" / "recovery.json").read_text())["matrices"] == 8


@pytest.mark.slow
def test_recover_command_end_to_end(ray_session, tmp_path):
    """Two tiny models (the trained one's q_proj of layer 1 rotated), the full-rank recovery (the base's
    weights back), evaluated on small in-domain and OOD sets in Ray workers; a rerun finds it done."""
    from dph_async.tasks.dataset import verl_row, write_rows
    from dph_async.tasks.embedded import make_splits

    model, tok = tiny(0, hidden=64, max_model_len=64)  # vLLM's CPU attention needs head_dim >= 32
    base = save_model(model, tok, tmp_path / "base")
    rotate_matrix(model, ROTATED, math.radians(30))
    trained = save_model(model, tok, tmp_path / "trained")
    splits = make_splits(0, 8, 8)
    data = {name: write_rows([verl_row(p.prompt, p.data_source, p.ground_truth, i, name)
                              for i, p in enumerate(splits[split])], tmp_path / f"{name}.parquet")
            for name, split in (("in_domain", "test"), ("ood", "ood_test"))}
    out = tmp_path / "recover"
    argv = ["recover", str(base), str(trained), "--replace", "triplets", "--k", "64", "-o", str(out),
            *(f"--data={k}={v}" for k, v in data.items()),
            *(f"--set={o}" for o in ("eval.k_max=2", "eval.max_prompts=4", "sampling.max_tokens=6"))]
    assert cli(argv) == 0
    report = json.loads((out / "recover.json").read_text())
    assert [r["name"] for r in report["recoveries"]] == ["triplets-k64"]
    assert report["recoveries"][0]["update_kept"] == pytest.approx(0, abs=1e-6)  # full rank: the base's weights
    assert set(report["eval"]) == {"base", "trained", "triplets-k64"}
    for res in report["eval"].values():
        assert set(res) == {"in_domain", "ood"}
        assert all(r["prompts"] == 4 and set(r["pass_at_k"]) == {"1", "2"} for r in res.values())
    # The restored model is the base: the same greedy answer, right or wrong, on every test prompt.
    evals = {name: load_results(out / "eval" / f"{name}.json") for name in ("base", "triplets-k64")}
    for split in ("in_domain", "ood"):
        assert [(r.prompt_id, r.greedy) for r in evals["base"][split].per_prompt] == \
            [(r.prompt_id, r.greedy) for r in evals["triplets-k64"][split].per_prompt]
    assert [row[0] for row in report["table"]["rows"]] == ["base", "trained", "triplets-k64"]
    # By the base's difficulty: each model's rows cover the 4 prompts of each test set.
    header, rows = report["by_base_difficulty"]["header"], report["by_base_difficulty"]["rows"]
    assert header[:4] == ["test set", "pi_0 on these prompts", "prompts", "model"]
    prompts: dict[tuple[str, str], int] = {}
    for r in rows:
        prompts[r[0], r[3]] = prompts.get((r[0], r[3]), 0) + int(r[2])
    assert prompts == {(s, m): 4 for s in ("in_domain", "ood") for m in report["eval"]}
    assert (out / "models" / "triplets-k64" / "config.json").is_file()
    for plot in ("recover.png", "pass_at_k.png"):
        assert (out / "plots" / plot).stat().st_size > 1000
    md = (out / "recover.md").read_text()
    assert "| triplets-k64 | triplets | 64 | 0.000 |" in md
    for split in ("in_domain", "ood"):  # the per-band table: one small table per test set, every row in it
        table = md.split(f"### {split}\n\n")[1].split("\n\n")[0]
        assert all(f"| {r[1]} | {r[2]} | {r[3]} |" in table for r in rows if r[0] == split)
    stamps = {f: f.stat().st_mtime_ns for f in (out / "eval").glob("*.json")}
    assert cli(argv) == 0
    assert {f: f.stat().st_mtime_ns for f in (out / "eval").glob("*.json")} == stamps


def test_a_model_with_a_non_finite_weight_is_one_error_naming_the_matrix(tmp_path, capsys):
    """A diverged run's final model may hold a NaN. Before: torch's LinAlgError traceback ("the input
    matrix contained non-finite values"), naming neither the model nor the matrix."""
    model, tok = tiny(0)
    base = save_model(model, tok, tmp_path / "base")
    with torch.no_grad():
        dict(model.named_parameters())[ROTATED][0, 0] = float("nan")
    diverged = save_model(model, tok, tmp_path / "diverged")
    capsys.readouterr()  # the saves' progress bars
    assert cli(["analyze", str(base), str(diverged), "-o", str(tmp_path / "out")]) == 2
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error: ")]
    assert errors == [f"error: diverged: {ROTATED} holds NaN or infinite values (a diverged model?): its singular "
                      "values are undefined"]
