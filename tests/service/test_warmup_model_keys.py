"""The warmup checks its keys against the model's warmup set, not against themselves: a key outside it is
refused before anything compiles, and the server stays not ready."""

from __future__ import annotations

from indexer_service.kernels.specialization import CompileKey, ModelConfig, warmup_keys
from indexer_service.service.compute.warmup import KeyState, Warmup, WarmupState
from indexer_service.service.observability.metrics import Metrics


def test_a_key_outside_the_models_warmup_set_is_refused() -> None:
    model = ModelConfig(compress_ratios=(4,))
    stray = CompileKey(compress_ratio=3)
    assert stray not in warmup_keys(model)
    warmup = Warmup([stray], target="cuda:90", enabled=True, workers=1, metrics=Metrics(), model=model)
    assert warmup.run() is WarmupState.FAILED
    (progress,) = warmup.progress()
    assert progress.state is KeyState.FAILED
    assert "is not in the model's warmup set" in progress.error
