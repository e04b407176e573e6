"""A tiny random-weight Qwen3-Omni, built deterministically from a seed and cached on disk.

`ensure_tiny(seed, cache_dir)` returns a checkpoint directory laid out like the real one
(`config.json`, `model.safetensors`, tokenizer and processor files). The first caller builds it
into a temporary sibling directory and renames it into place; a file lock makes concurrent stage
processes wait for that build instead of repeating it. Nothing is downloaded.

The model has the real structure at toy width (64): thinker, audio and vision towers, talker with
its 15-step code predictor, and code2wav with the real codec layout (16 codebooks of 2,048,
1,920 samples per 80 ms frame at 24 kHz). Its speech is noise. Token ids: the thinker vocabulary
is 2,048; the real special ids 151643..151675 move to 1900..1932 in the same order; the role
words `system`, `user`, `assistant` are single byte-level BPE tokens (the talker prompt builder
reads the token after `<|im_start|>`). Codec ids keep their real values.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[3]
SPECIAL_BASE = 1900  # tiny id of <|endoftext|>
THINKER_VOCAB = 2048
WIDTH = 64  # every transformer of the tiny model
TINY_VERSION = 2  # bumped when what is built changes (2: the chat template renders tools)
MARKER = "build_info.json"  # written last: its presence means the directory is complete

# Real Qwen3-Omni added tokens, ids 151643..151675 in order; tiny id = 1900 + index.
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eos>",
    "<tts_text_bos_single>", "<|audio_pad|>",
]  # fmt: skip
IDS = {tok: SPECIAL_BASE + i for i, tok in enumerate(SPECIAL_TOKENS)}

# Words merged into single BPE tokens; the three role words must be single tokens.
WORDS = [
    "system", "user", "assistant", "\n", "You", " are", " a", " helpful", " voice", " assistant",
    " Hello", " hello", " how", " is", " the", " weather", " today", "?", ".", ",", " What",
    " do", " you", " see", " hear", " in", " this", " image", " audio", " and", " Describe",
    " Say", " something", " short", " please", " it", " to", " me", " of", " I",
]  # fmt: skip

# The chat template of the real checkpoint, reduced to what the runtime sends: string or list
# content with text, audio and image parts; Qwen3's tools (a <tools> block in the system turn),
# an assistant turn's tool calls, and `tool` turns (one user turn of <tool_response>s).
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n\' }}'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and tools and loop.first %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{ '<|im_end|>\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'audio' %}{{ '<|audio_start|><|audio_pad|><|audio_end|>' }}"
    "{% elif c['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% for tc in message.get('tool_calls') or [] %}"
    "{{ '\n<tool_call>\n{\"name\": \"' + tc['function']['name'] + '\", \"arguments\": ' }}"
    "{{ tc['function']['arguments'] | tojson }}{{ '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_MROPE = {
    "rope_type": "default",
    "rope_theta": 1e6,
    "mrope_section": [4, 2, 2],
    "interleaved": True,
}
SPEAKERS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}


def default_dir(seed: int) -> Path:
    return REPO_ROOT / ".cache" / f"tiny-qwen3-omni-{TINY_VERSION}-{seed}"


def ensure_tiny(seed: int, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The checkpoint directory of the tiny model for `seed`, built on first use.

    Safe to call from several processes at once: one builds (under a file lock, into a temporary
    directory renamed into place), the others wait and reuse it.
    """
    out = Path(cache_dir) if cache_dir else default_dir(seed)
    return ensure_built(out, lambda tmp: build_tiny(seed, tmp))


def ensure_built(out: Path, build: Callable[[Path], object]) -> Path:
    """`out`, built by `build(tmp)` into a temporary sibling renamed into place unless it is
    complete already (`build` writes MARKER last); a file lock makes concurrent callers wait
    for one build instead of repeating it."""
    from filelock import FileLock

    if (out / MARKER).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if (out / MARKER).is_file():
            return out
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
        try:
            build(tmp)
            if out.exists():  # a half-built leftover without its marker
                shutil.rmtree(out)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def build_tiny(seed: int, out_dir: str | os.PathLike[str]) -> Any:
    """Build the model, tokenizer and processor files into `out_dir`; returns the model."""
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    out = Path(out_dir)
    tokenizer = build_tokenizer()
    cfg = build_config(tokenizer)
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(cfg).eval()
    _init_talker_moe(model, seed)
    patch_config(model.config)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _save_processor_files(out)
    n_params = sum(p.numel() for p in model.parameters())
    (out / MARKER).write_text(json.dumps({"seed": seed, "params": n_params}))
    return model


