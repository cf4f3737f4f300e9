"""Safetensors reading and writing: dtypes, sharding, tied heads, and clear errors on bad files."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from numba_vllm.loading.bf16 import BF16, to_bf16
from numba_vllm.loading.weights import WeightsError, load_weights, read_metadata, read_safetensors, save_safetensors
from numba_vllm.model.config import ModelConfig
from tests.helpers.tiny_llama import random_weights, tiny_config_dict, write_checkpoint


def test_reads_what_the_safetensors_package_writes(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "a": rng.standard_normal((3, 5)).astype(np.float32),
        "b": rng.standard_normal(7).astype(np.float16),
        "c": np.arange(4, dtype=np.int64),
    }
    save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt"})
    got = read_safetensors(tmp_path / "x.safetensors")
    assert set(got) == set(tensors)
    for k in tensors:
        assert got[k].dtype == tensors[k].dtype and np.array_equal(got[k], tensors[k])
    assert read_metadata(tmp_path / "x.safetensors") == {"format": "pt"}


def test_the_safetensors_package_reads_what_we_write(tmp_path):
    rng = np.random.default_rng(1)
    tensors = {"w": rng.standard_normal((4, 6)).astype(np.float32), "h": rng.standard_normal(3).astype(np.float16)}
    save_safetensors(tmp_path / "y.safetensors", tensors)
    got = load_file(tmp_path / "y.safetensors")
    for k in tensors:
        assert np.array_equal(got[k], tensors[k])


def test_bf16_round_trip_is_bit_exact(tmp_path):
    x = to_bf16(np.random.default_rng(2).standard_normal((5, 9)))
    save_safetensors(tmp_path / "b.safetensors", {"x": x})
    raw = (tmp_path / "b.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert header["x"]["dtype"] == "BF16" and header["x"]["shape"] == [5, 9]
    got = read_safetensors(tmp_path / "b.safetensors")["x"]
    assert got.dtype == BF16 and np.array_equal(got.view(np.uint16), x.view(np.uint16))


def test_written_values_are_the_arrays_values_whatever_their_layout(tmp_path):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    tensors = {"transposed": x.T, "big_endian": x.astype(">f4"), "strided": x[:, ::2], "flags": x > 5}
    save_safetensors(tmp_path / "l.safetensors", tensors, metadata={"format": "pt"})
    got = read_safetensors(tmp_path / "l.safetensors")
    for name, t in tensors.items():
        assert got[name].shape == t.shape and np.array_equal(got[name], t), name
    assert got["big_endian"].dtype == np.dtype("<f4") and got["flags"].dtype == np.dtype("?")
    assert read_metadata(tmp_path / "l.safetensors") == {"format": "pt"}


def test_a_dtype_the_reader_cannot_read_is_refused_and_nothing_is_written(tmp_path):
    with pytest.raises(WeightsError, match=r"tensor 'u': dtype uint16 is not one read_safetensors reads"):
        save_safetensors(tmp_path / "u.safetensors", {"f": np.zeros(2, np.float32), "u": np.zeros(2, np.uint16)})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bf16"])
def test_load_weights_checks_and_returns_every_tensor(tmp_path, dtype):
    cfg = tiny_config_dict()
    config = ModelConfig.from_dict(cfg)
    w = random_weights(config, dtype=dtype)
    write_checkpoint(tmp_path, cfg, w)
    got = load_weights(tmp_path, config)
    assert set(got) == set(config.tensor_shapes()) and "lm_head.weight" not in got  # tied
    for k in w:
        assert np.array_equal(np.asarray(got[k], np.float32), np.asarray(w[k], np.float32))


def test_untied_head_must_be_present(tmp_path):
    cfg = tiny_config_dict(tie_word_embeddings=False)
    config = ModelConfig.from_dict(cfg)
    w = random_weights(config)
    del w["lm_head.weight"]
    write_checkpoint(tmp_path, cfg, w)
    with pytest.raises(WeightsError, match="'lm_head.weight' is missing"):
        load_weights(tmp_path, config)


def test_sharded_checkpoint(tmp_path):
    cfg = tiny_config_dict()
    config = ModelConfig.from_dict(cfg)
    w = random_weights(config, dtype="bf16")
    names = sorted(w)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for shard, members in shards.items():
        save_safetensors(tmp_path / shard, {n: w[n] for n in members})
    weight_map = {n: shard for shard, members in shards.items() for n in members}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    got = load_weights(tmp_path, config)
    assert all(np.array_equal(got[n].view(np.uint16), w[n].view(np.uint16)) for n in w)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightsError, match="shard 'model-00002-of-00002.safetensors' is missing"):
        load_weights(tmp_path, config)


def test_wrong_shape_names_tensor_and_shapes(tmp_path):
    cfg = tiny_config_dict()
    config = ModelConfig.from_dict(cfg)
    w = random_weights(config)
    w["model.layers.1.mlp.up_proj.weight"] = w["model.layers.1.mlp.up_proj.weight"][:-1]
    write_checkpoint(tmp_path, cfg, w)
    with pytest.raises(
        WeightsError, match=r"'model.layers.1.mlp.up_proj.weight' has shape \(95, 64\), the config expects \(96, 64\)"
    ):
        load_weights(tmp_path, config)


def test_truncated_and_corrupt_files(tmp_path):
    cfg = tiny_config_dict()
    config = ModelConfig.from_dict(cfg)
    write_checkpoint(tmp_path, cfg, random_weights(config))
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    with pytest.raises(WeightsError, match="truncated"):
        load_weights(tmp_path, config)
    f.write_bytes(data[:5])
    with pytest.raises(WeightsError, match="not a safetensors file"):
        load_weights(tmp_path, config)
    f.write_bytes((1 << 40).to_bytes(8, "little") + data[8:])
    with pytest.raises(WeightsError, match="corrupt or truncated safetensors header"):
        load_weights(tmp_path, config)
    f.write_bytes(data[:8] + b"\xff" * 16 + data[24:])
    with pytest.raises(WeightsError, match="not JSON"):
        load_weights(tmp_path, config)
    f.unlink()
    with pytest.raises(WeightsError, match="no model.safetensors"):
        load_weights(tmp_path, config)
