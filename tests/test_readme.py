"""The README's first walk, run as a newcomer runs it: `quayutec up --standin` in one terminal; in a
second, its exports, then the README's command blocks in order, each line through bash as written
(placeholders filled from what the commands before it printed). The once-per-stack block runs once;
the walk and the approval run twice over on the same stack, so every name-based command is shown to
work again on a stack where the names already exist."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
from pathlib import Path

from tests.test_up import _base_port, _env, data_dir, running_up

__all__ = ["data_dir"]  # the fixture, used here

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def sh_blocks(section: str) -> list[list[str]]:
    """The ```sh blocks of the README's ``section`` (a ## heading's text, up to the next ## heading), in
    order, each as its command lines (comments and blank lines kept out)."""
    text = README[README.index(f"\n## {section}\n") :]
    text = text[: text.index("\n## ", 5)]
    blocks = re.findall(r"```sh\n(.*?)```", text, re.S)
    return [
        [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")] for block in blocks
    ]


def test_the_readme_is_a_door_a_few_hundred_lines_of_short_lines() -> None:
    lines = README.splitlines()
    assert len(lines) <= 300, len(lines)
    assert max(len(line) for line in lines) <= 200
    headings = re.findall(r"^## (.+)$", README, re.M)
    assert headings[:1] == ["Two commands"] and headings[-1] == "Documentation", headings


class Shell:
    """A second terminal: an environment, and each line run through bash from the checkout."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.said: list[tuple[str, str]] = []

    def run(self, line: str) -> str:
        done = subprocess.run(["bash", "-c", line], cwd=REPO, env=self.env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (line, done.stdout, done.stderr)
        self.said.append((line, done.stdout))
        return done.stdout

    def until(self, line: str, seen: str, what: str) -> str:
        """``line`` again until its output holds ``seen`` (a regular expression): a person waits too."""
        for _ in range(300):  # bounded: the wake is delivered, the run ends
            out = self.run(line)
            if re.search(seen, out, re.M):
                return out
            time.sleep(0.2)
        raise AssertionError(f"{what} never came: {line!r} printed {out!r}")

    def export(self, line: str, value: str) -> None:
        name = shlex.split(line, comments=True)[1].split("=", 1)[0]
        self.env[name] = value


def _first_column_of_first_row(table: str) -> str:
    return table.splitlines()[1].split()[0]


def test_a_newcomer_walks_the_readme_twice_on_one_stack(data_dir: Path) -> None:
    [[up_line], once, walk, approval] = sh_blocks("A first walk through the command line")
    assert up_line == ".venv/bin/quayutec up --standin"
    assert (REPO / ".venv" / "bin" / "quayutec").exists(), "no .venv/bin/quayutec: `make test` or `make demo` makes it"
    env = _env(QUAYUTEC_DATA_DIR=str(data_dir))
    # The one change to the README's line: a base port of the test's own, so tests never share ports.
    with running_up(env, _base_port(), REPO, "--standin") as up:
        exports = dict(re.findall(r"^export (\w+)=(\S+)$", up.out, re.M))
        [standin] = re.findall(r"^  standin  (http://127\.0\.0\.1:\d+) ", up.out, re.M)
        shell = Shell({**env, **exports})
        key = ""
        for line in once:
            if line.startswith("export QUAYUTEC_API_KEY="):
                shell.export(line, key)
                continue
            out = shell.run(line)
            if " keys create " in line:
                key = out.splitlines()[1]
        for n in (1, 2):
            runs = ""
            for line in walk:
                if " messages " in line:  # the reply of this pass's post
                    out = shell.until(
                        line, rf'(?s)(Noted, you asked "plan the launch".*){{{n}}}', "the planner's reply"
                    )
                    assert "planner (Acme's agent)" in out and "ana (Acme, as stated)" in out
                elif line.startswith(".venv/bin/quayutec runs "):
                    runs = shell.until(line, r"\A.*\n\S+ +planner +launch +\S+ +succeeded ", "the run's end")
                    assert len(runs.splitlines()) == 1 + 2 * n - 1, runs  # one per post; the approval's too
                elif "<run-id>" in line:
                    record = shell.run(line.replace("<run-id>", _first_column_of_first_row(runs)))
                    assert "status=succeeded" in record and "posted: a reply" in record
                    assert "  agent planner  room launch  woken by a message" in record, record
                elif " room list" in line:
                    assert re.search(r"^\S+ +launch +Acme ", shell.run(line), re.M)
                elif " agent list " in line:
                    assert re.search(r"^\S+ +planner +Acme \(yours\) +anthropic +scripted$", shell.run(line), re.M)
                else:
                    assert "woke 1 agent" in shell.run(line)
            token = ""
            for line in approval:
                if line.startswith("export STANDIN="):
                    shell.export(line, standin)
                elif line.endswith(" approvals") or " approvals " in line:
                    token = _first_column_of_first_row(shell.until(line, r"^\S+ +\d+ +remember ", "the held action"))
                elif "<token>" in line:
                    shell.run(line.replace("<token>", token))
                elif line.startswith(".venv/bin/quayutec runs "):
                    shell.until(line, r"\A.*\n\S+ +planner +launch +\S+ +succeeded ", "the approved run's end")
                else:
                    shell.run(line)
            assert token, "the README's steps never showed a held action"
            [newest, *_] = json.loads(shell.run(".venv/bin/quayutec runs --agent planner --json"))
            record = shell.run(f".venv/bin/quayutec run {newest['run_id']}")
            assert "action #0 remember: done" in record, record
