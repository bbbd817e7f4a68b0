"""A NumPy oracle for the model: float64, full causal attention, no batching tricks.

Written from the model definition, independent of the C engine: it reads checkpoints with
its own small readers (safetensors, llama2.c, and GGUF via conveyor.gguf with NumPy
dequantization), so a bug in the C loader cannot hide in
both. Meant for tiny models in tests.

    ref = ReferenceModel.load(path)           # HF folder, llama2.c .bin or .gguf
    ref.logits([1, 403, 407])                 # float64 [3][vocab]
    ref.greedy([1], 20)                       # 20 new token ids (argmax each step)

The model (LLaMA family): x = embed[token]; per layer
    x += o_proj(attention(rope(q_proj(n)), rope(k_proj(n)), v_proj(n))),  n = rmsnorm(x)
    x += down(silu(gate(n)) * up(n)),                                     n = rmsnorm(x)
logits = rmsnorm(x) @ lm_head.T (lm_head = embed when tied). RMSNorm: x / sqrt(mean(x^2) + eps) * w.
Grouped-query attention: query head h reads kv head h // (n_heads / n_kv_heads); scores scaled
by 1/sqrt(head_dim). RoPE rotates (i, i + head_dim/2) for HF checkpoints and GGUF qwen2
("halves") and (2i, 2i+1) for llama2.c and GGUF llama ("pairs": llama.cpp's converter
permutes the q/k rows) by angle pos * theta^(-2i/head_dim), with llama3 scaling of
the frequencies when the config asks for it. Biases (Qwen2 q/k/v, or any *_proj.bias in the
file) are added. Mistral's sliding window is not applied (attention is always full causal).
"""
from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import numpy as np

from ._core import ModelFormatError, UnsupportedError

__all__ = [
    "ReferenceModel",
    "read_safetensors_file",
    "read_hf_weights",
    "read_llama2c",
    "read_gguf",
    "rope_inv_freq",
]

_ST_DTYPES = {"F32": (np.dtype("<f4"), 4), "F16": (np.dtype("<f2"), 2), "BF16": (np.dtype("<u2"), 2),
              "F64": (np.dtype("<f8"), 8)}
_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
          "llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}


# ---------------------------------------------------------------------------- readers


# The C loader's cap on a safetensors header or shard index (csrc/model/json.h).
MAX_MODEL_JSON_BYTES = 16 << 20


def f32_to_bf16_bits(a) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return rounded.astype(np.uint16)