def patch_config(cfg: Any) -> Any:
    """Fix-ups config.json cannot carry; call after every load of a Qwen3-Omni config.

    The talker's `get_rope_index` (shared with the thinker) reads `config.audio_config.n_window`
    for prompts with audio, but the talker config declares no `audio_config`: point it at the
    thinker's.
    """
    cfg.talker_config.audio_config = cfg.thinker_config.audio_config
    return cfg


def config_dict() -> dict[str, Any]:
    """The tiny config as `Qwen3OmniMoeConfig(**d)` takes it, role ids still unset.

    Ties that fail silently when broken: encoder output widths and `thinker_hidden_size` equal the
    thinker width; the code predictor's width equals the talker's; `mrope_section` sums to
    head_dim / 2; `decoder_dim` is divisible by 2 ** len(upsample_rates).
    """
    h = WIDTH
    audio = dict(
        num_mel_bins=128, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128,
        d_model=h, max_source_positions=1500, n_window=50, output_dim=h, n_window_infer=800,
        conv_chunksize=500, downsample_hidden_size=32,
    )  # fmt: skip
    vision = dict(
        depth=2, hidden_size=h, intermediate_size=128, num_heads=4, in_channels=3, patch_size=16,
        spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=h,
        num_position_embeddings=64, deepstack_visual_indexes=[0, 1],
    )  # fmt: skip
    lm = dict(
        hidden_size=h, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
    )  # fmt: skip
    mm_ids = dict(
        audio_token_id=IDS["<|audio_pad|>"], image_token_id=IDS["<|image_pad|>"],
        video_token_id=IDS["<|video_pad|>"], audio_start_token_id=IDS["<|audio_start|>"],
        vision_start_token_id=IDS["<|vision_start|>"],  # read by get_rope_index, undeclared
        position_id_per_seconds=13,
    )  # fmt: skip
    thinker = dict(
        audio_config=audio, vision_config=vision,
        text_config=dict(lm, vocab_size=THINKER_VOCAB, rope_parameters=dict(_MROPE),
                         norm_topk_prob=True),
        audio_end_token_id=IDS["<|audio_end|>"], vision_end_token_id=IDS["<|vision_end|>"],
        **mm_ids,
    )  # fmt: skip
    talker = dict(
        text_config=dict(lm, vocab_size=3072, rope_parameters=dict(_MROPE), norm_topk_prob=False,
                         shared_expert_intermediate_size=64),  # read by the MoE block, undeclared
        code_predictor_config=dict(
            vocab_size=2048, hidden_size=h, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6}, num_code_groups=16,
        ),
        num_code_groups=16, thinker_hidden_size=h, accept_hidden_layer=1,
        codec_eos_token_id=2150, codec_nothink_id=2155, codec_think_bos_id=2156,
        codec_think_eos_id=2157, codec_pad_id=2148, codec_bos_id=2149, speaker_id=dict(SPEAKERS),
        spatial_merge_size=2,  # read by the talker's __init__, undeclared
        **mm_ids,
    )  # fmt: skip
    code2wav = dict(
        codebook_size=2048, hidden_size=h, max_position_embeddings=8000,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, num_attention_heads=4,
        num_key_value_heads=4, sliding_window=72, intermediate_size=128, num_hidden_layers=2,
        num_quantizers=16, upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], decoder_dim=64,
        initializer_range=0.08,  # 0.02 gives a ~1e-6 peak waveform; 0.08 peaks near 0.5
    )  # fmt: skip
    return dict(
        thinker_config=thinker, talker_config=talker, code2wav_config=code2wav,
        enable_audio_output=True, im_start_token_id=IDS["<|im_start|>"],
        im_end_token_id=IDS["<|im_end|>"], tts_pad_token_id=IDS["<tts_pad>"],
        tts_bos_token_id=IDS["<tts_text_bos>"], tts_eos_token_id=IDS["<tts_text_eos>"],
    )  # fmt: skip


