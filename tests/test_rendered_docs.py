"""Docs rendered from committed data (dph_async/app/rendered_docs.py): the repository's own docs match
their data; a block is rewritten from its data and nothing outside it changes; a stale block is named
by file, line and spec and fails --check; an unknown kind, an unclosed block, a missing file or a
renderer's complaint is one error naming the line, and the doc is left as it was; the tables' figures
against values whose percentages and standard errors are exact."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest

from dph_async.app import rendered_docs
from dph_async.app.ablate.seeds import BASE, CONFIG, IDENTITY, PROVENANCE
from dph_async.app.rendered_docs import Context, render

ROOT = Path(__file__).resolve().parents[1]
PREREG = ROOT / "docs" / "data" / "prereg"
CONFIRM_ARGS = ("embedded docs/data/prereg/embedded.csv docs/data/prereg/embedded-asrun.csv "
                "digit_sets docs/data/prereg/digit_sets.csv docs/data/prereg/digit_sets-asrun.csv")


def test_the_repositorys_docs_match_their_data(capsys):
    assert rendered_docs.main(["--check"]) == 0, capsys.readouterr().out
    text = (ROOT / "docs" / "ablations.md").read_text()
    assert text.count("<!-- rendered:") >= 4  # the blocks are there, not removed to pass


def _doc(tmp_path: Path, body: str) -> Path:
    doc = tmp_path / "docs" / "a.md"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(body)
    return doc


def _calibration(tmp_path: Path, rows: list[dict[str, str]]) -> str:
    path = tmp_path / "cal.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, ["task", "ood_warm_share", "in_domain/pass@1", "in_domain/pass@16", "ood/greedy",
                               "ood/pass@1", "ood/pass@16"])
        w.writeheader()
        w.writerows(rows)
    return "cal.csv"


ROW = {"task": "embedded", "ood_warm_share": "0.1", "in_domain/pass@1": "0.5", "in_domain/pass@16": "0.125",
       "ood/greedy": "1.0", "ood/pass@1": "0.0625", "ood/pass@16": "0.75"}


def test_a_block_is_rewritten_from_its_data_and_nothing_else_changes(tmp_path):
    name = _calibration(tmp_path, [ROW])
    before, after = "# Title\n\nprose quoting `<!-- rendered: KIND -->`, no block\n\n", "\n\ntail ü\n"
    text = f"{before}<!-- rendered: ood-calibration {name} -->\nhand-pasted figure\n<!-- end rendered -->{after}"
    new, changed = render(text, Context(tmp_path, tmp_path / "a.md", write=True))
    assert changed == [(5, f"ood-calibration {name}")]
    assert new.startswith(before) and new.endswith(after)
    assert "hand-pasted" not in new
    assert "| embedded | 0.1 | 50.0 / 12.5 | 100.0 | 6.2 | 75.0 |" in new  # 6.25 -> 6.2: round half to even
    again, changed = render(new, Context(tmp_path, tmp_path / "a.md", write=True))
    assert (again, changed) == (new, [])


def test_check_names_each_stale_block_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(rendered_docs, "ROOT", tmp_path)
    name = _calibration(tmp_path, [ROW])
    good, _ = render(f"<!-- rendered: ood-calibration {name} -->\n<!-- end rendered -->\n",
                     Context(tmp_path, tmp_path, write=True))
    stale = good.replace("75.0", "76.0")
    doc = _doc(tmp_path, f"intro\n\n{good}\n{stale}")
    assert rendered_docs.main(["--check", str(doc)]) == 1
    line = f"intro\n\n{good}\n".count("\n") + 1
    assert capsys.readouterr().out.splitlines() == [f"{doc}:{line}: stale: ood-calibration {name}"]
    assert doc.read_text() == f"intro\n\n{good}\n{stale}"
    assert rendered_docs.main([str(doc)]) == 0
    assert doc.read_text() == f"intro\n\n{good}\n{good}"
    assert rendered_docs.main(["--check", str(doc)]) == 0


@pytest.mark.parametrize(("body", "message"), [
    ("a\n<!-- rendered: nosuch x -->\n<!-- end rendered -->\n", "line 2: no renderer 'nosuch'"),
    ("a\nb\n<!-- rendered: ood-calibration cal.csv -->\nnever closed\n", "line 3: a block without"),
    ("<!-- rendered: ood-calibration cal.csv -->\n<!-- end rendered -->\n\n<!-- rendered: splits x.csv -->\n",
     "line 4: a block without"),
    ("<!-- rendered: ood-calibration missing.csv -->\n<!-- end rendered -->\n", "line 1: ood-calibration missing.csv"),
    ("x\n<!-- rendered: ood-calibration -->\n<!-- end rendered -->\n",
     "line 2: ood-calibration: ood-calibration CSV: 1 argument(s), got 0"),
    ("<!-- rendered: ood-calibration cal.csv -->\nx\n<!-- rendered: splits s.csv -->\n<!-- end rendered -->\n",
     "line 1: a block without `<!-- end rendered -->` before the next block"),
    ("<!-- rendered:  -->\n<!-- end rendered -->\n", "line 1: no renderer ''"),
    ("<!-- rendered: confirm embedded a.csv -->\n<!-- end rendered -->\n", "TASK FIRST_CSV AS_RUN_CSV per task, got 2"),
])
def test_a_bad_block_is_one_error_naming_its_line_and_the_doc_stays(tmp_path, capsys, monkeypatch, body, message):
    monkeypatch.setattr(rendered_docs, "ROOT", tmp_path)
    _calibration(tmp_path, [ROW])
    doc = _doc(tmp_path, body)
    assert rendered_docs.main([str(doc)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {doc}: ") and message in err, err
    assert doc.read_text() == body


def _seeds(tmp_path: Path, rows: list[tuple[str, int, dict[str, float]]]) -> str:
    figures = ["in_domain/pass@1", "in_domain/pass@16", "ood/pass@1", "ood/pass@16"]
    with (tmp_path / "seeds.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*IDENTITY, *CONFIG, *PROVENANCE, *figures])
        for group, seed, m in rows:
            w.writerow([f"{group}-{seed}", group, "base" if group == BASE else group, seed, 0, 0, "embedded", 0, 100,
                        "f" * 12, "", "", "", "0", *(m[k] for k in figures)])
    return "seeds.csv"


def test_splits_gives_each_groups_mean_and_standard_error_in_sweep_order(tmp_path):
    base = {"in_domain/pass@1": 0.25, "in_domain/pass@16": 1.0, "ood/pass@1": 0.5, "ood/pass@16": 0.875}
    name = _seeds(tmp_path, [
        (BASE, 0, base),
        ("zeta", 1, {"in_domain/pass@1": 0.4, "in_domain/pass@16": 0.5, "ood/pass@1": 0.25, "ood/pass@16": 0.5}),
        ("alpha", 1, {"in_domain/pass@1": 0.5, "in_domain/pass@16": 0.5, "ood/pass@1": 0.5, "ood/pass@16": 0.5}),
        ("zeta", 2, {"in_domain/pass@1": 0.6, "in_domain/pass@16": 0.5, "ood/pass@1": 0.75, "ood/pass@16": 0.5}),
    ])
    table = rendered_docs.splits([name], Context(tmp_path, tmp_path, write=False)).splitlines()
    # zeta: mean 0.5, s.e. stdev(0.4, 0.6)/sqrt(2) = 0.1; OOD P@1 mean 0.5, s.e. 0.25
    assert table[2:] == ["| π₀ | 1 | 25.0 / 100.0 | 50.0 / 87.5 |",
                         "| zeta | 2 | 50.0 ± 10.0 / 50.0 ± 0.0 | 50.0 ± 25.0 / 50.0 ± 0.0 |",
                         "| alpha | 1 | 50.0 / 50.0 | 50.0 / 50.0 |"]


def test_a_figure_is_drawn_by_a_render_and_only_asked_for_by_a_check(tmp_path):
    data = tmp_path / "docs" / "data" / "prereg"
    data.mkdir(parents=True)
    for f in PREREG.glob("*.csv"):
        shutil.copy(f, data / f.name)
    doc = tmp_path / "docs" / "ablations.md"
    args = ["docs/figures/c.png", *CONFIRM_ARGS.split()]
    with pytest.raises(ValueError, match=r"docs/figures/c\.png: no such figure"):
        rendered_docs.confirm_figure(args, Context(tmp_path, doc, write=False))
    link = rendered_docs.confirm_figure(args, Context(tmp_path, doc, write=True))
    assert link == "![Pass@16 against Pass@1 per task: embedded, digit_sets](figures/c.png)"
    assert (tmp_path / "docs" / "figures" / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert rendered_docs.confirm_figure(args, Context(tmp_path, doc, write=False)) == link
    with pytest.raises(ValueError, match="give PNG"):
        rendered_docs.confirm_figure([], Context(tmp_path, doc, write=True))


def test_confirm_refuses_sweeps_the_design_cannot_use(tmp_path):
    data = tmp_path / "d"
    data.mkdir()
    shutil.copy(PREREG / "embedded.csv", data / "first.csv")
    shutil.copy(PREREG / "embedded.csv", data / "second.csv")  # the as-run sweep replaced by the first
    with pytest.raises(ValueError, match="reference_pg_share"):
        rendered_docs.confirm_tables(["embedded", "d/first.csv", "d/second.csv"], Context(tmp_path, tmp_path, False))


def test_a_block_reads_and_writes_nothing_outside_the_repository(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    _calibration(tmp_path, [ROW])  # tmp_path/cal.csv: beside the repository, not in it
    (root / "link.csv").symlink_to(tmp_path / "cal.csv")
    ctx = Context(root, root / "docs" / "a.md", write=True)
    for arg in ("../cal.csv", str(tmp_path / "cal.csv"), "link.csv"):
        with pytest.raises(ValueError, match="outside the repository"):
            rendered_docs.ood_calibration([arg], ctx)
    with pytest.raises(ValueError, match="outside the repository"):
        rendered_docs.confirm_figure(["../x.png", *CONFIRM_ARGS.split()], ctx)
    with pytest.raises(ValueError, match=r"a figure is a \.png file"):
        rendered_docs.confirm_figure(["docs/a.md", *CONFIRM_ARGS.split()], ctx)
    assert not (tmp_path / "x.png").exists()
