"""Every bad input of the simulator gives one line ``libra-sim: error: ...``, exit 2, before any work, and
writes nothing. Most rows call ``main(argv)`` in-process (one numpy import for the whole table); a few run
the real entry points as subprocesses (``python -m libra_megatron.sim``, ``libra-sim``, ``scripts/simulate.sh``),
one of them under an address-space limit so that a regression of the memory bound fails fast.
"""
from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import libra_megatron.sim.runner as runner
from libra_megatron.cli import is_user_error
from libra_megatron.sim.__main__ import main, run

REPO = Path(__file__).resolve().parents[2]
LINUX = REPO / "data" / "traces" / "linux-6.12-files.qwen.txt"  # ships with the repository
SYNTH = np.concatenate([np.arange(1, 400) % 23 + 1, [150, 90, 64, 200, 33, 120]])
FLAGS = ["--seq-len", "64", "--gbs", "8", "--dp", "4", "--cp", "2", "--pool-size", "2", "--num-heads", "4",
         "--num-kv-heads", "2", "--head-dim", "8", "--num-chunks", "2", "--no-progress"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Input files of every row, in one folder (outputs go to a separate, per-row folder)."""
    d = tmp_path_factory.mktemp("inputs")
    contents = {
        "good.txt": "# synthetic\n" + "\n".join(map(str, SYNTH)) + "\n",
        "binary.txt": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR",
        "late_binary.txt": b"5\n7\n\xff\xfe\n",
        "empty.txt": "",
        "comments.txt": "# nothing but a comment\n\n",
        "word.txt": "5\n7\nabc\n",
        "negative.txt": "5\n-3\n",
        "huge_doc.txt": "5\n" + "9" * 30 + "\n",
        "long_line.txt": "1" * 5000,
        "big_corpus.txt": "1000000000\n" * 3,  # 3e9 tokens: 47M sequences at L=64
        "calib_bad.json": '{"head_dim": 8, "entries": [}',
        "calib_inf.json": '{"head_dim": 8, "entries": [{"block_tokens": 8, "heads": 2, "seconds": Infinity, "pairs": 36}]}',
        "a_file": "x",
    }
    for name, body in contents.items():
        (d / name).write_bytes(body if isinstance(body, bytes) else body.encode())
    (d / "a_dir").mkdir()
    return d


def _argv(files, out, change):
    """FLAGS with the good trace and outputs in ``out``, then ``change`` (later flags win in argparse)."""
    argv = ["--trace", str(files / "good.txt")] if "--trace" not in change else []
    return argv + FLAGS + ["--json", str(out / "r.json"), "--plots", str(out / "plots")] + change


# (id, flags that replace / add to the good command line, regex the one line must match after "error: ")
ROWS = [
    ("binary-trace", ["--trace", "{in}/binary.txt"], r"--trace \S+binary.txt:1: not UTF-8 text \(byte 0x89 at byte offset 0\)"),
    ("binary-later", ["--trace", "{in}/late_binary.txt"], r"late_binary.txt:3: not UTF-8 text \(byte 0xff at byte offset 4\)"),
    ("empty-trace", ["--trace", "{in}/empty.txt"], r"empty.txt: no document lengths"),
    ("comments-only", ["--trace", "{in}/comments.txt"], r"comments.txt: no document lengths"),
    ("directory-trace", ["--trace", "{in}/a_dir"], r"--trace \S+a_dir: is a directory"),
    ("missing-trace", ["--trace", "{in}/nope.txt"], r"--trace \S+nope.txt: no such file"),
    ("second-trace-missing", ["--trace", "{in}/good.txt", "--trace", "{in}/nope.txt"], r"nope.txt: no such file"),
    ("word-in-trace", ["--trace", "{in}/word.txt"], r"word.txt:3: expected one integer document length, got 'abc'"),
    ("negative-length", ["--trace", "{in}/negative.txt"], r"negative.txt:2: document length must be >= 0, got -3"),
    ("huge-length", ["--trace", "{in}/huge_doc.txt"], r"huge_doc.txt:2: document length 9{30} is larger than"),
    ("long-line", ["--trace", "{in}/long_line.txt"], r"long_line.txt:1: line longer than 4096 bytes"),
    ("huge-corpus-memory", ["--trace", "{in}/big_corpus.txt"],
     r"--seq-len 64 packs the 3000000000-token corpus into 46875000 sequences; packing would need about \d+\.\d+ GiB, "
     r"more than --memory-limit-gib 2"),
    ("document-budget", ["--memory-limit-gib", "1e-6"], r"good.txt:9: more than 7 documents in all --trace files"),
    ("seq-len-1", ["--seq-len", "1"], r"--seq-len 1 is below the minimum 64 tokens"),
    ("seq-len-0", ["--seq-len", "0"], r"--seq-len must be a positive integer, got 0"),
    ("seq-len-negative", ["--seq-len", "-64"], r"--seq-len must be a positive integer, got -64"),
    ("seq-len-word", ["--seq-len", "abc"], r"argument --seq-len: invalid int value: 'abc'"),
    ("seq-len-huge", ["--seq-len", str(2 ** 70)], r"SH-Tiles per pool, more than .* or a smaller --seq-len"),
    ("seq-len-above-corpus", ["--seq-len", str(2 ** 30), "--block-size", str(2 ** 20)],
     r"packs into 0 sequences of --seq-len 1073741824, fewer than one --gbs 8 window"),
    ("tau-inf", ["--tau", "inf"], r"--tau must be a finite number >= 0, got inf"),
    ("tau-nan", ["--tau", "0.1", "nan"], r"--tau must be a finite number >= 0, got nan"),
    ("tau-negative", ["--tau", "-0.1"], r"--tau must be a finite number >= 0, got -0.1"),
    ("tflops-inf", ["--attn-tflops", "inf"], r"--attn-tflops must be a finite number > 0, got inf"),
    ("bandwidth-zero", ["--inter-node-gbps", "0"], r"--inter-node-gbps must be a finite number > 0, got 0.0"),
    ("wlb-nan", ["--wlb-cap-factor", "nan"], r"--wlb-cap-factor must be a finite number >= 1"),
    ("memory-limit-zero", ["--memory-limit-gib", "0"], r"--memory-limit-gib must be a finite number > 0"),
    ("pool-not-dividing", ["--pool-size", "3"], r"--pool-size 3 must divide --dp 4 \(4 % 3 = 1\)"),
    ("gbs-not-dividing", ["--gbs", "6"], r"--gbs 6 must be divisible by --dp 4"),
    ("chunks-bad", ["--num-chunks", "3"], r"--num-chunks 3 must divide num_attention_heads/--head-split = 4/1 = 4"),
    ("heads-zero", ["--num-heads", "0"], r"--num-heads must be >= 1, got 0"),
    ("tp-not-dividing-heads", ["--tp", "4"], r"--num-kv-heads 2 must be divisible by --tp 4 \(each tensor-parallel rank runs --num-kv-heads / --tp heads; 2 % 4 = 2\)"),
    ("tp-zero", ["--tp", "0"], r"--tp must be >= 1, got 0"),
    ("max-windows-zero", ["--max-windows", "0"], r"--max-windows must be a positive integer, got 0"),
    ("too-many-tiles", ["--seq-len", "1048576", "--gbs", "4", "--block-size", "1"], r"SH-Tiles per pool, more than"),
    ("window-too-big", ["--gbs", "4096"], r"packs into \d+ sequences of --seq-len 64, fewer than one --gbs 4096 window"),
    ("jobs-zero", ["--jobs", "0"], r"--jobs must be a positive integer, got 0"),
    ("jobs-too-many", ["--jobs", "100000"], r"--jobs 100000 is more than the \d+ CPUs"),
    ("unknown-choice", ["--packing", "zigzag"], r"argument --packing: invalid choice: 'zigzag' \(choose from 'megatron', 'best_fit'\)"),
    ("layout-choice", ["--token-layout", "ring"], r"argument --token-layout: invalid choice: 'ring'"),
    ("unknown-flag", ["--bogus"], r"unrecognized arguments: --bogus"),
    ("abbreviated-flag", ["--seq", "128"], r"unrecognized arguments: --seq 128"),
    ("json-missing-folder", ["--json", "/nonexistent/dir/x.json"], r"--json /nonexistent/dir/x.json: the folder /nonexistent/dir does not exist"),
    ("json-is-directory", ["--json", "{in}/a_dir"], r"--json \S+a_dir: is a directory"),
    ("json-in-proc", ["--json", "/proc/x.json"], r"--json /proc/x.json: cannot write into /proc"),
    ("plots-in-proc", ["--plots", "/proc/nope"], r"--plots /proc/nope: cannot write into /proc"),
    ("plots-is-file", ["--plots", "{in}/a_file"], r"--plots \S+a_file: exists and is not a directory"),
    ("plots-parent-missing", ["--plots", "{in}/nope/plots"], r"--plots \S+: the folder \S+nope does not exist"),
    ("calibration-binary", ["--calibration", "{in}/binary.txt"], r"--calibration \S+binary.txt:1: not UTF-8 text"),
    ("calibration-syntax", ["--calibration", "{in}/calib_bad.json"], r"calib_bad.json:1:\d+: not valid JSON"),
    ("calibration-infinite", ["--calibration", "{in}/calib_inf.json"], r"finite seconds > 0"),
    ("calibration-directory", ["--calibration", "{in}/a_dir"], r"--calibration \S+a_dir: is a directory"),
]


@pytest.fixture
def no_packing(monkeypatch):
    """Any row that reaches packing fails the test with a traceback (AssertionError is not a user error)."""
    def refuse(*args, **kwargs):
        raise AssertionError("packing started: the error was not found before the work")
    monkeypatch.setattr(runner, "_pack_corpus", refuse)


@pytest.mark.parametrize("change, pattern", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_input_is_one_line_exit_2_before_work_and_writes_nothing(files, tmp_path, capsys, no_packing,
                                                                     change, pattern):
    out = tmp_path / "out"
    out.mkdir()
    argv = _argv(files, out, [c.replace("{in}", str(files)) for c in change])
    with pytest.raises(SystemExit) as exc:
        main(argv)
    captured = capsys.readouterr()
    assert exc.value.code == 2, captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert lines[0].startswith("libra-sim: error: "), lines[0]
    assert re.search(pattern, lines[0]), (pattern, lines[0])
    assert captured.out == ""  # no table: nothing ran
    assert sorted(os.listdir(out)) == []  # no json, no plots folder, no probe left behind


def test_debug_flag_and_env_show_the_traceback_of_a_user_error(files, tmp_path, monkeypatch):
    argv = _argv(files, tmp_path, ["--seq-len", "1"])
    with pytest.raises(ValueError, match="below the minimum"):
        main(argv + ["--debug"])
    monkeypatch.setenv("LIBRA_DEBUG", "1")
    with pytest.raises(ValueError, match="below the minimum"):
        main(argv)


def test_help_lists_choices_and_plain_defaults_not_enum_reprs(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert exc.value.code == 0
    assert "PackingMode" not in text and "TokenLayoutKind" not in text and "SequencePlacement" not in text
    assert "--packing {megatron,best_fit}" in text and "(default: megatron)" in text
    assert "--token-layout {contiguous,zigzag} CP token layout" in text and "(default: zigzag)" in text
    assert "--tile-placement {home,alg2,refined,time,dense}" in text and "(default: alg2)" in text
    assert "(default: None)" not in text and "--pool-size INT [INT ...] P values (each divides --dp) (default: 8)" in text


@pytest.mark.parametrize("packing", ["megatron", "best_fit"])
def test_max_windows_replays_exactly_the_first_windows_of_the_full_run(files, packing):
    """--max-windows 1 packs less (megatron) but its window is the full run's first window, number for number."""
    from libra_megatron.sim.__main__ import build_parser, spec_from_args

    argv = ["--trace", str(files / "good.txt")] + FLAGS + ["--no-distca", "--packing", packing]
    full = runner.run_simulation(SYNTH, spec_from_args(build_parser().parse_args(argv)))
    one = runner.run_simulation(SYNTH, spec_from_args(build_parser().parse_args(argv + ["--max-windows", "1"])))
    steps = full.spec.num_steps
    assert one.num_windows == 1 < full.num_windows and one.num_sequences == full.num_sequences
    assert one.ulysses.seconds == full.ulysses.seconds[:steps]
    assert one.candidates[0].steps["libra"].seconds == full.candidates[0].steps["libra"].seconds[:steps]


# ------------------------------------------------------------------------------ real entry points
def _limit_address_space(gib: float):
    def apply():
        size = int(gib * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (size, size))
    return apply


def _run(cmd, cwd=REPO, gib=None, env=None, timeout=120):
    full_env = dict(os.environ, OPENBLAS_NUM_THREADS="1", **(env or {}))
    full_env.pop("LIBRA_DEBUG", None)
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env,
                          preexec_fn=_limit_address_space(gib) if gib else None)


