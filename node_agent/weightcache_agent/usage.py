"""What every `weightcache` subcommand's help and exit status have in common.

Each subcommand builds its own argparse parser with `HelpFormatter` (every flag's help
ends with its default) and an `epilog` (examples, the environment variables it reads and
its exit codes), and returns one of the `EXIT_*` codes below, so a script can tell a
mistake in its own call from a failure it may retry. `refuse` is the one way a command
reports a mistake: one line naming the problem and the fix, on stderr.

Imports nothing heavy: `weightcache status` and `--help` stay fast.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import NoReturn

EXIT_OK = 0  # success, or a clean shutdown on SIGTERM
EXIT_FAILED = 1  # the work could not be done: model, memory, socket place, agent gone
EXIT_USAGE = 2  # the call itself is wrong: a flag, a flag's value, an environment variable
EXIT_BUSY = 3  # another agent already serves this socket
EXIT_INTERRUPTED = 130  # stopped by Ctrl-C (SIGINT): 128 + the signal number, as shells report it

EXIT_CODES = {
    EXIT_OK: "success (for a server: a clean shutdown on SIGTERM)",
    EXIT_FAILED: "failed: see the one-line message on stderr",
    EXIT_USAGE: "a bad flag, flag value or environment variable",
    EXIT_BUSY: "another agent already serves the socket",
    EXIT_INTERRUPTED: "interrupted by Ctrl-C (SIGINT)",
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's layout and appends `(default: ...)` to every optional flag's help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.default is argparse.SUPPRESS or action.required or not action.option_strings
                or "default" in text):
            return text
        if isinstance(action, (argparse._StoreTrueAction, argparse._AppendAction)) and not action.default:
            shown = "off" if action.nargs == 0 else "none"
        elif action.default is None:
            shown = "unset"
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


def epilog(examples: list[str], env: dict[str, str] | None = None, codes: tuple[int, ...] = (EXIT_OK, EXIT_FAILED,
                                                                                             EXIT_USAGE)) -> str:
    """The help's closing part: examples, environment variables, exit codes."""
    lines = ["examples:"] + [f"  {e}" for e in examples]
    if env:
        width = max(len(k) for k in env)
        lines += ["", "environment:"] + [f"  {k:<{width}}  {v}" for k, v in env.items()]
    lines += ["", "exit codes:"] + [f"  {c:<3}  {EXIT_CODES[c]}" for c in codes]
    return "\n".join(lines)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: the mistake and where to read more, not a page of usage."""

    def error(self, message: str) -> "NoReturn":
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def parser(prog: str, description: str, examples: list[str], env: dict[str, str] | None = None,
           codes: tuple[int, ...] = (EXIT_OK, EXIT_FAILED, EXIT_USAGE)) -> argparse.ArgumentParser:
    """An argparse parser with weightcache's help layout and one-line errors."""
    return ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter,
                          epilog=epilog(examples, env, codes))


def refuse(prog: str, message: str, code: int = EXIT_FAILED) -> int:
    """Print `prog: message` as one line on stderr; return `code` for the caller to exit with."""
    print(f"{prog}: {' '.join(str(message).split())}", file=sys.stderr)
    return code


TORCH_INSTALL = ("python -m pip install torch --index-url https://download.pytorch.org/whl/cpu (the CPU build; "
                 "on a GPU machine, the torch build for your CUDA)")


def torch_problem(what: str) -> str | None:
    """Why `what` cannot run here when torch is not installed (with the command that installs it), or None.

    Looks the package up without importing it: a refusal stays instant, and a present torch costs nothing here."""
    if importlib.util.find_spec("torch") is not None:
        return None
    return f"{what} needs torch, which is not installed: {TORCH_INSTALL}"
