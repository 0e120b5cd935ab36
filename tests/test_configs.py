"""configs/*.yaml load and validate; unknown keys and bad values are ConfigErrors naming the key."""

import pathlib
import re

import pytest

from xla_ckpt.comm import DistConfig
from xla_ckpt.config import (
    Config,
    TrainConfig,
    apply_overrides,
    config_from_dict,
    dump_config,
    load_config,
)
from xla_ckpt.errors import ConfigError
from xla_ckpt.manager import CheckpointConfig
from xla_ckpt.restore import RestoreConfig
from xla_ckpt.restore.cost import Bandwidths
from xla_ckpt.storage import StorageConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
ENV = {"XLA_CKPT_BUCKET": "my-bucket"}


def test_every_shipped_config_is_tested():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == [
        "cpu-emulation.yaml", "cuda-nccl.yaml", "gke-tpu.yaml", "tpu-vm.yaml"]


def test_cpu_emulation_is_the_demo_default():
    cfg = load_config(CONFIGS / "cpu-emulation.yaml", environ={})
    assert isinstance(cfg, Config)
    assert cfg.checkpoint.save_dir == "gs://xla-ckpt-demo/run"
    assert cfg.checkpoint.save_interval_updates == 4
    assert cfg.checkpoint.keep_interval_updates == 2
    assert cfg.checkpoint.keep_best_checkpoints == 1
    assert cfg.checkpoint.async_save is True and cfg.checkpoint.handle_sigterm is True
    # the demo's cost model describes its emulated link (tests/demo, README command 1)
    assert cfg.restore == RestoreConfig(strategy="auto", cost_model=Bandwidths(
        storage_stream_bytes_per_s=32 * 2**20, storage_host_bytes_per_s=64 * 2**20,
        first_byte_latency_s=0.03, streams_per_reader=8, restore_fixed_s=0.34))
    assert cfg.train.hosts == 2
    assert (cfg.dist.backend, cfg.dist.init_method) == ("gloo", "env://")
    assert cfg.storage == StorageConfig(max_workers=8, slice_size_bytes=8 * 2**20,
                                        retry_deadline_s=60.0)
    assert (cfg.train.model, cfg.train.workers, cfg.train.lr) == ("minilm", 4, 5e-5)


@pytest.mark.parametrize("name,save_dir,backend,init_method,strategy", [
    ("tpu-vm", "gs://my-bucket/runs/minilm", "xla", "xla://", "all_ranks"),
    ("gke-tpu", "gs://my-bucket/runs/minilm-gke", "xla", "xla://", "all_ranks"),
    ("cuda-nccl", "checkpoints/minilm-cuda", "nccl", "env://", "broadcast"),
])
def test_cluster_configs(name, save_dir, backend, init_method, strategy):
    cfg = load_config(CONFIGS / f"{name}.yaml", environ=ENV)
    assert cfg.checkpoint.save_dir == save_dir
    assert (cfg.dist.backend, cfg.dist.init_method) == (backend, init_method)
    assert cfg.restore.strategy == strategy
    assert cfg.checkpoint.save_interval_updates == 500
    assert cfg.checkpoint.keep_interval_updates == 3
    assert isinstance(cfg.dist.timeout_s, float) and cfg.dist.timeout_s == 1800.0
    if name == "cuda-nccl":
        assert cfg.restore.bucket_size_bytes == 64 * 2**20


def test_env_default_and_value():
    cfg = load_config(CONFIGS / "tpu-vm.yaml", environ={**ENV, "XLA_CKPT_RUN": "exp7"})
    assert cfg.checkpoint.save_dir == "gs://my-bucket/runs/exp7"
    cfg = load_config(CONFIGS / "cuda-nccl.yaml", environ={"XLA_CKPT_SAVE_DIR": "gs://b/c"})
    assert cfg.checkpoint.save_dir == "gs://b/c"


def test_unset_env_var_names_key_and_variable():
    with pytest.raises(ConfigError) as ei:
        load_config(CONFIGS / "tpu-vm.yaml", environ={})
    assert str(ei.value) == (
        f"{CONFIGS / 'tpu-vm.yaml'}: checkpoint.save_dir uses ${{XLA_CKPT_BUCKET}}, which is "
        "not set; export XLA_CKPT_BUCKET or write ${XLA_CKPT_BUCKET:-default}")


