"""A random-weight Smart Turn v3 of the real signature, for tests and benchmarks.

Smart Turn v3 (Pipecat's end-of-turn model) is Whisper's encoder over 80 log-mel bands by 800
frames (8 s of 16 kHz audio), attention pooling over time and a small classifier, exported to
ONNX with one input `input_features` [batch, 80, 800] and one output `logits` [batch, 1] that
holds the sigmoid probability that the turn is complete. This builds the same layers (smaller,
unless `real_size`) with random weights and exports them the same way, so
`realtime_omni/models/smart_turn.py` loads and runs it as it would the real file. `bias` steers
the answer: +6 makes every turn sound complete, -6 none; 0 leaves it to the random weights.

    python -m tests.models.random_smart_turn DIR [--bias 6] [--real-size]
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch
from torch import nn
from transformers import WhisperConfig
from transformers.models.whisper.modeling_whisper import WhisperEncoder

FILE = "smart-turn-v3-random.onnx"


class SmartTurnV3(nn.Module):
    def __init__(self, real_size: bool = False) -> None:
        super().__init__()
        d, layers, heads, ffn = (384, 4, 6, 1536) if real_size else (64, 2, 2, 128)
        cfg = WhisperConfig(
            d_model=d,
            encoder_layers=layers,
            encoder_attention_heads=heads,
            encoder_ffn_dim=ffn,
            num_mel_bins=80,
            max_source_positions=400,  # 800 frames after the stride-2 convolution
        )
        self.encoder = WhisperEncoder(cfg)
        self.pool_attention = nn.Sequential(nn.Linear(d, 256), nn.Tanh(), nn.Linear(256, 1))
        self.classifier = nn.Sequential(
            nn.Linear(d, 256),
            nn.LayerNorm(256),
            nn.GELU(),
            nn.Dropout(0.1),
            nn.Linear(256, 64),
            nn.GELU(),
            nn.Linear(64, 1),
        )

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        h = self.encoder(input_features).last_hidden_state
        w = torch.softmax(self.pool_attention(h), dim=1)
        return torch.sigmoid(self.classifier((w * h).sum(dim=1)))


def build(directory: str | Path, bias: float = 0.0, real_size: bool = False, seed: int = 0) -> Path:
    """Write `FILE` into `directory`; its path."""
    torch.manual_seed(seed)
    model = SmartTurnV3(real_size).eval()
    last = model.classifier[-1]
    assert isinstance(last, nn.Linear)
    with torch.no_grad():
        last.weight.mul_(0.1)  # the bias decides, the audio nudges
        last.bias.fill_(bias)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    path = out / FILE
    with warnings.catch_warnings():  # the TorchScript exporter's notes on itself and on tracing
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (torch.zeros(1, 80, 800),),
            str(path),
            input_names=["input_features"],
            output_names=["logits"],
            dynamic_axes={"input_features": {0: "batch_size"}, "logits": {0: "batch_size"}},
            dynamo=False,
        )
    return path


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("directory")
    p.add_argument("--bias", type=float, default=0.0)
    p.add_argument("--real-size", action="store_true")
    a = p.parse_args()
    print(build(a.directory, a.bias, a.real_size))
