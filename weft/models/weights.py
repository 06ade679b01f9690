"""Where a model's dense weights come from, by Hugging Face name (model.layers.N.self_attn.q_proj.weight, ...):
a state dict, a local safetensors checkpoint, or seeded random tensors. Each gives whole tensors, one at a
time, that the layers slice for their rank (weft/layers/transformer.py) and drop."""
from __future__ import annotations

import glob
import json
import os

import torch


def hf_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every weight of the dense decoder of `cfg` (a ModelConfig), by Hugging Face name, in model order."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        shapes.update({p + "input_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (cfg.heads * d, h),
                       p + "self_attn.k_proj.weight": (cfg.kv_heads * d, h),
                       p + "self_attn.v_proj.weight": (cfg.kv_heads * d, h),
                       p + "self_attn.o_proj.weight": (h, cfg.heads * d)})
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        shapes.update({p + "post_attention_layernorm.weight": (h,),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i)})
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


class _Weights:
    """name -> the whole tensor, checked against the config's shapes."""
    what = ""

    def __init__(self, shapes: dict):
        self.shapes = shapes

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._get(name)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{self.what} has no tensor {name!r}")
        if tuple(t.shape) != self.shapes[name]:
            raise ValueError(f"{self.what}[{name!r}] has shape {tuple(t.shape)}, the config says {self.shapes[name]}")
        return t


class StateDictWeights(_Weights):
    """The tensors of a state dict in Hugging Face naming (full, unsharded)."""
    what = "state_dict"

    def __init__(self, state_dict: dict, shapes: dict):
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict of tensors, got {type(state_dict).__name__}")
        super().__init__(shapes)
        self._get = state_dict.get
        self.dtype = self["model.embed_tokens.weight"].dtype


_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


class CheckpointWeights(_Weights):
    """The tensors of a local checkpoint directory's *.safetensors files, each read when asked for (on the cpu)."""

    def __init__(self, path: str, shapes: dict):
        try:
            from safetensors import safe_open
        except ImportError as e:
            raise ImportError("loading a checkpoint needs the safetensors package (pip install safetensors)") from e
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise ValueError(f"{path} has no *.safetensors files")
        super().__init__(shapes)
        self.what = f"the checkpoint {path}"
        self.where = {name: f for f in (safe_open(f, framework="pt", device="cpu") for f in files) for name in f.keys()}
        embed = "model.embed_tokens.weight"
        if embed not in self.where:
            raise ValueError(f"{self.what} has no tensor {embed!r}")
        self.dtype = _SAFETENSORS_DTYPES.get(self.where[embed].get_slice(embed).get_dtype(), torch.float32)

    def _get(self, name: str):
        f = self.where.get(name)
        return None if f is None else f.get_tensor(name)


class RandomWeights:
    """Seeded random tensors of the config's shapes, made on `device`: normal(0, std) matrices, norms of ones
    (transformers' initialisation). Tensor k of the model order comes from generator seed + k, so every rank
    makes the same tensors, whatever it reads first."""

    def __init__(self, shapes: dict, seed: int, dtype: torch.dtype, device: torch.device, std: float = 0.02):
        self.shapes, self.seed, self.dtype, self.device, self.std = shapes, seed, dtype, device, std
        self.index = {name: k for k, name in enumerate(shapes)}

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if len(shape) == 1:
            return torch.ones(shape, dtype=self.dtype, device=self.device)
        g = torch.Generator(self.device).manual_seed(self.seed + self.index[name])
        return torch.randn(shape, generator=g, dtype=self.dtype, device=self.device) * self.std


def read_config(path: str) -> dict:
    """config.json of a checkpoint directory."""
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise ValueError(f"{path} is not a checkpoint directory (no config.json)")
    with open(config) as f:
        return json.load(f)
