"""`conveyor chat [MODEL]`: talk to a model in the terminal, as `ollama run` does.

Each line you type is a user message; the model's answer streams back through its chat
template, and the conversation so far goes with every turn (the oldest turns are left out
when it no longer fits the context). Commands:

    /reset   forget the conversation (the --system message stays)
    /exit    leave (so do /bye and Ctrl-D)
    /help    list the commands

Ctrl-C stops the answer being written (what was written stays in the conversation); at
the prompt it only reminds how to leave. Lines read from a pipe work the same way, without
the prompt.
"""
from __future__ import annotations

import asyncio
import os
import select
import signal
import sys
import warnings
from contextlib import aclosing
from typing import Optional

COMMANDS = {"/reset": "forget the conversation", "/exit": "leave (also /bye, Ctrl-D)",
            "/help": "list the commands"}
PROMPT = ">>> "
ANSWER_ROOM = 16  # tokens of answer a turn must at least have room for


def build_parser():
    from .cli_args import MODEL_HELP, DefaultsHelpFormatter, Parser, add_model_arguments

    ap = Parser(prog="conveyor chat", formatter_class=DefaultsHelpFormatter,
                description="Chat with a model in the terminal: the answer streams, the conversation is "
                            "kept; /reset forgets it, /exit or Ctrl-D leaves, Ctrl-C stops an answer.")
    add_model_arguments(ap, MODEL_HELP)
    ap.add_argument("--system", default=None, help="a system message that starts the conversation "
                                                   "(default: none, the chat template's own)")
    g = ap.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=512, help="longest answer, in tokens")
    g.add_argument("--temperature", type=float, default=0.7, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling: keep this much mass")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    e = ap.add_argument_group("engine")
    e.add_argument("--max-model-len", type=int, default=None,
                   help="the context: conversation + answer, in tokens (default: the model's)")
    e.add_argument("--num-threads", type=int, default=None, help="CPU threads (default: all cores)")
    e.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to run")
    e.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight dtype ('auto': the checkpoint's)")
    return ap


class Conversation:
    """The messages so far and how they become a prompt that fits the context."""

    def __init__(self, tokenizer, max_model_len: int, system: Optional[str]):
        self.tok = tokenizer
        self.max_model_len = max_model_len
        self.system = [{"role": "system", "content": system}] if system else []
        self.turns: list = []
        self.templated = bool(getattr(tokenizer, "chat_template", None))

    def reset(self) -> None:
        self.turns = []

    def check_system(self) -> None:
        """ValueError naming --system when the system message leaves no room for a turn."""
        if not self.system:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            text = self.tok.apply_chat_template(self.system + [{"role": "user", "content": ""}],
                                                add_generation_prompt=True)
        n = len(self.tok.encode(text, add_special_tokens=not self.templated))
        if n + ANSWER_ROOM > self.max_model_len:
            raise ValueError(f"--system: the system message takes {n} tokens of the context of "
                             f"{self.max_model_len}, which leaves no room for a message and its answer")

    def prompt(self) -> Optional[dict]:
        """The conversation as prompt text and ids, the oldest turns left out until there is
        room for an answer; None when even the last message alone does not fit."""
        while self.turns:
            with warnings.catch_warnings():  # no template: said once at the start, not per turn
                warnings.simplefilter("ignore")
                text = self.tok.apply_chat_template(self.system + self.turns, add_generation_prompt=True)
            ids = self.tok.encode(text, add_special_tokens=not self.templated)
            if len(ids) + ANSWER_ROOM <= self.max_model_len:
                return {"prompt": text, "prompt_token_ids": ids}
            if len(self.turns) == 1:
                return None
            self.turns = self.turns[2:] if len(self.turns) > 2 else self.turns[-1:]
        return None


async def _answer(llm, prompt: dict, params, out, parts: list) -> None:
    """Streams one answer to `out`, its pieces into `parts`; stopping it (cancelling,
    or an interrupt inside) closes the request, which frees it in the engine."""
    try:
        async with aclosing(llm.generate(prompt, params)) as outputs:
            async for o in outputs:
                piece = o.outputs[0].text
                parts.append(piece)
                out.write(piece)
                out.flush()
    except asyncio.CancelledError:
        pass


class _Interrupts:
    """Ctrl-C for the whole session, without the race of `input()`.

    A SIGINT that lands after the prompt is written but before the read starts (or on
    another thread) would leave a blocking read waiting for Enter. Here the signal only
    writes its number to a wake-up pipe (Python's `signal.set_wakeup_fd`, done by the C
    handler on whichever thread takes it) and every wait selects on that pipe as well, so a
    Ctrl-C is seen at the prompt, while answering, or in between, and never escapes as a
    KeyboardInterrupt from wherever the main thread happens to be."""

    def __init__(self):
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        os.set_blocking(self.w, False)
        self.old_handler = signal.signal(signal.SIGINT, lambda signum, frame: None)
        self.old_wakeup = signal.set_wakeup_fd(self.w, warn_on_full_buffer=False)

    def close(self) -> None:
        signal.set_wakeup_fd(self.old_wakeup)
        signal.signal(signal.SIGINT, self.old_handler)
        os.close(self.r)
        os.close(self.w)

    def take(self) -> bool:
        """Whether a Ctrl-C came since the last call (the pipe drained)."""
        got = b""
        try:
            while chunk := os.read(self.r, 512):
                got += chunk
        except BlockingIOError:
            pass
        return signal.SIGINT in got


class _LineReader:
    """Lines from a file descriptor (a terminal, a pipe or a file), waiting on the
    interrupt pipe too; what the user typed is decoded as the terminal's encoding."""

    def __init__(self, fd: int, interrupts: _Interrupts, encoding: str):
        self.fd, self.interrupts, self.encoding = fd, interrupts, encoding
        self.buf = b""
        self.eof = False

    def readline(self) -> Optional[str]:
        """The next line without its newline; None at end of input (Ctrl-D at the start of
        a line); KeyboardInterrupt on Ctrl-C (what was typed of the line is dropped, as the
        terminal drops it)."""
        while b"\n" not in self.buf and not self.eof:
            ready, _, _ = select.select([self.fd, self.interrupts.r], [], [])
            if self.interrupts.r in ready and self.interrupts.take():
                self.buf = b""
                raise KeyboardInterrupt
            if self.fd in ready:
                chunk = os.read(self.fd, 65536)
                self.buf += chunk
                self.eof = not chunk
        if not self.buf:
            return None
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode(self.encoding, "replace")


def run_chat(llm, conv: Conversation, params_for, out=sys.stdout, interactive: bool = False,
             stdin_fd: int = 0) -> int:
    interrupts = _Interrupts()
    lines = _LineReader(stdin_fd, interrupts, getattr(sys.stdin, "encoding", None) or "utf-8")
    loop = asyncio.new_event_loop()
    try:
        while True:
            if interactive:
                sys.stderr.write(PROMPT)
                sys.stderr.flush()
            try:
                line = lines.readline()
            except KeyboardInterrupt:
                out.write("\n(use /exit or Ctrl-D to leave)\n")
                out.flush()
                continue
            if line is None:
                if interactive:
                    out.write("\n")
                return 0
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                cmd = text.split()[0].lower()
                if cmd in ("/exit", "/bye", "/quit"):
                    return 0
                if cmd in ("/reset", "/clear"):
                    conv.reset()
                    out.write("(conversation forgotten)\n")
                elif cmd in ("/help", "/?"):
                    out.write("".join(f"  {c:<7} {h}\n" for c, h in COMMANDS.items()))
                else:
                    out.write(f"unknown command {cmd}; /help lists them\n")
                out.flush()
                continue
            conv.turns.append({"role": "user", "content": line})
            prompt = conv.prompt()
            if prompt is None:
                conv.turns.pop()
                out.write(f"(that message is too long for the context of {conv.max_model_len} tokens)\n")
                out.flush()
                continue
            room = conv.max_model_len - len(prompt["prompt_token_ids"])
            parts: list = []
            task = loop.create_task(_answer(llm, prompt, params_for(room), out, parts))
            stopped = False

            def on_wakeup():
                nonlocal stopped
                if interrupts.take():
                    stopped = True
                    task.cancel()

            # Ctrl-C while answering cancels the answer from inside the loop, never as a
            # KeyboardInterrupt inside the engine's own callbacks (that could leave the
            # request's stream waiting forever).
            loop.add_reader(interrupts.r, on_wakeup)
            try:
                loop.run_until_complete(task)
            except asyncio.CancelledError:
                pass
            finally:
                loop.remove_reader(interrupts.r)
            out.write("\n[stopped]\n\n" if stopped else "\n\n")
            out.flush()
            conv.turns.append({"role": "assistant", "content": "".join(parts)})
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
        interrupts.close()


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    from . import AsyncLLM, SamplingParams

    if args.max_tokens < 1:
        ap.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    for name in ("max_model_len", "num_threads"):
        v = getattr(args, name)
        if v is not None and v < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    try:
        SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    except (ValueError, TypeError) as exc:
        ap.error(str(exc).replace("SamplingParams.", "--").replace("_", "-"))

    if args.model is None:
        from .default_model import default_model_path

        model = str(default_model_path())
    else:
        from .bench.common import resolve_model

        model = resolve_model(args.model)
    llm = AsyncLLM(model, max_num_seqs=1, max_model_len=args.max_model_len, num_threads=args.num_threads,
                   device=args.device, dtype=args.dtype)
    try:
        if llm.tokenizer is None:
            raise ValueError(f"{model} has no tokenizer; chat needs one")
        conv = Conversation(llm.tokenizer, int(llm.stats()["max_model_len"]), args.system)
        conv.check_system()
        stop = None
        if not conv.templated:
            stop = ["\nuser:"]  # the built-in 'role: content' format: the model's turn ends there
            print("conveyor chat: note: the model has no chat template; messages are sent as 'role: content' "
                  "lines, which it was not trained on", file=sys.stderr)

        def params_for(room: int):
            return SamplingParams(max_tokens=max(1, min(args.max_tokens, room)), temperature=args.temperature,
                                  top_p=args.top_p, seed=args.seed, stop=stop, output_kind="delta")

        interactive = sys.stdin.isatty()
        if interactive:
            print(f"conveyor chat: {model}; /help for commands, /exit or Ctrl-D to leave", file=sys.stderr)
        return run_chat(llm, conv, params_for, sys.stdout, interactive)
    finally:
        llm.close()
