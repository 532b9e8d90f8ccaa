"""``python -m k3jax.generate``: bad input is one ``error:`` line, exit status 2 and no output; the
checkpoint may be a run folder, a checkpoints folder or an HF folder; text is escaped."""

import io
import subprocess

import pytest

from k3jax.checkpoint_source import HF, ORBAX, describe_source
from k3jax.data.tokenizer import ByteTokenizer
from k3jax.generate import TextStream, escape, main
from tests.k3jax.cli_run import assert_one_error_line, run_cli


def _run(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, rc, out, err)


@pytest.mark.parametrize("extra, fragments", [
    (["--temperature", "-1"], ("temperature=-1.0", ">= 0")),
    (["--top-p", "0"], ("top_p=0.0", "(0, 1]")),
    (["--top-p", "1.5"], ("top_p=1.5",)),
    (["--top-k", "0"], ("top_k=0",)),
    (["--max-new-tokens", "0"], ("--max-new-tokens=0", ">= 1")),
])
def test_bad_sampling_arguments(tmp_path, capsys, extra, fragments):
    assert_one_error_line(_run(["--checkpoint", str(tmp_path), "--prompt", "x", *extra], capsys), *fragments)


def test_bad_checkpoint_paths(tmp_path, capsys):
    assert_one_error_line(_run(["--checkpoint", str(tmp_path / "nope"), "--prompt", "x"], capsys),
                          "nope", "does not exist")
    assert_one_error_line(_run(["--checkpoint", str(tmp_path), "--prompt", "x"], capsys),
                          "no config.json", "checkpoints folder")
    (tmp_path / "f.txt").write_text("x")
    assert_one_error_line(_run(["--checkpoint", str(tmp_path / "f.txt"), "--prompt", "x"], capsys), "is a file")


def test_argparse_error_from_the_shell(tmp_path):
    proc = run_cli(["-m", "k3jax.generate", "--checkpoint", str(tmp_path / "nope"), "--prompt", "x"])
    assert_one_error_line(proc, "does not exist")
    assert_one_error_line(run_cli(["-m", "k3jax.generate", "--prompt", "x"]), "--checkpoint")


def test_source_layouts(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert describe_source(tmp_path / "hf") == (HF, tmp_path / "hf")
    (tmp_path / "run" / "checkpoints" / "40").mkdir(parents=True)
    assert describe_source(tmp_path / "run") == (ORBAX, tmp_path / "run" / "checkpoints")
    assert describe_source(tmp_path / "run" / "checkpoints") == (ORBAX, tmp_path / "run" / "checkpoints")


def test_text_stream_echoes_the_prompt_and_escapes_control_bytes():
    out = io.StringIO()
    stream = TextStream(ByteTokenizer(), "say \x1b[31m", out)
    assert out.getvalue() == ""  # nothing before the first token
    for t in "é\x07!".encode():  # é is two bytes: printed whole, once both arrived
        stream.add(t)
        assert "\ufffd" not in out.getvalue()
    stream.add(ByteTokenizer.eos_id)
    stream.close()
    assert out.getvalue() == "say \\x1b[31mé\\x07!\n"
    assert escape("a\tb\nc\x00\x7f") == "a\tb\nc\\x00\\x7f"
