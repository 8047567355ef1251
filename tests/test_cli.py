"""The command line as users type it: options and KEY=VALUE overrides in any order, in every command
that takes overrides, and every user error as one `error:` line with exit status 2, no traceback."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import stub_model_dir

from dph_async.cli import commands
from dph_async.cli.commands import COMMANDS, command_module
from dph_async.cli.main import build_parser, main
from dph_async.tasks.dataset import verl_row, write_rows

A, B = "learner.lr=1e-4", "task.test_data.dev=dev.parquet"


@pytest.mark.parametrize(("argv", "expected"), [
    # The line: an option between two overrides.
    (["run", "--model", "M", "--data", "D", B, "--preset", "grpo", A],
     {"model": "M", "data": "D", "preset": "grpo"}),
    (["run", A, "--compare", "grpo,forward", B, "-o", "out"], {"compare": "grpo,forward", "output": "out"}),
    (["config", A, "--preset", "forward", B], {"preset": "forward"}),
    (["config", "--config", "forward", A, B], {"preset": "forward"}),
    # List options would otherwise swallow the overrides after them.
    (["ablate", "staleness", "--etas", "0", "4", A, "--seeds", "1", "2", B],
     {"etas": [0, 4], "seeds": [1, 2]}),
    (["ablate", "divergence", A, "--modes", "grpo", "forward", B, "--coeffs", "0.1"],
     {"modes": ["grpo", "forward"], "coeffs": [0.1]}),
    (["bench", A, "--steps", "20", B], {"steps": 20}),
    (["bench", "--set", A, "--out", "o", B], {"output": Path("o")}),
    (["bench", "peer", A, "--systems", "loop", B, "--steps", "9"], {"systems": ["loop"], "steps": 9}),
    (["score", A, "responses.jsonl", B, "--out", "r.jsonl"],
     {"file": Path("responses.jsonl"), "output": Path("r.jsonl")}),
    (["serve", "replay", A, "--no-wal", B], {"no_wal": True}),
    (["serve", "scorer", "--port", "0", A, B, "--insecure"], {"port": 0, "insecure": True}),
    (["soak", A, "--minutes", "2", B], {"minutes": 2.0}),
    # An option's value that looks like an override stays the option's value.
    (["eval", A, "--data", "dev=dev.parquet", "--model", "m", B], {"data": ["dev=dev.parquet"], "model": "m"}),
    (["presample", "--model", "m", A, "--data", "d", "-o", "x", B], {"model": "m", "data": "d", "output": "x"}),
])
def test_options_and_overrides_in_any_order(argv, expected):
    args = build_parser().parse_args(argv)
    assert args.overrides == [t for t in argv if t in (A, B)]  # in the order given: the last one wins
    assert {k: getattr(args, k) for k in expected} == expected


# Every command that writes somewhere, with what else it needs to parse, and whether it took --out
# before -o/--output was its one spelling (those keep --out working, unlisted).
OUTPUT_COMMANDS = [
    (["run"], False), (["presample", "--model", "m", "--data", "d"], False),
    (["eval", "--model", "m", "--data", "d"], False), (["soak"], False),
    (["bench"], True), (["bench", "peer"], True), (["bench", "weights"], True), (["bench", "gemm"], True),
    (["bench", "kernels"], True), (["bench", "transport"], True), (["bench", "scorer"], True),
    (["analyze", "b", "t"], True), (["recover", "b", "t"], True), (["ablate", "staleness"], True),
    (["ablate", "divergence"], True), (["ablate", "samplers"], True), (["simulate", "samplers"], True),
    (["score", "responses.jsonl"], True),
]


@pytest.mark.parametrize(("command", "took_out"), OUTPUT_COMMANDS, ids=[" ".join(c[:2]) for c, _ in OUTPUT_COMMANDS])
def test_every_command_writes_where_o_or_output_says(command, took_out, capsys):
    for option in ("-o", "--output", *(["--out"] if took_out else [])):
        args = build_parser([*command, option, "x"]).parse_args([*command, option, "x"])
        assert str(args.output) == "x", (command, option)
    with pytest.raises(SystemExit):
        build_parser([*command, "--help"]).parse_args([*command, "--help"])
    usage = capsys.readouterr().out
    assert "-o OUTPUT, --output OUTPUT" in usage and "--out " not in usage  # --output is the one documented


def test_soak_writes_into_its_output_directory():
    args = build_parser(["soak"]).parse_args(["soak", "-o", "runs/s", "--minutes", "1"])
    assert args.output == "runs/s" and args.minutes == 1.0


def test_a_stray_word_reaches_the_config_and_is_named():
    # Not an override and no option's value: load_config names it rather than argparse losing it.
    args = build_parser().parse_args(["config", A, "learner.steps", "--preset", "grpo"])
    assert args.overrides == [A, "learner.steps"]


def _one_error_line(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.out + captured.err
    return lines[0]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    stub_model_dir(tmp_path / "model")  # passes the checks before start
    (tmp_path / "corrupt.parquet").write_bytes(b"PAR1 this is no parquet file")
    write_rows([verl_row("q", "no_such_reward_xyz", "a", 0, "train")], tmp_path / "unscored.parquet")
    write_rows([verl_row("q", "countdown", {"target": 3, "numbers": [1, 2]}, 0, "train")], tmp_path / "ok.parquet")
    (tmp_path / "responses.jsonl").write_text(json.dumps(
        {"data_source": "countdown", "response": "<answer>1+2</answer>", "reward_model": {"ground_truth": {
            "target": 3, "numbers": [1, 2]}}}) + "\n")
    return {p.stem: p for p in tmp_path.iterdir()}


@pytest.mark.parametrize(("argv", "names"), [
    (["config", "learner.stepz=3"], ["learner.stepz", "unknown key"]),
    (["config", "learner.steps=many"], ["learner.steps", "'many'"]),
    (["config", "learner.lr=[1"], ["learner.lr=[1"]),
    (["config", "learner.steps"], ["'learner.steps'", "key=value"]),
    (["config", "--preset", "{tmp}/none.yaml"], ["none.yaml", "not found"]),
    (["run", "--model", "{model}", "--data", "{tmp}/none.parquet"], ["task.data", "none.parquet", "no such file"]),
    (["run", "--model", "{tmp}", "--data", "{ok}"], ["model.path", "not a Hugging Face model directory"]),
    (["run", "--model", "{model}", "--data", "{ok}", "task.test_data.dev={corrupt}"],
     ["task.test_data.dev", "corrupt.parquet", "not a readable parquet file"]),
    (["run", "--data", "{corrupt}", "--model", "{model}"], ["task.data", "corrupt.parquet", "not a readable parquet"]),
    (["run", "--model", "{model}", "--data", "{unscored}"], ["task.data", "unscored.parquet", "no_such_reward_xyz"]),
    (["eval", "--model", "{model}", "--data", "{corrupt}"], ["--data", "corrupt.parquet", "not a readable parquet"]),
    (["presample", "--model", "{model}", "--data", "{corrupt}", "-o", "{tmp}/x"], ["--data", "corrupt.parquet"]),
    (["score", "{corrupt}"], ["corrupt.parquet", "not a readable parquet file"]),
    (["score", "{tmp}/none.jsonl"], ["none.jsonl", "no such file"]),
    (["score", "{responses}", "rewards.plugins=[{tmp}/none.py]"], ["rewards.plugins", "none.py", "no such file"]),
    (["ablate", "staleness", "--seeds", "0", "replay.max_staleness=-1"], ["replay.max_staleness"]),
    (["rerun", "{tmp}"], ["{tmp}", "no recorded RL run there"]),
    (["rerun", "{tmp}", "replay.max_staleness=2"], ["replay.max_staleness=2", "changes only the learner"]),
    (["soak", "sampling.n=x"], ["sampling.n"]),
    (["serve", "replay", "net.hots=1"], ["net.hots", "unknown key"]),
    (["serve", "scorer", "rewards.workers=0"], ["rewards.workers"]),
    (["serve", "scorer", "--port", "70000"], ["--port 70000", "0-65535"]),  # was socket's OverflowError
    (["bench", "learner.steps=3", "--skip", "5"], ["learner.steps (3) must be more than --skip (5)"]),
])
def test_a_user_error_is_one_line_naming_what_is_wrong(argv, names, files, tmp_path, capsys):
    fill = {"tmp": str(tmp_path), **{k: str(v) for k, v in files.items()}}
    line = _one_error_line([a.format(**fill) for a in argv], capsys)
    for name in names:
        assert name.format(**fill) in line


def test_no_traceback_from_the_installed_command(files):
    # The process as a user starts it: the corrupt parquet of the issue, given to --data.
    proc = subprocess.run([sys.executable, "-m", "dph_async.cli.main", "eval", "--model", str(files["model"]),
                           "--data", str(files["corrupt"])], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: --data corrupt: ") and "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv", [["serve", "scorer"], ["serve", "replay"], ["config", "--list"], ["status"]])
def test_a_command_line_loads_only_its_own_commands_options(argv):
    """A service started from the command line carries no torch: other commands' options (samplers,
    peers, objectives) are built only when those commands are named."""
    code = (f"import sys; from dph_async.cli.main import build_parser; build_parser({argv!r}).parse_args({argv!r}); "
            "print(sorted(m for m in ('torch', 'vllm', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_the_table_of_commands_lists_exactly_the_command_modules():
    """Adding a command module without its line in COMMANDS (or a line without its module) fails here."""
    modules = {m.name for m in pkgutil.iter_modules(commands.__path__)} - {"common"}
    assert {name.replace(" ", "_") for name in COMMANDS} == modules
    for name in COMMANDS:
        mod = command_module(name)
        assert callable(mod.add_arguments) and callable(mod.main) and mod.DESCRIPTION.strip(), name
        # The help line lives in the table only.
        assert not hasattr(mod, "HELP") and not hasattr(mod, "NAME"), name


def test_the_top_level_help_imports_no_command():
    code = ("import sys; from dph_async.cli.main import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.startswith('dph_async.cli.commands.')), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stderr.strip() == "['dph_async.cli.commands.common']"
    listed = {line.split()[0] for line in out.stdout.splitlines() if line.startswith("    ")}
    assert {name.split()[0] for name in COMMANDS} <= listed


def test_a_staleness_sweep_takes_auto_beside_integer_etas():
    from dph_async.cli.main import build_parser
    from dph_async.tools.ablate.cells import staleness_sweep

    argv = ["ablate", "staleness", "--etas", "0", "auto", "--corrections", "decoupled", "--seeds", "0"]
    args = build_parser(argv).parse_args(argv)
    assert args.etas == [0, "auto"]
    sweep = staleness_sweep(args.etas, args.corrections, args.seeds, "js_low_var")
    assert [(c.key, c.overrides[0]) for c in sweep.cells] == [
        ("eta0-decoupled-seed0", "replay.max_staleness=0"), ("etaauto-decoupled-seed0", "replay.max_staleness=auto")]
    # Seed-major: one seed's cells, the pairs of a paired comparison, run side by side in time.
    grid = staleness_sweep([0, 4], ["behavior", "decoupled"], [1, 2], "grpo")
    assert [c.key for c in grid.cells] == [f"eta{e}-{c}-seed{s}" for s in (1, 2) for c in ("behavior", "decoupled")
                                           for e in (0, 4)]