def _assert_one_line(proc, tool, pattern):
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"{tool}: error: ") and re.search(pattern, lines[0]), lines[0]


def test_python_dash_m_entry_point_binary_trace(files, tmp_path):
    proc = _run([sys.executable, "-m", "libra_megatron.sim"] + _argv(files, tmp_path, ["--trace", str(files / "binary.txt")]))
    _assert_one_line(proc, "libra-sim", r"binary.txt:1: not UTF-8 text")
    assert os.listdir(tmp_path) == []


def test_libra_sim_console_script_directory_trace(files, tmp_path):
    exe = shutil.which("libra-sim", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("libra-sim is not installed in this environment (pip install -e .)")
    proc = _run([exe] + _argv(files, tmp_path, ["--trace", str(files / "a_dir")]))
    _assert_one_line(proc, "libra-sim", r"a_dir: is a directory")
    assert os.listdir(tmp_path) == []


def test_simulate_script_rejects_a_tiny_seq_len(tmp_path):
    proc = _run(["bash", "scripts/simulate.sh", "--seq-len", "1", "--json", str(tmp_path / "x.json")])
    _assert_one_line(proc, "libra-sim", r"--seq-len 1 is below the minimum 64")
    assert os.listdir(tmp_path) == []


def test_memory_bound_is_checked_before_packing_under_an_address_space_limit(tmp_path):
    """L=64 on the 478M-token Linux trace would pack 7.5M sequences (several GB); under a 0.5 GiB address-space
    limit a regression dies of MemoryError (exit 1, traceback) within seconds instead of exhausting the box."""
    cmd = [sys.executable, "-m", "libra_megatron.sim", "--trace", str(LINUX), "--seq-len", "64", "--gbs", "8",
           "--dp", "4", "--cp", "2", "--pool-size", "2", "--model", "qwen3-8b", "--no-progress",
           "--json", str(tmp_path / "x.json")]
    proc = _run(cmd, gib=0.5)
    _assert_one_line(proc, "libra-sim", r"packs the 477953230-token corpus into 7468019 sequences; packing would "
                                        r"need about 2\.\d\d GiB, more than --memory-limit-gib 2")
    bounded = _run(cmd + ["--max-windows", "1", "--no-distca"], gib=0.5)  # same L, packing bounded by the windows
    assert bounded.returncode == 0, bounded.stderr
    assert json.loads((tmp_path / "x.json").read_text())["num_windows"] == 1


# ------------------------------------------------------------------------------ fuzz
_LINE = st.one_of(
    st.integers(0, 400).map(str), st.integers(0, 400).map(str), st.integers(0, 400).map(str),
    st.integers(-10, 2 ** 70).map(str), st.just(""), st.just("# comment"), st.just("  12  "), st.just("1_000"),
    st.text(max_size=12), st.sampled_from(["1e3", "0x10", "nan", "--", "٣", "12\r", "\x00", "5 6"]),
)
_BODY = st.one_of(
    st.binary(max_size=300),
    st.lists(_LINE, max_size=120).map(lambda lines: "\n".join(lines).encode("utf-8", "surrogatepass")),
    st.tuples(st.lists(st.integers(1, 200).map(str), min_size=1, max_size=60), st.binary(max_size=6)).map(
        lambda t: ("\n".join(t[0]) + "\n").encode() + t[1]),
)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_BODY)
def test_any_trace_content_ends_in_a_clean_user_error_or_a_valid_run(fuzz_dir, capsys, body):
    path = fuzz_dir / "trace.txt"
    path.write_bytes(body)
    argv = ["--trace", str(path), "--seq-len", "64", "--gbs", "2", "--dp", "2", "--cp", "1", "--pool-size", "2",
            "--num-heads", "2", "--num-kv-heads", "1", "--head-dim", "4", "--num-chunks", "1", "--block-size", "32",
            "--max-windows", "1", "--no-distca", "--no-progress"]
    try:
        assert run(argv) == 0
    except ValueError as err:
        assert is_user_error(err), repr(err)  # never a bare UnicodeDecodeError
        assert str(err) and "\n" not in str(err)
    capsys.readouterr()