def build_config(tokenizer: Any) -> Any:
    from transformers import Qwen3OmniMoeConfig

    d = config_dict()
    role = {w: tokenizer.convert_tokens_to_ids(w) for w in ("system", "user", "assistant")}
    d.update(system_token_id=role["system"], user_token_id=role["user"])
    d["assistant_token_id"] = role["assistant"]
    d["thinker_config"]["user_token_id"] = role["user"]
    cfg = Qwen3OmniMoeConfig(**d)
    set_text_ends(cfg, eos=IDS["<|im_end|>"], pad=IDS["<|endoftext|>"])
    return cfg


def set_text_ends(cfg: Any, eos: int, pad: int) -> None:
    """The thinker's end-of-sequence and padding tokens, in its text config."""
    from transformers import PreTrainedConfig

    thinker = cfg.thinker_config
    assert isinstance(thinker, PreTrainedConfig)  # the config's constructor made it one
    thinker.text_config.eos_token_id = eos
    thinker.text_config.pad_token_id = pad


def build_tokenizer(
    special_ids: dict[str, int] | None = None, word_ids: dict[str, int] | None = None
) -> Any:
    """Byte-level BPE: the 256 byte symbols, merges that make WORDS single tokens, and the
    special tokens at `special_ids` (default: their tiny ids), wrapped as a
    `PreTrainedTokenizerFast`. `word_ids` moves some of WORDS to given ids (the real
    checkpoint's role words) out of the ids the merges gave them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_map = _bytes_to_unicode()
    vocab = {byte_map[b]: b for b in range(256)}
    merges = []
    for word in WORDS:
        symbols = "".join(byte_map[b] for b in word.encode())
        cur = symbols[0]
        for ch in symbols[1:]:
            if cur + ch not in vocab:
                merges.append((cur, ch))
                vocab[cur + ch] = len(vocab)
            cur += ch
    for word, i in (word_ids or {}).items():
        vocab[word] = i
    special_ids = special_ids or IDS
    assert max(vocab.values()) < min(special_ids.values())
    assert len(set(vocab.values())) == len(vocab)
    vocab.update(special_ids)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    extra = {
        "image_token": "<|image_pad|>",
        "audio_token": "<|audio_pad|>",
        "video_token": "<|video_pad|>",
        "vision_bos_token": "<|vision_start|>",
        "vision_eos_token": "<|vision_end|>",
        "audio_bos_token": "<|audio_start|>",
        "audio_eos_token": "<|audio_end|>",
    }
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=extra,
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what `ByteLevel` pre-tokenizers use)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += range(ord("®"), ord("ÿ") + 1)
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _save_processor_files(out: Path) -> None:
    """One merged `preprocessor_config.json` (Whisper 128-bin mel + Qwen2-VL image patches), as
    the real checkpoint has: saving the two processors one after the other would overwrite the
    first (Whisper then silently falls back to 80 mel bins)."""
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    fe = WhisperFeatureExtractor(
        feature_size=128,
        sampling_rate=16000,
        hop_length=160,
        chunk_length=300,
        n_fft=400,
        padding_value=0.0,
        return_attention_mask=True,
    )
    ip = Qwen2VLImageProcessorPil(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        size={"shortest_edge": 32 * 32, "longest_edge": 32 * 32 * 64},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    merged = {**ip.to_dict(), **fe.to_dict()}
    merged.pop("mel_filters", None)
    merged["processor_class"] = "Qwen3OmniMoeProcessor"
    (out / "preprocessor_config.json").write_text(json.dumps(merged, indent=1, default=_plain))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def _plain(o: Any) -> Any:
    return o.tolist() if hasattr(o, "tolist") else str(o)


def _init_talker_moe(model: Any, seed: int) -> None:
    """transformers 5.24 initialises only the thinker's MoE classes: the talker's experts keep
    `torch.empty` memory (builds not reproducible) and its router weight stays zero (every token
    takes the same experts). Draw them like the thinker's, from a seeded generator."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    std = model.config.talker_config.initializer_range
    with torch.no_grad():
        for layer in model.talker.model.layers:
            moe = layer.mlp
            for p in (moe.experts.gate_up_proj, moe.experts.down_proj, moe.gate.weight):
                p.copy_(torch.randn(p.shape, generator=g) * std)
