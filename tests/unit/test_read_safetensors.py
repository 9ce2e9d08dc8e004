"""utils.checkpoint.read_safetensors (shared by the MiMo refit's zero-bias check and the frozen draft's fresh head)."""

import torch
from safetensors.torch import save_file

from nemo_rl_spec.models.generation.mimo_surgery import zero_tensor_names
from nemo_rl_spec.utils.checkpoint import read_safetensors


def _checkpoint(tmp_path):
    save_file({"a": torch.zeros(2), "b": torch.arange(3.0)}, str(tmp_path / "model-00001.safetensors"))
    save_file({"c": torch.ones(2, 2, dtype=torch.bfloat16)}, str(tmp_path / "model-00002.safetensors"))
    (tmp_path / "notes.txt").write_text("not a shard")
    return tmp_path


def test_reads_the_named_tensors_across_shards(tmp_path):
    got = read_safetensors(_checkpoint(tmp_path), {"b", "c", "missing"})
    assert sorted(got) == ["b", "c"]
    assert torch.equal(got["b"], torch.arange(3.0))
    assert got["c"].dtype == torch.bfloat16 and got["c"].shape == (2, 2)


def test_zero_tensor_names_finds_only_all_zero_tensors(tmp_path):
    assert zero_tensor_names(str(_checkpoint(tmp_path)), {"a", "b", "c", "missing"}) == {"a"}
