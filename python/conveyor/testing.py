"""Random-weight checkpoints in the real formats, for tests and benchmarks.

    from conveyor.testing import write_hf_checkpoint, write_llama2c_checkpoint, SHAPES
    d = write_hf_checkpoint(tmp / "tiny", shape="tiny", arch="qwen2", dtype="bfloat16")
    f = write_llama2c_checkpoint(tmp / "tiny.bin", shape="tiny")
    g = write_gguf_checkpoint(tmp / "tiny.gguf", shape="tiny", arch="llama", ggml_type="Q4_0")

Output is a pure function of the arguments (weights from ``np.random.default_rng(seed)``,
tensors drawn in a fixed order, so the values do not depend on ``shards``). Tensors are
generated and written one at a time (large ones in row chunks), so writing a 1B-parameter
shape needs memory for one chunk, not for the model.

Weight scales: a matrix [out][in] has std gain/sqrt(in). q/k use a gain of 1.2 so attention
scores have std about 1.4 (attention is neither uniform nor one-hot); embeddings/lm_head
std 2/sqrt(dim) so logits have std about 2; o_proj/down_proj a gain of 4 so the residual
stream outweighs the token's own embedding (with tied embeddings a smaller gain makes
greedy decoding repeat the input token); norm weights 1 + N(0, 0.1); biases N(0, 0.2).

bfloat16 is stored as uint16 bit patterns rounded to nearest even from float32; float16
with NumPy's (round-to-nearest-even) cast.
"""
from __future__ import annotations

import copy
import functools
import json
import math
import os
import re
import struct
from collections import Counter
from pathlib import Path

import numpy as np

from . import _core
from .gguf import _TYPE_LAYOUT, GGMLType, GGUFReader, GGUFValueType, GGUFWriter, _ggml_type, quantize
from .hf_tokenizer import _bytes_to_unicode
from .reference import bf16_bits_to_f32, f32_to_bf16_bits, read_safetensors_file

# The stories260K model that ships inside the package (llama2.c's tinyllamas, MIT):
# stories260K.bin and its tokenizer tok512.bin. Tests use it, so they need no checkout beside.
STORIES_DIR = Path(__file__).resolve().parent / "data" / "stories260K"

__all__ = [
    "SHAPES",
    "ARCHS",
    "DTYPES",
    "CORPUS",
    "resolve_shape",
    "random_shape",
    "write_hf_checkpoint",
    "write_llama2c_checkpoint",
    "write_hf_tokenizer",
    "write_llama2c_tokenizer",
    "hf_tensor_layout",
    "f32_to_bf16_bits",
    "bf16_bits_to_f32",
    "round_to_dtype",
    "GGUF_ARCHS",
    "GGUF_TOKENIZERS",
    "write_gguf_checkpoint",
    "gguf_tensor_name",
    "llama_qk_permute",
]

# Named shapes. Keys follow conveyor._core.Checkpoint.config; optional keys: head_dim,
# tie_embeddings, arch, qkv_bias, rope_theta, rms_eps, bos_id, eos_id.
SHAPES: dict[str, dict] = {
    "tiny": dict(dim=64, hidden_dim=176, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512,
                 max_pos=512, tie_embeddings=False, rope_theta=10000.0, rms_eps=1e-5),
    "smollm-135m": dict(dim=576, hidden_dim=1536, n_layers=30, n_heads=9, n_kv_heads=3,
                        vocab_size=49152, max_pos=2048, tie_embeddings=True, rope_theta=10000.0,
                        rms_eps=1e-5),
    "tinyllama-1.1b": dict(dim=2048, hidden_dim=5632, n_layers=22, n_heads=32, n_kv_heads=4,
                           vocab_size=32000, max_pos=2048, tie_embeddings=False,
                           rope_theta=10000.0, rms_eps=1e-5),
    "qwen2-0.5b": dict(dim=896, hidden_dim=4864, n_layers=24, n_heads=14, n_kv_heads=2,
                       vocab_size=151936, max_pos=32768, tie_embeddings=True, arch="qwen2",
                       qkv_bias=True, rope_theta=1000000.0, rms_eps=1e-6),
}

ARCHS = ("llama", "mistral", "qwen2")
DTYPES = ("float32", "float16", "bfloat16")
_HF_ARCH = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
}
_ST_DTYPE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
_CHUNK = 1 << 22  # elements generated at a time
_OUT_GAIN = 4.0  # o_proj/down_proj gain: see the module docstring

