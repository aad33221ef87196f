"""The shared error style (``libra_megatron.cli``), the file checks (``libra_megatron.paths``) and the scripts.

run_cli: a ValueError is one line and exit 2, anything else (and an un-named UnicodeDecodeError) keeps its
traceback, --debug / LIBRA_DEBUG=1 show it for user errors too. paths: the chunked UTF-8 line reader is
checked against ``bytes.decode`` + ``split`` on random bytes and chunk sizes; output checks leave nothing.
Scripts: ``scripts/main.sh`` (the CPU training driver) and the torchrun wrappers answer in the same format.
"""
from __future__ import annotations

import enum
import json
import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra_megatron.cli import ArgumentParser, DefaultsHelpFormatter, UsageError, is_user_error, run_cli
from libra_megatron.paths import check_output_dir, check_output_file, iter_text_lines, read_json, read_text

REPO = Path(__file__).resolve().parents[1]


def _exit(main, argv, capsys, monkeypatch=None):
    with pytest.raises(SystemExit) as exc:
        run_cli("tool", main, argv)
    return exc.value.code, capsys.readouterr()


def _raise(err):
    def main(argv):
        raise err
    return main


def test_user_error_is_one_line_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("LIBRA_DEBUG", raising=False)
    code, out = _exit(_raise(ValueError("--x 3 must divide\n  4")), [], capsys)
    assert code == 2 and out.err == "tool: error: --x 3 must divide 4\n" and out.out == ""


@pytest.mark.parametrize("err", [RuntimeError("bug"), UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
                                 json.JSONDecodeError("Expecting value", "x", 0), KeyError("k")])
def test_internal_errors_and_unnamed_decode_errors_keep_their_traceback(err, monkeypatch):
    monkeypatch.delenv("LIBRA_DEBUG", raising=False)
    assert not is_user_error(err)
    with pytest.raises(type(err)):
        run_cli("tool", _raise(err), [])


def test_debug_flag_or_env_reraises_user_errors(monkeypatch):
    monkeypatch.delenv("LIBRA_DEBUG", raising=False)
    with pytest.raises(ValueError):
        run_cli("tool", _raise(ValueError("bad")), ["--debug"])
    monkeypatch.setenv("LIBRA_DEBUG", "1")
    with pytest.raises(ValueError):
        run_cli("tool", _raise(ValueError("bad")), [])
    monkeypatch.setenv("LIBRA_DEBUG", "0")
    with pytest.raises(SystemExit):
        run_cli("tool", _raise(ValueError("bad")), [])


def test_return_code_and_interrupt(capsys):
    assert _exit(lambda argv: 3, [], capsys)[0] == 3
    assert _exit(lambda argv: None, [], capsys)[0] == 0
    code, out = _exit(_raise(KeyboardInterrupt()), [], capsys)
    assert code == 130 and out.err == "tool: interrupted\n"


class _Kind(str, enum.Enum):
    ONE = "one"
    TWO = "two"


def test_parser_usage_errors_are_one_line_and_help_shows_plain_defaults(capsys, monkeypatch):
    monkeypatch.delenv("LIBRA_DEBUG", raising=False)

    def main(argv):
        p = ArgumentParser(prog="tool", formatter_class=DefaultsHelpFormatter)
        p.add_argument("--n", type=int, required=True, help="count")
        p.add_argument("--kind", choices=[k.value for k in _Kind], default=_Kind.ONE, help="kind")
        p.add_argument("--grid", type=int, nargs="+", default=[4, 8], help="values")
        p.parse_args(argv)

    code, out = _exit(main, ["--n", "x"], capsys)
    assert code == 2 and out.err == "tool: error: argument --n: invalid int value: 'x' (see --help)\n"
    code, out = _exit(main, [], capsys)
    assert out.err == "tool: error: the following arguments are required: --n (see --help)\n"
    code, out = _exit(main, ["--help"], capsys)
    assert code == 0 and "kind (default: one)" in out.out and "values (default: 4 8)" in out.out
    assert "count (default" not in out.out and "_Kind" not in out.out
    with pytest.raises(UsageError):
        ArgumentParser().parse_args(["--nope"])


# ------------------------------------------------------------------------------ paths
def _reference_lines(data: bytes):
    """What iter_text_lines must yield: decode all, split on '\\n' only, drop the empty tail."""
    lines = data.decode("utf-8").split("\n")
    return lines[:-1] if lines[-1] == "" else lines


@settings(max_examples=150, deadline=None)
@given(data=st.one_of(st.binary(max_size=64), st.text(max_size=40).map(lambda t: t.encode("utf-8", "surrogatepass")),
                      st.lists(st.sampled_from(["ab", "é", "€", "\n", "\r\n", "𝄞", "\u2028", "1"]), max_size=30)
                      .map(lambda xs: "".join(xs).encode())),
       chunk=st.integers(1, 9))
