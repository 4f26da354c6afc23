"""The cached GGUF header index (gguf_file._index) reads the same config and tensors as gguf.GGUFReader."""

from __future__ import annotations

import numpy as np
import torch

from kvserve.model import gguf_file
from kvserve.model.default_model import default_model_path


def test_cached_index_reads_what_the_reader_reads(tmp_path, monkeypatch):
    import gguf

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    path = default_model_path()
    gguf_file._index.cache_clear()
    built = gguf_file.read_config(path)  # parses the file, writes the index
    assert list((tmp_path / "gguf").glob("*.json"))
    gguf_file._index.cache_clear()
    monkeypatch.setattr(gguf_file, "_reader", None)  # the second read must not parse the file again
    assert gguf_file.read_config(path) == built
    assert built["vocab_size"] == 49152 and built["num_hidden_layers"] == 30 and built["tie_word_embeddings"]

    reader = gguf.GGUFReader(str(path))
    mine = dict(gguf_file.iter_weights(path, built, keep_blocks=True))
    assert len(mine) == len(reader.tensors)
    for t in reader.tensors:
        name = gguf_file._hf_name(t.name)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            continue  # rows permuted back (tested through generation parity)
        got = mine[name]
        if isinstance(got, gguf_file.GGUFBlocks):
            assert got.tensor_type == t.tensor_type and np.array_equal(got.data, np.asarray(t.data).reshape(got.shape[0], -1))
        else:
            want = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(got.shape)
            assert torch.equal(got, torch.from_numpy(want)), name
    gguf_file._index.cache_clear()


def test_index_is_rebuilt_when_the_cache_is_unreadable(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    path = default_model_path()
    gguf_file._index.cache_clear()
    config = gguf_file.read_config(path)
    for f in (tmp_path / "gguf").glob("*.json"):
        f.write_text("{not json")
    gguf_file._index.cache_clear()
    assert gguf_file.read_config(path) == config
    gguf_file._index.cache_clear()