# A small corpus of plain English for the tokenizers (written for this project).
CORPUS = """\
Once upon a time, there was a little girl named Lily. She loved to play outside in the park.
One day, she saw a big, red ball under a tree. She ran to the ball and picked it up.
Her friend Tom came over and asked if he could play too. Lily said yes, and they played all day.
The sun was warm and the sky was blue. Birds sang in the trees and the flowers were bright.
Tom threw the ball high into the air. Lily jumped and caught it with both hands.
They laughed and ran around the green grass until they were tired.
Then they sat down under the tree and ate some apples. The apples were sweet and juicy.
Lily's mom called her home for dinner. Lily waved goodbye to Tom and walked home.
At home, her dog Max was waiting by the door. Max wagged his tail and barked happily.
Lily gave Max a hug and told him about her day in the park.
After dinner, Lily read a book about a brave knight and a friendly dragon.
The knight and the dragon became good friends and went on many adventures together.
They crossed rivers, climbed mountains, and found a hidden cave full of shiny gold.
When the story was over, Lily closed the book and went to sleep.
She dreamed about the dragon flying over the town at night under the bright moon.
The next morning, it was raining. Lily put on her yellow boots and her blue coat.
She jumped in the puddles and watched the water splash everywhere.
A small frog hopped out of the puddle and looked at her. Lily smiled at the frog.
"Hello, little frog," she said. "Do you like the rain too?" The frog croaked and hopped away.
Ben was a boy who liked to build things. He had a box of blocks, wheels and tools.
One day, he built a tall tower that almost touched the ceiling of his room.
His sister Sue wanted to help, but she was too small to reach the top.
Ben lifted her up, and she put the last block on the tower. They were very proud.
Their dad took a picture of the tower and the two happy children.
In the garden, there were carrots, beans, tomatoes and big orange pumpkins.
Grandma showed the children how to water the plants and pull the weeds.
"Plants need sun, water and love to grow," Grandma said with a kind smile.
The cat slept on the window, and the mouse hid in a small hole in the wall.
A bird built a nest with sticks and leaves, and soon there were three blue eggs.
The baby birds opened their mouths wide, and their mother brought them food.
Every night, the family sat together, told stories and sang songs by the fire.
The little boat sailed across the lake while the fish swam below the water.
Anna found a key in the sand. She wondered what it could open.
She looked everywhere: under the bed, behind the chair, and inside the old chest.
At last, the key opened a tiny box with a silver ring and a note that said "Thank you".
Sam and Mia wanted to make a cake for their mother's birthday.
They mixed flour, sugar, eggs and milk in a big bowl, then baked it in the oven.
The kitchen smelled wonderful, and their mother was surprised and very happy.
It is important to share, to be kind, and to say sorry when you make a mistake.
The teacher asked the class to draw a picture of their favorite animal.
Some drew lions and tigers, others drew horses, rabbits, turtles and elephants.
Jack counted the stars: one, two, three, four, five, six, seven, eight, nine, ten.
The old man walked slowly with his cane and stopped to feed the ducks by the pond.
Winter came, and the snow covered the houses, the roads and the tall pine trees.
The children built a snowman with a carrot nose and two black buttons for eyes.
In spring, the snow melted and new leaves grew on every branch.
The train went fast through the hills, and the people waved from the windows.
Please remember to brush your teeth, wash your hands, and go to bed on time.
What is your name? Where do you live? How old are you? Why is the sky blue?
The quick brown fox jumps over the lazy dog, and the dog does not even wake up.
"""

_HF_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


# ---------------------------------------------------------------------------- shapes


def random_block_tables(r: np.random.Generator, ctx, bs: int):
    """Shuffled paged-KV block tables for sequences of ctx tokens each, blocks of bs:
    (tables [n_seqs][max_blocks] int32, the number of blocks a cache needs). Every
    sequence owns distinct blocks in a random order; entries past a sequence's last
    block hold junk ids, which a kernel must never read. Three spare blocks are never
    handed out."""
    ctx = np.asarray(ctx)
    blocks_per = (ctx + bs - 1) // bs
    mb = int(blocks_per.max()) + 1
    nb = int(blocks_per.sum()) + 3
    perm = r.permutation(nb)
    tables = np.zeros((len(ctx), mb), np.int32)
    used = 0
    for s in range(len(ctx)):
        tables[s, : blocks_per[s]] = perm[used:used + blocks_per[s]]
        tables[s, blocks_per[s]:] = r.integers(0, nb, mb - blocks_per[s])  # junk past the end
        used += blocks_per[s]
    return tables, nb


def unsanitized_env() -> dict:
    """os.environ without the sanitizer runtime that tools/sanitize.sh preloads into the
    interpreter: for a child that is none of ours or not instrumented (a compiler, a
    browser, a plain C driver), which the preloaded runtime would break or report on."""
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def subprocess_env(**extra) -> dict:
    """os.environ for a child Python that must import the same conveyor as this process
    (an installed package, or the checkout's python/ after an in-place build): its
    package root first on PYTHONPATH; ``extra`` overrides variables."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    env["PYTHONPATH"] = os.pathsep.join([root] + rest)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def resolve_shape(shape) -> dict:
    """A shape name or dict -> a full shape dict (head_dim filled in)."""
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
        s = copy.deepcopy(SHAPES[shape])
    elif isinstance(shape, dict):
        s = copy.deepcopy(shape)
    else:
        raise TypeError(f"shape must be a name or a dict, got {type(shape).__name__}")
    for key in ("dim", "hidden_dim", "n_layers", "n_heads", "vocab_size"):
        if key not in s:
            raise ValueError(f"shape has no {key!r}")
    s.setdefault("n_kv_heads", s["n_heads"])
    s.setdefault("max_pos", 512)
    s.setdefault("rope_theta", 10000.0)
    s.setdefault("rms_eps", 1e-5)
    if "_explicit_head_dim" in s:
        pass  # already resolved
    elif s.get("head_dim") is None:
        if s["dim"] % s["n_heads"]:
            raise ValueError(f"dim {s['dim']} is not a multiple of n_heads {s['n_heads']}; give head_dim")
        s["head_dim"] = s["dim"] // s["n_heads"]
        s["_explicit_head_dim"] = False
    else:
        s["_explicit_head_dim"] = True
    for key in ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_pos", "head_dim"):
        if not isinstance(s[key], (int, np.integer)) or s[key] <= 0:
            raise ValueError(f"shape[{key!r}] must be a positive int, got {s[key]!r}")
        s[key] = int(s[key])
    if s["n_heads"] % s["n_kv_heads"]:
        raise ValueError(f"n_heads {s['n_heads']} is not a multiple of n_kv_heads {s['n_kv_heads']}")
    if s["head_dim"] % 2:
        raise ValueError(f"head_dim {s['head_dim']} must be even for RoPE")
    return s


def random_shape(rng: np.random.Generator, *, llama2c: bool = False, max_vocab: int = 600) -> dict:
    """A small random shape for test grids (fast to write and to run in the reference).

    ``llama2c=True`` keeps head_dim = dim / n_heads (the format cannot say otherwise)."""
    n_kv = int(rng.choice([1, 2, 4]))
    n_heads = n_kv * int(rng.choice([1, 2, 3]))
    head_dim = int(rng.choice([8, 16, 32]))
    if llama2c or rng.random() < 0.6:
        dim = n_heads * head_dim
        explicit = None
    else:
        dim = int(rng.choice([32, 48, 64, 96]))
        explicit = head_dim
    shape = dict(dim=dim, hidden_dim=int(rng.integers(2, 9)) * 16 + int(rng.choice([0, 4])),
                 n_layers=int(rng.integers(1, 4)), n_heads=n_heads, n_kv_heads=n_kv,
                 vocab_size=int(rng.integers(300, max(301, max_vocab))),
                 max_pos=int(rng.choice([64, 128, 256])),
                 rope_theta=float(rng.choice([10000.0, 500000.0])),
                 rms_eps=float(rng.choice([1e-5, 1e-6])))
    if explicit is not None:
        shape["head_dim"] = explicit
    return shape


# ---------------------------------------------------------------------------- numbers


def gemm_input_dtype(weight_dtype: str, info: dict | None = None) -> str:
    """The dtype the CPU backend's GEMM rounds its input rows to for weights of
    ``weight_dtype`` at the level that runs (``info``: conveyor._core.kernel_info(), read now
    when None): "bfloat16" on the vdpbf16ps path (bf16 weights at the avx512_bf16 level),
    else "float32". For ReferenceModel.load(gemm_inputs=...)."""
    if info is None:
        info = _core.kernel_info()
    if weight_dtype in ("bfloat16", "BF16") and info["paths"].get("gemm_bf16") == "avx512_bf16":
        return "bfloat16"
    return "float32"


def round_to_dtype(a, dtype: str) -> np.ndarray:
    """The float32 values that ``a`` becomes once stored as ``dtype``."""
    a = np.asarray(a, dtype=np.float32)
    if dtype == "float32":
        return a.copy()
    if dtype == "float16":
        return a.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return bf16_bits_to_f32(f32_to_bf16_bits(a))
    raise ValueError(f"unknown dtype {dtype!r}; use one of {DTYPES}")


def _encode(a: np.ndarray, dtype: str) -> bytes:
    if dtype == "float32":
        return np.ascontiguousarray(a, dtype="<f4").tobytes()
    if dtype == "float16":
        return np.ascontiguousarray(a, dtype=np.float32).astype("<f2").tobytes()
    return f32_to_bf16_bits(a).astype("<u2").tobytes()


class _Gen:
    """Draws tensors in order from one generator; 'kind' picks the distribution."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def chunks(self, shape, kind: str, scale: float = 1.0):
        """Yields float32 pieces (row-major order) of a tensor of ``shape``."""
        n = int(np.prod(shape))
        done = 0
        while done < n:
            k = min(_CHUNK, n - done)
            x = self.rng.standard_normal(k, dtype=np.float32)
            if kind == "norm":
                x = np.float32(1.0) + np.float32(0.1) * x
            else:
                x *= np.float32(scale)
            done += k
            yield x

    def full(self, shape, kind: str, scale: float = 1.0) -> np.ndarray:
        return np.concatenate(list(self.chunks(shape, kind, scale))).reshape(shape)


