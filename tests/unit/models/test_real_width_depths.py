"""real_width.py's depths: each stack capped at its published depth, and the deepest that fits
a byte budget (what benchmarks/real_width.py --layers auto and gpu_check.sh's `real` step
choose). Meta-device models only: no weights, well under a second each."""

from __future__ import annotations

from realtime_omni.models.qwen3_omni.real_width import (
    PUBLISHED,
    checkpoint_bytes,
    deepest_fitting,
    published_depth,
    real_config_dict,
)


def depths(d: dict) -> dict[str, int]:
    thinker, talker = d["thinker_config"], d["talker_config"]
    return {
        "thinker": thinker["text_config"]["num_hidden_layers"],
        "audio": thinker["audio_config"]["encoder_layers"],
        "vision": thinker["vision_config"]["depth"],
        "talker": talker["text_config"]["num_hidden_layers"],
        "code_predictor": talker["code_predictor_config"]["num_hidden_layers"],
        "code2wav": d["code2wav_config"]["num_hidden_layers"],
    }


def test_a_stack_never_goes_past_its_published_depth() -> None:
    published = depths(PUBLISHED)
    assert published_depth() == max(published.values()) == 48
    assert real_config_dict(published_depth()) == real_config_dict(None) == PUBLISHED
    twelve = real_config_dict(12)
    assert depths(twelve) == {k: min(12, v) for k, v in published.items()}
    # The taps follow a cut stack and stay as published where it is whole.
    assert twelve["thinker_config"]["vision_config"]["deepstack_visual_indexes"] == [0, 1, 2]
    assert twelve["talker_config"]["accept_hidden_layer"] == 6
    thirty = real_config_dict(30)
    assert thirty["thinker_config"]["vision_config"]["deepstack_visual_indexes"] == [8, 16, 24]
    assert thirty["talker_config"]["accept_hidden_layer"] == 15
    two = real_config_dict(2)  # the checkpoint tests/models/test_real_width.py builds
    assert set(depths(two).values()) == {2}
    assert two["thinker_config"]["vision_config"]["deepstack_visual_indexes"] == [0, 1]
    assert two["talker_config"]["accept_hidden_layer"] == 1


def test_the_deepest_checkpoint_that_fits_a_budget() -> None:
    full = checkpoint_bytes(None)
    assert 70.4e9 < full < 70.6e9  # Qwen3-Omni-30B-A3B: 35.26 B parameters in bf16
    assert checkpoint_bytes(published_depth()) == full
    budget = 40 * 10**9
    layers = deepest_fitting(budget)
    assert checkpoint_bytes(layers) <= budget < checkpoint_bytes(layers + 1)
    assert deepest_fitting(full) == published_depth()
    assert deepest_fitting(0) == 1
