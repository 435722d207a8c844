"""Tiny random-weight models, built locally, so vLLM's real engine runs on a machine with no model hub.

Why random weights and not a downloaded checkpoint: the machines this runs on reach only package registries,
and a connector is proven by what it moves (bytes of KV blocks and embeddings), not by what the model says.
Two rules make such a model useful as proof:

- greedy tokens must depend on the context, or equal tokens prove nothing: matrices get a large enough
  spread, norms weight 1 and biases 0 (random norms and biases pull every context to the same token);
- the model family must be one whose vLLM code and image processor import without torchvision (below).

``vision`` is a BLIP-2 (ViT tower, Q-Former, OPT decoder): vLLM's LLaVA and PaliGemma paths import
torchvision (through vLLM's Pixtral module), and the registry's torchvision builds do not load beside the
CPU torch that vLLM's CPU build pins; BLIP-2 needs neither, and its image processor has a PIL path.
Each model is built once into a cache folder (``ASYNCCONN_MODEL_CACHE``, default
``~/.cache/asyncconn/models``), atomically, and reused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["MODELS", "ModelSpec", "build_model", "model_cache_dir"]

#: Bumped whenever what a builder writes changes, so an old cached folder is not reused.
_VERSION = 2


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One tiny model: its family and sizes."""

    family: str  # "llama", "gemma2", "gemma3", "deepseek_v2" (text) or "blip2"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 1024
    max_positions: int = 4096
    std: float = 0.1  # spread of the decoder's matrices
    about: str = ""
    sliding_window: int = 0  # gemma2/3: tokens each sliding-window layer attends to
    full_every: int = 0  # gemma2/3: every n-th layer is full attention, the others sliding-window


MODELS: dict[str, ModelSpec] = {
    "text": ModelSpec("llama", 128, 2, 4, 2, 256, about="2-layer Llama, 0.4M parameters (tests, demo)"),
    "text-100m": ModelSpec(
        "llama",
        768,
        14,
        12,
        4,
        2048,
        vocab=8192,
        max_positions=16384,
        std=0.05,
        about="14-layer Llama, ~100M parameters (benchmarks: prefill dominates)",
    ),
    "hybrid": ModelSpec(
        "gemma3",
        128,
        4,
        4,
        2,
        256,
        std=0.3,
        sliding_window=64,
        full_every=4,
        about="4-layer Gemma-3-style text model: 3 sliding-window layers (64 tokens), 1 full-attention layer",
    ),
    "hybrid-gemma2": ModelSpec(
        "gemma2",
        128,
        4,
        4,
        2,
        256,
        std=0.3,
        sliding_window=64,
        full_every=2,
        about="4-layer Gemma-2-style text model: sliding-window (64 tokens) and full-attention layers "
        "alternating, attention and final logits soft-capped",
    ),
    "hybrid-100m": ModelSpec(
        "gemma3",
        768,
        12,
        12,
        4,
        2048,
        vocab=8192,
        max_positions=16384,
        std=0.05,
        sliding_window=512,
        full_every=6,
        about="12-layer Gemma-3-style, ~100M parameters: 10 sliding-window layers (512 tokens), 2 full",
    ),
    "hybrid-100m-full": ModelSpec(
        "gemma3",
        768,
        12,
        12,
        4,
        2048,
        vocab=8192,
        max_positions=16384,
        std=0.05,
        sliding_window=512,
        full_every=1,
        about="hybrid-100m with every layer full attention (the hybrid model's store bytes compare with it)",
    ),
    "mla": ModelSpec(
        "deepseek_v2",
        128,
        2,
        4,
        4,
        256,
        std=0.2,
        about="2-layer DeepSeek-V2-style (MLA: one 576-wide latent KV row per token and layer), dense MLPs",
    ),
    "vision": ModelSpec(
        "blip2",
        128,
        2,
        4,
        4,
        256,
        std=0.3,
        about="BLIP-2: 2-layer ViT, Q-Former, 2-layer OPT; 8 image tokens",
    ),
}

