"""Qwen3-Omni as seven pipeline stages (the only package that imports torch and transformers).

One executor per stage, each a thin shell around the public `forward` calls of the transformers
implementation: `preprocessing` (conversation -> prompt ids, mel, image patches), `encoders`
(audio and image towers), `thinker` (prefill, then one token per step), `decode` (text deltas),
`talker` (one 16-code frame per step), `code2wav` (streamed 24 kHz PCM). `weights` loads one
part of a checkpoint; `tiny` builds the deterministic random-weight model the CPU config uses;
`memory_plan` sizes a config against a GPU (`realtime-omni check --gpu`) from meta-tensor
measures of each stage's largest step (`step_memory`).
Configs name executors by full path, e.g. `realtime_omni.models.qwen3_omni.thinker:ThinkerExecutor`.

Importing this package imports nothing heavy; each module imports torch itself.
"""