# ---------------------------------------------------------------------------- HF


def hf_tensor_layout(shape, arch: str = "llama", tie_embeddings: bool = False,
                     qkv_bias: bool | None = None) -> list[tuple[str, tuple, str, float]]:
    """(name, shape, kind, scale) for every tensor of a HF checkpoint, in generation order."""
    s = resolve_shape(shape)
    dim, hid, hd = s["dim"], s["hidden_dim"], s["head_dim"]
    q_dim, kv_dim = s["n_heads"] * hd, s["n_kv_heads"] * hd
    bias = (arch == "qwen2") if qkv_bias is None else qkv_bias
    emb_scale = 2.0 / math.sqrt(dim)
    out = [("model.embed_tokens.weight", (s["vocab_size"], dim), "normal", emb_scale)]
    for i in range(s["n_layers"]):
        p = f"model.layers.{i}."
        out.append((p + "input_layernorm.weight", (dim,), "norm", 1.0))
        out.append((p + "self_attn.q_proj.weight", (q_dim, dim), "normal", 1.2 / math.sqrt(dim)))
        out.append((p + "self_attn.k_proj.weight", (kv_dim, dim), "normal", 1.2 / math.sqrt(dim)))
        out.append((p + "self_attn.v_proj.weight", (kv_dim, dim), "normal", 1.0 / math.sqrt(dim)))
        if bias:
            out.append((p + "self_attn.q_proj.bias", (q_dim,), "normal", 0.2))
            out.append((p + "self_attn.k_proj.bias", (kv_dim,), "normal", 0.2))
            out.append((p + "self_attn.v_proj.bias", (kv_dim,), "normal", 0.2))
        out.append((p + "self_attn.o_proj.weight", (dim, q_dim), "normal", _OUT_GAIN / math.sqrt(q_dim)))
        out.append((p + "post_attention_layernorm.weight", (dim,), "norm", 1.0))
        out.append((p + "mlp.gate_proj.weight", (hid, dim), "normal", 1.0 / math.sqrt(dim)))
        out.append((p + "mlp.up_proj.weight", (hid, dim), "normal", 1.0 / math.sqrt(dim)))
        out.append((p + "mlp.down_proj.weight", (dim, hid), "normal", _OUT_GAIN / math.sqrt(hid)))
    out.append(("model.norm.weight", (dim,), "norm", 1.0))
    if not tie_embeddings:
        out.append(("lm_head.weight", (s["vocab_size"], dim), "normal", emb_scale))
    return out


