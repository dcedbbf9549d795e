"""README's and docs' command lines are ones the CLI accepts: every ``ppsplit ...`` line they show (a concrete
command, not the at-a-glance synopsis with ``[options]`` and ``a | b``) parses with the real argument parser."""
import glob
import os
import re
import shlex

import pytest

from ppsplit.cli.commands import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shown_commands():
    found = []
    for path in [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
        fenced = False
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if line.startswith("```"):
                    fenced = not fenced
                if not (fenced or line.startswith("    ")):  # code only: a fenced or an indented block
                    continue
                text = re.sub(r"^\s*(\$\s+)?", "", line.rstrip("\n"))
                text = re.sub(r"^.*&&\s*(?=ppsplit )", "", text)  # the install-then-run lines
                if not text.startswith("ppsplit ") or "[" in text or "|" in text or "..." in text:
                    continue
                text = re.split(r"\s+#\s", text)[0].rstrip(" &\\")
                found.append(pytest.param(text, id=f"{os.path.basename(path)}:{number}"))
    return found


COMMANDS = shown_commands()


def test_the_docs_show_commands():
    assert len(COMMANDS) >= 10 and any("compile" in c.values[0] for c in COMMANDS)


@pytest.mark.parametrize("line", COMMANDS)
def test_a_command_the_docs_show_parses(line):
    args = shlex.split(line)[1:]
    try:
        build_parser().parse_args(args)
    except SystemExit as e:
        pytest.fail(f"{line!r} does not parse (exit {e.code})")
