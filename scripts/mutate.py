"""Mutation testing of the boundary modules with mutmut: each module against its own fast tests.

    make mutate                                     every module of MODULES in turn
    make mutate MODULE=learner/guard.py             one module (several: comma-separated)
    make mutate MODULE=learner/guard.py BUDGET=600  seconds per module (default 1800)

Each module runs in a directory of its own, .mutate/<module>/ (git-ignored): a copy of the package
as it imports (dph_async/ with actors/, replay/, learner/ and kernels/ inside), links to tests/ and
docs/, and the repo's pyproject.toml with a [tool.mutmut] section for that module (mutmut reads its
settings from the pyproject.toml of the directory it runs in, and only there). mutmut copies the
package to mutants/ there, mutates the one module and keeps each mutant's verdict as it comes, so a
run stopped by its budget or by Ctrl-C goes on where it stopped the next time. When the module's
tests change, the mutants that survived them are tried again; `--fresh` starts the module anew.

A mutant is killed when a test fails or times out. The score is killed over tried; a survivor is
printed as file:line, the line before and after. A survivor named in EQUIVALENT (no test can tell
it from the original) is printed with the reason and scored apart: the score without them is the
one the 90% target applies to (docs/testing.md, Mutation testing).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".mutate"
MAPPED = ["actors", "replay", "learner", "kernels"]  # install as dph_async.<name> (pyproject.toml)

# Each boundary module and the fast tests that claim its behaviour (pytest arguments: files or node
# ids). Tests that start a trainer, vLLM or Ray stay out: mutmut runs a module's tests once per mutant.
MODULES: dict[str, list[str]] = {
    "replay/validation.py": ["tests/test_replay_validation.py", "tests/test_replay_edges.py"],
    "replay/store.py": ["tests/test_replay_store.py", "tests/test_replay_store_model.py", "tests/test_replay_budget.py",
                        "tests/test_replay_edges.py", "tests/test_replay_service.py",
                        # the one reader of an entry's newest version: a restore rewinds what is newer
                        "tests/test_replay_core_edges.py::test_a_restore_rewinds_every_group_with_a_token_newer_than_"
                        "the_snapshot_and_keeps_its_pending_batch"],
    "replay/staleness.py": ["tests/test_replay_staleness.py", "tests/test_replay_edges.py"],
    # The byte flips of a state file are replay/state.py's, and take seconds, which every mutant would repeat.
    "replay/wal.py": ["tests/test_replay_wal.py", "tests/test_replay_wal_manifest.py", "tests/test_replay_wal_edges.py",
                      "-k", "not no_byte_flip_in_a_state_file"],
    # The service's tests (sockets, processes) and the byte-flip sweeps (the log's) take seconds each; the
    # core's own tests claim what they check of it.
    "replay/core.py": ["tests/test_replay_core_edges.py", "tests/test_replay_staleness.py",
                       "tests/test_replay_edges.py", "tests/test_replay_quarantine.py",
                       "tests/test_replay_reference.py", "tests/test_replay_validation.py", "tests/test_replay_wal.py",
                       "-k", "not no_byte_flip and not over_sockets and not control_identity and not told_to_retry"],
    "learner/guard.py": ["tests/test_guard_rules.py",
                         "tests/test_learner_guard.py::test_screen_takes_out_exactly_the_unusable_records",
                         "tests/test_learner_guard.py::test_the_step_guard_counts_and_resets",
                         "tests/test_learner_guard.py::test_non_finite_weights_are_never_published"],
    "learner/staleness_control.py": [
        "tests/test_staleness_control.py",
        "tests/test_rerun.py::test_the_controller_doubles_until_a_window_is_unhealthy_then_halves_waits_and_adds_one",
        "tests/test_rerun.py::test_the_controller_raises_the_bound_only_while_the_learner_waits_for_data",
        "tests/test_rerun.py::test_the_controller_state_survives_a_checkpoint_within_the_limits"],
    "learner/recording.py": [
        "tests/test_recording.py",
        "tests/test_rerun.py::test_the_recording_reads_back_what_was_written_and_a_resume_keeps_the_steps_before_its_checkpoint",
        "tests/test_rerun.py::test_a_damaged_recording_is_refused_with_file_and_offset",
        "tests/test_rerun.py::test_a_checksummed_record_that_is_no_batch_is_refused"],
    "dph_async/pipeline/rerun.py": ["tests/test_rerun_edges.py",
                               "tests/test_rerun.py::test_a_metrics_line_cut_short_is_one_error_naming_file_and_line"],
    "dph_async/runtime/cpu_claims.py": ["tests/test_cpu_claims.py"],
    "dph_async/pipeline/warmstart.py": ["tests/test_warmstart.py"],
    # The app around a stand-in pool (the real pool's workers take seconds to start; the pool has its own tests).
    "dph_async/rewards/service.py": [
        "tests/test_scorer_edges.py",
        "tests/test_scorer_service.py::test_a_cancelled_upload_gives_its_reservation_back",
        "tests/test_scorer_service.py::test_bytes_are_taken_as_they_arrive_and_all_given_back",
        "tests/test_scorer_service.py::test_one_request_holds_at_most_as_much_as_it_leaves_free",
        "tests/test_scorer_service.py::test_settings_a_lone_largest_body_could_never_fit_are_refused"],
    "dph_async/rewards/result.py": ["tests/test_reward_result.py", "tests/test_rewards_registry.py"],
    "dph_async/protocol.py": ["tests/test_protocol_edges.py", "tests/test_protocol.py", "tests/test_protocol_fuzz.py"],
    # The pre-registered verdicts and the raw data they read (docs/preregistration.md).
    "dph_async/tools/ablate/confirm.py": ["tests/test_confirm.py", "tests/test_rendered_docs.py"],
    "dph_async/tools/ablate/confirm_staleness.py": ["tests/test_confirm_staleness.py"],
    "dph_async/tools/ablate/confirm_forgetting.py": ["tests/test_confirm_forgetting.py"],
    "dph_async/tools/ablate/seeds.py": ["tests/test_confirm.py", "tests/test_confirm_forgetting.py",
                                        "tests/test_confirm_staleness.py"],
    "dph_async/runtime/reuse.py": ["tests/test_reuse.py"],
    # The stride task's problems and reward: what every time-to-accuracy figure is measured on.
    "dph_async/tasks/stride.py": ["tests/test_task_stride.py"],
    # Time to target and the speed-up's interval: the headline of `bench tta`.
    "dph_async/tools/bench/tta_report.py": ["tests/test_bench_tta.py"],
    # bench scale's record and report: the grid's fast tests (its one real cell stays out), and the
    # docs' tables and figure rendered again from the committed grid
    **dict.fromkeys(("dph_async/tools/bench/scale.py", "dph_async/tools/bench/scale_data.py",
                     "dph_async/tools/bench/scale_report.py"),
                    [f"tests/test_bench_scale.py::{t}" for t in (
                        "test_the_grid_runs_size_by_size_and_keeps_a_steps_completion_tokens_near_the_budget",
                        "test_sizes_by_name_or_shape_with_heads_vllm_can_serve",
                        "test_projection_is_the_scaling_model_on_the_cells_costs_against_the_peers_best",
                        "test_a_cells_record_reads_back_and_one_with_other_work_is_refused",
                        "test_a_cell_of_repeats_keeps_medians_the_largest_peaks_and_the_paired_interval",
                        "test_report_and_plot_carry_every_cell",
                        "test_the_docs_table_puts_sizes_in_rows_and_lengths_in_columns_with_when_and_where",
                        "test_a_finished_cell_that_is_no_record_is_refused_by_name",
                        "test_a_grid_runs_only_the_cells_not_finished_and_refuses_one_recorded_with_other_work")]
                    + ["tests/test_rendered_docs.py::test_the_repositorys_docs_match_their_data"]),
    # The docs' tables rendered from their committed data (the docs themselves among the tests' inputs).
    "dph_async/tools/rendered_docs.py": ["tests/test_rendered_docs.py"],
}

# Survivors no test can kill, by module and the mutated line (stripped), with the reason. A key no
# longer matches once its line changes: the survivor is then shown unexplained until looked at again.
_NO_EXPLICIT_ETA = ("differs only for an explicit eta of 0 under a minimum above 0, which no caller makes: "
                    "the loop and rerun start at -1, a checkpoint's eta is clamped into the limits")
_LISTED_UNDER_THE_LOCK = ("the file was listed under the lock a moment before: only a process ignoring the "
                          "lock could remove it in between")
_WIRE_DEFAULTS = ("a recorded batch reached the learner through the replay client's decoder, under the "
                  "default limits (dph_async/replay_client.py): its record is within them, so they cannot bind")
_RECORD_LIMITS = "msg = decode(frames, Limits(max_bytes=len(payload), max_header_bytes=len(payload), max_frames=n,"
_FAST_PATH = ("the joined check is a fast path: a group it passes passes the check per completion, and one it "
              "fails is checked per completion after it; which groups take it changes only the time")
_LENGTHS_CHECKED = "the lengths were checked to agree just before: zip never meets lists of unequal length"
_ENVELOPE_TYPES = "the envelope is decoded typed (v an int, t a str): the other branch is never taken"
_SAME_BYTES = ("a TypeError there takes the copying path (np.ascontiguousarray), which sends the same bytes; a "
               "contiguous array reshaped by None (no change) or by -2 (numpy 2: the rest, as -1) casts to the same "
               "bytes")
_SERVE_COLUMNS = ("[record.request_id]", "[record.version]", "[[a for a, _ in record.group_ids]]",
                  "[[s for _, s in record.group_ids]]", "[record.reference_ids]",
                  "[[gid[0] for gid, _ in record.dropped]]", "[[gid[1] for gid, _ in record.dropped]]",
                  "[[reason for _, reason in record.dropped]]")
_PROTOCOL_KIND = ("parse_record keeps only str(e), the detail: the kind, a metrics category of the wire's decoder, "
                  "is never read")
_POSIX_NEWLINES = "written on POSIX, where text mode translates no newline: csv's own \\r\\n ends reach the file alike"
_UTF8_POSIX = ("the locale's encoding is UTF-8 on these machines (Python's UTF-8 mode in a C locale) and text mode "
               "writes a line break as \\n on POSIX: the same bytes")
_LAST_PART = "the part after the last '/' is the same however many splits are taken from the right"
_EXACT_EDGE = ("an interval's end (a mean plus or minus t times a standard error) or a geometric mean lands "
               "exactly on its threshold (0, -0.03, 0.9) with probability zero, and no test can put it there: "
               "t_critical and the square root round (an end built to be -0.03 comes out -0.0299999...)")
EQUIVALENT: dict[tuple[str, str], str] = {
    **{("dph_async/tools/bench/scale_data.py", f"return json.dumps(asdict(self), {arg})"):
        "the record's indentation: it reads back the same" for arg in ("indent=None", "", "indent=3")},
    ("dph_async/tools/bench/tta_report.py", "pyplot().close(None)"):
        "pyplot closes the current figure, which is the one `figure` just drew",
    **{("dph_async/pipeline/warmstart.py", f"return functools.cache(functools.partial(tok.encode, {arg}))"):
        "the embedded tokenizers have no template: encode adds no special token either way"
        for arg in ("", "add_special_tokens=True")},
    ("dph_async/pipeline/warmstart.py",
     "answer = _wrong_answer(p, rng) if rng.random() <= noise else rng.choice(p.solutions())"):
        "rng.random() equals the noise share with probability 2**-53 at most",
    ("dph_async/pipeline/warmstart.py", "opt = torch.optim.AdamW(model.parameters(), lr=ws.lr, )"):
        "torch's AdamW decays weights by 0.01 by default",
    ("dph_async/pipeline/warmstart.py", "loss = (nll * mask[:, 1:]).sum() / mask[:, 2:].sum()"):
        "the mask's first two positions are the prompt's (BOS and at least one token): counted by neither",
    **{("dph_async/pipeline/warmstart.py", f"torch.manual_seed(cfg.seed {d})"): (
        "nothing in the warm start draws from torch's generator: the model is built before, with its own "
        "seed, and has no dropout") for d in ("- 1", "+ 2")},
    **{("dph_async/pipeline/warmstart.py", f"opt.zero_grad(set_to_none={v})"):
        "the gradients are zeroed or dropped before each backward: the same step" for v in ("None", "False")},
    **{("dph_async/pipeline/warmstart.py", f"torch.set_num_threads(max({lo}, cfg.learner.threads {by}))"):
        "how many threads compute, not what: the same losses and weights to the tests' tolerance"
        for lo, by in (("2", "* 2"), ("1", "/ 2"), ("1", "* 3"))},
    **{("replay/staleness.py", line): (
        "a fast path: with no tickets of that basis, or no anonymous actor, the sum it skips is 0")
       for line in ("if coming or len(self.trusted) < len(self.in_flight):",
                    "if coming and len(self.trusted) <= len(self.in_flight):")},
    ("replay/staleness.py", "elif room <= self.groups_per_batch and (anonymous := self._anonymous_in_flight()):"):
        "at room == B the rule gives max(B, min(B, left) - held) = B: the room it had",
    **{("replay/wal.py", f"pa.array({column}, {t}),"):
       "RecordBatch.from_arrays casts each column to WAL_SCHEMA's type: an inferred int64, string or (empty list) "
       "null column is written as the same bytes" for column in _SERVE_COLUMNS for t in ("None", "")},
    ("replay/core.py", "if eta <= before:"):
        "a grace of the bound already in force: expiry takes the highest, and any later change to a lower bound "
        "adds a grace at least as high for at least as long",
    ("replay/core.py", '+ "XXXX".join(f"; {n}" for n in notes)'):
        "a restore has one note at most: the two come from the two branches of one if",
    ("replay/core.py", "def state(self, wal_segment: int = 1) -> ReplayState:"):
        "every caller passes the segment (_write_state)",
    **{("replay/core.py", f"for g, served in zip(state.groups, state.served, {strict}):"):
       "a state's groups and served counts are read from the rows of one table (replay/state.py): one length"
       for strict in ("strict=None", "", "strict=False")},
    **{("replay/wal.py", line): "only the first check of a log, in its constructor, finds the loss (it lowers the "
       "acknowledged bytes to the file's), and the counts are 0 before it"
       for line in ("self.damaged_records = 1", "self.skipped_bytes = acked - size")},
    **{("replay/wal.py", f'if isinstance(fields, dict) and "{k}" not in fields and set(fields) <= '
        '{"wal_id", "keep_from", "crc32"}:'): "fields within {wal_id, keep_from, crc32} hold no format field anyway"
       for k in ("XXformatXX", "FORMAT")},
    ("replay/wal.py", 'assert self._file is not None or self._ack_fd is not None, "WriteAheadLog.open() first"'):
        "the segment and wal.ack are opened (_next_segment) and closed (close) together: both or neither",
    **{("replay/wal.py", f"path.unlink(missing_ok={m})"):
       "every file dropped was named by the manifest until the rewrite just before, and checked there when the log "
       "opened; nothing else deletes a log's files" for m in ("None", "False")},
    **{("replay/wal.py", f"{field} = {v}"): "open() and _next_segment set it before anything reads it"
       for field in ("self._written", "self.bytes_since_base") for v in ("1", "None")},
    **{("replay/wal.py", f"self._crc = {v}  # of the segment being written, as the manifest will keep it"):
       "_next_segment sets it before anything reads it" for v in ("1", "None")},
    **{("replay/wal.py", f"self._ack = Ack(0, -1, {b}, self._boot, {d})"):
       "the bytes and durability of an acknowledgement of no segment are never read: only the live segment's are"
       for b, d in (("1", "fsync"), ("0", "None"))},
    ("replay/wal.py", "self._leftovers = None"):
        "read only in the branch that runs once, before wal.ack's descriptor is opened",
    ("replay/wal.py", "self._ack = Ack(0, -2, 0, self._boot, fsync)"):
        "no segment is numbered below 0: -1 and -2 both acknowledge none",
    ("replay/wal.py", "if size <= len(MAGIC):"):
        "8 bytes here are the magic (records() read the segment before and refused anything else): written again, "
        "the same bytes",
    ("replay/wal.py", "started = (m.live is None or n >= m.live) and path.stat().st_size <= len(MAGIC) and "
                      "MAGIC.startswith("):
        "the live segment of its magic or less, deleted as a leftover, is written again as its magic when it is "
        "sealed right after: the same sealed segment",
    ("replay/wal.py", 'self._file = ""'): "_next_segment, _seal's one caller, opens the next segment right after",
    ("replay/wal.py", "with open(path, ) as f:"):
        "the file is opened only to fsync its descriptor: text or binary alike",
    ("replay/wal.py", "while start <= size:"): "at start == size the window is empty: nothing found, the loop ends",
    ("replay/wal.py", "window = bytes(view[start : min(size, start + SEARCH_BYTES + len(_SYNC) + 1)])"):
        "a wider overlap finds a sync starting past the window's end one window early, where it would be the "
        "first found in the next window anyway: the same record",
    ("replay/wal.py", "at = window.find(_SYNC, at + 2)"):
        "a sync cannot start one byte after another (its second byte is not its first)",
    ("replay/wal.py", "self.truncated_bytes = size - damage.offset"):
        "one truncation per log at most: only recovery repairs, and only the live segment's last damage, with "
        "nothing sound after it, lies past its acknowledged end",
    ("replay/wal.py", "size = path.stat().st_size if path.exists() else 1"):
        "a missing file's 0 or 1 bytes are both below what was acknowledged, which counts the 8-byte magic, and "
        "below the magic that sealing writes whole",
    ("replay/wal.py", "if sealed is None and size < len(MAGIC) or MAGIC.startswith(bytes(view)):"):
        "bytes that begin the magic are fewer than 8, which only the live segment can be: a sealed one's length "
        "is checked against the manifest's, at least 8",
    ("replay/wal.py", "if sealed is None and size <= len(MAGIC) and MAGIC.startswith(bytes(view)):"):
        "8 bytes that begin the magic are the magic, which the check before has passed",
    ("replay/wal.py", '(n,) = struct.unpack_from("<I", payload, )'): "the offset's default is 0",
    **{("replay/wal.py", f'raise ProtocolError({k}, f"group record header: {{e}}") from None'): _PROTOCOL_KIND
       for k in ("None", '"XXframesXX"', '"FRAMES"')},
    **{("replay/wal.py", f'raise ProtocolError({k}, f"group record of {{len(payload)}} bytes holds {{at}}")'):
       _PROTOCOL_KIND for k in ("None", '"XXframesXX"', '"FRAMES"')},
    ("replay/wal.py", "for at in range(0, len(data) - _SLOT + 2, _SLOT) if len(data) == 2 * _SLOT else ():"):
        "the file is two slots long there: the range starts 0 and _SLOT either way",
    **{("replay/store.py", f'if entry is not None and entry.place != "{p}":'):
       "claiming a pending group again moves it from pending to pending: the same counts and place"
       for p in ("XXpendingXX", "PENDING")},
    **{("replay/store.py", line): "push numbers only order a group's heap items: any increasing count does"
       for line in ("self._pushes += 2", "self._pushes = 1")},
    **{("replay/store.py", f"for c, start, end in zip(comps, starts.tolist(), ends.tolist(), {strict}):"):
       "starts and ends are made from the completions' own lengths: the three always have one length"
       for strict in ("strict=None", "", "strict=False")},
    **{("replay/validation.py", line): _FAST_PATH for line in (
        "if len(comps) > 1 or group.num_tokens <= SMALL_GROUP_TOKENS:",
        "if len(comps) >= 1 and group.num_tokens <= SMALL_GROUP_TOKENS:",
        "if len(comps) > 2 and group.num_tokens <= SMALL_GROUP_TOKENS:",
        "if len(comps) > 1 and group.num_tokens < SMALL_GROUP_TOKENS:")},
    **{("learner/recording.py", f'(rl_dir / RUN_INFO).write_text(json.dumps(info, {indent}) + "\\n")'):
       "the description's indentation: it reads back the same" for indent in ("indent=None", "", "indent=2")},
    ("learner/recording.py", "(n,) = _COUNT.unpack_from(payload, )"): "the offset's default is 0",
    ("learner/recording.py", _RECORD_LIMITS.replace("max_bytes=len(payload), ", "")): _WIRE_DEFAULTS,
    ("learner/recording.py", _RECORD_LIMITS.replace("max_header_bytes=len(payload), ", "")): _WIRE_DEFAULTS,
    ("learner/recording.py", _RECORD_LIMITS.replace(" max_frames=n,", "") + " accept=frozenset({Batch})))"):
        _WIRE_DEFAULTS,
    ("learner/recording.py", "log.warning(e)"): "logging formats a message only when given arguments: the same text",
    **{("learner/recording.py", f'self._file = path.open("ab", {b})'):
       "every write is an os.writev on the descriptor, never through the file object's buffer"
       for b in ("", "buffering=1")},
    ("learner/staleness_control.py", "if self.eta <= 0:"): _NO_EXPLICIT_ETA,
    ("learner/staleness_control.py", "if self.eta < 1:"): _NO_EXPLICIT_ETA,
    ("learner/staleness_control.py", 'bool(state.get("slow_start", None)), int(state.get("hold", 0)))'):
        "bool(None) is bool(False)",
    ("learner/staleness_control.py", 'bool(state.get("slow_start", )), int(state.get("hold", 0)))'):
        "get without a default gives None, and bool(None) is bool(False)",
    **{("dph_async/rewards/result.py", 'if type(x).__module__ == "numpy" and type(x).__name__ in ("bool", '
                                       f'"{name}"):  # np.bool_ (numpy 1 and 2)'):
       "numpy 1's name for its bool type; numpy 2 (what the tests run on) names it bool: only a numpy 1 install "
       "tells them apart" for name in ("XXbool_XX", "BOOL_")},
    **{("dph_async/protocol.py", line): _LENGTHS_CHECKED for line in [
        *(f"tags = [(tag, shape) for b in self.buckets for tag, shape in zip(b.dtypes, b.shapes, {s})]"
          for s in ("strict=None", "", "strict=False")),
        *(f"for i, (offset, (tag, shape)) in enumerate(zip(shm.offsets, tags, {s})):"
          for s in ("strict=None", "", "strict=False")),
        *(f"for name, tag, array in zip(self.names, self.tensor_dtypes, self.arrays, {s}):"
          for s in ("strict=None", "", "strict=False"))]},
    ("dph_async/protocol.py", 'return repr(value)[:40] if (isinstance(value, (int, str))) or True else '
                              'f"a {type(value).__name__}"'): _ENVELOPE_TYPES,
    ("dph_async/protocol.py", 'return repr(value)[:40] if isinstance(value, (int, str)) else '
                              'f"a {type(None).__name__}"'): _ENVELOPE_TYPES,
    **{("dph_async/protocol.py", line): _SAME_BYTES for line in (
        'view = memoryview(obj).cast(None)', 'view = memoryview(None).cast("B")',
        'view = memoryview(np.ascontiguousarray(obj).reshape(None)).cast("B")',
        'view = memoryview(np.ascontiguousarray(obj).reshape(-2)).cast("B")')},
    ("dph_async/protocol.py", 'return memoryview(getattr(frame, "buffer", frame)).cast("b")'):
        "msgspec and np.frombuffer read a buffer's bytes whatever its item format: a view of signed bytes gives "
        "the same header and arrays, and a strided one is refused by cast alike",
    ("dph_async/protocol.py", "used[i] = 2"): "the marks are only tested for truth: 2 is as true as 1",
    ("dph_async/protocol.py", "count = shape[0] if (len(shape) == 1) and False else math.prod(shape)"):
        "the product of one dimension is that dimension: the 1-d branch is a fast path",
    ("dph_async/protocol.py", '_frames.out = ""'):
        "nothing reads the frames out between encodes: each encode sets them before the encoder runs",
    **{("dph_async/protocol.py", f"raise _fail({args})"):
       "outside decoding nobody reads the kind and field set aside, and the next decode resets them"
       for args in ('None, name, "an array descriptor outside decoding"',
                    'name, "an array descriptor outside decoding"',
                    '"array", None, "an array descriptor outside decoding"',
                    '"array", "an array descriptor outside decoding"',
                    '"XXarrayXX", name, "an array descriptor outside decoding"',
                    '"ARRAY", name, "an array descriptor outside decoding"')},
    ("dph_async/protocol.py", 'if name is None or obj.dtype.byteorder == ">":'):
        "a dtype the protocol names is never big-endian, and one it does not name stays unnamed in little-endian "
        "order: the same refusal",
    ("dph_async/protocol.py", 'return detail, cls.__name__ + path.rstrip("XX`XX")[1:]'):
        "msgspec's path ends in a field name (lower case) or ']': never in an X",
    **{("dph_async/pipeline/rerun.py", f"shutil.rmtree(fresh, {arg})"):
       "the directory was made by mkdtemp just before and only the trainer's save wrote in it: removing it "
       "does not fail, so there is no error to ignore" for arg in ("ignore_errors=None", "", "ignore_errors=False")},
    ("dph_async/rewards/service.py", 'declared = request.headers.get("CONTENT-LENGTH", "")'):
        "Starlette's request headers are looked up case-insensitively",
    ("dph_async/rewards/service.py", 'declared = request.headers.get("content-length", "XXXX")'):
        "without a Content-Length the default is only tested for digits: neither \"\" nor \"XXXX\" is a number",
    **{("dph_async/pipeline/rerun.py", "d = (o.double() - t.double()) if o.shape == t.shape else "
                                  f"torch.full({shape}, math.inf, {dtype})"):
       "a tensor of +inf, of any length or float dtype, makes the distance and the largest difference +inf"
       for shape, dtype in (("(1,)", "dtype=None"), ("(1,)", ""), ("(2,)", "dtype=torch.float64"))},
    **{("dph_async/pipeline/rerun.py", f"self.report = RerunReport(str(rl_dir), str(out), overrides, counterfactual, "
                                  f"start, start, {stopped})"):
       "run() says why it stopped before anything reads it" for stopped in ("None", '"XXXX"')},
    **{("dph_async/pipeline/rerun.py", f'write_output(self.out / f"diagnose_v{{diagnose}}.json", '
                                  f"json.dumps(asdict(found), {indent}))"):
       "the diagnosis's indentation: it reads back the same" for indent in ("indent=None", "", "indent=2")},
    ("dph_async/runtime/cpu_claims.py", "path.unlink(missing_ok=None)"): _LISTED_UNDER_THE_LOCK,
    ("dph_async/runtime/cpu_claims.py", "path.unlink(missing_ok=False)"): _LISTED_UNDER_THE_LOCK,
    ("dph_async/runtime/cpu_claims.py",
     "claim = Claim(uuid.uuid4().hex, me, start_time(me) or 1, sorted(used(plan)), _command(me))"):
        "the running process's own start time is never None: its /proc entry exists while it runs",
    **{("dph_async/tools/ablate/seeds.py", line): why for line, why in (
        ('with path.open("w", newline=None) as f:', _POSIX_NEWLINES), ('with path.open("w", ) as f:', _POSIX_NEWLINES),
        ('with path.open(newline="", encoding="UTF-8-SIG") as f:', "the codec's name is case-blind: the same codec"),
        *((f"h.update(data.read({n}))", "after seeking to a MiB before the end, a read of a MiB or more reads the "
           "same bytes, to the end") for n in ("None", "3**20", "2**21")),
        ('name = column.rsplit("/", )[-1]', _LAST_PART), ('name = column.rsplit("/", 2)[-1]', _LAST_PART),
        *((f"r = dict(zip(header, values, {s}))", "the lengths were checked to agree on the line before")
          for s in ("strict=None", "", "strict=False")))},
    **{("dph_async/tools/ablate/confirm.py", line): why for line, why in (
        ("if not bases[1] or bases[0] != bases[1] or len(prints) != 1 or not next(iter(prints)):",
         "pi_0's rows must be equal: one missing while the other is not fails the next clause"),
        ("if self.diff.se is None and self.diff.df is None:",
         "a test's difference comes from `paired`, whose standard error and df are None together"),
        ("if not t[2].complete:", "`complete` is the task's, the same on its five tests"),
        *((line, "a rejected test has p <= 0.005, so its difference is never 0") for line in (
            "h1 = t[1].rejected and t[1].diff.delta >= 0 and bound_holds(t[2])",
            "if t[4].rejected and t[4].diff.delta >= 0:",
            "elif t[3].rejected and t[3].diff.delta >= 0 and not t[4].rejected:",
            'reading = ("above" if t.diff.delta >= 0 else "below") if t.rejected else "level"')),
        ('else ("above" if f.gap.delta >= 0 else "below") if f.rejected else "level")',
         "a gap of 0 has p = 1 (s.e. 0) or t = 0: never rejected"),
        ("return (stat(list(p1.values())), stat(list(p16.values()))) if p1 or p16 else None",
         "arm_values refuses a row without either column, so both are empty or neither is"),
        *((line, "p = 2 and p = 1 both sort after every real p and are never rejected") for line in (
            "rejected = holm([t.holm_p for t in tests] + [2.0] * (FAMILY_SIZE - len(tests)))",
            "rejected = holm([2.0 if f.gap is None or f.gap.p is None else f.gap.p for f in found])")),
        *((f"return [replace(t, rejected=r) for t, r in zip(tests, rejected, {s})]",
           "zip's default is strict=False") for s in ("strict=None", "")),
        *((f"return [replace(f, rejected=r) for f, r in zip(found, rejected, {s})]",
           "Holm returns one decision per p it was given: the lengths agree") for s in ("strict=None", "",
                                                                                      "strict=False")))},
    **{("dph_async/tools/rendered_docs.py", line): why for line, why in (
        *((f"with ctx.path({p}).open({a}) as f:", "a CSV's line breaks in quoted fields are refused either way; "
           "the codec's name is case-blind") for p in ("path", "name") for a in (
            'newline=None, encoding="utf-8-sig"', 'encoding="utf-8-sig"', 'newline="", encoding="UTF-8-SIG"')),
        *((f"r = {{k: v.strip() for k, v in zip(header, values, {a})}}", "the lengths were checked to agree just "
           "before") for a in ("strict=None", "", "strict=False")),
        ('length, kind = struct.unpack(">i4s", header)', "a PNG chunk's length is below 2**31 (the format's bound)"),
        ('return value.decode("LATIN-1")', "the codec's name is case-blind"),
        *((f"parts += [(t.get_text(), tuple(round(v, {n}) for v in getattr(t, \"xy\", t.get_position()))) "
           "for t in ax.texts]", "the annotated points are means of a few shares: the 10th decimal is float noise")
          for n in ("10",)),
        *((f"parts += [(t.get_text(), tuple(round(v, 9) for v in getattr(t, \"xy\"{d}))) for t in ax.texts]",
           "every text of the figure is an annotation, which has its point") for d in (", None", ", ")),
        ('parts += [[t.get_text() for t in legend.get_texts()] if (legend) or True else []]',
         "every panel of the figure has a legend"),
        ("confirm_plot.pyplot().close(None)", "pyplot closes the current figure, which is the one just drawn"),
        ('elif png.exists() and not (have or "XXXX").startswith(SOURCE):', '"" and "XXXX" both fail the prefix'),
        *((f"draft = png.with_name(png.name + {n})", "any name beside the figure serves; it is moved over it")
          for n in ('"XX.draftXX"', '".DRAFT"')),
        ('raise ValueError(f"line {text.count(chr(10), None, m.start()) + 1}: a carriage return that ends no line "',
         "count's start None is 0"),
        *((f'body = RENDERERS[kind](args, ctx).{f} + "\\n"', "no renderer's output starts or ends with a line "
           "break, a space or an X") for f in ('rstrip(None)', 'lstrip("\\n")', 'rstrip("XX\\nXX")')),
        *((f"with doc.open({a}) as f:  # line ends kept as they are", _UTF8_POSIX)
          for a in ('encoding=None, newline=""', 'newline=""', 'encoding="UTF-8", newline=""')),
        *((f"with doc.open({a}) as f:", _UTF8_POSIX) for a in (
            '"w", encoding=None, newline=""', '"w", encoding="utf-8", newline=None', '"w", newline=""',
            '"w", encoding="utf-8", ', '"w", encoding="UTF-8", newline=""')),
        *((f"draft.unlink(missing_ok={v})", "every draft in the list was written a moment before")
          for v in ("None", "False")))},
    **{("dph_async/tools/ablate/confirm_staleness.py", line): _EXACT_EDGE for line in (
        "if high <= 0 and low <= -MARGIN:", "if high < 0 and low < -MARGIN:", "elif low >= -MARGIN:",
        "ok = accuracy.low >= -MARGIN and ratio.ratio >= AUTO_RATIO",
        "ok = accuracy.low > -MARGIN and ratio.ratio > AUTO_RATIO")},
}

DETECTED = {"killed", "timeout", "segfault", "caught by type check"}
PENDING = {"not checked", "check was interrupted by user"}


@dataclass(frozen=True)
class Survivor:
    name: str
    status: str
    line: int
    before: str
    after: str
    why: str | None  # the reason it is equivalent; None: a test should kill it


def slug(module: str) -> str:
    return module.removesuffix(".py").replace("/", ".")


def tests_of(selection: list[str]) -> list[Path]:
    """The test files a selection runs, and the conftest they share."""
    files = {ROOT / a.split("::")[0] for a in selection if a.startswith("tests/")}
    return sorted(files | {ROOT / "tests" / "conftest.py"})


def digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()


def staged(module: str) -> str:
    """A module's path as it imports: the design card's directories install inside dph_async/."""
    return module if module.startswith("dph_async/") else f"dph_async/{module}"


def prepare(module: str, fresh: bool) -> Path:
    """The module's directory: the package as it imports (dph_async/ with the design card's directories
    inside it, copied: mutmut names a mutant by its file's path and its trampoline by the module's
    __name__, and walks no linked folder), links to the tests and docs (tests read the docs' data), and
    its mutmut settings."""
    work = WORK / slug(module)
    if fresh and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    for name in [*MAPPED, "dph_async"]:  # the layout before one namespace: links beside dph_async/
        if (work / name).is_symlink():
            (work / name).unlink()
    stage = work / "dph_async"
    shutil.rmtree(stage, ignore_errors=True)
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "dph_async", stage, ignore=skip)
    for name in MAPPED:
        shutil.copytree(ROOT / name, stage / name, ignore=skip)
    for name in ["tests", "docs"]:
        link = work / name
        if not link.is_symlink():
            link.symlink_to(Path("..", "..", name))
    selection = ", ".join(f'"{a}"' for a in MODULES[module])
    settings = f"""
[tool.mutmut]
source_paths = ["dph_async"]
also_copy = ["docs"]
only_mutate = ["{staged(module)}"]
pytest_add_cli_args_test_selection = [{selection}]
pytest_add_cli_args = ["-p", "no:cacheprovider"]
# Workers fork from a server that has imported the tests but run nothing: torch's thread pools are
# not fork-safe once used.
process_isolation = "forkserver"
"""
    text = (ROOT / "pyproject.toml").read_text() + settings
    if not (work / "pyproject.toml").is_file() or (work / "pyproject.toml").read_text() != text:
        (work / "pyproject.toml").write_text(text)
    return work


def mutmut(work: Path, args: list[str], deadline: float) -> bool:
    """Run mutmut in `work`, niced, until `deadline`; False if the budget stopped it (its verdicts so
    far are kept)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the mutants, not the checkout
    cmd = ["nice", "-n", "10", str(Path(sys.executable).parent / "mutmut"), *args]
    with open(work / "mutmut.log", "ab") as out:  # its progress and any failure, for a look afterwards
        proc = subprocess.Popen(cmd, cwd=work, env=env, start_new_session=True, stdout=out, stderr=subprocess.STDOUT)
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        return True
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)  # mutmut stops its workers and keeps what it has
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return False


