"""How long a GGUF file's tokenizer takes to load, and where the time goes.

    python tools/bench_gguf_tokenizer.py MODEL.gguf [MODEL.gguf ...] [--repeat 3] [--llm] [--reference]

For each file: the wall and CPU seconds of GGUFTokenizer.from_file (best of --repeat),
then its parts: reading the metadata (C), the vocabulary dict, the encoder (the C
SentencePiece tables for "llama" vocabularies; the merges split from the file's strings
and the `tokenizers` BPE for "gpt2" ones), the per-id bytes. --reference also times the
merge list a "llama" vocabulary's scores give and the `tokenizers` BPE over it (what the
C encoder replaces; the tests' reference, conveyor.gguf_tokenizer_reference, which loads
the conveyor._testing hooks). --llm also times LLM(MODEL) (engine and
tokenizer) once. CPU seconds are the steadier figure on a busy machine.
"""
from __future__ import annotations

import argparse
import gc
import time


class _Clock:
    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def lap(self) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        out = (wall - self.wall, cpu - self.cpu)
        self.wall, self.cpu = wall, cpu
        return out


def _parts(path: str, reference: bool) -> list[tuple[str, float, float]]:
    from tokenizers import models

    from conveyor import _core
    from conveyor import gguf_tokenizer as G

    if reference:  # loaded before the clock starts
        from conveyor.gguf_tokenizer_reference import score_merges
    out = []
    clock = _Clock()
    md = _core.gguf_metadata(path, array_limit=G.GGUF_METADATA_ARRAY_LIMIT)
    out.append(("metadata (C reader)", *clock.lap()))
    collecting = gc.isenabled()
    gc.disable()
    try:
        tokens = md["tokenizer.ggml.tokens"]
        types = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        vocab = dict(zip(reversed(tokens), range(len(tokens) - 1, -1, -1)))
        out.append(("vocabulary dict", *clock.lap()))
        llama = md.get("tokenizer.ggml.model") == "llama"
        if llama:
            _core.SpmTokenizer(tokens, md["tokenizer.ggml.scores"], types, unk_id=-1, add_space_prefix=True,
                               max_token_chars=G.MERGE_MAX_TOKEN_CHARS, seed=1)
            out.append(("SentencePiece tables (C)", *clock.lap()))
        else:
            merges = G._split_merges(md["tokenizer.ggml.merges"])
            out.append((f"merges from the file: {len(merges)}", *clock.lap()))
            models.BPE(vocab, merges)
            out.append(("tokenizers BPE model", *clock.lap()))
        G._token_bytes(tokens, types, vocab, "metaspace" if llama else "bytelevel")
        out.append(("per-id bytes", *clock.lap()))
        if llama and reference:
            merges = score_merges(tokens, md["tokenizer.ggml.scores"], types)
            out.append((f"reference: merges from scores (C): {len(merges)}", *clock.lap()))
            models.BPE(vocab, merges)
            out.append(("reference: tokenizers BPE over them", *clock.lap()))
    finally:
        if collecting:
            gc.enable()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="GGUF files")
    ap.add_argument("--repeat", type=int, default=3, help="loads per file; the best is shown (default 3)")
    ap.add_argument("--llm", action="store_true", help="also time LLM(MODEL) once")
    ap.add_argument("--reference", action="store_true",
                    help="also time the merge list and tokenizers BPE the C encoder replaces")
    args = ap.parse_args(argv)

    from conveyor.gguf_tokenizer import GGUFTokenizer

    for path in args.models:
        best = None
        for _ in range(max(1, args.repeat)):
            clock = _Clock()
            tok = GGUFTokenizer.from_file(path)
            took = clock.lap()
            best = took if best is None or took[0] < best[0] else best
        print(f"{path}: vocabulary {tok.vocab_size} ({tok.model})")
        print(f"  tokenizer load        {best[0]:7.3f} s wall  {best[1]:7.3f} s CPU  (best of {args.repeat})")
        for name, wall, cpu in _parts(path, args.reference):
            print(f"    {name:34s} {wall:7.3f} s wall  {cpu:7.3f} s CPU")
        if args.llm:
            from conveyor import LLM

            clock = _Clock()
            llm = LLM(path)
            wall, cpu = clock.lap()
            print(f"  LLM(model)            {wall:7.3f} s wall  {cpu:7.3f} s CPU")
            del llm


if __name__ == "__main__":
    main()
