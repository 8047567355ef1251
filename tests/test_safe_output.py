"""Outputs written into a run directory that may be a stranger's: no symlink on the way is followed, no
link in place of an output file is written through (dph_async/safe_files.py, `dph-async rerun`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dph_async.cli.main import main as cli
from dph_async.learner.recording import RUN_INFO
from dph_async.safe_files import UnsafeFile, open_output, output_dir, write_output


def test_an_output_file_is_written_from_its_start_and_a_link_there_is_refused_untouched(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    write_output(out / "report.md", "a long first report")
    write_output(out / "report.md", "second")
    assert (out / "report.md").read_text() == "second"
    (out / "soft").symlink_to(victim)
    os.link(victim, out / "hard")
    os.mkfifo(out / "fifo")
    for name, says in (("soft", "a symbolic link"), ("hard", "a hard link to another file"), ("fifo", "a FIFO")):
        with pytest.raises(UnsafeFile, match=f"^{out / name}: {says}"):
            write_output(out / name, "overwritten")
    assert victim.read_text() == "precious"
    with open_output(out / "stream.jsonl") as f:
        f.write("{}\n")
    assert (out / "stream.jsonl").read_text() == "{}\n"


def test_an_output_directory_is_made_below_its_base_through_real_directories_only(tmp_path):
    run = tmp_path / "run"
    assert output_dir(run, run / "rerun" / "same").is_dir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "rl").mkdir()
    (run / "rl" / "rerun").symlink_to(elsewhere)
    with pytest.raises(UnsafeFile, match=f"^{run / 'rl' / 'rerun'}: a symbolic link, where an output directory"):
        output_dir(run, run / "rl" / "rerun" / "same")
    with pytest.raises(UnsafeFile, match="not inside"):
        output_dir(run, run / "rerun" / ".." / ".." / "elsewhere")
    assert not any(elsewhere.iterdir())


@pytest.mark.parametrize("where", ["rerun", "rerun/same"])
def test_rerun_refuses_a_symlinked_output_directory_in_the_run_before_it_starts(tmp_path, capsys, where):
    """Before: `rerun` followed RUN_DIR/rerun -> elsewhere and wrote its report, metrics and model there."""
    rl_dir = tmp_path / "run" / "rl" / "grpo"
    rl_dir.mkdir(parents=True)
    (rl_dir / RUN_INFO).write_text("{}")  # never read: the output is checked first
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (rl_dir / where).parent.mkdir(parents=True, exist_ok=True)
    (rl_dir / where).symlink_to(elsewhere)
    assert cli(["rerun", str(rl_dir)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {rl_dir / where}: a symbolic link, where an output directory belongs; not followed"]
    assert not any(elsewhere.iterdir())
    # -o inside the run is held to the same rule.
    assert cli(["rerun", str(rl_dir), "-o", str(rl_dir / "rerun" / "same" / "x")]) == 2
    assert not any(elsewhere.iterdir())


def test_output_dir_accepts_a_base_reached_through_a_link_of_the_users(tmp_path):
    """The way to the run is the user's (runs/ on a bigger disk); only below it is checked."""
    (tmp_path / "disk").mkdir()
    (tmp_path / "runs").symlink_to(tmp_path / "disk")
    assert output_dir(tmp_path / "runs", tmp_path / "runs" / "rerun" / "same") == tmp_path / "runs" / "rerun" / "same"
    assert (tmp_path / "disk" / "rerun" / "same").is_dir()
    assert Path(tmp_path / "runs").is_symlink()