def statuses(work: Path) -> dict[str, str]:
    """{mutant: status} as mutmut recorded them."""
    out = subprocess.run([str(Path(sys.executable).parent / "mutmut"), "results", "--all", "true"], cwd=work,
                         capture_output=True, text=True, check=True).stdout
    return dict(m.groups() for m in re.finditer(r"^\s+(\S+): (.+)$", out, re.M))


def function_start(source: str, key: str) -> int:
    """The first line of the function a mutant key names (learner.guard.x_screen__mutmut_3,
    learner.guard.xǁStepGuardǁafter_batch__mutmut_7), as mutmut's diff counts it: the comments just
    above the def included."""
    name = key.rsplit(".", 1)[1].rsplit("__mutmut_", 1)[0]
    path = name.split("ǁ")[1:] if name.startswith("xǁ") else [name.removeprefix("x_")]
    body: list[ast.stmt] = ast.parse(source).body
    node: ast.AST | None = None
    for part in path:
        node = next(n for n in body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                    and n.name == part)
        body = node.body
    assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    lines = source.splitlines()
    start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    while start > 1 and lines[start - 2].strip().startswith("#"):
        start -= 1
    return start


def survivor(work: Path, module: str, name: str, status: str) -> Survivor:
    """Where a mutant is and what it changed, from `mutmut show`'s diff of its function."""
    diff = subprocess.run([str(Path(sys.executable).parent / "mutmut"), "show", name], cwd=work,
                          capture_output=True, text=True, check=True).stdout.splitlines()
    start = function_start((ROOT / module).read_text(), name)
    line, at, before, after = 0, 0, [], []
    for d in diff:
        if m := re.match(r"@@ -(\d+)", d):
            at = int(m.group(1))
        elif d.startswith("-") and not d.startswith("---"):
            line = line or start + at - 1
            before.append(d[1:].strip())
            at += 1
        elif d.startswith("+") and not d.startswith("+++"):
            after.append(d[1:].strip())
        elif d.startswith(" "):
            at += 1
    mutated = " ".join(after)
    return Survivor(name, status, line, " ".join(before), mutated, EQUIVALENT.get((module, mutated)))


