"""Every fenced code block in README.md and docs/*.md is run here, or checked against what is run.

How a block is treated depends on the HTML comment on the line right before its fence:

- no comment, a ``python`` block: run as a script at 1 rank (cwd: a temporary directory);
- ``<!-- run: 2 ranks -->`` (any N): a ``python`` block run under ``mpiexec -n N python -m mpi4py``;
  ``<!-- run: 2 ranks, needs deepspeed -->`` (modules separated by commas): the same, skipped
  with the reason when one of those modules is not installed (scripts/bootstrap.sh installs the
  training clients with ``MPICOMM_DEEPSPEED=1``, as scripts/test.sh does);
- ``<!-- excerpt: examples/NAME.py -->``: the block is a piece of that example, which
  tests/test_examples.py runs; every code line of the block (comments, blank lines and ``...``
  left out, whitespace and trailing ``# comments`` ignored) must be a line of the example, in the
  same order, so the excerpt cannot drift from the code that runs;
- a shell block (``bash``, ``sh``, ``console``) with no comment: every command in it is checked
  cheaply and safely, nothing is executed for real: ``scripts/*.sh`` must exist and be
  executable; ``python -m bench|ckpt|accelerators [PROGRAM]`` must accept ``--help`` and every
  ``--option`` of the line must appear in that help; ``python [-m mpi4py] examples/NAME.py``
  must name an example the suite runs; ``python -m pytest``/``scripts/mpi_pytest.py`` lines must
  name existing test files; launchers (``mpiexec``/``srun``/``scripts/mpirun.sh``, their options),
  ``VAR=value`` prefixes and ``# comments`` are skipped;
- ``<!-- not run: REASON -->``: nothing is checked (commands for another machine, e.g. a
  cluster's module system); say why;
- ``<!-- output: COMMAND -->``: a sample of what COMMAND prints (a ``text`` block); COMMAND is
  checked as a shell command above.

Any other block fails with a message that says which of these to use.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass

import pytest

from mpitest import mpiexec_cmd

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON = ("python", "py", "python3")
SHELL = ("bash", "sh", "shell", "console")
MODULES = ("bench", "ckpt", "accelerators")   # python -m MOD [PROGRAM] --help is cheap and safe
MARKER = re.compile(r"^\s*<!--\s*(excerpt|run|not run|output)\s*:\s*(.*?)\s*-->\s*$")
HOW = ("mark it (on the line right before the fence) with one of: "
       "<!-- excerpt: examples/NAME.py --> (its code lines must be lines of that example, in "
       "order), <!-- run: 2 ranks --> (a python block that needs ranks), <!-- output: COMMAND --> "
       "(a sample of what COMMAND prints), <!-- not run: REASON --> (commands for another "
       "machine); or make it a python block that runs as a script at 1 rank "
       "(see tests/test_docs.py's docstring)")


@dataclass
class Block:
    page: pathlib.Path
    line: int             # 1-based line of the opening fence
    lang: str
    code: str
    marker: tuple[str, str] | None   # (kind, argument) of the comment before the fence

    @property
    def where(self) -> str:
        return f"{_rel(self.page)}:{self.line}"


def _rel(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)


def parse_blocks(page: pathlib.Path) -> list[Block]:
    """The fenced blocks of one markdown page (fences may be indented, as in list items)."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            text = lines[i]
            body.append(text[len(indent):] if text.startswith(indent) else text.lstrip())
            i += 1
        if i >= len(lines):
            raise AssertionError(f"{_rel(page)}:{start + 1}: code block never closed")
        i += 1
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = MARKER.match(prev)
        blocks.append(Block(page, start + 1, lang, "\n".join(body) + "\n",
                            (mark.group(1), mark.group(2)) if mark else None))
    return blocks


BLOCKS = [b for page in PAGES for b in parse_blocks(page)]
#: pages whose blocks run on every MPI in CI (what the MPI library changes: ULFM, the backend's
#: transport); the other pages' blocks are marked ``once`` (their code is tested on every MPI by
#: the suite itself)
EVERY_MPI = ("elastic.md", "horovod.md", "collectives.md", "torch-backend.md")