def test_chunked_line_reader_matches_decode_and_split_at_any_chunk_size(tmp_path_factory, data, chunk):
    path = tmp_path_factory.getbasetemp() / "lines.bin"
    path.write_bytes(data)
    try:
        expected = list(enumerate(_reference_lines(data), start=1))
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        with pytest.raises(ValueError, match=rf"^f:{line}: not UTF-8 text \(byte 0x{data[err.start]:02x} at byte "
                                             rf"offset {err.start}\)"):
            list(iter_text_lines(path, "f", max_line_bytes=1000, chunk_bytes=chunk))
        return
    assert list(iter_text_lines(path, "f", max_line_bytes=1000, chunk_bytes=chunk)) == expected


def test_line_reader_bounds_line_length(tmp_path):
    path = tmp_path / "one_long_line"
    path.write_bytes(b"12\n" + b"3" * 100)
    with pytest.raises(ValueError, match=r"one_long_line:2: line longer than 50 bytes"):
        list(iter_text_lines(path, str(path), max_line_bytes=50, chunk_bytes=16))


def test_input_file_checks(tmp_path):
    with pytest.raises(ValueError, match=r"^x: no such file$"):
        read_text(tmp_path / "missing", "x")
    with pytest.raises(ValueError, match=r"^x: is a directory, expected a file$"):
        read_text(tmp_path, "x")
    big = tmp_path / "big"
    big.write_bytes(b"a" * 101)
    with pytest.raises(ValueError, match=r"^x: larger than 100 bytes"):
        read_text(big, "x", max_bytes=100)
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "a": 1,\n}\n')
    with pytest.raises(ValueError, match=r"^--cal \S+bad.json:3:1: not valid JSON"):
        read_json(bad, f"--cal {bad}")
    with pytest.raises(ValueError, match=r"^y: is not a regular file$"):
        read_text("/dev/null", "y")


def test_output_checks_create_nothing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert check_output_file(out / "r.json", "j") and check_output_dir(out / "plots", "p") and check_output_dir(out, "p")
    assert os.listdir(out) == []
    with pytest.raises(ValueError, match=r"j: the folder \S+missing does not exist"):
        check_output_file(out / "missing" / "r.json", "j")
    with pytest.raises(ValueError, match=r"p: the folder \S+missing does not exist"):
        check_output_dir(out / "missing" / "plots", "p")
    (out / "file").write_text("x")
    with pytest.raises(ValueError, match=r"p: exists and is not a directory"):
        check_output_dir(out / "file", "p")
    with pytest.raises(ValueError, match=r"p: the folder \S+file is not a directory"):
        check_output_dir(out / "file" / "plots", "p")
    with pytest.raises(ValueError, match=r"j: cannot write into /proc"):
        check_output_file("/proc/x.json", "j")
    assert sorted(os.listdir(out)) == ["file"]


# ------------------------------------------------------------------------------ scripts
def _script(args, env=None):
    full = {k: v for k, v in os.environ.items() if k not in ("LIBRA_DEBUG", "MEGATRON_LM_PATH", "NNODES", "NODE_RANK",
                                                              "MASTER_ADDR")}
    return subprocess.run(["bash"] + args, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(full, **(env or {})))


def _one_line(proc, prefix):
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(prefix), lines[0]
    return lines[0]


def test_main_script_rejects_bad_flags_in_one_line_before_building_anything():
    line = _one_line(_script(["scripts/main.sh", "--dp", "3"]), "libra-train-cpu: error: ")
    assert line.endswith("--pool-size 2 must divide the data-parallel size 3 (3 % 2 = 1)")  # our flag, not --libra-*


def test_main_driver_checks_counts_trace_and_workdir(capsys, tmp_path, monkeypatch):
    from libra_megatron.testing.train_cpu import main

    monkeypatch.delenv("LIBRA_DEBUG", raising=False)
    for argv, pattern in ((["--steps", "0"], "--steps must be a positive integer, got 0"),
                          (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
                          (["--data", "trace", "--trace", str(tmp_path)], "is a directory"),
                          (["--workdir", str(tmp_path / "a" / "b")], "does not exist"),
                          (["--head-split", "3"], "--head-split 3 must divide num_attention_heads 4")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.count("\n") == 1 and pattern in err, err


@pytest.mark.parametrize("script, env, expected", [
    (["scripts/torchrun_single_node.sh"], {}, "torchrun_multi_node.sh: error: give a run config"),
    (["scripts/torchrun_multi_node.sh"], {}, "torchrun_multi_node.sh: error: give a run config"),
    (["scripts/torchrun_multi_node.sh", "c.args"], {"NNODES": "2"}, "torchrun_multi_node.sh: error: set NODE_RANK"),
    (["scripts/slurm_libra.sbatch"], {}, "slurm_libra.sbatch: error: give a run config"),
])
def test_launch_scripts_report_missing_settings_in_one_line(script, env, expected):
    _one_line(_script(script, env), expected)
