"""LoRA adapters: reading PEFT folders and llama.cpp GGUF LoRA files into the
low-rank pairs the engine adds to its projections, checked against the base model.

The loader is Python over NumPy (the safetensors and GGUF readers of
conveyor.reference and conveyor.gguf): an adapter is a few small f32 matrices,
its checks are about JSON keys and shapes whose errors must name the key, and
the engine only needs the final arrays, which cross to C once per load.

A projection W (out x in) with an adapter computes y = W x + scale * B (A x),
A: [rank][in], B: [out][rank], scale = alpha / rank (alpha / sqrt(rank) under
rsLoRA).
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ._core import ConveyorError

# The engine's projections, by PEFT (HF) module name, in the engine's order.
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_GGUF_MODULES = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
                 "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
MAX_ADAPTER_CONFIG_BYTES = 1 << 20


class LoRAError(ConveyorError, ValueError):
    """An adapter the engine cannot use; ``field`` names the key or tensor at fault."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class LoRARequest:
    """A request's adapter, as vLLM names it: lora_name (what clients call it),
    lora_int_id (a positive id unique per adapter), lora_path (PEFT folder or GGUF file)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise TypeError("lora_name must be a non-empty str")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or \
                not 1 <= self.lora_int_id < 2**63:
            raise ValueError(f"lora_int_id must be an int in [1, 2**63), got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, (str, os.PathLike)):
            raise TypeError("lora_path must be a path")
        object.__setattr__(self, "lora_path", os.fspath(self.lora_path))

    # vLLM's attribute names
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


@dataclass
class LoRAAdapter:
    """A loaded adapter in the engine's layout: weights[(layer, module)] = (A, B), f32,
    q/k rows of B in the base model's RoPE layout."""

    rank: int
    scale: float
    weights: dict = field(default_factory=dict)

    def delta(self, layer: int, module: str, x: np.ndarray) -> np.ndarray | None:
        """scale * (x A^T) B^T for rows x, or None when the module has no adapter."""
        ab = self.weights.get((layer, module))
        if ab is None:
            return None
        a, b = ab
        return (x @ a.T.astype(x.dtype)) @ b.T.astype(x.dtype) * x.dtype.type(self.scale)

    def merged(self, layer: int, module: str, w: np.ndarray) -> np.ndarray:
        """W + scale * B A (the merged weight)."""
        ab = self.weights.get((layer, module))
        if ab is None:
            return w
        a, b = ab
        return w + self.scale * (b.astype(np.float64) @ a.astype(np.float64))


def module_shapes(cfg: dict) -> dict:
    """{module: (out, in)} of the base model's projections."""
    dim, hidden = cfg["dim"], cfg["hidden_dim"]
    q, kv = cfg["n_heads"] * cfg["head_dim"], cfg["n_kv_heads"] * cfg["head_dim"]
    return {"q_proj": (q, dim), "k_proj": (kv, dim), "v_proj": (kv, dim), "o_proj": (dim, q),
            "gate_proj": (hidden, dim), "up_proj": (hidden, dim), "down_proj": (dim, hidden)}


MAX_RANK = 1024  # the engine's largest max_lora_rank


def max_adapter_bytes(cfg: dict, max_rank: int | None) -> int:
    """The most tensor bytes an adapter for this base can need (rank max_rank, every module
    of every layer, float32), plus room for headers: larger files are refused unread."""
    per_layer = sum(i + o for o, i in module_shapes(cfg).values())
    return cfg["n_layers"] * per_layer * (max_rank or MAX_RANK) * 4 + (1 << 20)


def _check_file_size(path: Path, cfg: dict, max_rank: int | None) -> None:
    limit = max_adapter_bytes(cfg, max_rank)
    size = path.stat().st_size
    if size > limit:
        raise LoRAError(f"{path}: {size} bytes, more than an adapter of rank {max_rank or MAX_RANK} for this base "
                        f"can hold ({limit})", "size")