def bf16_bits_to_f32(bits) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def read_safetensors_file(path) -> dict[str, tuple[str, np.ndarray]]:
    """{name: (dtype, values)} of one .safetensors file; values as float32 (exact for
    F32/F16/BF16), shaped as stored."""
    path = Path(path)
    data = path.read_bytes()
    if len(data) < 8:
        raise ModelFormatError(f"{path}: too short for a safetensors file")
    (n,) = struct.unpack_from("<Q", data, 0)
    if n > len(data) - 8:
        raise ModelFormatError(f"{path}: header length {n} runs past the end of the file")
    if n > MAX_MODEL_JSON_BYTES:
        raise ModelFormatError(f"{path}: header length {n} is over the {MAX_MODEL_JSON_BYTES}-byte limit")
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: bad safetensors header ({e})") from None
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], list(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ModelFormatError(f"{path}: tensor {name!r} has a malformed header entry") from None
        if dtype not in _ST_DTYPES:
            raise UnsupportedError(f"{path}: tensor {name!r} has dtype {dtype}")
        np_dtype, size = _ST_DTYPES[dtype]
        count = int(np.prod(shape)) if shape else 1
        if not (0 <= begin <= end <= len(data) - base) or end - begin != count * size:
            raise ModelFormatError(f"{path}: tensor {name!r} offsets {begin}..{end} do not fit "
                                   f"shape {shape} {dtype} in a file of {len(data)} bytes")
        raw = np.frombuffer(data, dtype=np_dtype, count=count, offset=base + begin)
        if dtype == "BF16":
            vals = (raw.astype(np.uint32) << np.uint32(16)).view(np.float32)
        else:
            vals = raw.astype(np.float32)
        out[name] = (dtype, vals.reshape(shape))
    return out


def read_hf_weights(folder) -> dict[str, tuple[str, np.ndarray]]:
    """All tensors of a HF folder: model.safetensors or the shards named by
    model.safetensors.index.json."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        if index.stat().st_size > MAX_MODEL_JSON_BYTES:
            raise ModelFormatError(f"{index}: more than the {MAX_MODEL_JSON_BYTES} bytes a shard index may have")
        with open(index, encoding="utf-8") as f:
            doc = json.load(f)
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict):
            raise ModelFormatError(f"{index}: \"weight_map\" is missing or not an object")
        out: dict = {}
        for fname in sorted({_shard_name(index, v) for v in weight_map.values()}):
            out.update(read_safetensors_file(folder / fname))
        missing = set(weight_map) - set(out)
        if missing:
            raise ModelFormatError(f"{index}: tensors not found in their shards: {sorted(missing)[:5]}")
        return out
    single = folder / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {folder}")
    return read_safetensors_file(single)


def _shard_name(index: Path, name) -> str:
    """A weight_map shard name: a plain file name in the index's folder, as the C
    reader requires (no separators, no "." or "..")."""
    if not isinstance(name, str) or not name or len(name.encode("utf-8", "surrogatepass")) > 255 or \
            "/" in name or "\0" in name or name in (".", ".."):
        raise ModelFormatError(f"{index}: weight_map names shard {name!r}, which is not a plain file name "
                               "in the same directory")
    return name


def read_llama2c(path) -> tuple[dict, dict]:
    """(config, weights) of a llama2.c version-0 .bin (float32)."""
    path = Path(path)
    data = path.read_bytes()
    if len(data) < 28:
        raise ModelFormatError(f"{path}: too short for a llama2.c header ({len(data)} bytes)")
    if struct.unpack_from("<I", data, 0)[0] == 0x616B3432:
        raise UnsupportedError(f"{path}: llama2.c version 1/2 exports are not supported (only version 0)")
    dim, hid, n_layers, n_heads, n_kv, vocab, seq_len = struct.unpack_from("<7i", data, 0)
    shared = vocab > 0
    vocab = abs(vocab)
    if min(dim, hid, n_layers, n_heads, n_kv, vocab, seq_len) <= 0 or dim % n_heads or n_heads % n_kv:
        raise ModelFormatError(f"{path}: bad header dim={dim} hidden_dim={hid} n_layers={n_layers} "
                               f"n_heads={n_heads} n_kv_heads={n_kv} vocab_size={vocab} seq_len={seq_len}")
    hd = dim // n_heads
    kv_dim = n_kv * hd
    L = n_layers
    parts = [("embed", (vocab, dim)), ("rms_att", (L, dim)), ("wq", (L, dim, dim)), ("wk", (L, kv_dim, dim)),
             ("wv", (L, kv_dim, dim)), ("wo", (L, dim, dim)), ("rms_ffn", (L, dim)), ("w1", (L, hid, dim)),
             ("w2", (L, dim, hid)), ("w3", (L, hid, dim)), ("rms_final", (dim,)),
             ("freq_real", (seq_len, hd // 2)), ("freq_imag", (seq_len, hd // 2))]
    if not shared:
        parts.append(("wcls", (vocab, dim)))
    need = 28 + 4 * sum(int(np.prod(s)) for _, s in parts)
    if len(data) != need:
        raise ModelFormatError(f"{path}: file is {len(data)} bytes; the header implies {need}")
    arrays = {}
    off = 28
    for name, shape in parts:
        count = int(np.prod(shape))
        arrays[name] = np.frombuffer(data, dtype="<f4", count=count, offset=off).reshape(shape).astype(np.float64)
        off += 4 * count
    config = dict(format="llama2c", arch="llama", dim=dim, hidden_dim=hid, n_layers=L, n_heads=n_heads,
                  n_kv_heads=n_kv, head_dim=hd, vocab_size=vocab, max_pos=seq_len, rms_eps=1e-5,
                  rope_theta=10000.0, rope_layout="pairs", rope_scaling=None, tie_embeddings=shared,
                  qkv_bias=False, bos_id=1, eos_ids=[2], dtype="float32")
    layers = [dict(attn_norm=arrays["rms_att"][i], wq=arrays["wq"][i], wk=arrays["wk"][i], wv=arrays["wv"][i],
                   wo=arrays["wo"][i], ffn_norm=arrays["rms_ffn"][i], w_gate=arrays["w1"][i],
                   w_up=arrays["w3"][i], w_down=arrays["w2"][i]) for i in range(L)]
    weights = dict(embed=arrays["embed"], final_norm=arrays["rms_final"],
                   lm_head=None if shared else arrays["wcls"], layers=layers)
    return config, weights


_GGUF_ROPE = {"llama": "pairs", "qwen2": "halves", "qwen3": "halves", "gemma3": "halves"}


def read_gguf(path) -> tuple[dict, dict]:
    """(config, weights) of a GGUF llama/qwen2 model, every tensor dequantized to float64."""
    from .gguf import GGUFError, GGUFReader

    try:
        f = GGUFReader(path)
    except GGUFError as e:
        raise ModelFormatError(str(e)) from None
    md = f.metadata
    arch = md.get("general.architecture")
    if arch not in _GGUF_ROPE:
        raise UnsupportedError(f"{path}: GGUF architecture {arch!r} is not supported ({', '.join(_GGUF_ROPE)})")

    def key(name, default=None):
        v = md.get(f"{arch}.{name}", default)
        if v is None:
            raise ModelFormatError(f"{path}: metadata {arch}.{name} is missing")
        return v

    dim, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    scaling = md.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise UnsupportedError(f"{path}: rope scaling {scaling!r} is not supported")
    tok = md.get("tokenizer.ggml.tokens")
    cfg = dict(format="gguf", arch=arch, dim=dim, hidden_dim=int(key("feed_forward_length")),
               n_layers=int(key("block_count")), n_heads=n_heads,
               n_kv_heads=int(key("attention.head_count_kv", n_heads)),
               head_dim=int(key("attention.key_length", dim // n_heads)),
               vocab_size=int(md.get(f"{arch}.vocab_size") or (len(tok) if tok else
                                                               f.tensors["token_embd.weight"].shape[0])),
               max_pos=int(key("context_length", 2048)),
               rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6 if arch == "gemma3" else 1e-5)),
               rope_theta=float(key("rope.freq_base", 10000.0)), rope_layout=_GGUF_ROPE[arch],
               rope_scaling=({"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
                             if scaling == "linear" else None),
               tie_embeddings="output.weight" not in f.tensors,
               qkv_bias="blk.0.attn_q.bias" in f.tensors,
               bos_id=md.get("tokenizer.ggml.bos_token_id"), dtype="gguf")
    eos = md.get("tokenizer.ggml.eos_token_id")
    cfg["eos_ids"] = [eos] if isinstance(eos, int) else []
    cfg["qk_norm"] = arch in ("qwen3", "gemma3")
    if arch == "gemma3":
        # HF Gemma3: embeddings * sqrt(dim); the GGUF norms already hold (1 + w); local layers
        # (all but every pattern-th) use base 10000 and a sliding window; GELU-tanh gating
        cfg.update(gemma=True, embed_scale=math.sqrt(dim), rope_local_theta=10000.0,
                   sliding_window=int(md.get("gemma3.attention.sliding_window", 0)),
                   swa_period=int(md.get("gemma3.attention.sliding_window_pattern", 6)),
                   # HF's query_pre_attn_scalar: head_dim, but dim / heads for the 27B model (62 layers)
                   attn_scale=1.0 / math.sqrt(dim // n_heads) if cfg["n_layers"] == 62 else None)
    if cfg["n_heads"] % cfg["n_kv_heads"]:
        raise ModelFormatError(f"{path}: head_count {n_heads} is not a multiple of head_count_kv "
                               f"{cfg['n_kv_heads']}")

    def get(name, shape, required=True):
        if name not in f.tensors:
            if required:
                raise ModelFormatError(f"{path}: tensor {name} is missing")
            return None
        info = f.tensors[name]
        if tuple(info.shape) != tuple(shape):
            raise ModelFormatError(f"{path}: tensor {name} has shape {list(info.shape)}, expected {list(shape)}")
        return f.tensor(name).astype(np.float64)

    hd, hid, V = cfg["head_dim"], cfg["hidden_dim"], cfg["vocab_size"]
    q_dim, kv_dim = n_heads * hd, cfg["n_kv_heads"] * hd
    bias = cfg["qkv_bias"]
    layers = []
    for i in range(cfg["n_layers"]):
        p = f"blk.{i}."
        layers.append(dict(
            attn_norm=get(p + "attn_norm.weight", (dim,)),
            wq=get(p + "attn_q.weight", (q_dim, dim)), wk=get(p + "attn_k.weight", (kv_dim, dim)),
            wv=get(p + "attn_v.weight", (kv_dim, dim)), wo=get(p + "attn_output.weight", (dim, q_dim)),
            bq=get(p + "attn_q.bias", (q_dim,), bias), bk=get(p + "attn_k.bias", (kv_dim,), bias),
            bv=get(p + "attn_v.bias", (kv_dim,), bias), bo=get(p + "attn_output.bias", (dim,), False),
            ffn_norm=get(p + "ffn_norm.weight", (dim,)),
            w_gate=get(p + "ffn_gate.weight", (hid, dim)), w_up=get(p + "ffn_up.weight", (hid, dim)),
            w_down=get(p + "ffn_down.weight", (dim, hid)),
            q_norm=get(p + "attn_q_norm.weight", (hd,), cfg["qk_norm"]),
            k_norm=get(p + "attn_k_norm.weight", (hd,), cfg["qk_norm"]),
            post_attn_norm=get(p + "post_attention_norm.weight", (dim,), arch == "gemma3"),
            post_ffn_norm=get(p + "post_ffw_norm.weight", (dim,), arch == "gemma3"),
        ))
    if "rope_freqs.weight" in f.tensors:  # llama 3.x: per-frequency divisors
        cfg["rope_freqs"] = get("rope_freqs.weight", (hd // 2,))
    weights = dict(embed=get("token_embd.weight", (V, dim)), final_norm=get("output_norm.weight", (dim,)),
                   lm_head=None if cfg["tie_embeddings"] else get("output.weight", (V, dim)), layers=layers)
    return cfg, weights


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _hf_config(folder: Path) -> dict:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            c = json.load(f)
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{cfg_path}: not valid JSON ({e})") from None
    names = list(c.get("architectures") or []) + [c.get("model_type")]
    arch = next((_ARCHS[n] for n in names if n in _ARCHS), None)
    if arch is None:
        raise UnsupportedError(f"{cfg_path}: architecture {names} is not supported")
    try:
        dim, n_heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        cfg = dict(format="hf", arch=arch, dim=dim, hidden_dim=int(c["intermediate_size"]),
                   n_layers=int(c["num_hidden_layers"]), n_heads=n_heads,
                   n_kv_heads=int(c.get("num_key_value_heads") or n_heads),
                   head_dim=int(c.get("head_dim") or dim // n_heads), vocab_size=int(c["vocab_size"]),
                   max_pos=int(c.get("max_position_embeddings") or 2048),
                   rms_eps=float(c.get("rms_norm_eps") or 1e-6),
                   rope_theta=float(c.get("rope_theta") or 10000.0), rope_layout="halves",
                   rope_scaling=c.get("rope_scaling"),
                   tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                   qkv_bias=arch == "qwen2" or bool(c.get("attention_bias", False)),
                   bos_id=c.get("bos_token_id"), dtype=c.get("torch_dtype"))
    except KeyError as e:
        raise ModelFormatError(f"{cfg_path}: missing {e.args[0]!r}") from None
    eos = c.get("eos_token_id")
    cfg["eos_ids"] = [e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int)]
    if cfg["n_heads"] % cfg["n_kv_heads"]:
        raise ModelFormatError(f"{cfg_path}: num_attention_heads {n_heads} is not a multiple of "
                               f"num_key_value_heads {cfg['n_kv_heads']}")
    return cfg


def _hf_weights(folder: Path, cfg: dict) -> dict:
    raw = read_hf_weights(folder)

    def get(name, shape, required=True):
        if name not in raw:
            if required:
                raise ModelFormatError(f"{folder}: tensor {name} is missing")
            return None
        arr = raw[name][1]
        if tuple(arr.shape) != tuple(shape):
            raise ModelFormatError(f"{folder}: tensor {name} has shape {list(arr.shape)}, expected {list(shape)}")
        return arr.astype(np.float64)

    dim, hid, hd = cfg["dim"], cfg["hidden_dim"], cfg["head_dim"]
    q_dim, kv_dim, V = cfg["n_heads"] * hd, cfg["n_kv_heads"] * hd, cfg["vocab_size"]
    layers = []
    for i in range(cfg["n_layers"]):
        p = f"model.layers.{i}."
        layers.append(dict(
            attn_norm=get(p + "input_layernorm.weight", (dim,)),
            wq=get(p + "self_attn.q_proj.weight", (q_dim, dim)),
            wk=get(p + "self_attn.k_proj.weight", (kv_dim, dim)),
            wv=get(p + "self_attn.v_proj.weight", (kv_dim, dim)),
            wo=get(p + "self_attn.o_proj.weight", (dim, q_dim)),
            bq=get(p + "self_attn.q_proj.bias", (q_dim,), cfg["qkv_bias"]),
            bk=get(p + "self_attn.k_proj.bias", (kv_dim,), cfg["qkv_bias"]),
            bv=get(p + "self_attn.v_proj.bias", (kv_dim,), cfg["qkv_bias"]),
            bo=get(p + "self_attn.o_proj.bias", (dim,), False),
            ffn_norm=get(p + "post_attention_layernorm.weight", (dim,)),
            w_gate=get(p + "mlp.gate_proj.weight", (hid, dim)),
            w_up=get(p + "mlp.up_proj.weight", (hid, dim)),
            w_down=get(p + "mlp.down_proj.weight", (dim, hid)),
        ))
    return dict(embed=get("model.embed_tokens.weight", (V, dim)), final_norm=get("model.norm.weight", (dim,)),
                lm_head=None if cfg["tie_embeddings"] else get("lm_head.weight", (V, dim)), layers=layers)


# ---------------------------------------------------------------------------- math


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> np.ndarray:
    """Rotation frequencies theta^(-2i/head_dim), i < head_dim/2, with llama3 (or linear)
    scaling applied when given."""
    freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if not scaling:
        return freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return freq
    factor = float(scaling["factor"])
    if kind == "linear":
        return freq / factor
    if kind != "llama3":
        raise UnsupportedError(f"rope_scaling type {kind!r} is not supported")
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen, high_freq_wavelen = old_ctx / low, old_ctx / high
    out = np.empty_like(freq)
    for i, f in enumerate(freq):
        wavelen = 2 * math.pi / f
        if wavelen < high_freq_wavelen:      # high frequency: unchanged
            out[i] = f
        elif wavelen > low_freq_wavelen:     # low frequency: slowed by factor
            out[i] = f / factor
        else:                                # in between: blend the two
            smooth = (old_ctx / wavelen - low) / (high - low)
            out[i] = (1 - smooth) * f / factor + smooth * f
    return out


def _rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray, layout: str) -> np.ndarray:
    """x: [T][heads][head_dim], pos: [T]."""
    ang = pos[:, None].astype(np.float64) * inv_freq[None, :]  # [T][head_dim/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = np.empty_like(x)
    if layout == "halves":
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        out[..., :half] = a * cos - b * sin
        out[..., half:] = b * cos + a * sin
    else:  # adjacent pairs (2i, 2i+1)
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
    return out


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


class ReferenceModel:
    """config: dict with the keys of conveyor._core.Checkpoint.config (plus "format");
    weights: embed, final_norm, lm_head (None when tied), layers (list of dicts)."""

    def __init__(self, config: dict, weights: dict, gemm_inputs: str = "float32"):
        if gemm_inputs not in ("float32", "bfloat16"):
            raise ValueError(f"gemm_inputs must be 'float32' or 'bfloat16', got {gemm_inputs!r}")
        self.config = config
        self.weights = weights
        self.gemm_inputs = gemm_inputs
        self.inv_freq = rope_inv_freq(config["head_dim"], config["rope_theta"], config.get("rope_scaling"))
        if config.get("rope_freqs") is not None:
            self.inv_freq = self.inv_freq / config["rope_freqs"]
        # Gemma 3's local layers: their own base, no scaling
        self.inv_freq_local = rope_inv_freq(config["head_dim"], config.get("rope_local_theta", 10000.0))
        self.lora = None  # a conveyor.lora.LoRAAdapter whose deltas every projection adds

    def _proj(self, x: np.ndarray, w: np.ndarray, layer: int, module: str) -> np.ndarray:
        """x @ w.T plus the adapter's scale * (x A^T) B^T for that module, when one is set."""
        y = self._mm(x, w)
        d = self.lora.delta(layer, module, x) if self.lora is not None else None
        return y if d is None else y + d

    def _is_local(self, layer: int) -> bool:
        c = self.config
        return c.get("sliding_window", 0) > 0 and (layer + 1) % c.get("swa_period", 6) != 0

    @classmethod
    def load(cls, path, gemm_inputs: str = "float32") -> "ReferenceModel":
        """gemm_inputs="bfloat16" rounds the input rows of every weight GEMM to bfloat16 (round
        to nearest even), as the engine's vdpbf16ps path does for bf16 weights."""
        path = Path(os.fspath(path))
        if path.is_dir():
            cfg = _hf_config(path)
            return cls(cfg, _hf_weights(path, cfg), gemm_inputs)
        if path.is_file():
            return cls(*(read_gguf(path) if _is_gguf(path) else read_llama2c(path)), gemm_inputs)
        raise FileNotFoundError(f"model not found: {path}")

    def _mm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """x @ w.T with x rounded as the engine's GEMM reads it."""
        if self.gemm_inputs == "bfloat16":  # the float32 row (as the engine holds it), then bf16
            x = bf16_bits_to_f32(f32_to_bf16_bits(x)).astype(x.dtype)
        return x @ w.T

    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"]

    def _check_tokens(self, tokens) -> np.ndarray:
        toks = np.asarray(list(tokens), dtype=np.int64)
        if toks.ndim != 1:
            raise ValueError("tokens must be a flat sequence of ids")
        if toks.size and (toks.min() < 0 or toks.max() >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        return toks

    def forward(self, tokens, cache: list | None = None) -> np.ndarray:
        """Logits [len(tokens)][vocab] for tokens that continue the sequence held in
        ``cache`` (a list that collects each layer's keys and values; pass [] to start)."""
        c, W = self.config, self.weights
        toks = self._check_tokens(tokens)
        T = len(toks)
        if cache is None:
            cache = []
        start = cache[0][0].shape[0] if cache else 0
        pos = np.arange(start, start + T)
        H, KV, hd = c["n_heads"], c["n_kv_heads"], c["head_dim"]
        group = H // KV
        x = W["embed"][toks]  # [T][dim]
        if c.get("embed_scale"):
            x = x * np.float64(np.float32(c["embed_scale"]))
        for li, L in enumerate(W["layers"]):
            local = self._is_local(li)
            inv_freq = self.inv_freq_local if local else self.inv_freq
            h = _rmsnorm(x, L["attn_norm"], c["rms_eps"])
            q, k, v = (self._proj(h, L["wq"], li, "q_proj"), self._proj(h, L["wk"], li, "k_proj"),
                       self._proj(h, L["wv"], li, "v_proj"))
            if L.get("bq") is not None:
                q, k, v = q + L["bq"], k + L["bk"], v + L["bv"]
            q, k = q.reshape(T, H, hd), k.reshape(T, KV, hd)
            if L.get("q_norm") is not None:  # per head, before RoPE
                q, k = _rmsnorm(q, L["q_norm"], c["rms_eps"]), _rmsnorm(k, L["k_norm"], c["rms_eps"])
            q = _rope(q, pos, inv_freq, c["rope_layout"])
            k = _rope(k, pos, inv_freq, c["rope_layout"])
            v = v.reshape(T, KV, hd)
            if len(cache) <= li:
                cache.append((k, v))
            else:
                cache[li] = (np.concatenate([cache[li][0], k]), np.concatenate([cache[li][1], v]))
            K, V = cache[li]  # [S][KV][hd]
            S = K.shape[0]
            kh = np.repeat(K, group, axis=1).transpose(1, 2, 0)  # [H][hd][S]
            vh = np.repeat(V, group, axis=1).transpose(1, 0, 2)  # [H][S][hd]
            scale = c.get("attn_scale") or 1.0 / math.sqrt(hd)
            scores = q.transpose(1, 0, 2) @ kh * scale           # [H][T][S]
            key_pos = np.arange(S)
            visible = key_pos[None, None, :] <= pos[None, :, None]
            if local:  # the sliding window: the last `window` positions, this one included
                visible &= key_pos[None, None, :] > pos[None, :, None] - c["sliding_window"]
            scores = np.where(visible, scores, -np.inf)
            scores -= scores.max(axis=-1, keepdims=True)
            p = np.exp(scores)
            p /= p.sum(axis=-1, keepdims=True)
            att = (p @ vh).transpose(1, 0, 2).reshape(T, H * hd)
            out = self._proj(att, L["wo"], li, "o_proj")
            if L.get("bo") is not None:
                out = out + L["bo"]
            if L.get("post_attn_norm") is not None:
                out = _rmsnorm(out, L["post_attn_norm"], c["rms_eps"])
            x = x + out
            h = _rmsnorm(x, L["ffn_norm"], c["rms_eps"])
            act = _gelu_tanh if c.get("gemma") else _silu
            out = self._proj(act(self._proj(h, L["w_gate"], li, "gate_proj")) * self._proj(h, L["w_up"], li, "up_proj"),
                             L["w_down"], li, "down_proj")
            if L.get("post_ffn_norm") is not None:
                out = _rmsnorm(out, L["post_ffn_norm"], c["rms_eps"])
            x = x + out
        x = _rmsnorm(x, W["final_norm"], c["rms_eps"])
        head = W["embed"] if W["lm_head"] is None else W["lm_head"]
        return self._mm(x, head)

    def logits(self, tokens) -> np.ndarray:
        """float64 [len(tokens)][vocab]: row t predicts the token after tokens[:t+1]."""
        return self.forward(tokens, [])

    def greedy(self, prompt_tokens, n_new: int, stop_ids=()) -> list[int]:
        """n_new argmax tokens after the prompt (fewer if one in ``stop_ids`` comes; it is
        included). Ties go to the lowest id."""
        if len(prompt_tokens) == 0:
            raise ValueError("the prompt must have at least one token")
        cache: list = []
        logits = self.forward(prompt_tokens, cache)[-1]
        out: list[int] = []
        stop = set(stop_ids or ())
        while len(out) < n_new:
            tok = int(np.argmax(logits))
            out.append(tok)
            if tok in stop or len(out) == n_new:
                break
            logits = self.forward([tok], cache)[-1]
        return out
