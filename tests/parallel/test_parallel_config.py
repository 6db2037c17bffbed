"""ParallelConfig: validation that names the field, YAML presets in the design notes' spelling, the
LLM/serve entry points, and the logical-axis rules (no devices needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from jax.sharding import PartitionSpec as P

from dsjax.config import ConfigError, ParallelConfig
from dsjax.engine.llm import parallel_config
from dsjax.model.transformer import abstract_model
from dsjax.parallel.sharding import RULES, logical_to_spec
from dsjax.serve.config import config_from_args

PRESETS = Path(__file__).resolve().parents[2] / "configs" / "parallel"


@pytest.mark.parametrize("path", sorted(PRESETS.glob("*.yaml")), ids=lambda p: p.stem)
def test_presets_load(path):
    config = ParallelConfig.from_yaml(path)
    assert config.num_devices == config.tensor_parallel_size * config.expert_parallel_size * config.data_parallel_size


def test_design_notes_spelling_maps_to_sizes(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("parallel_config:\n  tensor_parallel_degree: 2\n  expert_parallel_degree: 4\n"
                    "  data_parallel_degree: 1\n  pipeline_parallel_degree: 1\n")
    config = ParallelConfig.from_yaml(path)
    assert (config.tensor_parallel_size, config.expert_parallel_size, config.num_batch_shards) == (2, 4, 4)
    assert ParallelConfig.from_yaml("tp2-ep4") == config  # a preset by name
    switched_off = ParallelConfig.from_dict({"expert_parallel": "disabled", "tensor_parallel_size": 2})
    assert switched_off.expert_parallel_size == 1


@pytest.mark.parametrize("settings, field, accepted", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size", "a positive integer"),
    ({"expert_capacity_factor": -1.0}, "expert_capacity_factor", "a positive number"),
    ({"expert_all_to_all": "nccl"}, "expert_all_to_all", "auto, allgather, padded, ragged"),
    ({"num_processes": 2}, "coordinator_address", "'host:port' of process 0"),
    ({"num_processes": 2, "process_id": 2, "coordinator_address": "h:1"}, "process_id", "[0, num_processes=2)"),
    ({"pipeline_parallel_degree": 4}, "pipeline_parallel_degree", "1 (pipeline parallelism is not implemented)"),
    ({"tensor_parallel": 2}, "tensor_parallel", "tensor_parallel_size"),
])
def test_bad_settings_name_field_value_and_accepted(settings, field, accepted):
    with pytest.raises(ConfigError) as err:
        ParallelConfig.from_dict(settings)
    assert field in str(err.value) and accepted in str(err.value)


def test_llm_sizes_override_the_file():
    config = parallel_config("tp2-ep4", expert_parallel_size=2, data_parallel_size=None)
    assert (config.tensor_parallel_size, config.expert_parallel_size, config.data_parallel_size) == (2, 2, 1)


def test_serve_flags_and_environment():
    config = config_from_args(["--parallel-config", "dp2-ep4", "--tensor-parallel-size", "2"],
                              env={"DSJAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "DSJAX_NUM_PROCESSES": "2",
                                   "DSJAX_PROCESS_ID": "1"})
    parallel = config.parallel()
    assert (parallel.data_parallel_size, parallel.expert_parallel_size, parallel.tensor_parallel_size) == (2, 4, 2)
    assert (parallel.coordinator_address, parallel.num_processes, parallel.process_id) == ("10.0.0.1:1234", 2, 1)
    flags = config_from_args(["--coordinator-address", "h:9", "--num-processes", "2", "--process-id", "0",
                              "--expert-parallel-size", "8"], env={"DSJAX_PROCESS_ID": "1"})
    assert flags.parallel().process_id == 0 and flags.parallel().expert_parallel_size == 8
    with pytest.raises(ConfigError, match="process_id"):
        config_from_args([], env={"DSJAX_PROCESS_ID": "one"})


def test_every_parameter_axis_has_a_rule_and_the_split_is_the_intended_one():
    from flax import nnx

    from dsjax.config import ModelConfig
    from dsjax.parallel.sharding import param_specs

    specs = dict(nnx.to_flat_state(param_specs(nnx.state(abstract_model(ModelConfig.tiny())))))
    assert specs[("moe_layers", "mlp", "w_gate")] == P(None, "expert", None, "tensor")
    assert specs[("moe_layers", "attn", "q_b")] == P(None, None, "tensor", None)
    assert specs[("moe_layers", "attn", "o_proj")] == P(None, "tensor", None, None)
    assert specs[("moe_layers", "attn", "kv_a")] == P(None, None, None)  # the latent is not split
    assert specs[("embed",)] == P("tensor", None) and specs[("lm_head",)] == P(None, "tensor")
    assert set(RULES) >= {"layers", "vocab", "embed", "heads", "q_lora", "kv_lora", "qk_head", "v_head", "mlp",
                          "expert", "moe_mlp", None}
    with pytest.raises(ValueError, match="no sharding rule"):
        logical_to_spec(("heads", "nonsense"))


def test_meshes_set_their_xla_flags_before_the_backend_starts(monkeypatch):
    from dsjax.parallel import mesh

    flag = mesh.MESH_XLA_FLAGS[0]
    monkeypatch.setattr(mesh, "backends_are_initialized", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    mesh.prepare_process(ParallelConfig())  # one device: nothing to add
    assert flag not in mesh.os.environ["XLA_FLAGS"]
    mesh.prepare_process(ParallelConfig(expert_parallel_size=2))
    assert mesh.os.environ["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=8 {flag}"
    mesh.prepare_process(ParallelConfig(expert_parallel_size=2))  # added once
    assert mesh.os.environ["XLA_FLAGS"].count(flag) == 1
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION")  # the user's own choice stays
    mesh.prepare_process(ParallelConfig(tensor_parallel_size=2))
    assert mesh.os.environ["XLA_FLAGS"] == "--xla_gpu_enable_command_buffer=FUSION"
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setattr(mesh, "backends_are_initialized", lambda: True)  # too late: flags are read
    mesh.prepare_process(ParallelConfig(tensor_parallel_size=2))
    assert "XLA_FLAGS" not in mesh.os.environ