def _safetensors_header(entries: list[tuple[str, tuple]], dtype: str) -> tuple[bytes, int]:
    """Header bytes (length prefix included, padded to 8) and the data size."""
    meta: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, shp in entries:
        n = int(np.prod(shp)) * _ITEMSIZE[dtype]
        meta[name] = {"dtype": _ST_DTYPE[dtype], "shape": list(shp), "data_offsets": [off, off + n]}
        off += n
    head = json.dumps(meta, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head, off


def _split_shards(layout, shards: int, dtype: str) -> list[list]:
    """Consecutive groups of about equal bytes; every group gets at least one tensor."""
    if not isinstance(shards, int) or shards < 1 or shards > len(layout):
        raise ValueError(f"shards must be an int between 1 and {len(layout)}, got {shards!r}")
    sizes = [int(np.prod(t[1])) * _ITEMSIZE[dtype] for t in layout]
    target = sum(sizes) / shards
    groups: list[list] = [[]]
    acc = 0
    for idx, (t, n) in enumerate(zip(layout, sizes)):
        must_split = len(layout) - idx == shards - len(groups)
        if groups[-1] and len(groups) < shards and (acc >= target * len(groups) or must_split):
            groups.append([])
        groups[-1].append(t)
        acc += n
    return groups


def write_hf_checkpoint(path, *, shape="tiny", arch: str | None = None, dtype: str = "float32",
                        seed: int = 0, tie_embeddings: bool | None = None, rope_scaling=None,
                        shards: int = 1, max_position_embeddings: int | None = None,
                        tokenizer: bool = True, rope_theta: float | None = None,
                        rms_eps: float | None = None) -> Path:
    """Writes a HF model folder: config.json, model.safetensors (or ``shards`` files and
    model.safetensors.index.json), and with ``tokenizer`` a byte-level BPE tokenizer.json,
    tokenizer_config.json (chat template) and generation_config.json. Returns the folder.

    ``shape``: a name in SHAPES or a dict; ``arch`` defaults to the shape's (else "llama");
    ``tie_embeddings`` to the shape's. ``rope_scaling``: None, a HF rope_scaling dict, or "llama3" for
    {factor 8, low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings max_pos}.
    """
    s = resolve_shape(shape)
    arch = arch or s.get("arch", "llama")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; use one of {ARCHS}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {DTYPES}")
    tie = s.get("tie_embeddings", False) if tie_embeddings is None else bool(tie_embeddings)
    bias = arch == "qwen2"  # Qwen2 always has q/k/v biases; LLaMA/Mistral none
    max_pos = s["max_pos"] if max_position_embeddings is None else int(max_position_embeddings)
    theta = s["rope_theta"] if rope_theta is None else float(rope_theta)
    eps = s["rms_eps"] if rms_eps is None else float(rms_eps)
    if rope_scaling == "llama3":
        rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": s["max_pos"]}
    if rope_scaling is not None and not isinstance(rope_scaling, dict):
        raise TypeError("rope_scaling must be None, a dict, or 'llama3'")
    if tokenizer and s["vocab_size"] < 258:
        raise ValueError(f"vocab_size {s['vocab_size']} is too small for a byte-level tokenizer (>= 258)")

    out = Path(os.fspath(path))
    out.mkdir(parents=True, exist_ok=True)
    arch_name, model_type = _HF_ARCH[arch]
    bos_id, eos_id = s.get("bos_id", 0), s.get("eos_id", 1)
    config = {
        "architectures": [arch_name],
        "model_type": model_type,
        "hidden_size": s["dim"],
        "intermediate_size": s["hidden_dim"],
        "num_hidden_layers": s["n_layers"],
        "num_attention_heads": s["n_heads"],
        "num_key_value_heads": s["n_kv_heads"],
        "vocab_size": s["vocab_size"],
        "max_position_embeddings": max_pos,
        "rms_norm_eps": eps,
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": tie,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if s["_explicit_head_dim"]:
        config["head_dim"] = s["head_dim"]
    if arch == "llama":
        config["attention_bias"] = bias
        config["mlp_bias"] = False
    elif arch == "mistral":
        config["sliding_window"] = None
    elif arch == "qwen2":
        config["use_sliding_window"] = False
        config["sliding_window"] = max_pos
        config["max_window_layers"] = s["n_layers"]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    layout = hf_tensor_layout(s, arch, tie, bias)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    groups = _split_shards(layout, shards, dtype)
    names = (["model.safetensors"] if shards == 1 else
             [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)])
    gen = _Gen(seed)
    weight_map = {}
    total = 0
    for fname, group in zip(names, groups):
        head, size = _safetensors_header([(t[0], t[1]) for t in group], dtype)
        total += size
        with open(out / fname, "wb") as f:
            f.write(head)
            for name, shp, kind, scale in group:
                for piece in gen.chunks(shp, kind, scale):
                    f.write(_encode(piece, dtype))
                weight_map[name] = fname
    if shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    if tokenizer:
        write_hf_tokenizer(out, s["vocab_size"], bos_id=bos_id, eos_id=eos_id)
        gen_cfg = {"bos_token_id": bos_id, "eos_token_id": eos_id}
        (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    return out


# ---------------------------------------------------------------------------- tokenizers


def _train_merges(words: dict[tuple[str, ...], int], n_merges: int) -> list[tuple[str, str]]:
    """Plain BPE: merge the most frequent adjacent pair (smallest pair on ties) n times,
    or until no pair occurs twice."""
    words = dict(words)
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        counts: Counter = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                counts[(a, b)] += c
        if not counts:
            break
        best_count = max(counts.values())
        if best_count < 2:
            break
        pair = min(p for p, c in counts.items() if c == best_count)
        merges.append(pair)
        merged = pair[0] + pair[1]
        new_words: dict = {}
        for w, c in words.items():
            if len(w) > 1:
                nw, i = [], 0
                while i < len(w):
                    if i + 1 < len(w) and w[i] == pair[0] and w[i + 1] == pair[1]:
                        nw.append(merged)
                        i += 2
                    else:
                        nw.append(w[i])
                        i += 1
                w = tuple(nw)
            new_words[w] = new_words.get(w, 0) + c
        words = new_words
    return merges


@functools.lru_cache(maxsize=8)
def _byte_level_merges(n_merges: int) -> tuple:
    table = _bytes_to_unicode()
    # GPT-2-like split: a word keeps its leading space.
    pieces = re.findall(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+", CORPUS)
    words = Counter(tuple(table[b] for b in p.encode("utf-8")) for p in pieces)
    return tuple(_train_merges(words, n_merges))


def _pseudo_word(k: int) -> str:
    """A distinct made-up word for padding id k, as a byte-level symbol ("Ġ" is a space)."""
    cons, vows = "bcdfghklmnprstvz", "aeiou"
    s = ""
    while True:
        s += cons[k % 16] + vows[(k // 16) % 5]
        k //= 80
        if k == 0:
            return "\u0120" + s


def _byte_level_vocab(vocab_size: int, bos_id: int = 0, eos_id: int = 1) -> tuple[dict, list]:
    """The test byte-level BPE vocabulary: token -> id (exactly ``vocab_size`` ids) and
    merges ("a b" strings, in rank order)."""
    if sorted((bos_id, eos_id)) != [0, 1]:
        raise ValueError("the test tokenizer puts <s>/</s> at ids 0 and 1")
    if vocab_size < 258:
        raise ValueError(f"vocab_size {vocab_size} < 258")
    special = {bos_id: "<s>", eos_id: "</s>"}
    vocab: dict[str, int] = {}
    for i in (0, 1):
        vocab[special[i]] = i
    table = _bytes_to_unicode()
    for b in range(256):
        vocab[table[b]] = len(vocab)
    merges = []
    for a, b in _byte_level_merges(vocab_size - len(vocab)):
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
            merges.append(f"{a} {b}")  # byte-level symbols never contain a space
    k = 0
    while len(vocab) < vocab_size:
        word = _pseudo_word(k)  # a random model then prints random words, not markup
        if word not in vocab:
            vocab[word] = len(vocab)
        k += 1
    return vocab, merges


def write_hf_tokenizer(folder, vocab_size: int, *, bos_id: int = 0, eos_id: int = 1) -> None:
    """tokenizer.json (byte-level BPE with exactly ``vocab_size`` ids: "<s>", "</s>", the
    256 byte symbols, merges learned from CORPUS, then padding entries that encoding
    never produces (made-up words with a leading space, no merges lead to them)),
    tokenizer_config.json (BOS added, chat template)."""
    folder = Path(folder)
    vocab, merges = _byte_level_vocab(vocab_size, bos_id, eos_id)
    special = {bos_id: "<s>", eos_id: "</s>"}
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": special[i], "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True} for i in (0, 1)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [bos_id], "tokens": ["<s>"]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "vocab": vocab, "merges": merges},
    }
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False) + "\n", encoding="utf-8")
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
        "chat_template": _HF_CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")


