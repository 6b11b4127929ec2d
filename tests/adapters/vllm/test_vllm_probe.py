"""Learning each worker's part of every checkpoint tensor from vLLM's loader (one worker here): every
element of every tensor lands, the engine's weights are untouched by the probe, the result is cached,
and a tensor the loader refuses is named."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from rlsync import ConfigError  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]

from _support import vllm_engines as common  # noqa: E402


@pytest.mark.parametrize("arch", ["qwen3-moe"])
def test_probe_finds_every_element_leaves_weights_alone_and_caches(arch: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("RLSYNC_CACHE_DIR", str(cache))
    llm = common.engine(common.save(arch, 100, tmp_path / "v0"))
    before = common.generate(llm)
    tensors = common.trainer.tensors(common.trainer.build(arch, 100))
    [boxes] = llm.collective_rpc("rlsync_probe", args=(tensors,))
    # one worker reads all of every tensor: per-expert gate/up/down included (fused into w13/w2 by the loader)
    assert boxes == {name: [[0] * len(shape), list(shape)] for name, _, shape in tensors}
    assert common.generate(llm) == before  # the probe ran on stand-ins, never on the served weights
    [cached] = list((cache / "vllm-probe").glob("*.json"))
    cached.write_text(cached.read_text().replace('"model.norm.weight": [[0], [128]]', '"model.norm.weight": [[0], [64]]'))
    [again] = llm.collective_rpc("rlsync_probe", args=(tensors,))
    assert again["model.norm.weight"] == [[0], [64]]  # read back from the cache, not probed again

    bogus = [*tensors, ["model.layers.1.mlp.not_a_weight.weight", "torch.bfloat16", [4, 4]]]
    with pytest.raises(Exception, match="model.layers.1.mlp.not_a_weight.weight") as info:
        llm.collective_rpc("rlsync_probe", args=(bogus,))
    assert isinstance(info.value, ConfigError) or "ConfigError" in repr(info.value)
    assert common.generate(llm) == before