def test_overrides_parse_yaml_values_in_order():
    cfg = load_config(CONFIGS / "cpu-emulation.yaml", environ={}, overrides=[
        "checkpoint.keep_interval_updates=5", "checkpoint.async_save=false",
        "storage.retry_deadline_s=7", "checkpoint.save_dir=/tmp/run=1",
        "train.model=tiny", "checkpoint.keep_interval_updates=6"])
    assert cfg.checkpoint.keep_interval_updates == 6
    assert cfg.checkpoint.async_save is False
    assert cfg.storage.retry_deadline_s == 7.0 and isinstance(cfg.storage.retry_deadline_s, float)
    assert cfg.checkpoint.save_dir == "/tmp/run=1"
    assert cfg.train.model == "tiny"
    # untouched keys keep the file's values
    assert cfg.checkpoint.save_interval_updates == 4


def test_defaults_without_file():
    cfg = load_config(None, overrides=["checkpoint.save_dir=gs://b/r"])
    assert cfg == Config(checkpoint=CheckpointConfig(save_dir="gs://b/r"))


def test_overrides_do_not_mutate_input():
    data = {"checkpoint": {"save_dir": "a"}}
    out = apply_overrides(data, ["checkpoint.save_dir=b"])
    assert data == {"checkpoint": {"save_dir": "a"}} and out == {"checkpoint": {"save_dir": "b"}}


@pytest.mark.parametrize("override,message", [
    ("checkpoint.keep_last=3",
     ("override 'checkpoint.keep_last=3': unknown key 'checkpoint.keep_last'; valid keys under "
      "checkpoint: async_save, best_checkpoint_metric, exit_grace_s, exit_on_preemption, "
      "handle_sigterm, "
      "keep_best_checkpoints, keep_interval_updates, keep_last_epochs, "
      "keep_local_checkpoints, local_dir, local_interval_updates, local_max_bytes, "
      "local_min_interval_s, local_policy, local_replica_domains, local_replicas, "
      "maximize_best_checkpoint_metric, no_epoch_checkpoints, no_save, restore_file, "
      "reuse_staging_buffers, save_dir, save_interval_epochs, save_interval_seconds, "
      "save_interval_updates, "
      "sync_interval_updates")),
    ("chekpoint.save_dir=x",
     ("override 'chekpoint.save_dir=x': unknown key 'chekpoint.save_dir'; valid keys under the "
      "top level: checkpoint, dist, restore, storage, train")),
    ("checkpoint.save_dir.x=1",
     ("override 'checkpoint.save_dir.x=1': unknown key 'checkpoint.save_dir.x': "
      "checkpoint.save_dir is a value, not a section")),
    ("checkpoint.keep_interval_updates",
     "override 'checkpoint.keep_interval_updates' must look like section.key=value"),
    ("=3", "override '=3': empty key"),
])
def test_bad_override_names_key(override, message):
    with pytest.raises(ConfigError) as ei:
        load_config(CONFIGS / "cpu-emulation.yaml", environ={}, overrides=[override])
    assert str(ei.value) == message


F = "configs/cpu-emulation.yaml"