@functools.lru_cache(maxsize=8)
def _sentencepiece_merges(n_merges: int) -> tuple:
    words = Counter()
    for line in CORPUS.splitlines():
        for w in line.split(" "):
            if w:
                words[tuple(" " + w)] += 1
    return tuple(_train_merges(words, n_merges))


def _llama2c_pieces(vocab_size: int) -> list[tuple[float, bytes]]:
    """(score, piece) of the test SentencePiece-style vocabulary, by id."""
    if vocab_size < 259:
        raise ValueError(f"vocab_size {vocab_size} < 259 (3 special + 256 byte tokens)")
    pieces: list[tuple[float, bytes]] = [(0.0, b"<unk>"), (0.0, b"\n<s>\n"), (0.0, b"\n</s>\n")]
    pieces += [(0.0, f"<0x{b:02X}>".encode()) for b in range(256)]
    seen = {p for _, p in pieces}
    chars = sorted(set(" " + CORPUS.replace("\n", "")))
    for c in chars:
        if len(pieces) >= vocab_size:
            break
        pieces.append((-1e6, c.encode("utf-8")))
        seen.add(c.encode("utf-8"))
    rank = 0
    for a, b in _sentencepiece_merges(max(0, vocab_size - len(pieces))):
        if len(pieces) >= vocab_size:
            break
        p = (a + b).encode("utf-8")
        if p not in seen:
            pieces.append((-float(rank), p))
            seen.add(p)
            rank += 1
    k = 0
    while len(pieces) < vocab_size:
        pieces.append((-1e9, f"<extra_{k}>".encode()))
        k += 1
    return pieces


def write_llama2c_tokenizer(path, vocab_size: int) -> Path:
    """A llama2.c tokenizer.bin: <unk>, "\\n<s>\\n", "\\n</s>\\n", <0x00>..<0xFF>, the
    characters of CORPUS (score -1e6), pieces merged from CORPUS (score -rank), then
    padding pieces "<extra_N>" (score -1e9, never produced by encoding)."""
    pieces = _llama2c_pieces(vocab_size)
    path = Path(path)
    with open(path, "wb") as f:
        f.write(struct.pack("<i", max(len(p) for _, p in pieces)))
        for score, p in pieces:
            f.write(struct.pack("<fi", score, len(p)))
            f.write(p)
    return path


# ---------------------------------------------------------------------------- llama2.c