def run_module(module: str, budget_s: float, fresh: bool) -> tuple[dict[str, str], list[Survivor], float]:
    work = prepare(module, fresh)
    start = time.monotonic()
    deadline = start + budget_s
    # The tests the verdicts were reached against: when they change, the survivors meet them again.
    stamp, tests = work / "tests.sha256", digest(tests_of(MODULES[module]))
    if not stamp.is_file():
        stamp.write_text(tests)
    stale = stamp.read_text() != tests
    if stale:  # mutmut keeps its first record of which tests reach each function, blind to tests added since
        (work / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
    done = mutmut(work, ["run", "--max-children", "1"], deadline)
    if done and stale:
        again = [k for k, s in statuses(work).items() if s in ("survived", "no tests", "suspicious")]
        if not again or mutmut(work, ["run", "--max-children", "1", *again], deadline):
            stamp.write_text(tests)
    found = statuses(work)
    left = [survivor(work, module, k, s) for k, s in found.items() if s not in DETECTED | PENDING]
    return found, sorted(left, key=lambda s: s.line), time.monotonic() - start


def summary(module: str, found: dict[str, str], left: list[Survivor], seconds: float) -> str:
    tried = sum(s not in PENDING for s in found.values())
    killed = sum(s in DETECTED for s in found.values())
    equivalent = sum(s.why is not None for s in left)
    pending = len(found) - tried
    score = (f"score {100 * killed / max(1, tried - equivalent):.1f}% without the equivalent "
             f"({100 * killed / tried:.1f}% with)") if tried else "no score yet"
    rows = [f"{module}: {len(found)} mutants, {killed} killed, {len(left)} survived ({equivalent} equivalent), "
            f"{score}, {pending} pending{' (run again to go on)' if pending else ''}; {seconds:.0f} s"]
    for s in left:
        rows.append(f"  {module}:{s.line}  [{s.status}]  {s.before}  ->  {s.after}")
        if s.why:
            rows.append(f"      equivalent: {s.why}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", default="", help="comma-separated paths from MODULES (default: all)")
    parser.add_argument("--budget", type=float, default=1800, help="seconds per module (default 1800)")
    parser.add_argument("--fresh", action="store_true", help="forget the module's earlier verdicts")
    args = parser.parse_args(argv)
    modules = [m for m in args.module.split(",") if m] or list(MODULES)
    if unknown := [m for m in modules if m not in MODULES]:
        parser.error(f"MODULE {', '.join(unknown)}: not in the table of scripts/mutate.py ({', '.join(MODULES)})")
    if not (Path(sys.executable).parent / "mutmut").exists():  # the `mutate` extra of pyproject.toml
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", ".[mutate]"], cwd=ROOT, check=True)
    for module in modules:
        print(summary(module, *run_module(module, args.budget, args.fresh)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