@pytest.mark.parametrize("override,message", [
    ("checkpoint.keep_interval_updates=-2",
     f"{F}: checkpoint.keep_interval_updates must be an integer >= -1, got -2"),
    ("checkpoint.keep_interval_updates=2.5",
     f"{F}: checkpoint.keep_interval_updates must be an integer, got 2.5 (float)"),
    ("checkpoint.save_interval_updates=true",
     f"{F}: checkpoint.save_interval_updates must be an integer, got True (bool)"),
    ("checkpoint.async_save=yes please",
     f"{F}: checkpoint.async_save must be true or false, got 'yes please' (str)"),
    ("restore.strategy=fastest",
     (f"{F}: restore.strategy must be one of auto, all_ranks, per_host, broadcast, striped; "
      "got 'fastest'")),
    ("restore.bucket_size_bytes=0",
     f"{F}: restore.bucket_size_bytes must be an integer >= 1, got 0"),
    ("restore.host_shared_memory=sometimes",
     f"{F}: restore.host_shared_memory must be true or false, got 'sometimes' (str)"),
    ("checkpoint.save_dir=", f"{F}: checkpoint.save_dir must be a non-empty string, got ''"),
    ("dist.timeout_s=0", f"{F}: dist.timeout_s must be a number > 0, got 0.0"),
    ("checkpoint.sync_interval_updates=0",
     f"{F}: checkpoint.sync_interval_updates must be an integer >= 1, got 0"),
    ("checkpoint.exit_grace_s=-1",
     f"{F}: checkpoint.exit_grace_s must be a number >= 0, got -1.0"),
    ("storage.max_workers=0", f"{F}: storage.max_workers must be a positive integer, got 0"),
    ("storage.slice_size_bytes=1MiB",
     f"{F}: storage.slice_size_bytes must be an integer, got '1MiB' (str)"),
    ("dist.init_method=localhost:1234",
     (f"{F}: dist.init_method must start with env://, xla://, tcp:// or file://, got "
      "'localhost:1234'")),
    ("dist.backend=mpi",
     (f"{F}: dist.backend must be one of 'auto', 'single', 'gloo', 'nccl', "
      "'xla', got 'mpi' (str)")),
    ("train.workers=0", f"{F}: train.workers must be an integer >= 1, got 0"),
    ("train.lr=-1", f"{F}: train.lr must be a number > 0, got -1.0"),
    ("checkpoint=3", f"{F}: checkpoint must be a mapping, got int 3"),
])
def test_bad_value_names_key(override, message, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError) as ei:
        load_config(F, environ={}, overrides=[override])
    assert str(ei.value) == message


def test_unknown_key_in_file_names_dotted_key(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("checkpoint:\n  save_dir: x\n  keep_interval_update: 3\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert str(ei.value).startswith(f"{p}: unknown key 'checkpoint.keep_interval_update'; "
                                    "valid keys under checkpoint: async_save, ")


@pytest.mark.parametrize("text,message", [
    ("- 1\n- 2\n", ("top level must be a mapping of sections (checkpoint, restore, storage, "
                    "dist, train), got list")),
    ("checkpoint: [\n", "not valid YAML: "),
    ("storage:\n  max_workers: 4\n  slice_size: 5\n", "unknown key 'storage.slice_size'; "),
])
def test_bad_files(tmp_path, text, message):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert str(ei.value).startswith(f"{p}: {message}")


def test_missing_file_is_config_error(tmp_path):
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'nope.yaml'}: cannot read "
                                                    "config file: No such file or directory")):
        load_config(tmp_path / "nope.yaml")


def test_empty_file_gives_defaults(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("# nothing\n")
    assert load_config(p) == Config()


def test_dump_round_trips(tmp_path):
    cfg = load_config(CONFIGS / "gke-tpu.yaml", environ=ENV)
    p = tmp_path / "dump.yaml"
    p.write_text(dump_config(cfg))
    assert load_config(p) == cfg


def test_dataclasses_are_kw_only_and_validate_directly():
    with pytest.raises(TypeError):
        CheckpointConfig("dir")  # type: ignore[call-arg]  # kw_only: the TypeError under test
    with pytest.raises(ConfigError, match=r"^checkpoint\.keep_best_checkpoints must be an "
                                          r"integer >= -1, got -5$"):
        CheckpointConfig(keep_best_checkpoints=-5)
    with pytest.raises(ConfigError, match=r"^dist\.timeout_s must be a number > 0, got 0$"):
        DistConfig(timeout_s=0)
    with pytest.raises(ConfigError, match=r"^train\.model must be one of minilm, tiny; "
                                          r"got 'bert'$"):
        TrainConfig(model="bert")  # type: ignore[arg-type]  # the refused value under test


def test_config_from_dict_prefix():
    with pytest.raises(ConfigError) as ei:
        config_from_dict({"save_dir": 3}, CheckpointConfig, where="cli", prefix="checkpoint")
    assert str(ei.value) == "cli: checkpoint.save_dir must be a string, got 3 (int)"
