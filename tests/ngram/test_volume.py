"""The table volume: same logits from disk as from RAM, mismatches refused with a clear error."""

from __future__ import annotations

import json
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from conversion.ngram_volume import main as convert_main
from infernix_jax.cache.sequence import init_cache
from infernix_jax.model.forward import forward
from infernix_jax.ngram.memory import table_from_volume, table_in_memory
from infernix_jax.ngram.volume import NgramVolumeError, open_volume, write_volume
from tests.ngram.conftest import VOCAB, tiny_config, tiny_raw_config

T = 24


@partial(jax.jit, static_argnums=(3,))
def _logits(params, tokens, rows, cfg):
    positions = jnp.arange(tokens.shape[1])[None]
    logits, _, _ = forward(params, tokens, positions, init_cache(cfg, 1, 32), cfg, ngram_rows=rows)
    return logits


def logits_with(table, params, cfg, tokens):
    rows = table.rows(tokens, 0, len(tokens))[:, None]
    return np.asarray(_logits(params, jnp.asarray([tokens], jnp.int32), rows, cfg))


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(5).integers(0, VOCAB, T).tolist()


def test_volume_on_disk_gives_the_logits_of_the_table_in_memory(
    tmp_path, tiny_cfg, tiny_params, tiny_table, tokens
):
    write_volume(tmp_path / "vol", tiny_cfg, tiny_table)
    disk = table_from_volume(tiny_cfg, tmp_path / "vol", cache_bytes=4 << 10)  # smaller than the rows read
    ram = table_in_memory(tiny_cfg, tiny_table)
    np.testing.assert_array_equal(
        logits_with(disk, tiny_params, tiny_cfg, tokens), logits_with(ram, tiny_params, tiny_cfg, tokens)
    )
    assert disk.cache.stats.misses > 0  # the rows really came from disk


def test_only_the_needed_rows_are_read(tmp_path, tiny_cfg, tiny_table, tokens):
    write_volume(tmp_path / "vol", tiny_cfg, tiny_table)
    disk = table_from_volume(tiny_cfg, tmp_path / "vol")
    rows = disk.rows(tokens, 0, len(tokens))
    ids = disk.hasher.ids(disk.hasher.context(tokens, 0, len(tokens)))
    np.testing.assert_array_equal(rows, tiny_table[ids])
    assert disk.cache.stats.misses == len(np.unique(ids)) < tiny_table.shape[0] // 10
    disk.rows(tokens, 0, len(tokens))
    assert disk.cache.stats.hits == len(np.unique(ids))  # the second lookup is served from the host cache


@pytest.mark.parametrize(
    "change, message",
    [
        ({"seed": 8}, "hash seed"),
        ({"orders": [2, 4]}, "hash orders"),
        ({"table_rows": 5000}, "shape"),
        ({"row_width": 4}, "shape"),
        ({"table_dtype": "bfloat16"}, "dtype"),
    ],
)
def test_a_volume_of_another_memory_is_refused_naming_the_difference(
    tmp_path, tiny_cfg, tiny_table, change, message
):
    write_volume(tmp_path / "vol", tiny_cfg, tiny_table)
    with pytest.raises(NgramVolumeError, match=f"does not match this model's n-gram memory: .*{message}"):
        open_volume(tmp_path / "vol", tiny_config(**change))


def test_a_table_of_the_wrong_shape_is_not_written(tmp_path, tiny_cfg, tiny_table):
    with pytest.raises(NgramVolumeError, match="addresses"):
        write_volume(tmp_path / "vol", tiny_cfg, tiny_table[:-1])


def test_checksum_in_config_and_damaged_data_are_caught(tmp_path, tiny_cfg, tiny_table):
    manifest = write_volume(tmp_path / "vol", tiny_cfg, tiny_table)
    open_volume(tmp_path / "vol", tiny_config(table_sha256=manifest["sha256"]), verify=True)
    with pytest.raises(NgramVolumeError, match="sha256"):
        open_volume(tmp_path / "vol", tiny_config(table_sha256="0" * 64))
    changed = tiny_table.copy()
    changed[17] += 1.0
    other = write_volume(tmp_path / "other", tiny_cfg, changed)
    manifest_file = tmp_path / "other" / "manifest.json"
    data = json.loads(manifest_file.read_text())
    data["sha256"] = manifest["sha256"]  # the manifest claims the original table
    manifest_file.write_text(json.dumps(data))
    assert other["sha256"] != manifest["sha256"]
    with pytest.raises(NgramVolumeError, match="damaged"):
        open_volume(tmp_path / "other", tiny_cfg, verify=True)


def test_a_folder_without_manifest_is_not_a_volume(tmp_path, tiny_cfg):
    with pytest.raises(NgramVolumeError, match="not an n-gram table volume"):
        open_volume(tmp_path, tiny_cfg)


def test_conversion_writes_volumes_from_npy_and_safetensors(tmp_path, tiny_cfg, tiny_table):
    config = tmp_path / "model"
    config.mkdir()
    (config / "config.json").write_text(json.dumps(tiny_raw_config()))
    np.save(tmp_path / "table.npy", tiny_table)
    save_file({"ngram.table": tiny_table}, tmp_path / "ckpt.safetensors")
    assert (
        convert_main(
            ["--config", str(config), "--npy", str(tmp_path / "table.npy"), "--out", str(tmp_path / "a")]
        )
        == 0
    )
    assert (
        convert_main(
            [
                "--config",
                str(config),
                "--safetensors",
                str(tmp_path / "ckpt.safetensors"),
                "--tensor",
                "ngram.table",
                "--out",
                str(tmp_path / "b"),
            ]
        )
        == 0
    )
    assert convert_main(["--config", str(config), "--verify", str(tmp_path / "b")]) == 0
    for name in ("a", "b"):
        rows = open_volume(tmp_path / name, tiny_cfg).read_range(0, tiny_table.shape[0])
        np.testing.assert_array_equal(rows, tiny_table)
    np.save(tmp_path / "short.npy", tiny_table[:100])
    assert (
        convert_main(
            ["--config", str(config), "--npy", str(tmp_path / "short.npy"), "--out", str(tmp_path / "c")]
        )
        == 2
    )
