"""The README and the guides stay true to the code.

- Every command in a shell code block (```bash, ```sh, ```shell, ```console) of README.md,
  CONTRIBUTING.md and docs/*.md is checked, one case per line of a file: a Python
  program's arguments are parsed by the program's own argparse parser, without running
  the program; torchrun's options by torchrun's parser; pytest's by pytest's; a
  `pip install` of mpfp16 names only extras that setup.py declares; `./setup.sh` is
  there and executable. Any other program must be in ALLOWED, with its reason.
- Every relative link in those files leads to a file that exists (and to a heading
  that exists, for a link with an anchor into a markdown file), and every repository
  path they name (tests/..., docs/..., examples/..., mpfp16/...) exists.
- The README's Python example runs as it is shown.

A parse is in-process: argparse's ``parse_args`` is patched so that the program's first
parse raises a private exception once it has succeeded, and the program is run with
runpy up to that point (its imports and its parser; nothing after). A flag the program
does not know, a bad choice or a missing argument fails the case with the command and
argparse's own message. Checks that a program makes after its parse (a data path that
must exist, a flag that contradicts another) are not made here: those need the machine
the command is meant for.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import os
import re
import runpy
import shlex
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}

# Programs whose commands are not checked, each with the reason. A program not named here
# and not one of the kinds below fails its case: check it, or list it.
ALLOWED = {
    "git": "git's own command line; nothing of this project's to check",
    "tc": "Linux traffic control's own command line; nothing of this project's to check",
    "ip": "iproute2's own command line; nothing of this project's to check",
    "ls": "lists files; nothing to check",
    "cat": "prints files; nothing to check",
    "cd": "a shell builtin; nothing to check",
    "export": "a shell builtin; nothing to check",
    "mkdir": "makes a folder; nothing to check",
    "nvidia-smi": "the GPU driver's tool; nothing of this project's to check",
    "lint-imports": "import-linter, with pyproject.toml's contracts; tests/test_layers.py runs it",
}

# Python programs whose arguments cannot be parsed here without running them (their parse
# comes after heavy work, or they do not use argparse), by script path (from the
# repository root) or module name, each with the reason. None today.
NOT_PARSEABLE: dict[str, str] = {}

# Words that only prefix the command they run.
PREFIXES = {"sudo", "env", "time", "nohup"}

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")


@dataclasses.dataclass
class Block:
    lang: str
    start: int  # the line number (1-based) of the block's first line of content
    lines: list[str]


def doc_files() -> list[str]:
    """README.md, CONTRIBUTING.md and every docs/*.md, as paths from the repository root."""
    files = [name for name in ("README.md", "CONTRIBUTING.md") if (ROOT / name).is_file()]
    return files + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))


def fenced_blocks(name: str) -> list[Block]:
    blocks, current, fence, indent = [], None, "", 0
    for number, line in enumerate((ROOT / name).read_text(encoding="utf-8").splitlines(), 1):
        match = _FENCE.match(line)
        if current is None:
            if match:
                fence, indent = match["fence"], len(match["indent"])
                current = Block(match["lang"].lower(), number + 1, [])
        elif match and match["fence"][0] == fence[0] and len(match["fence"]) >= len(fence) and not match["lang"]:
            blocks.append(current)
            current = None
        else:
            current.lines.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())
    return blocks


def strip_comment(line: str) -> str:
    """``line`` without a comment: from an unquoted ``#`` that starts a word."""
    quote, escaped = None, False
    for i, char in enumerate(line):
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def command_lines(block: Block) -> list[tuple[int, str]]:
    """(line number, command line) for each command line of a shell block: continued lines
    joined, comments dropped, blank lines skipped, a ``$ `` prompt stripped. In a console
    block with prompts, only the prompted lines (and their continuations) are commands."""
    prompted = block.lang == "console" and any(line.startswith("$ ") for line in block.lines)
    out, pending, first = [], "", 0
    for number, raw in enumerate(block.lines, block.start):
        if not pending:
            if prompted and not raw.startswith("$ "):
                continue  # a console block's output
            raw = raw.removeprefix("$ ")
            first = number
        line = strip_comment(raw).rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        if text:
            out.append((first, text))
    if pending.strip():
        out.append((first, pending.strip()))
    return out


def cases() -> list[tuple[str, int, str]]:
    return [(name, number, text) for name in doc_files() for block in fenced_blocks(name)
            if block.lang in SHELL_LANGUAGES for number, text in command_lines(block)]


CASES = cases()


# --------------------------------------------------------------------- splitting a line

_SEPARATORS = {"&&", "||", ";", "|", "&", "|&"}
_REDIRECTS = {">", ">>", "<", ">&", "&>", "<&", ">|", "&>>"}


def simple_commands(text: str) -> list[list[str]]:
    """The simple commands of a command line (split at ``&&``, ``||``, ``;`` and pipes),
    each as its words, without redirections."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, ""
    commands, words, tokens = [], [], list(lexer)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token in _SEPARATORS:
            commands.append(words)
            words = []
        elif token in _REDIRECTS:
            if words and words[-1].isdigit():
                words.pop()  # 2> FILE: the 2 is the redirection's
            i += 1  # its target
        elif token in ("(", ")", "((", "))"):
            pytest.fail(f"{text!r}: subshells are not understood by this test; write the command plainly",
                        pytrace=False)
        else:
            words.append(token)
        i += 1
    commands.append(words)
    return [c for c in commands if c]


def _program(words: list[str]) -> list[str]:
    """Without the environment assignments and prefixes (``sudo``, ``env``) before it."""
    while words:
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
            words = words[1:]
        elif os.path.basename(words[0]) in PREFIXES:
            words = words[1:]
            while words and words[0].startswith("-"):
                words = words[1:]
        else:
            break
    return words


# --------------------------------------------------------------------- parsing a program


class _Parsed(Exception):
    def __init__(self, namespace, extras):
        super().__init__()
        self.namespace, self.extras = namespace, extras


class _ParseError(Exception):
    pass


@contextlib.contextmanager
def _first_parse_raises():
    """While active, the first top-level ``parse_args`` / ``parse_known_args`` of any
    argparse parser raises _Parsed once it succeeds, and a parser error raises _ParseError
    with argparse's message instead of exiting."""
    cls = argparse.ArgumentParser
    parse_args, parse_known_args, error = cls.parse_args, cls.parse_known_args, cls.error
    depth = [0]

    def parsing(original, returns_extras):
        def parse(self, args=None, namespace=None):
            if depth[0]:
                return original(self, args, namespace)
            depth[0] += 1
            try:
                result = original(self, args, namespace)
            finally:
                depth[0] -= 1
            namespace, extras = result if returns_extras else (result, [])
            raise _Parsed(namespace, extras)
        return parse

    def raise_error(self, message):
        raise _ParseError(f"{self.prog}: error: {message}")

    cls.parse_args, cls.parse_known_args = parsing(parse_args, False), parsing(parse_known_args, True)
    cls.error = raise_error
    try:
        yield
    finally:
        cls.parse_args, cls.parse_known_args, cls.error = parse_args, parse_known_args, error


def _require(condition, message: str) -> None:
    if not condition:
        pytest.fail(message, pytrace=False)


def parse_program(command: str, argv: list[str], *, script: str | None = None, module: str | None = None) -> None:
    """Run ``script`` (a path from the repository root) or ``module`` as ``__main__`` with
    ``argv``, up to its first argparse parse, and fail the case if that parse fails."""
    name = script if script is not None else module
    if name in NOT_PARSEABLE:
        exists = (ROOT / script).is_file() if script is not None else _module_exists(module)
        _require(exists, f"{command}: {name} does not exist")
        return  # listed, with its reason, in NOT_PARSEABLE
    if script is not None and not (ROOT / script).is_file():
        pytest.fail(f"{command}: {script} does not exist", pytrace=False)
    saved_argv, out = sys.argv, io.StringIO()
    sys.argv = [script if script is not None else module, *argv]
    failure = (f"{name} ran to its end without an argparse parse: list it in NOT_PARSEABLE with the "
               "reason")
    try:
        with _first_parse_raises(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), \
                warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*found in sys.modules.*", category=RuntimeWarning)
            if script is not None:
                runpy.run_path(str(ROOT / script), run_name="__main__")
            else:
                runpy.run_module(module, run_name="__main__", alter_sys=False)
    except _Parsed as parsed:
        failure = f"unrecognized arguments: {' '.join(parsed.extras)}" if parsed.extras else None
    except _ParseError as exc:
        failure = str(exc)
    except SystemExit as exc:  # --help or --version printed and exited 0; anything else is a failure
        failure = None if exc.code in (0, None) else f"exited with {exc.code} before its parse:\n{out.getvalue()}"
    finally:
        sys.argv = saved_argv
    if failure:
        pytest.fail(f"{command}:\n{failure}", pytrace=False)


def _module_exists(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _raising(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    def error(message):
        raise _ParseError(f"{parser.prog}: error: {message}")

    parser.error = error
    return parser


def check_torchrun(command: str, argv: list[str]) -> None:
    """torchrun's options by torchrun's own parser; then the program it starts."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "torchrun"
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args, failure = _raising(parser).parse_args(argv), None
    except _ParseError as exc:
        failure = str(exc)
    if failure:
        pytest.fail(f"{command}:\n{failure}", pytrace=False)
    if args.no_python:
        pytest.fail(f"{command}: torchrun --no-python is not understood by this test", pytrace=False)
    if args.module:
        parse_program(command, args.training_script_args, module=args.training_script)
    else:
        parse_program(command, args.training_script_args, script=args.training_script)


def check_pytest(command: str, argv: list[str], config) -> None:
    """pytest's options by this session's own pytest parser (its plugins' options
    included); the files named exist; a -m expression names registered markers."""
    from _pytest.config.exceptions import UsageError
    from _pytest.mark import expression as match_expression

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            namespace, failure = config._parser.parse(argv), None
    except UsageError as exc:
        failure = str(exc)
    if failure:
        pytest.fail(f"{command}:\n{failure}", pytrace=False)
    for target in getattr(namespace, "file_or_dir", None) or []:
        path = target.split("::")[0]
        _require((ROOT / path).exists(), f"{command}: {path} does not exist")
    markers = {line.split(":")[0].split("(")[0].strip() for line in config.getini("markers")}
    for option in ("markexpr", "keyword"):
        expression = getattr(namespace, option, "") or ""
        if not expression:
            continue
        try:
            compiled, failure = match_expression.Expression.compile(expression), None
        except (SyntaxError, getattr(match_expression, "ParseError", SyntaxError)) as exc:  # ParseError: pytest < 9
            failure = f"{expression!r}: {exc}"
        if failure:
            pytest.fail(f"{command}:\n{failure}", pytrace=False)
        if option == "markexpr":
            names = (set(compiled.idents()) if hasattr(compiled, "idents")
                     else set(re.findall(r"[A-Za-z_]\w*", expression)) - {"and", "or", "not"})
            unknown = sorted(names - markers)
            _require(not unknown, f"{command}: -m names markers that are not registered: {unknown}")


@functools.lru_cache(maxsize=1)
def declared_extras() -> frozenset[str]:
    """The extras mpfp16 declares: setup.py's extras_require (setup.py run with
    setuptools.setup recording its arguments) and pyproject.toml's
    [project.optional-dependencies], if any."""
    import tomllib

    import setuptools

    seen: dict = {}
    setup, cwd = setuptools.setup, os.getcwd()
    setuptools.setup = lambda **kwargs: seen.update(kwargs)
    try:
        os.chdir(ROOT)
        runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    finally:
        setuptools.setup = setup
        os.chdir(cwd)
    extras = set(seen.get("extras_require") or {})
    project = tomllib.loads((ROOT / "pyproject.toml").read_text()).get("project", {})
    extras |= set(project.get("optional-dependencies", {}))
    return frozenset(extras)


_PIP_VALUE_OPTIONS = {"-r", "--requirement", "-c", "--constraint", "-i", "--index-url", "--extra-index-url",
                      "-f", "--find-links", "-t", "--target", "--prefix", "--root", "--platform",
                      "--python-version", "--only-binary", "--no-binary", "--upgrade-strategy", "-C",
                      "--config-settings", "--src", "--progress-bar"}


def check_pip(command: str, argv: list[str]) -> None:
    """A ``pip install`` of mpfp16 (``mpfp16[X]``, ``.[X]``, ``-e '.[X]'``) names only
    extras that mpfp16 declares; other requirements are well formed; a requirements file
    named exists."""
    from packaging.requirements import InvalidRequirement, Requirement

    _require(argv and argv[0] == "install", f"{command}: only `pip install` is understood by this test")
    words, i = argv[1:], 0
    requirements = []
    while i < len(words):
        word = words[i]
        if word in ("-e", "--editable"):
            requirements.append(words[i + 1])
            i += 1
        elif word in ("-r", "--requirement"):
            _require((ROOT / words[i + 1]).is_file(), f"{command}: {words[i + 1]} does not exist")
            i += 1
        elif word in _PIP_VALUE_OPTIONS:
            i += 1
        elif not word.startswith("-"):
            requirements.append(word)
        i += 1
    for requirement in requirements:
        match = re.fullmatch(r"(?P<target>[^\[\]<>=!~;@\s]+)(?:\[(?P<extras>[^\]]*)\])?(?P<rest>.*)", requirement)
        target, extras = match["target"], [e.strip() for e in (match["extras"] or "").split(",") if e.strip()]
        ours = target.lower() == "mpfp16" or (target.startswith(".") and (ROOT / target).resolve() == ROOT)
        if ours:
            unknown = sorted(set(extras) - declared_extras())
            _require(not unknown, f"{command}: mpfp16 declares no extra {', '.join(unknown)} (setup.py's "
                     f"extras_require has {', '.join(sorted(declared_extras()))})")
        elif not re.match(r"[./]|\w+://", target):
            try:
                Requirement(requirement)
            except InvalidRequirement as exc:
                failure = f"{requirement!r}: {exc}"
            else:
                failure = None
            if failure:
                pytest.fail(f"{command}:\n{failure}", pytrace=False)


def check_python(command: str, argv: list[str], config) -> None:
    """``python [options] X.py ...`` or ``python -m mod ...``."""
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-m", "-c"):
        i += 2 if argv[i] in ("-X", "-W") else 1
    argv = argv[i:]
    _require(argv, f"{command}: an interactive Python is not a command to show")
    if argv[0] == "-c":
        pytest.fail(f"{command}: python -c has no parser to check; list it in NOT_PARSEABLE", pytrace=False)
    if argv[0] != "-m":
        parse_program(command, argv[1:], script=argv[0])
        return
    module, rest = argv[1], argv[2:]
    if module == "pytest":
        check_pytest(command, rest, config)
    elif module == "pip":
        check_pip(command, rest)
    elif module in ("torch.distributed.run", "torch.distributed.launch"):
        check_torchrun(command, rest)
    else:
        parse_program(command, rest, module=module)


def check_command(command: str, words: list[str], config) -> None:
    words = _program(words)
    if not words:
        return
    program = os.path.basename(words[0])
    if words[0] in ("./setup.sh", "setup.sh") or words[0].endswith("/setup.sh"):
        setup = ROOT / "setup.sh"
        _require(setup.is_file() and os.access(setup, os.X_OK),
                 f"{command}: setup.sh is missing or not executable")
    elif re.fullmatch(r"python(\d+(\.\d+)*)?", program):
        check_python(command, words[1:], config)
    elif program == "torchrun":
        check_torchrun(command, words[1:])
    elif program in ("pytest", "py.test"):
        check_pytest(command, words[1:], config)
    elif re.fullmatch(r"pip(\d+(\.\d+)*)?", program):
        check_pip(command, words[1:])
    elif program not in ALLOWED:
        pytest.fail(f"{command}: {program} is neither checked by this test nor listed in ALLOWED with a reason",
                    pytrace=False)


@pytest.mark.parametrize("doc, line, text", CASES, ids=[f"{doc}:{line}" for doc, line, _ in CASES])
def test_a_documented_command_parses(doc, line, text, pytestconfig):
    """Each command of this line of ``doc`` is one that its program accepts."""
    for words in simple_commands(text):
        check_command(f"{doc}:{line}: {' '.join(words)}", words, pytestconfig)


def test_the_commands_are_found():
    """The extraction itself works: the README's two commands are among the cases, and
    every kind of file has some."""
    texts = {(doc, text) for doc, _, text in CASES}
    assert ("README.md", "./setup.sh && .venv/bin/python train_cifar.py") in texts
    assert ("README.md", "./setup.sh && .venv/bin/python -m pytest -q") in texts
    assert {doc for doc, _, _ in CASES} >= {"README.md", "CONTRIBUTING.md", "docs/BANDWIDTH.md"}


def test_the_splitting_of_a_block():
    block = Block("console", 10, ["$ python a.py --x 1 \\", "    --y 'a # b'  # a comment", "output line",
                                  "$ git log && ls -l | cat > out.txt 2>&1", "", "$ # only a comment"])
    assert command_lines(block) == [(10, "python a.py --x 1      --y 'a # b'"),
                                    (13, "git log && ls -l | cat > out.txt 2>&1")]
    assert simple_commands("git log && ls -l | cat > out.txt 2>&1") == [["git", "log"], ["ls", "-l"], ["cat"]]
    assert simple_commands("A=1 B='x y' torchrun a.py") == [["A=1", "B=x y", "torchrun", "a.py"]]
    assert _program(["A=1", "sudo", "-E", "python", "a.py"]) == ["python", "a.py"]
    assert strip_comment("--rdzv-endpoint host:29400#x # c") == "--rdzv-endpoint host:29400#x "


def test_a_bad_flag_fails_the_parse(pytestconfig):
    """The check has teeth: a flag the program does not know, a bad choice, a bad
    torchrun option and an undeclared extra each fail, with argparse's message."""
    for command, message in (("python train_cifar.py --no-such-flag", "unrecognized arguments: --no-such-flag"),
                             ("python -m mpfp16.bench.step --optimizer lamb", "invalid choice: 'lamb'"),
                             ("torchrun --no-such-option train_cifar.py", "unrecognized arguments"),
                             ("python -m pytest --no-such-option", "unrecognized arguments"),
                             ("pip install 'mpfp16[no-such-extra]'", "declares no extra no-such-extra")):
        with pytest.raises(pytest.fail.Exception, match=re.escape(message)):
            for words in simple_commands(command):
                check_command(command, words, pytestconfig)


# --------------------------------------------------------------------- links and paths

_LINK = re.compile(r"!?\[[^\]]*\]\((?P<target><[^>]+>|[^)\s]+)(?:\s+\"[^\"]*\")?\)")
_REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*(?P<target>\S+)")
# Files that a link may name before they exist, with the reason.
# Files the docs link to before they are written (each with why); empty when every guide exists.
PENDING: dict[str, str] = {}


def _prose(name: str) -> list[tuple[int, str]]:
    """(line number, line) of ``name`` outside its fenced code blocks."""
    out, fence = [], None
    for number, line in enumerate((ROOT / name).read_text(encoding="utf-8").splitlines(), 1):
        match = _FENCE.match(line)
        if match and (fence is None or (match["fence"][0] == fence[0] and not match["lang"])):
            fence = match["fence"] if fence is None else None
        elif fence is None:
            out.append((number, re.sub(r"`[^`]*`", "", line)))
    return out


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown file."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match[1].strip().lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


@pytest.mark.parametrize("doc", doc_files())
def test_the_relative_links_resolve(doc):
    broken, pending = [], []
    for number, line in _prose(doc):
        for match in [*_LINK.finditer(line), *_REFERENCE.finditer(line)]:
            target = match["target"].strip("<>")
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                continue  # http:, https:, mailto:
            path, _, anchor = target.partition("#")
            file = (ROOT / doc).parent / path if path else ROOT / doc
            relative = os.path.relpath(file.resolve(), ROOT)
            if not file.exists():
                (pending if relative in PENDING else broken).append(f"{doc}:{number}: {target}")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{doc}:{number}: {target} (no heading for #{anchor})")
    assert not broken, "links to nothing:\n" + "\n".join(broken)
    if pending:
        pytest.xfail("links to files not written yet (PENDING): " + ", ".join(pending))


# Repository paths named in the docs that are not this repository's files, with the reason.
NAMED_ELSEWHERE = {
    "docs/img/sharding_trajectory_nN_clipC.json": "a pattern: N ranks, clipping C",
    "docs/img/sharding_trajectory_nN_clipC.png": "a pattern: N ranks, clipping C",
    "examples/FP16_Optimizer_simple/distributed_apex/distributed_data_parallel.py": "a path in apex's repository",
}
_PATH = re.compile(r"(?<![\w/.-])((?:docs|tests|examples|mpfp16)/[\w/.-]*\w\.(?:py|md|json|png|sh))")


@pytest.mark.parametrize("doc", doc_files())
def test_the_files_named_exist(doc):
    """A guarantee that names its test names a test that exists."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    missing = sorted({p for p in _PATH.findall(text) if p not in NAMED_ELSEWHERE and not (ROOT / p).exists()})
    pending = [p for p in missing if p in PENDING]
    missing = [p for p in missing if p not in PENDING]
    assert not missing, f"{doc} names files that do not exist: {missing}"
    if pending:
        pytest.xfail("names files not written yet (PENDING): " + ", ".join(pending))


# --------------------------------------------------------------------- the README's example


def test_the_readme_python_example_runs(tmp_path, monkeypatch):
    """The README's one Python block, run as shown (in a temporary folder, for its
    checkpoint file): the model learns, and the state_dict saves and loads."""
    import torch

    blocks = [b for b in fenced_blocks("README.md") if b.lang == "python"]
    assert len(blocks) == 1, "the README shows one Python example"
    (block,) = blocks
    assert sum(1 for line in block.lines if line.strip()) <= 20, "the README's example is at most 20 lines"
    code = compile("\n" * (block.start - 1) + "\n".join(block.lines), str(ROOT / "README.md"), "exec")
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__readme__"}
    with torch.random.fork_rng(), contextlib.redirect_stdout(io.StringIO()) as out:
        exec(code, namespace)  # noqa: S102 (the README's own example)
    opt, loss = namespace["opt"], namespace["loss"]
    assert isinstance(opt, __import__("mpfp16").FP16Optimizer)
    assert loss.dtype == torch.float32 and loss.item() < 0.5, out.getvalue()  # chance: ln 4 = 1.39
    assert opt.skipped_steps < 10 and "loss" in out.getvalue()
    assert (tmp_path / "opt.pt").is_file()


def test_the_distributed_guide_example_runs_in_one_process(monkeypatch):
    """docs/DISTRIBUTED.md's first Python block, run as shown in a process without
    torchrun's variables: it runs alone, as its text says, and takes its step."""
    import torch

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    block = next(b for b in fenced_blocks("docs/DISTRIBUTED.md") if b.lang == "python")
    code = compile("\n" * (block.start - 1) + "\n".join(block.lines), str(ROOT / "docs/DISTRIBUTED.md"), "exec")
    namespace = {"__name__": "__guide__"}
    with torch.random.fork_rng(), contextlib.redirect_stdout(io.StringIO()):
        exec(code, namespace)  # noqa: S102 (the guide's own example)
    assert namespace["stats"] is None and not namespace["info"].distributed
    assert namespace["opt"].skipped_steps == 0 and torch.isfinite(namespace["loss"])