#: The vision model's image size and its number of placeholder tokens per image.
IMAGE_SIZE = 56
IMAGE_TOKENS = 8
#: Token id of the vision model's image placeholder.
IMAGE_TOKEN_ID = 4


def model_cache_dir() -> Path:
    return Path(os.environ.get("ASYNCCONN_MODEL_CACHE") or Path.home() / ".cache" / "asyncconn" / "models")


def build_model(
    name: str, cache_dir: Path | None = None, progress: Callable[[str], None] | None = None
) -> Path:
    """The folder of model ``name`` (a key of :data:`MODELS`), built on first use."""
    spec = MODELS[name]
    root = cache_dir if cache_dir is not None else model_cache_dir()
    target = root / f"{name}-v{_VERSION}"
    if (target / "config.json").exists():
        return target
    say = progress or (lambda _msg: None)
    say(f"building the tiny model {name!r} ({spec.about}) in {target} (once)")
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        if spec.family == "llama":
            _build_llama(spec, tmp)
        elif spec.family in ("gemma2", "gemma3"):
            _build_gemma(spec, tmp)
        elif spec.family == "deepseek_v2":
            _build_deepseek_v2(spec, tmp)
        else:
            _build_blip2(spec, tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process built it meanwhile
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"built {name!r}")
    return target


def _init_weights(model: Any, std_for: Callable[[str], float]) -> None:
    import torch

    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                is_norm_weight = "norm" in name.lower() and name.endswith("weight")
                param.fill_(1.0 if is_norm_weight else 0.0)
            else:
                param.normal_(0.0, std_for(name))


def _word_tokenizer(vocab_size: int, special: dict[str, int]) -> Any:
    """A word-level tokenizer: ``w<i>`` is token ``i``. Prompts in text and in token ids mean the same."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = dict(special)
    vocab.update({f"w{i}": i for i in range(len(special), vocab_size)})
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="<unk>", bos_token="</s>", eos_token="</s>", pad_token="<pad>"
    )


def _build_llama(spec: ModelSpec, out: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        vocab_size=spec.vocab,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=False,
    )
    config.bos_token_id = config.eos_token_id = 1
    config.pad_token_id = 0
    model = LlamaForCausalLM(config)
    _init_weights(model, lambda _name: spec.std)
    model.save_pretrained(out, safe_serialization=True)
    special = {"<pad>": 0, "</s>": 1, "<s>": 2, "<unk>": 3, "<mask>": 4}
    _word_tokenizer(spec.vocab, special).save_pretrained(out)


def _build_gemma(spec: ModelSpec, out: Path) -> None:
    """Sliding-window layers interleaved with full-attention ones: vLLM's hybrid KV cache manager gives each
    kind its own KV cache groups, and frees a sliding-window layer's blocks once they leave its window.
    Gemma 2 keeps its soft caps (attention logits 50, final logits 30: vLLM's CPU attention applies the
    former), Gemma 3 has none."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    head_dim = spec.hidden // spec.heads
    shape: dict[str, Any] = {
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_positions,
        "sliding_window": spec.sliding_window,
        "layer_types": [
            "full_attention" if (i + 1) % spec.full_every == 0 else "sliding_attention"
            for i in range(spec.layers)
        ],
        "tie_word_embeddings": True,
    }
    model: Any
    if spec.family == "gemma2":
        config: Any = Gemma2Config(**shape)
        config.bos_token_id = config.eos_token_id = 1
        config.pad_token_id = 0
        model = Gemma2ForCausalLM(config)
    else:
        config = Gemma3TextConfig(**shape)
        config.bos_token_id = config.eos_token_id = 1
        config.pad_token_id = 0
        model = Gemma3ForCausalLM(config)
    # Gemma scales the embeddings up by sqrt(hidden). Gemma 2's embeddings are drawn that much narrower:
    # otherwise a token's own embedding drowns what attention adds and greedy decoding repeats the last
    # prompt token whatever came before. (Gemma 3's stay as built, which its benchmarks' figures used.)
    embed_std = spec.std / spec.hidden**0.5 if spec.family == "gemma2" else spec.std
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:  # Gemma's norms scale by (1 + weight): 0 is the identity
                param.zero_()
            else:
                param.normal_(0.0, embed_std if "embed_tokens" in name else spec.std)
    model.save_pretrained(out, safe_serialization=True)
    special = {"<pad>": 0, "</s>": 1, "<s>": 2, "<unk>": 3, "<mask>": 4}
    _word_tokenizer(spec.vocab, special).save_pretrained(out)


