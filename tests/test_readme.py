"""README's Python snippet that builds the tiny pipeline runs as written (CPU, reference numerics), and
its test commands are the ones CI runs."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def test_tiny_pipeline_snippet_runs(capsys):
    pytest.importorskip("diffusers")
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (snippet,) = [b for b in blocks if "build_tiny_pipeline" in b]
    scope: dict = {}
    exec(compile(snippet, str(README), "exec"), scope)
    assert scope["frames"].shape == (17, 128, 128, 3)
    assert "transformer.blocks.0.attn1" in capsys.readouterr().out


def test_the_test_commands_are_what_ci_runs():
    """README's test command and its build-group command are the two .ci/run runs, so every test
    runs on every submission."""
    readme, ci = README.read_text(), (README.parent / ".ci" / "run").read_text()
    for command in ('python -m pytest -q -m "not compile"', "python -m pytest -q -m compile"):
        assert command in readme, command
        assert command.replace("-q", "-q -ra") in ci, command