def write_llama2c_checkpoint(path, *, shape="tiny", seed: int = 0, tied: bool = True,
                             tokenizer: bool = True) -> Path:
    """Writes a llama2.c (version 0) float32 .bin and, with ``tokenizer``, tokenizer.bin
    beside it. ``path``: the .bin file, or a folder (then folder/model.bin). Returns the
    .bin path."""
    s = resolve_shape(shape)
    if s["_explicit_head_dim"] and s["head_dim"] * s["n_heads"] != s["dim"]:
        raise ValueError("llama2.c checkpoints need head_dim == dim / n_heads")
    out = Path(os.fspath(path))
    if out.is_dir():
        out = out / "model.bin"
    out.parent.mkdir(parents=True, exist_ok=True)
    dim, hid, L, V = s["dim"], s["hidden_dim"], s["n_layers"], s["vocab_size"]
    hd = s["head_dim"]
    kv_dim = s["n_kv_heads"] * hd
    emb = 2.0 / math.sqrt(dim)
    gen = _Gen(seed)
    with open(out, "wb") as f:
        f.write(struct.pack("<7i", dim, hid, L, s["n_heads"], s["n_kv_heads"], V if tied else -V, s["max_pos"]))
        parts = [
            ((V, dim), "normal", emb),                        # token_embedding
            ((L, dim), "norm", 1.0),                          # rms_att
            ((L, dim, dim), "normal", 1.2 / math.sqrt(dim)),  # wq
            ((L, kv_dim, dim), "normal", 1.2 / math.sqrt(dim)),  # wk
            ((L, kv_dim, dim), "normal", 1.0 / math.sqrt(dim)),  # wv
            ((L, dim, dim), "normal", _OUT_GAIN / math.sqrt(dim)),  # wo
            ((L, dim), "norm", 1.0),                          # rms_ffn
            ((L, hid, dim), "normal", 1.0 / math.sqrt(dim)),  # w1 (gate)
            ((L, dim, hid), "normal", _OUT_GAIN / math.sqrt(hid)),  # w2 (down)
            ((L, hid, dim), "normal", 1.0 / math.sqrt(dim)),  # w3 (up)
            ((dim,), "norm", 1.0),                            # rms_final
        ]
        for shp, kind, scale in parts:
            for piece in gen.chunks(shp, kind, scale):
                f.write(_encode(piece, "float32"))
        # The two unused RoPE tables [seq_len][head_dim/2]: written with their true values.
        freq = 1.0 / (10000.0 ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
        ang = np.outer(np.arange(s["max_pos"], dtype=np.float64), freq)
        f.write(np.cos(ang).astype("<f4").tobytes())
        f.write(np.sin(ang).astype("<f4").tobytes())
        if not tied:
            for piece in gen.chunks((V, dim), "normal", emb):
                f.write(_encode(piece, "float32"))
    if tokenizer:
        write_llama2c_tokenizer(out.parent / "tokenizer.bin", V)
    return out


def truncate_checkpoint(src, dst, n_layers: int) -> Path:
    """Writes a copy of checkpoint ``src`` (llama2.c .bin or GGUF) keeping only its
    first ``n_layers`` layers: a draft model for speculative decoding that shares the
    target's vocabulary and embeddings and proposes roughly what the target would.
    Returns the written path (``dst``)."""
    src, dst = Path(os.fspath(src)), Path(os.fspath(dst))
    if not isinstance(n_layers, int) or isinstance(n_layers, bool) or n_layers < 1:
        raise ValueError(f"n_layers must be a positive int, got {n_layers!r}")
    with open(src, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return _truncate_gguf(src, dst, n_layers)
    return _truncate_llama2c(src, dst, n_layers)


def _truncate_llama2c(src: Path, dst: Path, n_layers: int) -> Path:
    raw = np.fromfile(src, dtype=np.uint8)
    dim, hid, L, nh, nkv, v, seq = struct.unpack_from("<7i", raw, 0)
    if not 1 <= n_layers <= L:
        raise ValueError(f"{src}: has {L} layers, cannot keep {n_layers}")
    V, hd = abs(v), dim // nh
    per_layer = [dim, dim * dim, nkv * hd * dim, nkv * hd * dim, dim * dim, dim, hid * dim, dim * hid, hid * dim]
    w = raw[28:].view("<f4")
    out, pos = [w[:V * dim]], V * dim
    for n in per_layer:  # rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3: each all layers, layer-major
        out.append(w[pos:pos + n * n_layers])
        pos += n * L
    out.append(w[pos:])  # rms_final, the RoPE tables, and the classifier when untied
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(dst, "wb") as f:
        f.write(struct.pack("<7i", dim, hid, n_layers, nh, nkv, v, seq))
        for a in out:
            f.write(a.tobytes())
    return dst


def _truncate_gguf(src: Path, dst: Path, n_layers: int) -> Path:
    return rewrite_gguf(src, dst, n_layers=n_layers)


def rewrite_gguf(src, dst, *, n_layers: int | None = None, add_tensors: dict | None = None) -> Path:
    """Copies GGUF ``src`` to ``dst`` with its metadata (types kept) and tensors (bytes
    kept): only the first ``n_layers`` layers when given (``{arch}.block_count`` to
    match), plus ``add_tensors`` (name -> float32 array, stored as F32). Returns ``dst``."""
    r = GGUFReader(src)
    key = f"{r.metadata.get('general.architecture')}.block_count"
    if n_layers is not None and not (isinstance(r.metadata.get(key), int) and 1 <= n_layers <= r.metadata[key]):
        raise ValueError(f"{src}: has {r.metadata.get(key)} layers ({key}), cannot keep {n_layers}")
    w = GGUFWriter(dst, alignment=r.alignment)
    for k, value in r.metadata.items():
        if k == "general.alignment":
            continue
        vt, et = r.metadata_types[k]
        w.add(k, n_layers if (k == key and n_layers is not None) else value, vt, et)
    for name, info in r.tensors.items():
        if n_layers is not None and name.startswith("blk.") and int(name.split(".")[1]) >= n_layers:
            continue
        w.add_tensor_producer(name, info.shape, info.ggml_type, lambda name=name: [r.raw(name).tobytes()])
    for name, array in (add_tensors or {}).items():
        w.add_tensor(name, array)
    return w.write()


# ---------------------------------------------------------------------------- GGUF

GGUF_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
GGUF_TOKENIZERS = ("gpt2", "llama")
_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name for a HF tensor name (model.layers.3.self_attn.q_proj.weight ->
    blk.3.attn_q.weight)."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    if not m or m.group(2) not in _GGUF_LAYER_NAMES:
        raise ValueError(f"no GGUF name for tensor {hf_name!r}")
    return f"blk.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}"


def llama_qk_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The row permutation llama.cpp's converter applies to LLaMA q/k weights (and biases):
    within each head, HF's rows (i, i + head_dim/2) become rows (2i, 2i+1), so the
    interleaved-pairs RoPE of a GGUF llama model equals HF's rotate-half RoPE."""
    w = np.asarray(w)
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_gpt2_tokenizer(vocab_size: int, bos_id: int, eos_id: int) -> dict:
    vocab, merges = _byte_level_vocab(vocab_size, bos_id, eos_id)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [3 if i in (bos_id, eos_id) else 1 for i in range(len(tokens))]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": bos_id, "tokenizer.ggml.eos_token_id": eos_id,
            "tokenizer.ggml.add_bos_token": True}


def _gguf_llama_tokenizer(vocab_size: int) -> dict:
    """The llama2.c test vocabulary in llama.cpp's SentencePiece form: spaces as "▁",
    <unk> (type 2), <s>/</s> (control, 3), <0xNN> byte tokens (6), the rest normal (1)."""
    tokens, scores, types = [], [], []
    for i, (score, piece) in enumerate(_llama2c_pieces(vocab_size)):
        if i == 0:
            tokens.append("<unk>"), types.append(2)
        elif i in (1, 2):
            tokens.append("<s>" if i == 1 else "</s>"), types.append(3)
        elif i < 259:
            tokens.append(piece.decode()), types.append(6)
        else:
            tokens.append(piece.decode("utf-8").replace(" ", "\u2581")), types.append(1)
        scores.append(score)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_space_prefix": True}


def write_gguf_checkpoint(path, *, shape="tiny", arch: str | None = None, ggml_type="F32",
                          embed_type=None, seed: int = 0, tie_embeddings: bool | None = None,
                          tokenizer: str | None = "gpt2", chat_template: str | None = _HF_CHAT_TEMPLATE,
                          alignment: int = 32, version: int = 3, context_length: int | None = None,
                          rope_theta: float | None = None, rms_eps: float | None = None,
                          extra_metadata: dict | None = None, tensor_types: dict | None = None) -> Path:
    """Writes a random-weight model as one GGUF file (llama.cpp's names and metadata keys)
    and returns its path (``path``, or path/model.gguf for a folder).

    The float32 weights are exactly those of ``write_hf_checkpoint`` with the same shape,
    arch, seed and tying (same draw order), so the two files describe the same model. For
    arch "llama" the q/k rows are permuted as llama.cpp's converter does (see
    ``llama_qk_permute``; GGUF llama uses the interleaved-pairs RoPE); "qwen2" keeps HF's
    order (rotate-half RoPE) and has q/k/v biases. "qwen3" and "gemma3" (HF order, no
    biases) add each layer's attn_q_norm/attn_k_norm ([head_dim]) after its FFN, and gemma3
    its post_attention_norm and post_ffw_norm (the values stored are the (1 + w) llama.cpp's
    converter writes); pass "gemma3.attention.sliding_window" in ``extra_metadata`` for
    its local layers.

    ``ggml_type``: the type of the 2-D weights (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
    Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K); ``embed_type``: token_embd/output (default: ``ggml_type``);
    ``tensor_types``: per-matrix types by llama.cpp's short name ("attn_k", "ffn_down", ...),
    as a K-quant mix stores them. A matrix whose rows are not a multiple of the type's
    block cannot be block-quantized and is stored as F32 (llama.cpp also falls back for
    such tensors); norms and biases are always F32.
    ``tokenizer``: "gpt2" (the byte-level BPE test vocabulary of ``write_hf_tokenizer``,
    pre-tokenizer "gpt2"), "llama" (the SentencePiece-style vocabulary of
    ``write_llama2c_tokenizer``, with scores) or None; ``chat_template`` is stored with it.
    ``extra_metadata``: more entries, key -> value or (value, GGUFValueType), written last
    (a key already set is replaced).
    """
    s = resolve_shape(shape)
    arch = arch or s.get("arch", "llama")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"unknown GGUF arch {arch!r}; use one of {GGUF_ARCHS}")
    if tokenizer not in GGUF_TOKENIZERS + (None,):
        raise ValueError(f"unknown tokenizer {tokenizer!r}; use one of {GGUF_TOKENIZERS} or None")
    mat_type = _ggml_type(ggml_type)
    emb_type = mat_type if embed_type is None else _ggml_type(embed_type)
    tie = s.get("tie_embeddings", False) if tie_embeddings is None else bool(tie_embeddings)
    out = Path(os.fspath(path))
    if out.is_dir():
        out = out / "model.gguf"
    V, dim = s["vocab_size"], s["dim"]
    w = GGUFWriter(out, alignment=alignment, version=version)
    U32, F32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    w.add("general.architecture", arch)
    w.add("general.name", f"conveyor-random-{arch}-{mat_type.name.lower()}")
    w.add("general.file_type", {GGMLType.F32: 0, GGMLType.F16: 1, GGMLType.Q4_0: 2, GGMLType.Q4_1: 3,
                                GGMLType.Q8_0: 7, GGMLType.Q5_0: 8, GGMLType.Q5_1: 9, GGMLType.Q2_K: 10, GGMLType.Q3_K: 12, GGMLType.Q4_K: 15,
                                GGMLType.Q5_K: 17, GGMLType.Q6_K: 18, GGMLType.BF16: 32}[mat_type], U32)
    w.add(f"{arch}.context_length", int(context_length or s["max_pos"]), U32)
    w.add(f"{arch}.embedding_length", dim, U32)
    w.add(f"{arch}.feed_forward_length", s["hidden_dim"], U32)
    w.add(f"{arch}.block_count", s["n_layers"], U32)
    w.add(f"{arch}.attention.head_count", s["n_heads"], U32)
    w.add(f"{arch}.attention.head_count_kv", s["n_kv_heads"], U32)
    w.add(f"{arch}.rope.freq_base", float(s["rope_theta"] if rope_theta is None else rope_theta), F32)
    w.add(f"{arch}.attention.layer_norm_rms_epsilon", float(s["rms_eps"] if rms_eps is None else rms_eps), F32)
    w.add(f"{arch}.rope.dimension_count", s["head_dim"], U32)
    w.add(f"{arch}.vocab_size", V, U32)
    if s["_explicit_head_dim"]:
        w.add(f"{arch}.attention.key_length", s["head_dim"], U32)
        w.add(f"{arch}.attention.value_length", s["head_dim"], U32)
    if tokenizer == "gpt2":
        tok = _gguf_gpt2_tokenizer(V, s.get("bos_id", 0), s.get("eos_id", 1))
    elif tokenizer == "llama":
        tok = _gguf_llama_tokenizer(V)
    else:
        tok = {}
    for key, value in tok.items():
        if key.endswith("_id"):
            w.add(key, value, U32)
        else:
            w.add(key, value)
    if tokenizer and chat_template:
        w.add("tokenizer.chat_template", chat_template)
    for key, value in (extra_metadata or {}).items():
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], GGUFValueType):
            w.add(key, value[0], value[1])
        else:
            w.add(key, value)

    gen = _Gen(seed)
    layout = []
    for entry in hf_tensor_layout(s, arch, tie, arch == "qwen2"):
        layout.append(entry)
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", entry[0])
        if m and arch in ("qwen3", "gemma3"):  # the layer's extra norms, by their GGUF names
            extra = ["attn_q_norm", "attn_k_norm"] + (["post_attention_norm", "post_ffw_norm"] if arch == "gemma3" else [])
            for e in extra:
                layout.append((f"blk.{m.group(1)}.{e}.weight", (s["head_dim"] if "_k_" in e or "_q_" in e else s["dim"],),
                               "norm", 1.0))
    for name, shp, kind, scale in layout:
        arr = gen.full(shp, kind, scale)
        gname = name if name.startswith("blk.") else gguf_tensor_name(name)
        if arch == "llama" and gname.split(".")[-2] in ("attn_q", "attn_k"):
            arr = llama_qk_permute(arr, s["n_heads"] if "attn_q" in gname else s["n_kv_heads"])
        t = GGMLType.F32
        if arr.ndim == 2:
            t = emb_type if gname in ("token_embd.weight", "output.weight") else mat_type
            short = gname.split(".")[-2]
            if tensor_types and short in tensor_types:
                t = _ggml_type(tensor_types[short])
            if arr.shape[1] % _TYPE_LAYOUT[t][0]:
                t = GGMLType.F32
        data = quantize(arr, t)
        w.add_tensor_producer(gname, arr.shape, t, lambda data=data: [data.tobytes()])
    return w.write()


