"""Errors with a known cause, and how to say one in a line (and the words for an option
and a dtype that such lines use). The scripts print each as one line, with no traceback:
the user's to fix (:class:`UserError` and its kinds) with exit status 2, the others
with exit status 1."""

import re


def escape_breaks(text: str) -> str:
    """``text`` on one line, its line breaks written ``\\n`` (``\\r``): for a message
    of mpfp16's own, whose breaks can only come from a name in it, such as a path."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


def one_line(exc: BaseException) -> str:
    """An exception's message as one line: its first non-empty line (an OSError's
    reason alone), or the name of its type when it has no message. Errors re-raised from a DataLoader worker carry
    the worker's traceback; their last line is the message. A :class:`UserError`'s
    message is whole, its line breaks written ``\\n``: they can only come from a name in
    it, such as a path."""
    if isinstance(exc, OSError) and exc.strerror:  # "No such file or directory", not "[Errno 2] ..."
        return exc.strerror
    text = str(exc).strip()
    if "Original Traceback" in text:
        text = re.sub(r"^[\w.]+(Error|Exception): ", "", text.splitlines()[-1])
    elif isinstance(exc, UserError):
        # mpfp16's own messages are one line; a line break in one comes from what it
        # names (a path with a newline in it), which must not be cut at it.
        return escape_breaks(text) or type(exc).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def dtype_name(dtype) -> str | None:
    """A dtype as mpfp16 writes it, in messages and in what it saves: ``"float16"``."""
    return None if dtype is None else str(dtype).replace("torch.", "")


def library_words(name: str, value) -> str:
    """An option as the library's own API spells it, ``name=value``: the default wording
    of validators that front ends (the scripts' flags) word their own way."""
    return f"{name}={value!r}"


def compile_errors() -> tuple[type[BaseException], ...]:
    """What compiling a kernel with ``torch.compile`` can raise: dynamo's and inductor's
    own errors (a missing or broken C++ compiler arrives as InductorError), a compiler
    that cannot be run, and the recompile limit. Anything else is a bug and propagates.
    A function, not a constant, because naming these imports torch's compiler stack:
    call it only where a compile has run (``except compile_errors() as exc``)."""
    import subprocess

    import torch._dynamo.exc
    import torch._inductor.exc

    return (
        torch._dynamo.exc.TorchDynamoException,
        torch._dynamo.exc.FailOnRecompileLimitHit,
        torch._dynamo.exc.TritonUnavailableError,
        torch._inductor.exc.InvalidCxxCompiler,
        torch._inductor.exc.CppCompileError,
        torch._inductor.exc.OperatorIssue,
        subprocess.CalledProcessError,
        OSError,
    )


def last_error_line(output: str, skip: tuple[str, ...] = ()) -> str:
    """The line of a failed child process's output that says why: the last one-line
    error (``error: ...``, or argparse's ``prog: error: ...``), else the last
    ``SomeError: ...`` of a traceback, else the last line (a launcher such as torchrun
    prints its own summary after a worker's message, whose lines it tags ``[rankN]:``). Lines containing any of
    ``skip`` (known noise) are ignored."""
    # torchrun tags each line of a worker's stderr with "[rankN]: "
    lines = [re.sub(r"^\[(?:default)?rank\d+\]:\s*", "", line.strip()) for line in output.splitlines()
             if line.strip() and not any(s in line for s in skip)]
    errors = [line for line in lines if line.startswith("error:") or ": error: " in line]
    raised = [line for line in lines if re.match(r"^[\w.]*(Error|Exception): ", line)]
    return (errors or raised or lines or ["no output"])[-1]


class UserError(Exception):
    """A problem with the input: a flag, a path, a data set or a checkpoint."""


class DataError(UserError):
    """A data set that is missing, empty or in the wrong format."""


class CheckpointError(UserError):
    """A checkpoint that is missing, corrupt, unsafe or from another model."""


class ReplicaDivergenceError(RuntimeError):
    """Data-parallel ranks hold different weights, masters or optimizer state."""


class FusedStepUnavailable(RuntimeError):
    """``fused=True`` was asked for, and the fused step could not be compiled on
    some rank."""