def _build_deepseek_v2(spec: ModelSpec, out: Path) -> None:
    """Multi-head latent attention: vLLM caches one latent row (``kv_lora_rank + qk_rope_head_dim``) per token
    and layer, the same on every tensor-parallel rank. vLLM's CPU MLA decode kernel takes a 576-wide row
    only (512 + 64, DeepSeek's own sizes; 320 fails with "Unsupported block size: 16"). Every layer gets a
    dense MLP (``first_k_dense_replace``): the routed experts are never built."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        moe_intermediate_size=64,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=spec.layers,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        vocab_size=spec.vocab,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=False,
    )
    config.bos_token_id = config.eos_token_id = 1
    config.pad_token_id = 0
    model = DeepseekV2ForCausalLM(config)
    _init_weights(model, lambda _name: spec.std)  # DeepSeek's RMS norms scale by weight: 1 is the identity
    model.save_pretrained(out, safe_serialization=True)
    special = {"<pad>": 0, "</s>": 1, "<s>": 2, "<unk>": 3, "<mask>": 4}
    _word_tokenizer(spec.vocab, special).save_pretrained(out)


def _build_blip2(spec: ModelSpec, out: Path) -> None:
    from transformers import (
        Blip2Config,
        Blip2ForConditionalGeneration,
        Blip2Processor,
        Blip2QFormerConfig,
        Blip2VisionConfig,
        BlipImageProcessor,
        OPTConfig,
    )

    special = {"<pad>": 0, "</s>": 1, "<s>": 2, "<unk>": 3, "<image>": IMAGE_TOKEN_ID}
    tokenizer = _word_tokenizer(spec.vocab, special)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision = Blip2VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=14,
    )
    qformer = Blip2QFormerConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        encoder_hidden_size=64,
        vocab_size=spec.vocab,
    )
    text = OPTConfig(
        hidden_size=spec.hidden,
        ffn_dim=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        vocab_size=spec.vocab,
        max_position_embeddings=spec.max_positions,
        word_embed_proj_dim=spec.hidden,
    )
    config = Blip2Config(
        vision_config=vision.to_dict(),
        qformer_config=qformer.to_dict(),
        text_config=text.to_dict(),
        num_query_tokens=IMAGE_TOKENS,
        image_token_index=IMAGE_TOKEN_ID,
    )
    model = Blip2ForConditionalGeneration(config)
    # The image path gets a wider spread than the decoder, so that images steer the tokens.
    _init_weights(model, lambda name: spec.std if name.startswith("language_model") else 0.5)
    model.save_pretrained(out, safe_serialization=True)
    processor = Blip2Processor(
        image_processor=BlipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
        tokenizer=tokenizer,
        num_query_tokens=IMAGE_TOKENS,
    )
    processor.save_pretrained(out)
    # BlipImageProcessor falls back to its PIL implementation without torchvision; name it so no warning.
    path = out / "processor_config.json"
    data = json.loads(path.read_text())
    data.get("image_processor", {})["image_processor_type"] = "BlipImageProcessorPil"
    path.write_text(json.dumps(data, indent=1))