# ---------------------------------------------------------------------------------------------
# excerpts

def _code_line(text: str) -> str:
    """A line as compared: trailing ``# comment`` and surrounding whitespace removed, inner
    whitespace collapsed; '' for a comment, a blank line or ``...``."""
    text = re.sub(r"\s+#\s.*$|\s+#$", "", text).strip()
    if text.startswith("#") or text in ("", "..."):
        return ""
    return " ".join(text.split())


def _examples_run_by_suite() -> set[pathlib.Path]:
    from test_examples import EXAMPLES

    return {pathlib.Path(p).resolve() for p in EXAMPLES}


def check_excerpt(block: Block, name: str) -> None:
    path = (ROOT / name).resolve()
    assert path.is_file(), f"{block.where}: <!-- excerpt: {name} --> names no file ({HOW})"
    assert path in _examples_run_by_suite(), (
        f"{block.where}: <!-- excerpt: {name} -->: {name} is not run by tests/test_examples.py; "
        f"an excerpt must come from an example in examples/ that the suite runs")
    example = [c for c in map(_code_line, path.read_text().splitlines()) if c]
    at = 0
    for raw in block.code.splitlines():
        want = _code_line(raw)
        if not want:
            continue
        try:
            at = example.index(want, at) + 1
        except ValueError:
            hint = ("it is in the example, but earlier than the line before it: keep the "
                    "excerpt's lines in the example's order") if want in example else (
                "it is not a line of the example: copy the line from the example (comments "
                "and whitespace may differ), or change the example and the excerpt together")
            raise AssertionError(f"{block.where}: excerpt of {name}: line {raw.strip()!r}: "
                                 f"{hint}") from None


# ---------------------------------------------------------------------------------------------
# shell commands: checked, never executed (apart from --help)

