"""The argument parsing every `conveyor` subcommand shares: one-line usage
errors, help that shows defaults, and the model named positionally or as
--model."""
from __future__ import annotations

import argparse
import re
import sys


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default unless its help already says it ("default") or there
    is nothing to show (None, False: a flag or a default the help describes)."""

    def _get_help_string(self, action):
        help_ = action.help or ""
        if "default" in help_ or action.default is None or action.default is False \
                or action.default is argparse.SUPPRESS:
            return help_
        return super()._get_help_string(action)


class RawDescriptionDefaultsHelpFormatter(DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """DefaultsHelpFormatter that keeps the description's own line breaks."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line: `PROG: error: MESSAGE (see PROG --help)`,
    exit status 2. With add_model_arguments, parse_args puts the model given either way
    (positionally or as --model) into ``model``."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(self._dash_values_joined(args), namespace)

    def _dash_values_joined(self, args: list) -> list:
        """argparse takes only plain negative numbers as values: after an option that needs
        one, "-5GiB" or "-1e3" reads as an unknown option and the user is told the option
        "expected one argument". Joined as --option=-5GiB, the value's own check names it."""
        out: list = []
        for a in args:
            prev = out[-1] if out else None
            if (isinstance(a, str) and _DASH_VALUE.match(a) and isinstance(prev, str) and prev.startswith("--")
                    and "=" not in prev):
                action = self._option_string_actions.get(prev)
                if action is not None and action.nargs is None:  # an option that takes exactly one value
                    out[-1] = f"{prev}={a}"
                    continue
            out.append(a)
        return out

    def parse_args(self, args=None, namespace=None):
        ns = super().parse_args(args, namespace)
        if hasattr(ns, _MODEL_OPTION):
            option = ns.__dict__.pop(_MODEL_OPTION)
            if option is not None:
                if ns.model is not None and ns.model != option:
                    self.error(f"the model is given twice: {ns.model!r} and --model {option!r}")
                ns.model = option
        return ns


_DASH_VALUE = re.compile(r"-[0-9.]")


_MODEL_OPTION = "model_option"
MODEL_HELP = ("a built-in model's name (SmolLM2-135M-Instruct, gemma-3-270m, stories260K), a .gguf file, "
              "a Hugging Face model folder or a llama2.c .bin (default: SmolLM2-135M-Instruct, fetched once)")


def add_model_arguments(p: argparse.ArgumentParser, help_: str = MODEL_HELP) -> None:
    """The model as a positional argument or as --model (either; the same thing)."""
    p.add_argument("model", nargs="?", default=None, help=help_)
    p.add_argument("--model", dest=_MODEL_OPTION, default=None, metavar="MODEL",
                   help="the model, as an option instead of positionally (default: as for MODEL)")


def count(text: str) -> int:
    """argparse type of a count (requests, tokens, repetitions): an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def size(text: str) -> str:
    """argparse type of a memory size ("4GiB", "512MB", bytes): checked here, passed on as given."""
    from .engine import parse_bytes

    try:
        parse_bytes(text, "size")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("size: ").removeprefix("size ")) from None
    return text


def positive_numbers(text: str) -> list:
    """argparse type of a comma-separated list of finite numbers > 0 (rates, fractions)."""
    out = []
    for item in str(text).replace(" ", "").split(","):
        if not item:
            continue
        try:
            value = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not a number") from None
        if not (value > 0 and value != float("inf")):
            raise argparse.ArgumentTypeError(f"each value must be a finite number > 0, got {item}")
        out.append(value)
    if not out:
        raise argparse.ArgumentTypeError("no value given")
    return out