def _pairs_permute(b: np.ndarray, n_heads: int, inverse: bool = False) -> np.ndarray:
    """HF's rotate-half row order -> the interleaved-pairs order (llama.cpp's converter's
    permutation), or back."""
    hd = b.shape[0] // n_heads
    if inverse:
        return b.reshape(n_heads, hd // 2, 2, *b.shape[1:]).swapaxes(1, 2).reshape(b.shape)
    return b.reshape(n_heads, 2, hd // 2, *b.shape[1:]).swapaxes(1, 2).reshape(b.shape)


def load_adapter(path, cfg: dict, max_rank: int | None = None) -> LoRAAdapter:
    """Reads the adapter at path (a PEFT folder or a GGUF LoRA file) for a base model of
    config cfg (conveyor._core.Checkpoint.config); LoRAError naming the key on anything
    the engine cannot apply exactly."""
    p = Path(os.fspath(path))
    if p.is_dir():
        if (p / "adapter_model.safetensors").is_file():
            _check_file_size(p / "adapter_model.safetensors", cfg, max_rank)
        ad, order = _load_peft(p, cfg)
    elif p.is_file():
        _check_file_size(p, cfg, max_rank)
        ad, order = _load_gguf(p, cfg, max_rank)
    else:
        raise FileNotFoundError(f"LoRA adapter not found: {p}")
    if not ad.weights:
        raise LoRAError(f"{p}: the adapter has no LoRA weights", "target_modules")
    if max_rank is not None and ad.rank > max_rank:
        raise LoRAError(f"{p}: rank r={ad.rank} is over max_lora_rank={max_rank}", "r")
    shapes = module_shapes(cfg)
    for (layer, mod), (a, b) in ad.weights.items():
        if not 0 <= layer < cfg["n_layers"]:
            raise LoRAError(f"{p}: layer {layer} of {mod} is beyond the base model's {cfg['n_layers']} layers",
                            "layers")
        out, inp = shapes[mod]
        if a.shape != (ad.rank, inp) or b.shape != (out, ad.rank):
            raise LoRAError(f"{p}: layer {layer} {mod}: lora_A {a.shape} / lora_B {b.shape} do not match the base "
                            f"(expected ({ad.rank}, {inp}) / ({out}, {ad.rank}))", mod)
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise LoRAError(f"{p}: layer {layer} {mod} has non-finite values", mod)
    if cfg.get("rope_layout") == "pairs" and order == "hf":
        for (layer, mod), (a, b) in list(ad.weights.items()):
            if mod in ("q_proj", "k_proj"):
                heads = cfg["n_heads"] if mod == "q_proj" else cfg["n_kv_heads"]
                ad.weights[(layer, mod)] = (a, np.ascontiguousarray(_pairs_permute(b, heads)))
    elif cfg.get("rope_layout") != "pairs" and order == "pairs":
        for (layer, mod), (a, b) in list(ad.weights.items()):
            if mod in ("q_proj", "k_proj"):
                heads = cfg["n_heads"] if mod == "q_proj" else cfg["n_kv_heads"]
                ad.weights[(layer, mod)] = (a, np.ascontiguousarray(_pairs_permute(b, heads, inverse=True)))
    return ad


def _load_peft(p: Path, cfg: dict):
    from .reference import read_safetensors_file

    cfg_path = p / "adapter_config.json"
    if not cfg_path.is_file():
        raise LoRAError(f"{p}: no adapter_config.json (a PEFT adapter folder has one)", "adapter_config.json")
    if cfg_path.stat().st_size > MAX_ADAPTER_CONFIG_BYTES:
        raise LoRAError(f"{cfg_path}: over {MAX_ADAPTER_CONFIG_BYTES} bytes", "adapter_config.json")
    try:
        ac = json.loads(cfg_path.read_text("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise LoRAError(f"{cfg_path}: not valid JSON ({e})", "adapter_config.json") from None
    if not isinstance(ac, dict):
        raise LoRAError(f"{cfg_path}: must hold a JSON object", "adapter_config.json")
    ptype = ac.get("peft_type", "LORA")
    if ptype != "LORA":
        raise LoRAError(f"{cfg_path}: peft_type {ptype!r} is not supported (only LORA)", "peft_type")
    if ac.get("use_dora"):
        raise LoRAError(f"{cfg_path}: use_dora: DoRA adapters are not supported", "use_dora")
    if ac.get("bias", "none") != "none":
        raise LoRAError(f"{cfg_path}: bias {ac.get('bias')!r} is not supported (only 'none')", "bias")
    for key in ("layers_to_transform", "rank_pattern", "alpha_pattern", "modules_to_save"):
        if ac.get(key):
            raise LoRAError(f"{cfg_path}: {key} is not supported", key)
    r, alpha = ac.get("r"), ac.get("lora_alpha", ac.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoRAError(f"{cfg_path}: r must be an int >= 1, got {r!r}", "r")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoRAError(f"{cfg_path}: lora_alpha must be a number, got {alpha!r}", "lora_alpha")
    targets = ac.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise LoRAError(f"{cfg_path}: target_modules must be a list of module names", "target_modules")
    for t in targets:
        if t not in MODULES:
            raise LoRAError(f"{cfg_path}: target_modules: {t!r} is not a module the engine has "
                            f"({', '.join(MODULES)})", "target_modules")
    scale = alpha / math.sqrt(r) if ac.get("use_rslora") else alpha / r
    st = p / "adapter_model.safetensors"
    if not st.is_file():
        if (p / "adapter_model.bin").is_file():
            raise LoRAError(f"{p}: adapter_model.bin (pickle) is not read; save with safetensors",
                            "adapter_model.safetensors")
        raise LoRAError(f"{p}: no adapter_model.safetensors", "adapter_model.safetensors")
    tensors = read_safetensors_file(st)
    pairs: dict = {}
    pat = re.compile(r"(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\."
                     r"lora_([AB])(?:\.default)?\.weight")
    for name, (_dtype, arr) in tensors.items():
        m = pat.fullmatch(name)
        if not m:
            if "lora_magnitude_vector" in name:
                raise LoRAError(f"{st}: {name}: DoRA magnitude vectors are not supported", "use_dora")
            raise LoRAError(f"{st}: tensor {name!r} is not a LoRA weight of a module the engine has", name)
        layer, mod, ab = int(m.group(1)), m.group(2), m.group(3)
        if mod not in targets:
            raise LoRAError(f"{st}: tensor {name!r}: module {mod!r} is not in target_modules", name)
        if arr.ndim != 2:
            raise LoRAError(f"{st}: tensor {name!r} must be 2-D, got shape {arr.shape}", name)
        pairs.setdefault((layer, mod), {})[ab] = np.ascontiguousarray(arr, dtype=np.float32)
    ad = LoRAAdapter(rank=r, scale=float(scale))
    for key, d in sorted(pairs.items()):
        if "A" not in d or "B" not in d:
            raise LoRAError(f"{st}: layer {key[0]} {key[1]} has lora_{'A' if 'A' not in d else 'B'} missing",
                            key[1])
        if d["A"].shape[0] != r or d["B"].shape[1] != r:
            raise LoRAError(f"{st}: layer {key[0]} {key[1]}: rank {d['A'].shape[0]} does not match r={r}", "r")
        ad.weights[key] = (d["A"], d["B"])
    return ad, "hf"


def _load_gguf(p: Path, cfg: dict, max_rank: int | None = None):
    from .gguf import GGUFError, GGUFReader

    try:
        f = GGUFReader(p)
    except GGUFError as e:
        raise LoRAError(f"{p}: {e}", "gguf") from None
    md = f.metadata
    if md.get("general.type") != "adapter":
        raise LoRAError(f"{p}: general.type is {md.get('general.type')!r}, not 'adapter'", "general.type")
    if md.get("adapter.type", "lora") != "lora":
        raise LoRAError(f"{p}: adapter.type {md.get('adapter.type')!r} is not supported (only lora)",
                        "adapter.type")
    arch = md.get("general.architecture")
    if arch != cfg.get("arch"):
        raise LoRAError(f"{p}: general.architecture {arch!r} does not match the base model's {cfg.get('arch')!r}",
                        "general.architecture")
    alpha = md.get("adapter.lora.alpha", 0.0)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoRAError(f"{p}: adapter.lora.alpha must be a number", "adapter.lora.alpha")
    pairs: dict = {}
    pat = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])")
    for name in f.tensors:
        m = pat.fullmatch(name)
        if not m:
            raise LoRAError(f"{p}: tensor {name!r} is not a LoRA weight", name)
        layer, short, ab = int(m.group(1)), m.group(2), m.group(3)
        if short not in _GGUF_MODULES:
            raise LoRAError(f"{p}: tensor {name!r}: {short!r} is not a module the engine has", name)
        shape = tuple(f.tensors[name].shape)
        out, inp = module_shapes(cfg)[_GGUF_MODULES[short]]
        rank_dim, other = (shape[0], shape[1] if len(shape) == 2 else None) if ab == "a" else \
            (shape[1] if len(shape) == 2 else None, shape[0])
        if len(shape) != 2 or other != (inp if ab == "a" else out) or not 1 <= rank_dim <= (max_rank or MAX_RANK):
            raise LoRAError(f"{p}: tensor {name!r} has shape {shape}, which does not match the base "
                            f"({'(rank, %d)' % inp if ab == 'a' else '(%d, rank)' % out}, rank <= "
                            f"{max_rank or MAX_RANK})", name)
        arr = f.tensor(name)
        pairs.setdefault((layer, _GGUF_MODULES[short]), {})[ab] = np.ascontiguousarray(arr, dtype=np.float32)
    rank = None
    weights = {}
    for key, d in sorted(pairs.items()):
        if "a" not in d or "b" not in d:
            raise LoRAError(f"{p}: layer {key[0]} {key[1]} has lora_{'a' if 'a' not in d else 'b'} missing", key[1])
        r = d["a"].shape[0]
        if rank is None:
            rank = r
        if r != rank or d["b"].shape[1] != rank:
            raise LoRAError(f"{p}: layer {key[0]} {key[1]}: rank {r} differs from the adapter's rank {rank}", "rank")
        weights[key] = (d["a"], d["b"])
    if rank is None:
        raise LoRAError(f"{p}: the adapter has no LoRA tensors", "tensors")
    scale = alpha / rank if alpha else 1.0  # llama.cpp: alpha 0 means scale 1
    return LoRAAdapter(rank=rank, scale=float(scale), weights=weights), ("pairs" if arch == "llama" else "hf")