@functools.lru_cache(maxsize=None)
def _help(module: str, program: str | None) -> str:
    cmd = [sys.executable, "-m", module, *([program] if program else []), "--help"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(cmd[1:])} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _commands(code: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and prompts removed."""
    out, pending = [], ""
    for line in code.splitlines():
        line = re.sub(r"^\$\s+", "", line.strip())
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            words = line.split()
        if words:
            out.append(shlex.join(words))
    return out


_LAUNCHER_OPTS_WITH_VALUE = {"-n", "-np", "--ntasks", "--ntasks-per-node", "--map-by", "--mpi",
                             "-N", "--nodes", "--hostfile", "--mpiexec"}


def _strip_launcher(words: list[str]) -> list[str]:
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):   # VAR=value prefixes
        words = words[1:]
    if words and os.path.basename(words[0]) in ("mpiexec", "mpirun", "srun", "mpirun.sh",
                                                "timeout"):
        words = words[1:]
        while words and words[0].startswith("-"):
            opt = words.pop(0)
            if opt in _LAUNCHER_OPTS_WITH_VALUE and "=" not in opt and words:
                words.pop(0)
        if words and re.match(r"^\d+[smh]?$", words[0]):   # timeout's duration
            words = words[1:]
    return words


def check_command(where: str, command: str) -> None:
    words = _strip_launcher(shlex.split(command))
    if not words:
        return
    head = words[0]
    if head.endswith(".sh"):
        script = (ROOT / head).resolve()
        assert script.is_file() and os.access(script, os.X_OK), (
            f"{where}: {head}: no such executable script in the repository")
        if script.name == "mpirun.sh":
            check_command(where, shlex.join(["mpirun.sh", *words[1:]]))
        return
    if head in ("python", "python3"):
        args = words[1:]
        if args[:2] == ["-m", "mpi4py"]:
            args = args[2:]
        if args[:1] == ["-c"]:
            return
        if args[:2] == ["-m", "pytest"] or args[:1] == ["scripts/mpi_pytest.py"]:
            files = [a for a in args if a.startswith("tests/")]
            missing = [f for f in files if not (ROOT / f).exists()]
            assert files and not missing, (
                f"{where}: {command!r}: expected pytest on existing test files, missing {missing}")
            return
        if args[:1] == ["-m"] and len(args) > 1:
            module, rest = args[1], args[2:]
            assert module in MODULES, (
                f"{where}: {command!r}: python -m {module} is not a program of this project "
                f"({', '.join(MODULES)}); {HOW}")
            program = rest[0] if rest and not rest[0].startswith("-") and module != "accelerators" else None
            if module == "bench" and program == "netsim" and "--" in rest:
                inner = rest[rest.index("--") + 1:]
                check_command(where, shlex.join(["python", "-m", "bench", *inner]))
                rest = rest[:rest.index("--")]
            text = _help(module, program)
            for opt in (w.split("=")[0] for w in rest if w.startswith("--")):
                assert opt == "--help" or re.search(re.escape(opt) + r"\b", text), (
                    f"{where}: {command!r}: option {opt} is not in "
                    f"`python -m {module}{' ' + program if program else ''} --help`")
            return
        if args and args[0].endswith(".py") and args[0].startswith("examples/"):
            path = (ROOT / args[0]).resolve()
            assert path in _examples_run_by_suite(), (
                f"{where}: {command!r}: {args[0]} is not an example that tests/test_examples.py "
                f"runs; {HOW}")
            return
    raise AssertionError(f"{where}: command {command!r} is neither run nor checked here; {HOW}")


# ---------------------------------------------------------------------------------------------
# the test

def _run_python(block: Block, ranks: int, tmp_path: pathlib.Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(block.code)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONWARNINGS="ignore::FutureWarning", OMP_NUM_THREADS="1")
    cmd = ([*mpiexec_cmd(ranks), sys.executable, "-m", "mpi4py", str(script)] if ranks > 1
           else [sys.executable, str(script)])
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (
        f"{block.where}: the python block failed at {ranks} rank(s) (exit {proc.returncode}); "
        f"fix it, or {HOW}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")


def _run_marker(block: Block, arg: str) -> tuple[int, list[str]]:
    """The ranks and the modules a ``<!-- run: N ranks[, needs MOD, ...] -->`` block needs."""
    m = re.fullmatch(r"(\d+) ranks?(?:,\s*needs\s+([\w.]+(?:\s*,\s*[\w.]+)*))?", arg)
    assert m and block.lang in PYTHON, (
        f"{block.where}: expected <!-- run: N ranks --> or <!-- run: N ranks, needs MODULE --> "
        f"before a python block, got <!-- run: {arg} --> before a {block.lang or 'plain'} block")
    return int(m.group(1)), [n.strip() for n in (m.group(2) or "").split(",") if n.strip()]


@pytest.mark.parametrize("block", [pytest.param(b, marks=() if b.page.name in EVERY_MPI else pytest.mark.once)
                                   for b in BLOCKS], ids=[b.where for b in BLOCKS])
def test_code_block(block: Block, tmp_path):
    kind, arg = block.marker or (None, None)
    if kind == "excerpt":
        check_excerpt(block, arg)
    elif kind == "not run":
        assert arg, f"{block.where}: <!-- not run: REASON -->: say why the block cannot run"
    elif kind == "output":
        assert block.code.strip(), f"{block.where}: empty output sample"
        check_command(block.where, arg)
    elif kind == "run":
        ranks, needs = _run_marker(block, arg)
        missing = [name for name in needs if importlib.util.find_spec(name) is None]
        if missing:
            pytest.skip(f"{block.where}: needs {', '.join(missing)}, not installed here "
                        "(scripts/bootstrap.sh installs the clients with MPICOMM_DEEPSPEED=1)")
        _run_python(block, ranks, tmp_path)
    elif block.lang in PYTHON:
        _run_python(block, 1, tmp_path)
    elif block.lang in SHELL:
        for command in _commands(block.code):
            check_command(block.where, command)
    else:
        raise AssertionError(f"{block.where}: a {block.lang or 'plain'} block is neither run nor "
                             f"checked; {HOW}")


def test_parser_sees_markers_and_indented_fences(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n\n<!-- excerpt: examples/x.py -->\n```python\nx = 1\n```\n\n"
                    "- item:\n\n  ```bash\n  ls  # list\n  ```\n")
    a, b = parse_blocks(page)
    assert (a.lang, a.code, a.marker) == ("python", "x = 1\n", ("excerpt", "examples/x.py"))
    assert (b.lang, b.code, b.marker) == ("bash", "ls  # list\n", None)


def test_run_marker_names_ranks_and_needed_modules(tmp_path):
    block = Block(ROOT / "README.md", 1, "python", "pass\n", None)
    assert _run_marker(block, "2 ranks") == (2, [])
    assert _run_marker(block, "2 ranks, needs lightning, torch.distributed") == (
        2, ["lightning", "torch.distributed"])
    with pytest.raises(AssertionError, match="expected <!-- run: N ranks -->"):
        _run_marker(block, "2 ranks, lightning")
    missing = Block(ROOT / "README.md", 1, "python", "raise SystemExit(1)\n",
                    ("run", "2 ranks, needs no_such_module_here"))
    with pytest.raises(pytest.skip.Exception, match="needs no_such_module_here, not installed"):
        test_code_block(missing, tmp_path)


def test_excerpt_check_catches_drift(tmp_path):
    example = sorted(_examples_run_by_suite())[0]
    lines = [c for c in example.read_text().splitlines() if _code_line(c)]
    good = Block(ROOT / "README.md", 1, "python", "\n".join([lines[0], "...", lines[2]]) + "\n",
                 ("excerpt", str(example.relative_to(ROOT))))
    check_excerpt(good, str(example.relative_to(ROOT)))
    for code in (lines[2] + "\n" + lines[0] + "\n", "not_in_the_example(1)\n"):
        with pytest.raises(AssertionError, match="excerpt of"):
            check_excerpt(Block(ROOT / "README.md", 1, "python", code, None),
                          str(example.relative_to(ROOT)))


def test_command_check_catches_unknown_options():
    check_command("x", "mpiexec -n 2 python -m mpi4py -m bench zero --parts time")
    with pytest.raises(AssertionError, match="option --no-such-option"):
        check_command("x", "python -m bench zero --no-such-option 3")
    with pytest.raises(AssertionError, match="no such executable script"):
        check_command("x", "./scripts/no-such.sh")
    with pytest.raises(AssertionError, match="neither run nor checked"):
        check_command("x", "rm -rf /tmp/something")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
    text = re.sub(r"(?ms)^\s*(```|~~~).*?^\s*\1", "", page.read_text())   # not in code blocks
    return {_slug(m.group(1)) for m in re.finditer(r"(?m)^#+\s+(.*)$", text)}


@pytest.mark.once
@pytest.mark.parametrize("page", PAGES, ids=[_rel(p) for p in PAGES])
def test_links_resolve(page):
    """Every relative link of a page names a file that exists, and a heading in it for #anchors."""
    text = re.sub(r"(?ms)^\s*(```|~~~).*?^\s*\1", "", page.read_text())
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor} in {_rel(dest)}")
    assert not bad, f"{_rel(page)}: broken links: " + "; ".join(bad)


def test_link_check_catches_a_broken_anchor(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Title: one (two)\n\n[ok](#title-one-two) [bad](#nowhere) [gone](missing.md)\n")
    with pytest.raises(AssertionError) as exc:
        test_links_resolve(page)
    assert "#nowhere" in str(exc.value) and "missing.md: no such file" in str(exc.value)
    assert "title-one-two" not in str(exc.value)


def test_readme_fits_a_screen_before_its_links():
    """The README says what mpicomm is and how to start, then points into docs/ (issue 31)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    first = next((i + 1 for i, line in enumerate(lines) if "](docs/" in line), None)
    assert first is not None and first <= 60, (
        f"README.md: the first link into docs/ is at line {first}; keep it within 60 lines "
        "(move details into docs/)")
    assert len(lines) < 150, f"README.md has {len(lines)} lines; keep it under 150"