# ---------------------------------------------------------------------------- LoRA

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_lora_weights(cfg: dict, rank: int, targets=LORA_MODULES, seed: int = 0, scale: float = 0.3) -> dict:
    """{(layer, module): (A [rank][in], B [out][rank])} float32, random (B nonzero, unlike a
    fresh PEFT adapter, so the adapter changes the output). cfg: a Checkpoint.config."""
    from .lora import module_shapes

    rng = np.random.default_rng(seed)
    shapes = module_shapes(cfg)
    out = {}
    for layer in range(cfg["n_layers"]):
        for mod in targets:
            o, i = shapes[mod]
            a = (rng.standard_normal((rank, i)) * scale / np.sqrt(i)).astype(np.float32)
            b = (rng.standard_normal((o, rank)) * scale / np.sqrt(rank)).astype(np.float32)
            out[(layer, mod)] = (a, b)
    return out


def write_peft_adapter(folder, weights: dict, *, rank: int, alpha: float, use_rslora: bool = False,
                       config_extra: dict | None = None, dtype: str = "float32",
                       extra_tensors: dict | None = None) -> Path:
    """A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors, PEFT's tensor
    names) holding ``weights`` as random_lora_weights returns them (HF row order)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    targets = sorted({m for _, m in weights}, key=LORA_MODULES.index)
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets, "bias": "none",
           "use_rslora": use_rslora, "use_dora": False, "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}
    cfg.update(config_extra or {})
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = {}
    for (layer, mod), (a, b) in weights.items():
        part = "self_attn" if mod in LORA_MODULES[:4] else "mlp"
        base = f"base_model.model.model.layers.{layer}.{part}.{mod}"
        tensors[f"{base}.lora_A.weight"] = a
        tensors[f"{base}.lora_B.weight"] = b
    tensors.update(extra_tensors or {})
    names = sorted(tensors)
    head, _ = _safetensors_header([(n, tensors[n].shape) for n in names], dtype)
    with open(folder / "adapter_model.safetensors", "wb") as f:
        f.write(head)
        for n in names:
            f.write(_encode(tensors[n], dtype))
    return folder


def write_merged_lora(dst, base, weights: dict, scale: float) -> Path:
    """A copy of the HF folder ``base`` at ``dst`` with W + scale * B A written into the
    projections of ``weights`` ({(layer, module): (A, B)}, as random_lora_weights makes),
    summed in float64 and stored as float32: the checkpoint an adapter merged into its base is."""
    dst, base = Path(dst), Path(base)
    dst.mkdir(parents=True)
    for f in base.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = {k: v for k, (_, v) in read_safetensors_file(base / "model.safetensors").items()}
    for (layer, mod), (a, b) in weights.items():
        part = "self_attn" if mod in LORA_MODULES[:4] else "mlp"
        name = f"model.layers.{layer}.{part}.{mod}.weight"
        tensors[name] = (tensors[name].astype(np.float64) + scale * (b.astype(np.float64) @ a)).astype(np.float32)
    names = sorted(tensors)
    meta, off = {}, 0
    for n in names:
        meta[n] = {"dtype": "F32", "shape": list(tensors[n].shape), "data_offsets": [off, off + tensors[n].nbytes]}
        off += tensors[n].nbytes
    head = json.dumps(meta).encode()
    head += b" " * (-len(head) % 8)
    with open(dst / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for n in names:
            f.write(np.ascontiguousarray(tensors[n]).tobytes())
    return dst


def write_gguf_lora(path, weights: dict, *, alpha: float, arch: str = "llama", n_heads: int | None = None,
                    n_kv_heads: int | None = None, general_type: str = "adapter") -> Path:
    """llama.cpp's GGUF LoRA form of ``weights`` (HF row order in; for arch llama the q/k
    rows of B are permuted as llama.cpp's converter does, so pass n_heads/n_kv_heads)."""
    from .gguf import GGUFWriter

    w = GGUFWriter(path)
    w.add("general.architecture", arch)
    w.add("general.type", general_type)
    w.add("adapter.type", "lora")
    w.add("adapter.lora.alpha", float(alpha))
    short = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    for (layer, mod), (a, b) in sorted(weights.items()):
        if arch == "llama" and mod in ("q_proj", "k_proj"):
            b = llama_qk_permute(b, n_heads if mod == "q_proj" else n_kv_heads)
        w.add_tensor(f"blk.{layer}.{short[mod]}.weight.lora_a", np.ascontiguousarray(a, dtype=np.float32))
        w.add_tensor(f"blk.{layer}.{short[mod]}.weight.lora_b", np.ascontiguousarray(b, dtype=np.float32))
    return w.write()
