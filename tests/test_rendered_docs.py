"""Docs rendered from committed data (dph_async/tools/rendered_docs.py): the repository's own docs match
their data; a block is rewritten from its data and nothing outside it changes; a stale block is named
by file, line and spec and fails --check; an unknown kind, an unclosed block, a missing file or a
renderer's complaint is one error naming the line, and the doc is left as it was; the tables' figures
against values whose percentages and standard errors are exact."""

from __future__ import annotations

import csv
import shutil
import struct
from pathlib import Path

import pytest

from dph_async.tools import rendered_docs
from dph_async.tools.ablate import confirm_plot
from dph_async.tools.ablate.seeds import BASE, CONFIG, IDENTITY, PROVENANCE
from dph_async.tools.rendered_docs import Context, render

ROOT = Path(__file__).resolve().parents[1]
PREREG = ROOT / "docs" / "data" / "prereg"
CONFIRM_ARGS = ("embedded docs/data/prereg/embedded.csv docs/data/prereg/embedded-asrun.csv "
                "digit_sets docs/data/prereg/digit_sets.csv docs/data/prereg/digit_sets-asrun.csv")


def test_the_repositorys_docs_match_their_data(capsys):
    assert rendered_docs.main(["--check"]) == 0, capsys.readouterr().out
    # Every committed result file is some block's input: a table taken out of its block to be edited by
    # hand leaves its data unrendered, and fails here.
    specs = [b.spec.split() for d in rendered_docs.docs(ROOT) for b in rendered_docs.blocks(d.read_text())]
    inputs = {a for _, *args in specs for a in args}
    data = {str(p.relative_to(ROOT)) for ext in ("csv", "json") for p in (ROOT / "docs" / "data").rglob(f"*.{ext}")}
    assert data and data <= inputs, data - inputs
    figures = [args[0] for kind, *args in specs if kind == "confirm-figure"]
    assert figures and all(rendered_docs.source_of(ROOT / f).startswith(rendered_docs.SOURCE) for f in figures)


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
     "line 1: a block without `<!-- end rendered -->` (line 3 comes first)"),
    ("<!-- rendered:  -->\n<!-- end rendered -->\n", "line 1: no renderer ''"),
    ("a\n\n<!-- end rendered -->\n", "line 3: a marker outside a block"),
    ("<!-- Rendered: ood-calibration cal.csv -->\nx\n<!-- end rendered -->\n", "line 1: a marker outside a block"),
    ("<!--  rendered: ood-calibration cal.csv -->\n", "line 1: a marker outside a block"),
    ("<!-- rendered: ood-calibration cal.csv --> trailing\n<!-- end rendered -->\n",
     "line 1: a block's opening marker not alone on its line"),
    ("a\rb\n", "line 1: a carriage return that ends no line"),
    ("<!-- rendered: confirm embedded a b embedded c d -->\n<!-- end rendered -->\n", "a task given twice"),
    ("<!-- rendered: confirm embedded a.csv -->\n<!-- end rendered -->\n", "TASK FIRST_CSV AS_RUN_CSV per task, got 2"),
])
def test_a_bad_block_is_one_error_naming_its_line_and_the_doc_stays(tmp_path, capsys, monkeypatch, body, message):
    monkeypatch.setattr(rendered_docs, "ROOT", tmp_path)
    _calibration(tmp_path, [ROW])
    doc = _doc(tmp_path, body)
    assert rendered_docs.main([str(doc)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {doc}: ") and message in err, err
    assert doc.read_bytes() == body.encode()


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


def test_a_figure_is_drawn_once_every_block_rendered_and_only_asked_for_by_a_check(tmp_path):
    data = tmp_path / "docs" / "data" / "prereg"
    data.mkdir(parents=True)
    for f in PREREG.glob("*.csv"):
        shutil.copy(f, data / f.name)
    doc = tmp_path / "docs" / "ablations.md"
    args = ["docs/figures/c.png", *CONFIRM_ARGS.split()]
    check = Context(tmp_path, doc, write=False)
    link = rendered_docs.confirm_figure(args, check)
    assert link == "![Pass@16 against Pass@1 per task: embedded, digit_sets](figures/c.png)"
    assert check.stale_figures == ["docs/figures/c.png"] and not check.figures
    ctx = Context(tmp_path, doc, write=True)
    assert rendered_docs.confirm_figure(args, ctx) == link and len(ctx.figures) == 1
    png = tmp_path / "docs" / "figures" / "c.png"
    assert not png.exists()  # drawn later, by main, once every block rendered
    draft, final = ctx.figures[0]()
    assert final == png and draft.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not png.exists()
    draft.rename(png)
    assert rendered_docs.source_of(png).startswith(rendered_docs.SOURCE)
    check = Context(tmp_path, doc, write=False)
    assert rendered_docs.confirm_figure(args, check) == link and check.stale_figures == []
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


@pytest.mark.parametrize(("csv_text", "says"), [
    ("task,ood_warm_share\nembedded,0.1\n", "no column in_domain/pass@1, in_domain/pass@16, ood/greedy"),
    (",".join(ROW) + "\nembedded,0.1,0.5\n", "line 2: 7 fields in the header, not here"),
    (",".join(ROW) + "\n" + ",".join({**ROW, "ood/pass@1": "nan"}.values()) + "\n", "ood/pass@1 nan is not a share"),
    (",".join(ROW) + "\n" + ",".join({**ROW, "ood/greedy": "7"}.values()) + "\n", "ood/greedy 7.0 is not a share"),
    (",".join(ROW) + "\n" + ",".join({**ROW, "ood/greedy": "x"}.values()) + "\n", "ood/greedy 'x' is not a number"),
    (",".join(ROW) + "\n", "no rows"),
    (",".join(ROW) + "\n" + ",".join({**ROW, "task": '"a\nb"'}.values()) + "\n", "a line break in a table cell"),
])
def test_a_calibration_file_that_is_not_one_is_refused_by_name(tmp_path, csv_text, says):
    (tmp_path / "cal.csv").write_text(csv_text)
    with pytest.raises(ValueError, match=says):
        rendered_docs.ood_calibration(["cal.csv"], Context(tmp_path, tmp_path / "a.md", write=True))


def test_a_calibration_file_with_a_byte_order_mark_or_a_bar_reads_as_its_text(tmp_path):
    row = ",".join({**ROW, "task": "a|b"}.values())
    (tmp_path / "cal.csv").write_text("\ufeff" + ",".join(ROW) + "\n" + row + "\n")
    table = rendered_docs.ood_calibration(["cal.csv"], Context(tmp_path, tmp_path / "a.md", write=True))
    assert table.splitlines()[2] == "| a\\|b | 0.1 | 50.0 / 12.5 | 100.0 | 6.2 | 75.0 |"


def test_splits_refuses_rows_that_are_not_one_sweeps(tmp_path):
    m = {"in_domain/pass@1": 0.5, "in_domain/pass@16": 0.5, "ood/pass@1": 0.5, "ood/pass@16": 0.5}
    ctx = Context(tmp_path, tmp_path, write=False)
    for rows, says in [([("g", 1, m)], "no pi_0 row"),
                       ([(BASE, 0, m), ("g", 1, m), ("g", 1, m)], "group g has seed 1 twice"),
                       ([(BASE, 0, m), ("g", 1, {**m, "ood/pass@16": ""})], "cell g-1: no ood/pass@16")]:
        with pytest.raises(ValueError, match=says):
            rendered_docs.splits([_seeds(tmp_path, rows)], ctx)
    _seeds(tmp_path, [(BASE, 0, m), ("g", 1, m)])
    text = (tmp_path / "seeds.csv").read_text().replace(",embedded,", ",digit_sets,", 1)
    (tmp_path / "seeds.csv").write_text(text)
    with pytest.raises(ValueError, match="more than one task or step count"):
        rendered_docs.splits(["seeds.csv"], ctx)


def _figure_block(png: str) -> str:
    """A doc's block drawing the confirmatory figure to `png` from the committed rows."""
    return f"<!-- rendered: confirm-figure {png} {CONFIRM_ARGS} -->\n<!-- end rendered -->\n"


def _repository(tmp_path: Path) -> Path:
    """A copy of the confirmatory data and a doc with its figure block, as a repository of its own."""
    root = tmp_path / "repo"
    data = root / "docs" / "data" / "prereg"
    data.mkdir(parents=True)
    for f in PREREG.glob("*.csv"):
        shutil.copy(f, data / f.name)
    _doc(root, "# A\n\n" + _figure_block("docs/figures/c.png"))
    return root


def test_a_figure_put_there_by_hand_or_drawn_from_other_data_is_stale_and_never_overwritten(tmp_path, capsys,
                                                                                         monkeypatch):
    root = _repository(tmp_path)
    monkeypatch.setattr(rendered_docs, "ROOT", root)
    png = root / "docs" / "figures" / "c.png"
    assert rendered_docs.main([]) == 0 and png.is_file()
    assert rendered_docs.main(["--check"]) == 0
    drawn = png.read_bytes()
    # Other data: the figure no longer matches them.
    csv_file = root / "docs" / "data" / "prereg" / "embedded.csv"
    with csv_file.open(newline="") as f:
        rows = list(csv.reader(f))
    column = rows[0].index("in_domain/pass@16")
    row = next(r for r in rows if r[1] == "grpo@d_exp")  # arm A, a point of the figure
    row[column] = str(float(row[column]) - 0.01)
    with csv_file.open("w", newline="") as f:
        csv.writer(f).writerows(rows)
    capsys.readouterr()
    assert rendered_docs.main(["--check"]) == 1
    assert "stale: confirm-figure docs/figures/c.png" in capsys.readouterr().out
    assert rendered_docs.main([]) == 0 and png.read_bytes() != drawn
    # A figure made by hand (any PNG without the renderer's digest) is stale, and a render refuses to
    # overwrite it: it is no drawing of this command's.
    confirm_plot.pyplot().imsave(png, [[0.0, 1.0]])
    hand = png.read_bytes()
    assert rendered_docs.main(["--check"]) == 1
    assert rendered_docs.main([]) == 2
    assert "docs/figures/c.png: a figure this command did not draw; it would be overwritten" in capsys.readouterr().err
    assert png.read_bytes() == hand


def test_a_render_writes_nothing_unless_every_block_of_every_file_rendered(tmp_path, capsys, monkeypatch):
    root = _repository(tmp_path)
    monkeypatch.setattr(rendered_docs, "ROOT", root)
    name = _calibration(root, [ROW])
    first = _doc(root, f"<!-- rendered: ood-calibration {name} -->\nold\n<!-- end rendered -->\n")
    second = root / "docs" / "b.md"
    second.write_text("<!-- rendered: ood-calibration missing.csv -->\n<!-- end rendered -->\n")
    figure_doc = root / "docs" / "c.md"
    figure_doc.write_text(_figure_block("docs/figures/c.png"))
    assert rendered_docs.main([str(figure_doc), str(first), str(second)]) == 2
    assert "b.md: line 1: ood-calibration missing.csv" in capsys.readouterr().err
    assert first.read_text().count("old") == 1 and not (root / "docs" / "figures" / "c.png").exists()
    assert [p.name for p in rendered_docs.docs(root)] == ["a.md", "b.md", "c.md"]


def test_line_ends_outside_the_blocks_are_kept(tmp_path):
    name = _calibration(tmp_path, [ROW])
    text = f"a\r\nb\r\n<!-- rendered: ood-calibration {name} -->\nx\n<!-- end rendered -->\r\nc\r\n"
    new, _ = render(text, Context(tmp_path, tmp_path / "a.md", write=True))
    assert new.startswith("a\r\nb\r\n") and new.endswith("<!-- end rendered -->\r\nc\r\n")


def test_a_figure_drawn_by_other_plotting_code_is_stale(tmp_path, capsys, monkeypatch):
    root = _repository(tmp_path)
    monkeypatch.setattr(rendered_docs, "ROOT", root)
    assert rendered_docs.main([]) == 0 and rendered_docs.main(["--check"]) == 0
    monkeypatch.setitem(confirm_plot.ARM_LABELS, "A", "A the control, relabelled")
    capsys.readouterr()
    assert rendered_docs.main(["--check"]) == 1
    assert "stale: confirm-figure docs/figures/c.png" in capsys.readouterr().out


def test_one_figure_per_block_and_none_that_cannot_be_drawn(tmp_path, capsys, monkeypatch):
    root = _repository(tmp_path)
    monkeypatch.setattr(rendered_docs, "ROOT", root)
    twice = root / "docs" / "z.md"
    twice.write_text(_figure_block("docs/figures/c.png"))
    assert rendered_docs.main([]) == 2
    assert ("z.md: line 1: confirm-figure docs/figures/c.png" in (err := capsys.readouterr().err)
            and "docs/figures/c.png: drawn by another block too (one block per figure)" in err)
    twice.write_text(_figure_block("docs/notadir/c.png"))
    (root / "docs" / "notadir").write_text("x")
    assert rendered_docs.main([]) == 2
    assert "docs/notadir/c.png: a directory, or under a file" in capsys.readouterr().err
    assert not (root / "docs" / "figures").exists()
    assert (root / "docs" / "a.md").read_text().endswith(" -->\n<!-- end rendered -->\n")  # its block still empty


def test_a_doc_that_leads_out_of_the_repository_is_refused_and_left_alone(tmp_path, capsys, monkeypatch):
    root = _repository(tmp_path)
    monkeypatch.setattr(rendered_docs, "ROOT", root)
    name = _calibration(root, [ROW])
    victim = tmp_path / "victim.md"
    victim.write_text(f"<!-- rendered: ood-calibration {name} -->\nold\n<!-- end rendered -->\n")
    (root / "docs" / "sub").mkdir()
    (root / "docs" / "sub" / "evil.md").symlink_to(victim)
    assert root / "docs" / "sub" / "evil.md" in rendered_docs.docs(root)  # docs/**/*.md: subfolders too
    assert rendered_docs.main([]) == 2
    assert "evil.md: outside the repository" in capsys.readouterr().err
    assert "old" in victim.read_text()


def test_a_calibration_file_with_a_repeated_column_or_a_huge_field_is_refused(tmp_path):
    ctx = Context(tmp_path, tmp_path / "a.md", write=True)
    (tmp_path / "cal.csv").write_text(",".join(ROW) + ",ood/pass@16\n" + ",".join(ROW.values()) + ",0.0\n")
    with pytest.raises(ValueError, match="column ood/pass@16 given twice"):
        rendered_docs.ood_calibration(["cal.csv"], ctx)
    (tmp_path / "cal.csv").write_text(",".join(ROW) + "\n" + ",".join({**ROW, "task": "x" * 200_000}.values()) + "\n")
    with pytest.raises(ValueError, match="not a CSV file"):
        rendered_docs.ood_calibration(["cal.csv"], ctx)


def test_the_command_says_what_it_rendered_and_drew_and_teaches_in_help(tmp_path, capsys, monkeypatch):
    root = _repository(tmp_path)
    monkeypatch.setattr(rendered_docs, "ROOT", root)
    second = root / "docs" / "b.md"
    second.write_text(_figure_block("docs/figures/d.png"))
    assert rendered_docs.main([]) == 0
    out = capsys.readouterr()
    doc = root / "docs" / "a.md"
    assert out.out.splitlines() == [f"{root}/docs/figures/c.png: drawn", f"{root}/docs/figures/d.png: drawn",
                                    f"{doc}:3: rendered: confirm-figure docs/figures/c.png {CONFIRM_ARGS}",
                                    f"{second}:1: rendered: confirm-figure docs/figures/d.png {CONFIRM_ARGS}"]
    assert out.err == ""
    with pytest.raises(SystemExit):
        rendered_docs.main(["--help"])
    text = capsys.readouterr().out
    assert text.startswith("usage: python -m dph_async.tools.rendered_docs [-h] [--check] [FILE ...]".replace(
        "FILE", "files"))
    assert "\n    <!-- rendered: KIND ARG ... -->\n" in text  # the docstring's layout kept
    assert "--check     compare only; exit 1 naming every stale block" in text
    assert "markdown files (default: README.md docs/**/*.md)" in text


def test_a_figure_that_cannot_be_drawn_leaves_every_file_as_it_was(tmp_path, capsys, monkeypatch):
    root = _repository(tmp_path)
    monkeypatch.setattr(rendered_docs, "ROOT", root)
    (root / "docs" / "b.md").write_text(_figure_block("docs/figures/d.png"))
    save = confirm_plot.save

    def fail_second(fig, out, source=None):
        if out.name.startswith("d.png"):
            confirm_plot.pyplot().close(fig)
            raise OSError("disk full")
        save(fig, out, source)

    monkeypatch.setattr(confirm_plot, "save", fail_second)
    before = {p: p.read_bytes() for p in (root / "docs").glob("*.md")}
    assert rendered_docs.main([]) == 2
    out = capsys.readouterr()
    assert out.err == "error: a figure cannot be drawn (disk full); nothing written\n" and out.out == ""
    assert not (root / "docs" / "figures").exists() or not list((root / "docs" / "figures").iterdir())
    assert {p: p.read_bytes() for p in (root / "docs").glob("*.md")} == before


@pytest.mark.parametrize(("values", "ok"), [({"ood/pass@1": "0.0"}, "| 0.0 | 75.0 |"),
                                            ({"ood/pass@1": "1.5"}, "line 2: ood/pass@1 1.5 is not a share"),
                                            ({"ood_warm_share": "x"}, "line 2: ood_warm_share 'x' is not a number"),
                                            ({"task": '"a\rb"'}, "a line break in a table cell")])
def test_calibration_values_at_their_edges(tmp_path, values, ok):
    (tmp_path / "cal.csv").write_text(",".join(ROW) + "\n" + ",".join({**ROW, **values}.values()) + "\n")
    ctx = Context(tmp_path, tmp_path / "a.md", write=True)
    if ok.startswith("|"):
        assert rendered_docs.ood_calibration(["cal.csv"], ctx).endswith(ok)
    else:
        with pytest.raises(ValueError, match=ok):
            rendered_docs.ood_calibration(["cal.csv"], ctx)


def test_errors_name_every_item_and_the_kind_that_complained(tmp_path):
    ctx = Context(tmp_path, tmp_path / "a.md", write=True)
    (tmp_path / "cal.csv").write_text("task,task,ood/greedy,ood/greedy\n")
    with pytest.raises(ValueError, match=r"^cal\.csv: column ood/greedy, task given twice$"):
        rendered_docs.ood_calibration(["cal.csv"], ctx)
    for kind, args, says in [(rendered_docs.splits, [], r"splits SEEDS_CSV: 1 argument\(s\), got 0"),
                             (rendered_docs.confirm_tables, ["a"], "confirm: give TASK FIRST_CSV AS_RUN_CSV per task"),
                             (rendered_docs.confirm_tables, ["a", "b", "c", "a", "d", "e"],
                              r"confirm: a task given twice \(a, a\)"),
                             (rendered_docs.confirm_figure, ["f.png", "a"],
                              "confirm-figure: give TASK FIRST_CSV AS_RUN_CSV per task"),
                             (rendered_docs.confirm_figure, [],
                              "^confirm-figure: give PNG, then TASK FIRST_CSV AS_RUN_CSV per task$"),
                             (rendered_docs.scale_tables, ["s.json"], r"^scale JSON TABLE: 2 argument\(s\), got 1$"),
                             (rendered_docs.scale_tables, ["s.json", "speed"],
                              r"^scale: table 'speed' \(known: ratios, cpu, memory, projection\)$"),
                             (rendered_docs.scale_figure, ["s.json"],
                              r"^scale-figure PNG JSON: 2 argument\(s\), got 1$")]:
        with pytest.raises(ValueError, match=says):
            kind(args, ctx)
    rows = [(BASE, 0, {"in_domain/pass@1": 0.5, "in_domain/pass@16": 0.5, "ood/pass@1": "", "ood/pass@16": ""})]
    with pytest.raises(ValueError, match=r"^seeds\.csv, cell pi_0-0: no ood/pass@1, ood/pass@16$"):
        rendered_docs.splits([_seeds(tmp_path, rows)], ctx)
    with pytest.raises(ValueError, match=r"^seeds\.csv: no pi_0 row"):
        rendered_docs.splits([_seeds(tmp_path, rows[1:])], ctx)
    with pytest.raises(ValueError, match=r"known: cells, confirm, confirm-figure, confirm-forgetting, "
                                         r"confirm-staleness, ood-calibration, results, scale, scale-figure, "
                                         r"splits, tta\)$"):
        render("<!-- rendered: nope -->\n<!-- end rendered -->\n", ctx)
    with pytest.raises(ValueError, match=r"^line 3: a carriage return that ends no line \(lines end in LF or CRLF\)$"):
        render("\n\na\rb\n", ctx)
    for line in ("<!-- end rendered -->  ", "<!-- end rendered -->X"):
        with pytest.raises(ValueError, match=r"line 1: a block without `<!-- end rendered -->` \(line 3 comes first\)"):
            render(f"<!-- rendered: splits s.csv -->\nx\n{line}\n", ctx)


def test_data_that_would_write_a_block_marker_is_refused(tmp_path, monkeypatch):
    """A renderer's output is the data's: a line of it that is a marker would end the block early or
    open another, so the block is refused, whichever renderer made it."""
    ctx = Context(tmp_path, tmp_path / "a.md", write=True)
    for line in ("<!-- end rendered -->", "  <!-- rendered: splits x.csv -->", "<!--END RENDERED"):
        monkeypatch.setitem(rendered_docs.RENDERERS, "echo", lambda args, ctx, line=line: f"| a |\n{line}\n# b")
        with pytest.raises(ValueError, match=r"^line 1: echo: its data holds a block marker$"):
            render("<!-- rendered: echo -->\n<!-- end rendered -->\n", ctx)
    monkeypatch.setitem(rendered_docs.RENDERERS, "echo", lambda args, ctx: "| <!-- end rendered --> |")
    assert render("<!-- rendered: echo -->\n<!-- end rendered -->\n", ctx)[0] == \
        "<!-- rendered: echo -->\n| <!-- end rendered --> |\n<!-- end rendered -->\n"  # inside a line: text


def _png(*chunks: tuple[bytes, bytes]) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + b"".join(struct.pack(">I", len(d)) + k + d + b"\0\0\0\0" for k, d in chunks)


def test_the_source_chunk_is_read_as_written_and_nowhere_else(tmp_path):
    png = tmp_path / "f.png"
    cases = [(_png((b"IHDR", b"x" * 13), (b"tEXt", b"Source\0a\0b"), (b"IEND", b"")), "a\0b"),
             (_png((b"tEXt", b"Source\0" + b"v" * 4089), (b"IEND", b"")), "v" * 4089),  # 4,096 bytes: read
             (_png((b"tEXt", b"Source\0" + b"v" * 4090), (b"IEND", b"")), None),  # 4,097: skipped
             (_png((b"IEND", b""), (b"tEXt", b"Source\0after")), None),  # nothing counts after the end
             (_png((b"zTXt", b"Source\0\0x"), (b"IEND", b"")), None),  # compressed text: not this chunk
             (_png((b"tEXt", b"Other\0x"), (b"tEXt", b"Source\0\xe9")), "\xe9"),
             (b"GIF89a", None)]
    for data, want in cases:
        png.write_bytes(data)
        assert rendered_docs.source_of(png) == want, data[:40]


RESULTS_HEADER = "benchmark,figure,date,commit,machine,command,load"


def test_results_are_a_table_of_the_records_with_every_field_checked(tmp_path):
    ctx = Context(tmp_path, tmp_path / "a.md", write=False)
    (tmp_path / "r.csv").write_text(RESULTS_HEADER + "\n"
                                    '`bench x`,"1.5× y, | z",2026-11-29 13:01–14:02,0c9c19e,host,`dph-async bench x`,\n'
                                    "b,2×,2026-11-27,bf4ea29 to 7682f70+dirty,h,c,1.0–1.8\n")
    assert rendered_docs.results(["r.csv"], ctx).splitlines() == [
        "| benchmark | figure | date | commit | machine | command | load |", "|---|---|---|---|---|---|---|",
        "| `bench x` | 1.5× y, \\| z | 2026-11-29 13:01–14:02 | 0c9c19e | host | `dph-async bench x` | - |",
        "| b | 2× | 2026-11-27 | bf4ea29 to 7682f70+dirty | h | c | 1.0–1.8 |"]
    for row, says in [("b,,2026-11-27,abcdef0,h,c,", "line 2: no figure"),
                      ("b,f,2026-11-27,abcdef0,,,", "line 2: no machine, command"),
                      ("b,f,27 Nov,abcdef0,h,c,", "line 2: date '27 Nov' is not YYYY-MM-DD"),
                      ("b,f,2026-11-27,HEAD,h,c,", "line 2: commit 'HEAD' is not a hash"),
                      ("b,f,2026-11-27,abcdef0,h,c", "line 2: 6 fields, the header has 7"),
                      ('b,"f\ng",2026-11-27,abcdef0,h,c,', r"r\.csv, line 3: .*a line break in a table cell")]:
        (tmp_path / "r.csv").write_text(RESULTS_HEADER + "\n" + row + "\n")
        with pytest.raises(ValueError, match=says):
            rendered_docs.results(["r.csv"], ctx)
    for date in ("2026-13-45", "2026-11-29 99:99", "2026-11-29 10:00–25:61", "٢٠٢٦-١١-٢٩"):
        (tmp_path / "r.csv").write_text(RESULTS_HEADER + f"\nb,f,{date},abcdef0,h,c,\n", encoding="utf-8")
        with pytest.raises(ValueError, match="is not YYYY-MM-DD"):
            rendered_docs.results(["r.csv"], ctx)
    crlf = RESULTS_HEADER + "\r\nb,f,2026-11-27,abcdef0,h,c, \r\n"  # with a byte-order mark, a blank load
    (tmp_path / "r.csv").write_bytes(b"\xef\xbb\xbf" + crlf.encode())
    assert rendered_docs.results(["r.csv"], ctx).splitlines()[-1] == "| b | f | 2026-11-27 | abcdef0 | h | c | - |"
    (tmp_path / "r.csv").write_text(RESULTS_HEADER + "\nb," + "f" * 200_000 + ",2026-11-27,abcdef0,h,c,\n")
    with pytest.raises(ValueError, match=r"^r\.csv: not a CSV file of UTF-8 text \(field larger"):
        rendered_docs.results(["r.csv"], ctx)
    (tmp_path / "r.csv").write_bytes((RESULTS_HEADER + "\nb,\xe9,2026-11-27,abcdef0,h,c,\n").encode("latin-1"))
    with pytest.raises(ValueError, match=r"^r\.csv: not a CSV file of UTF-8 text"):
        rendered_docs.results(["r.csv"], ctx)
    (tmp_path / "r.csv").write_text(RESULTS_HEADER + '\nb,f,2026-11-27,abcdef0,"h\n\ni",c,\n')
    with pytest.raises(ValueError, match=r"^r\.csv, line 4: .*a line break"):  # the file's line the record ends on
        rendered_docs.results(["r.csv"], ctx)
    for field, value in (("date", "2" * 60), ("commit", "z" * 60)):  # a long value cut at 40 characters
        row = {"date": "2026-11-27", "commit": "abcdef0", field: value}
        (tmp_path / "r.csv").write_text(RESULTS_HEADER + f"\nb,f,{row['date']},{row['commit']},h,c,\n")
        with pytest.raises(ValueError, match=f"line 2: {field} '{value[:40]}' is not"):
            rendered_docs.results(["r.csv"], ctx)
    (tmp_path / "r.csv").write_text("")
    with pytest.raises(ValueError, match=r"^r\.csv: columns none; want benchmark, figure"):
        rendered_docs.results(["r.csv"], ctx)
    (tmp_path / "r.csv").write_text(RESULTS_HEADER + "\n")
    with pytest.raises(ValueError, match=r"^r\.csv: no result$"):
        rendered_docs.results(["r.csv"], ctx)
    (tmp_path / "r.csv").write_text("benchmark,figure\nb,f\n")
    with pytest.raises(ValueError, match=r"^r\.csv: columns benchmark, figure; want benchmark, figure, date"):
        rendered_docs.results(["r.csv"], ctx)
    with pytest.raises(ValueError, match=r"results CSV: 1 argument\(s\), got 2"):
        rendered_docs.results(["r.csv", "x"], ctx)


def test_cells_lists_each_cells_columns_as_recorded(tmp_path):
    m = {"in_domain/pass@1": 0.5, "in_domain/pass@16": 0.25, "ood/pass@1": 0.125, "ood/pass@16": 1.0}
    name = _seeds(tmp_path, [(BASE, 0, m), ("eta16", 0, {**m, "ood/pass@16": ""}), ("eta8", 1, m)])
    ctx = Context(tmp_path, tmp_path / "a.md", write=False)
    table = rendered_docs.cells([name, "in_domain/pass@16", "ood/pass@16"], ctx).splitlines()
    assert table == ["| cell | commit | date | in_domain/pass@16 | ood/pass@16 |", "|---|---|---|---|---|",
                     "| eta16-0 |  |  | 0.25 |  |", "| eta8-1 |  |  | 0.25 | 1 |"]
    with pytest.raises(ValueError, match=r"^seeds\.csv: no cell has nope, none$"):
        rendered_docs.cells([name, "nope", "none"], ctx)
    with pytest.raises(ValueError, match=r"give a file and at least one column, got 1 argument"):
        rendered_docs.cells([name], ctx)
    with pytest.raises(ValueError, match=r"^seeds\.csv: no cell$"):
        rendered_docs.cells([_seeds(tmp_path, [(BASE, 0, m)]), "ood/pass@1"], ctx)


def test_confirm_staleness_renders_design_2_from_each_tasks_sweep():
    from dph_async.tools.ablate import confirm_staleness
    from dph_async.tools.ablate.seeds import read_seeds

    data = "docs/data/staleness/embedded.csv"
    ctx = Context(ROOT, ROOT / "docs" / "a.md", write=False)
    text = rendered_docs.confirm_staleness_tables(["embedded", data], ctx)
    assert text == confirm_staleness.markdown({"embedded": read_seeds(ROOT / data)})
    assert "| embedded | decoupled | 16 | yes |" in text and "- **embedded**: S1 " in text
    with pytest.raises(ValueError, match=r"^confirm-staleness: give TASK CSV per task, got 3 argument"):
        rendered_docs.confirm_staleness_tables(["embedded", data, "digit_sets"], ctx)
    with pytest.raises(ValueError, match=r"^confirm-staleness: a task given twice \(embedded, embedded\)"):
        rendered_docs.confirm_staleness_tables(["embedded", data, "embedded", data], ctx)
    with pytest.raises(ValueError, match=r"digit_sets, cell .*: task embedded"):  # the rows are another task's
        rendered_docs.confirm_staleness_tables(["digit_sets", data], ctx)
    with pytest.raises(ValueError, match=r"cell .*: learner.mini_batches=1; the design runs 4"):
        rendered_docs.confirm_staleness_tables(["mini_batches=4", "embedded", data], ctx)
    for bad in ("0", "x", "-1", "", "04", "٤", "²"):
        with pytest.raises(ValueError, match=f"confirm-staleness: mini_batches='{bad}' is not a whole number"):
            rendered_docs.confirm_staleness_tables([f"mini_batches={bad}", "embedded", data], ctx)
    assert rendered_docs.confirm_staleness_tables(["mini_batches=1", "embedded", data], ctx) == text


def test_confirm_forgetting_renders_design_3_from_each_tasks_sweep():
    from dph_async.tools.ablate import confirm_forgetting
    from dph_async.tools.ablate.seeds import read_seeds

    data = {t: f"docs/data/forgetting/{t}.csv" for t in ("embedded", "digit_sets")}
    ctx = Context(ROOT, ROOT / "docs" / "a.md", write=False)
    text = rendered_docs.confirm_forgetting_tables([x for t, d in data.items() for x in (t, d)], ctx)
    assert text == confirm_forgetting.markdown({t: read_seeds(ROOT / d) for t, d in data.items()})
    assert "| digit_sets | 3 | R − G |" in text and "- **embedded**: F " in text
    with pytest.raises(ValueError, match="confirm-forgetting: give TASK CSV per task, got 1 argument"):
        rendered_docs.confirm_forgetting_tables(["embedded"], ctx)
    with pytest.raises(ValueError, match=r"confirm-forgetting: a task given twice"):
        rendered_docs.confirm_forgetting_tables(["embedded", data["embedded"]] * 2, ctx)
    with pytest.raises(ValueError, match=r"digit_sets, cell .*: task embedded"):  # the rows are another task's
        rendered_docs.confirm_forgetting_tables(["digit_sets", data["embedded"]], ctx)
