"""The Python examples in README.md and docs/*.md run as written, or say that they are fragments.

Every fenced ``python`` block is collected (one test per block, its id ``file:line`` of the opening
fence). Its leading comment lines may hold markers, visible to a reader and still Python to a
highlighter:

- ``# fragment: <why>``: a piece of a program (a loop body, a signature, names the text leaves to
  you). Not run; the reason is required.
- ``# run: torchrun --nproc_per_node=N``: run under ``torchrun --standalone --nproc_per_node=N``.
- ``# run: pytest``: a test file; run with ``python -m pytest``.
- ``# <name>.py`` (e.g. ``# train.py``): the file name the text gives the block; it is written there.

Any other block runs as ``python <file>``. Each runs in a fresh process, in a temporary directory,
with this checkout's ``src`` first on ``PYTHONPATH`` and no launcher variables (``_launch.job_env``),
and must exit 0 within its deadline. Nothing may download: the examples use scikit-learn's bundled
digits or synthetic tensors. Shell commands go in ``bash`` blocks and output in ``text`` blocks;
neither is collected.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from _launch import REPO, job_env, torchrun

DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# A slow block here takes ~20 s (a Trainer that starts 2 processes, on a loaded 2-core CI machine);
# six times that leaves room for a slower machine while a hang still fails this one test.
TIMEOUT_S = 120

# The runnable blocks counted when this test was written: marking one more block a fragment is a
# decision, so it must come with a change here.
MIN_RUNNABLE = 13

_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)\s*(?P<info>.*)$")
_FRAGMENT = re.compile(r"^#\s*fragment\b:?\s*(?P<reason>.*)$")
_RUN = re.compile(r"^#\s*run:\s*(?P<command>.*)$")
_TORCHRUN = re.compile(r"^torchrun --nproc_per_node=(?P<n>[1-9][0-9]*)$")
_FILE_NAME = re.compile(r"^#\s*(?P<name>[\w./-]+\.py)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced Python block of a Markdown file and the markers of its leading comments."""

    doc: str  # path relative to the repository, e.g. "docs/config.md"
    line: int  # 1-based line of the opening fence
    code: str
    fragment: str | None  # the reason after "# fragment:", "" when it gives none; None: not a fragment
    run: str | None  # the command after "# run:"; None: plain python
    file_name: str  # where the block is written in its temporary directory

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def _markers(code: str) -> tuple[str | None, str | None, str]:
    fragment = run = None
    file_name = "example.py"
    for line in code.splitlines():
        line = line.strip()
        if not line.startswith("#"):
            break
        if match := _FRAGMENT.match(line):
            fragment = match["reason"].strip()
        elif match := _RUN.match(line):
            run = match["command"].strip()
        elif match := _FILE_NAME.match(line):
            file_name = match["name"]
    return fragment, run, file_name


def collect_blocks(doc: Path, root: Path = REPO) -> list[Block]:
    """The fenced blocks of ``doc`` whose info string starts with ``python`` (or ``py``), named by
    ``doc``'s path relative to ``root``."""
    lines = doc.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _OPEN.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = i + 1
        while end < len(lines) and not closing.match(lines[end]):
            end += 1
        language = (opening["info"].split() or [""])[0].lower()
        if language in ("python", "py", "python3"):
            # A block inside a list item is indented like the item: take that indent off.
            body = [line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : end]]
            code = "\n".join(body) + "\n"
            fragment, run, file_name = _markers(code)
            doc_id = doc.relative_to(root).as_posix()
            blocks.append(Block(doc_id, i + 1, code, fragment, run, file_name))
        i = end + 1
    return blocks


BLOCKS = [block for doc in DOC_FILES for block in collect_blocks(doc)]
RUNNABLE = [block for block in BLOCKS if block.fragment is None]


def _command(block: Block, path: Path) -> list[str]:
    if block.run is None:
        return [sys.executable, str(path)]
    if block.run == "pytest":
        return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)]
    match = _TORCHRUN.match(block.run)
    if match is None:
        raise ValueError(
            f"{block.id}: unknown '# run: {block.run}'; use '# run: torchrun --nproc_per_node=N' "
            "or '# run: pytest', or no marker for plain python."
        )
    return torchrun(str(path), options=("--standalone", f"--nproc_per_node={match['n']}"))


@pytest.mark.parametrize("block", RUNNABLE, ids=[block.id for block in RUNNABLE])
def test_doc_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    path = tmp_path / block.file_name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(block.code, encoding="utf-8")
    cmd = _command(block, path)
    # A session of its own, so that a block that hangs is stopped with every process it started
    # (torchrun's workers, the Trainer's ranks), not only the first one.
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{block.id} did not finish within {TIMEOUT_S} s ({' '.join(cmd)}):\n{output[-4000:]}")
    assert proc.returncode == 0, (
        f"{block.id} exited with {proc.returncode} ({' '.join(cmd)}):\n{output[-4000:]}\n"
        f"Fix the example, or mark it '# fragment: <why>' on its first line."
    )


def test_collect_blocks_reads_markers_and_indented_fences_and_skips_other_languages(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "```python\nprint(1)\n```\n"
        "```bash\necho no\n```\n"
        "```text\nan output\n```\n"
        "- an item:\n\n  ```python\n  # fragment: inside a list\n  if x:\n      y()\n  ```\n"
        "```python\n# job.py\n# run: torchrun --nproc_per_node=3\nimport distkit\n```\n",
        encoding="utf-8",
    )
    blocks = collect_blocks(doc, root=tmp_path)
    assert [(b.id, b.fragment, b.run, b.file_name) for b in blocks] == [
        ("doc.md:1", None, None, "example.py"),
        ("doc.md:12", "inside a list", None, "example.py"),
        ("doc.md:17", None, "torchrun --nproc_per_node=3", "job.py"),
    ]
    assert blocks[1].code == "# fragment: inside a list\nif x:\n    y()\n"
    assert _command(blocks[2], tmp_path / "job.py")[-2:] == ["--nproc_per_node=3", str(tmp_path / "job.py")]


def test_every_fragment_marker_gives_a_reason_and_every_run_marker_is_known() -> None:
    problems = [f"{b.id}: '# fragment:' without a reason" for b in BLOCKS if b.fragment == ""]
    for block in BLOCKS:
        if block.fragment is not None and not block.code.lstrip().startswith("# fragment:"):
            problems.append(f"{block.id}: the fragment marker must be the first line, '# fragment: <why>'")
        if block.fragment is not None and block.run is not None:
            problems.append(f"{block.id}: a fragment with a '# run:' marker")
        if block.run is not None and block.run != "pytest" and not _TORCHRUN.match(block.run):
            problems.append(f"{block.id}: unknown '# run: {block.run}'")
    assert not problems, "\n".join(problems)


def test_the_first_readme_block_and_config_first_script_are_among_enough_runnable_blocks() -> None:
    runnable = [block.id for block in RUNNABLE]
    first_readme = next(block for block in BLOCKS if block.doc == "README.md")
    first_config = next(block for block in BLOCKS if block.doc == "docs/config.md")
    assert first_readme.id in runnable, runnable
    assert first_config.id in runnable, runnable
    assert "# train.py" in first_config.code  # "A first script", not another block moved first
    assert len(runnable) >= MIN_RUNNABLE, (
        f"only {len(runnable)} of {len(BLOCKS)} Python blocks run ({runnable}); expected at least "
        f"{MIN_RUNNABLE}. Make the examples run rather than marking them fragments."
    )
