"""``python -m k3jax.train``: every user error is one ``error:`` line with exit status 2 and leaves
no checkpoint folder behind; ``--debug`` shows the traceback; ``--set`` values are typed."""

import subprocess

import pytest

from k3jax.train.__main__ import main
from tests.k3jax.cli_run import assert_one_error_line, run_cli

TRAIN = ["-m", "k3jax.train", "--config", "experiments/demo_recall.py"]


@pytest.mark.parametrize("assignment, fragments", [
    ("steps=abc", ("--set steps='abc'", "expected int")),
    ("steps=1.5", ("--set steps='1.5'", "expected int")),
    ("optimizer.learning_rate=abc", ("--set optimizer.learning_rate='abc'", "expected float")),
    ("model.hidden=abc", ("--set model.hidden='abc'", "expected int")),
    ("model.dtype=float33", ("--set model.dtype='float33'", "dtype")),
    ("optimizer.learnin_rate=1", ("has no field 'learnin_rate'",)),
])
def test_bad_set_values_are_one_line_naming_key_value_and_type(tmp_path, assignment, fragments, capsys):
    rc = main(TRAIN[2:] + ["--set", f"checkpoint.dir={tmp_path / 'ck'}", "--set", assignment])
    out, err = capsys.readouterr()
    assert_one_error_line(subprocess.CompletedProcess([], rc, out, err), *fragments)
    assert not (tmp_path / "ck").exists()


def test_a_bad_set_value_from_the_shell(tmp_path):
    """The same in a fresh process: nothing else (no JAX start-up noise, no traceback) on stderr."""
    proc = run_cli([*TRAIN, "--set", f"checkpoint.dir={tmp_path / 'ck'}", "--set", "steps=1.5"])
    assert_one_error_line(proc, "--set steps='1.5'", "expected int")
    assert not (tmp_path / "ck").exists()


def test_empty_text_data_is_an_error_before_anything_is_written(tmp_path):
    data = tmp_path / "empty.txt"
    data.write_text("  \n\t\n")
    proc = run_cli([*TRAIN, "--set", "data.source=text", "--set", f"data.path={data}",
                    "--set", f"checkpoint.dir={tmp_path / 'ck'}", "--set", f"log_dir={tmp_path / 'log'}"])
    assert_one_error_line(proc, str(data), "empty or whitespace only")
    assert not (tmp_path / "ck").exists() and not (tmp_path / "log").exists()


def test_argparse_errors_and_missing_files_follow_the_convention(tmp_path, capsys):
    assert_one_error_line(run_cli([*TRAIN, "--bogus"]), "unrecognized arguments: --bogus")
    for argv, fragments in [
        (["--config", str(tmp_path / "nope.py")], ("--config", "does not exist")),
        (TRAIN[2:] + ["--init-from", str(tmp_path / "nowhere"), "--set", f"checkpoint.dir={tmp_path / 'ck'}"],
         ("--init-from", "does not exist")),
    ]:
        rc = main(argv)
        out, err = capsys.readouterr()
        assert_one_error_line(subprocess.CompletedProcess([], rc, out, err), *fragments)
    assert not (tmp_path / "ck").exists()


def test_debug_shows_the_traceback(monkeypatch):
    with pytest.raises(ValueError, match="expected int"):
        main(TRAIN[2:] + ["--set", "steps=abc", "--debug"])
    monkeypatch.setenv("K3JAX_DEBUG", "1")
    with pytest.raises(ValueError, match="expected int"):
        main(TRAIN[2:] + ["--set", "steps=abc"])
