"""The argument parsing every `conveyor` subcommand shares: one-line usage
errors, help that shows defaults, and the model named positionally or as
--model."""
from __future__ import annotations

import argparse


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

    def parse_args(self, args=None, namespace=None):
        ns = super().parse_args(args, namespace)
        if hasattr(ns, _MODEL_OPTION):
            option = ns.__dict__.pop(_MODEL_OPTION)
            if option is not None:
                if ns.model is not None and ns.model != option:
                    self.error(f"the model is given twice: {ns.model!r} and --model {option!r}")
                ns.model = option
        return ns


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

