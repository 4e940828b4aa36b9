"""Malformed job specs and command lines, each with the exact message lmlaunch must print.

Shared by test_malformed_specs.py. ``{spec}`` in a message is the spec file's path.
BASE is the spec the cases edit; the line numbers in the messages refer to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmcore.job.model_types import causal_lm_types

BASE = """\
name: t
cluster: local
resources:
  nodes: 2
  tasks_per_node: 1
  time: "00:20:00"
model:
  type: gpt2
data:
  path: /data/tiny
  seq_len: 128
  micro_batch_size: 8
trainer:
  global_batch_size: 16
  max_steps: 10
  precision: 32-true
"""

GPU_BASE = BASE.replace("cluster: local", "cluster: h100-ib").replace(
    "  tasks_per_node: 1\n", "  gpus_per_node: 8\n"
)


@dataclass
class Case:
    id: str
    text: str | None  # spec file content; None: no file is written
    expected: str  # the exact stderr line(s), without "error: " and the trailing newline
    argv: list[str] = field(default_factory=list)  # after "validate {spec}"
    environ: dict[str, str] = field(default_factory=dict)  # added to the test's environment
    command: str = "validate"


def edit(old: str, new: str, base: str = BASE) -> str:
    assert old in base, old
    return base.replace(old, new, 1)


def add(text: str, base: str = BASE) -> str:
    return base + text


CASES: list[Case] = [
    # --- the scale harness (simulate:) ---
    Case("simulate_counts_dir_relative", add("simulate:\n  counts_dir: counts\n"), "{spec}: simulate.counts_dir (line 18): 'counts' is relative: give an absolute directory (the ranks run elsewhere)"),
    Case("simulate_and_eval", add("simulate: {}\neval:\n  checkpoint: /tmp/x\n"), "{spec}: simulate: the scale harness trains no model, so it has no checkpoint to evaluate; remove eval or simulate"),
    # --- unknown keys: key path, line, closest key, valid keys ---
    Case("unknown_key_nested", edit("  nodes: 2", "  nodse: 2"), "{spec}: resources.nodse (line 4): unknown key 'nodse' (did you mean 'nodes'?); valid keys here: nodes, spare_nodes, gpus_per_node, tasks_per_node, cpus_per_task, mem, time, partition, partition_kind, account, qos, constraint, exclusive, placement"),
    Case("unknown_key_top_level", add("optimizer: {lr: 0.001}\n"), "{spec}: optimizer (line 17): unknown key 'optimizer' (did you mean 'optim'?); valid keys here: name, cluster, clusters, move, resources, model, data, trainer, optim, checkpoint, preemption, watchdog, health, profile, env, logging, notify, eval, simulate, slurm, container"),
    Case("unknown_key_without_close_match", edit("  max_steps: 10", "  max_steps: 10\n  banana: 1"), "{spec}: trainer.banana (line 16): unknown key 'banana'; valid keys here: strategy, zero_stage, tensor_parallel_size, sequence_parallel, pipeline_parallel_size, pipeline_schedule, pipeline_microbatches, pipeline_split, offload_optimizer, offload_params, precision, global_batch_size, max_steps, gradient_clip_val, val_check_interval, limit_val_batches, log_every_n_steps, seed"),
    Case("unknown_key_deep", add("logging:\n  wandb:\n    projet: x\n"), "{spec}: 2 problems:\n  - logging.wandb.project (line 18): required key is missing\n  - logging.wandb.projet (line 19): unknown key 'projet' (did you mean 'project'?); valid keys here: project, entity, mode"),
    # --- wrong types ---
    Case("nodes_is_a_word", edit("  nodes: 2", "  nodes: two"), "{spec}: resources.nodes (line 4): must be an integer (got 'two')"),
    Case("nodes_is_a_fraction", edit("  nodes: 2", "  nodes: 2.5"), '{spec}: resources.nodes (line 4): must be an integer (got 2.5)'),
    Case("nodes_is_a_boolean", edit("  nodes: 2", "  nodes: yes"), '{spec}: resources.nodes (line 4): must be an integer (got True)'),
    Case("nodes_is_quoted_text", edit("  nodes: 2", '  nodes: "2"'), "{spec}: resources.nodes (line 4): must be an integer (got '2')"),
    Case("section_is_a_string", edit("data:\n  path: /data/tiny\n  seq_len: 128\n  micro_batch_size: 8\n", "data: /data/tiny\n"), "{spec}: data (line 9): must be a mapping of keys to values (got '/data/tiny')"),
    Case("name_is_a_number", edit("name: t", "name: 123"), '{spec}: name (line 1): must be a string (quote it) (got 123)'),
    Case("env_value_is_a_boolean", add("env:\n  vars:\n    USE_FOO: true\n"), '{spec}: line 19: env.vars.USE_FOO: True is a YAML boolean; quote the text you mean, e.g. "1" or "true"'),
    Case("betas_has_one_number", add("optim:\n  betas: [0.9]\n"), '{spec}: optim.betas (line 18): betas must be two numbers [beta1, beta2], got 1'),
    Case("model_layers_negative", edit("  type: gpt2", "  type: gpt2\n  config:\n    n_layer: -1"), "{spec}: line 10: model.config.n_layer must be at least 1 (it is a count or size), got -1"),
    Case("model_vocab_zero", edit("  type: gpt2", "  type: gpt2\n  config:\n    vocab_size: 0"), "{spec}: line 10: model.config.vocab_size must be at least 1 (it is a count or size), got 0"),
    Case("model_config_is_a_list", edit("  type: gpt2", "  type: gpt2\n  config: [1, 2]"), '{spec}: model.config (line 9): must be a mapping of keys to values (got [1, 2])'),
    Case("time_is_a_boolean", edit('  time: "00:20:00"', "  time: true"), '{spec}: resources.time (line 6): time must be a SLURM time string such as 04:00:00'),
    Case("resources_is_null", edit('resources:\n  nodes: 2\n  tasks_per_node: 1\n  time: "00:20:00"\n', "resources:\n"), '{spec}: resources (line 3): must be a mapping of keys to values (got None)'),
    # --- ranges and allowed values ---
    Case("nodes_zero", edit("  nodes: 2", "  nodes: 0"), '{spec}: resources.nodes (line 4): Input should be greater than or equal to 1 (got 0)'),
    Case("seq_len_too_small", edit("  seq_len: 128", "  seq_len: 4"), '{spec}: data.seq_len (line 11): Input should be greater than or equal to 8 (got 4)'),
    Case("val_fraction_too_large", edit("  micro_batch_size: 8", "  micro_batch_size: 8\n  val_fraction: 0.7"), '{spec}: data.val_fraction (line 13): Input should be less than 0.5 (got 0.7)'),
    Case("lr_too_large", add("optim:\n  lr: 2\n"), '{spec}: optim.lr (line 18): Input should be less than 1 (got 2)'),
    Case("seed_negative", edit("  max_steps: 10", "  max_steps: 10\n  seed: -1"), '{spec}: trainer.seed (line 16): Input should be greater than or equal to 0 (got -1)'),
    Case("gradient_clip_zero", edit("  max_steps: 10", "  max_steps: 10\n  gradient_clip_val: 0"), '{spec}: trainer.gradient_clip_val (line 16): Input should be greater than 0 (got 0)'),
    Case("micro_batch_zero", edit("  micro_batch_size: 8", "  micro_batch_size: 0"), '{spec}: data.micro_batch_size (line 12): Input should be greater than or equal to 1 (got 0)'),
    Case("keep_last_zero", add("checkpoint:\n  keep_last: 0\n"), '{spec}: checkpoint.keep_last (line 18): Input should be greater than or equal to 1 (got 0)'),
    Case("strategy_typo", edit("  max_steps: 10", "  max_steps: 10\n  strategy: dpp"), "{spec}: trainer.strategy (line 16): Input should be 'ddp', 'fsdp' or 'deepspeed', got 'dpp' (did you mean 'ddp'?)"),
    Case("precision_unknown", edit("  precision: 32-true", "  precision: bf16"), "{spec}: trainer.precision (line 16): Input should be 'bf16-mixed', '16-mixed' or '32-true', got 'bf16'"),
    Case("straggler_threshold_not_above_1", add("health:\n  stragglers:\n    threshold: 1\n"), "{spec}: health.stragglers.threshold (line 19): Input should be greater than 1 (got 1)"),
    Case("straggler_window_zero", add("health:\n  stragglers:\n    window: 0\n"), "{spec}: health.stragglers.window (line 19): Input should be greater than or equal to 1 (got 0)"),
    Case("straggler_exclude_without_spares", add("health:\n  stragglers:\n    action: exclude\n"), "{spec}: line 19: health.stragglers.action: exclude needs resources.spare_nodes >= 1: the slow node is left out of a restart in place and a spare takes its place (a running job cannot change its own ExcNodeList for a requeue)"),
    Case("profile_rank_outside_the_job", add("profile:\n  start_step: 5\n  ranks: [0, 9]\n"), "{spec}: line 19: profile.ranks(9) is not a rank of this job: its ranks are 0..1 (nodes x tasks_per_node)"),
    Case("profile_steps_zero", add("profile:\n  start_step: 5\n  steps: 0\n"), "{spec}: profile.steps (line 19): Input should be greater than or equal to 1 (got 0)"),
    Case("pushgateway_url_not_http", add("logging:\n  pushgateway:\n    url: pushgateway:9091\n"), "{spec}: logging.pushgateway.url (line 19): 'pushgateway:9091' is not an http(s) URL: http:// or https:// followed by no spaces or control characters"),
    Case("straggler_action_unknown", add("health:\n  stragglers:\n    action: kill\n"), "{spec}: health.stragglers.action (line 19): Input should be 'warn' or 'exclude', got 'kill'"),
    Case("signal_unknown", add("preemption:\n  signal: USR3\n"), "{spec}: preemption.signal (line 18): Input should be 'USR1', 'USR2', 'URG', 'XCPU' or 'HUP', got 'USR3' (did you mean 'USR2'?)"),
    Case("mem_not_slurm", edit("  nodes: 2", "  nodes: 2\n  mem: 64GB"), "{spec}: resources.mem (line 5): '64GB' is not a SLURM memory size: a whole number with an optional unit K, M, G or T, e.g. 64G or 500M"),
    Case("time_not_slurm", edit('  time: "00:20:00"', "  time: 1 hour"), "{spec}: resources.time (line 6): '1 hour' is not a SLURM time; use MM, HH:MM:SS, D-HH or D-HH:MM:SS"),
    Case("partition_with_space", edit("  nodes: 2", '  nodes: 2\n  partition: "low high"'), "{spec}: resources.partition (line 5): 'low high' is not a SLURM name: letters, digits and _ . , & | : * [ ] - (what SLURM accepts here)"),
    Case("name_with_space", edit("name: t", "name: my job"), "{spec}: name (line 1): 'my job' is not a valid run name: 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"),
    Case("name_with_shell", edit("name: t", "name: \"a'; echo foo\""), '{spec}: name (line 1): "a\'; echo foo" is not a valid run name: 1-64 letters, digits, \'.\', \'_\' or \'-\', starting with a letter or digit'),
    Case("missing_required_key", edit("  seq_len: 128\n", ""), '{spec}: data.seq_len (line 9): required key is missing'),
    Case("missing_section", edit("trainer:\n  global_batch_size: 16\n  max_steps: 10\n  precision: 32-true\n", ""), '{spec}: trainer: required key is missing'),
    Case("wandb_without_project", add("logging:\n  wandb: {mode: offline}\n"), '{spec}: logging.wandb.project (line 18): required key is missing'),
    Case("non_string_top_level_key", add("1: x\n"), '{spec}: top-level key 1 is not a name'),
    # --- model ---
    Case("unknown_model_type", edit("  type: gpt2", "  type: gtp2"), "{spec}: line 8: model.type(gtp2) is not a transformers causal LM type (did you mean 'gpt2'?); " + f"{len(causal_lm_types())} types are known, e.g. gpt2, llama, mistral, mixtral, qwen2, qwen3, gemma2, phi3, gpt_neox, opt"),
    Case("model_type_and_pretrained", edit("  type: gpt2", "  type: gpt2\n  pretrained: /models/x"), '{spec}: model (line 7): set exactly one of model.type or model.pretrained'),
    Case("model_without_source", edit("  type: gpt2", "  compile: true"), '{spec}: model (line 7): set exactly one of model.type or model.pretrained'),
    # --- cross-field rules ---
    Case("zero_stage_without_deepspeed", edit("  max_steps: 10", "  max_steps: 10\n  zero_stage: 2"), "{spec}: line 16: trainer.zero_stage(2) needs trainer.strategy: deepspeed (strategy is 'ddp')"),
    Case("deepspeed_without_zero_stage", edit("  max_steps: 10", "  max_steps: 10\n  strategy: deepspeed"), '{spec}: line 16: trainer.strategy deepspeed needs trainer.zero_stage (1, 2 or 3)'),
    Case("offload_optimizer_needs_stage_2", edit("  max_steps: 10", "  max_steps: 10\n  strategy: deepspeed\n  zero_stage: 1\n  offload_optimizer: true"), '{spec}: line 18: trainer.offload_optimizer needs DeepSpeed zero_stage >= 2 (zero_stage is 1)'),
    Case("tensor_parallel_without_fsdp", edit("  max_steps: 10", "  max_steps: 10\n  tensor_parallel_size: 2"), "{spec}: line 16: trainer.tensor_parallel_size(2) needs trainer.strategy: fsdp (FSDP2 over the data-parallel ranks, TP inside each node); strategy is 'ddp'"),
    Case("sequence_parallel_without_tensor_parallel", edit("  max_steps: 10", "  max_steps: 10\n  strategy: fsdp\n  sequence_parallel: true"), "{spec}: line 17: trainer.sequence_parallel splits the sequence over the tensor-parallel ranks: it needs trainer.tensor_parallel_size >= 2 (it is 1)"),
    # pipelines: the strategy, the schedule's name
    Case("pipeline_without_fsdp", edit("  max_steps: 10", "  max_steps: 10\n  pipeline_parallel_size: 2"), "{spec}: line 16: trainer.pipeline_parallel_size(2) needs trainer.strategy: fsdp (FSDP2 over the data-parallel ranks of each stage, as torchtitan runs it; DDP and DeepSpeed's engine cannot drive a pipeline schedule); strategy is 'ddp'"),
    Case("pipeline_schedule_unknown", edit("  max_steps: 10", "  max_steps: 10\n  strategy: fsdp\n  pipeline_parallel_size: 2\n  pipeline_schedule: zbv"), "{spec}: trainer.pipeline_schedule (line 18): Input should be 'gpipe', '1f1b', 'interleaved_1f1b' or 'interleaved_zero_bubble', got 'zbv'"),
    Case("tensor_parallel_zero", edit("  max_steps: 10", "  max_steps: 10\n  strategy: fsdp\n  tensor_parallel_size: 0"), "{spec}: trainer.tensor_parallel_size (line 17): Input should be greater than or equal to 1 (got 0)"),
    Case("data_path_and_sources", edit("  seq_len:", "  sources: [{path: /tmp/a, weight: 1}]\n  seq_len:"), "{spec}: data (line 9): set exactly one of data.path (one prepared store) or data.sources (a weighted mixture)"),
    Case("data_source_weight_negative", edit("  path:", "  sources: [{path: /tmp/a, weight: -1}]\n  # path:"), "{spec}: data.sources[0].weight (line 10): Input should be greater than 0 (got -1)"),
    Case("offload_params_needs_stage_3", edit("  max_steps: 10", "  max_steps: 10\n  strategy: deepspeed\n  zero_stage: 2\n  offload_params: true"), '{spec}: line 18: trainer.offload_params needs DeepSpeed zero_stage 3 (zero_stage is 2)'),
    Case("warning_not_shorter_than_time", edit('  time: "00:20:00"', '  time: "00:02:00"') + "preemption:\n  warning_seconds: 120\n", '{spec}: line 18: preemption.warning_seconds(120) is not shorter than resources.time(00:02:00) = 120 s'),
    Case("warmup_above_max_steps", add("optim:\n  warmup_steps: 50\n"), '{spec}: line 18: optim.warmup_steps(50) is above trainer.max_steps(10)'),
    Case("min_lr_above_lr", add("optim:\n  lr: 0.001\n  min_lr: 0.01\n"), '{spec}: line 19: optim.min_lr(0.01) is above optim.lr(0.001)'),
    Case("partition_and_kind", edit("  nodes: 2", "  nodes: 2\n  partition: low\n  partition_kind: high_priority"), '{spec}: line 5: resources.partition(low) and resources.partition_kind(high_priority) both pick a partition; set one'),
    Case("tasks_per_node_not_gpus", edit("  gpus_per_node: 8", "  gpus_per_node: 8\n  tasks_per_node: 4", GPU_BASE), '{spec}: line 6: resources.tasks_per_node(4) must equal resources.gpus_per_node(8): one task per GPU'),
    # --- environment ---
    Case("env_name_invalid", add("env:\n  vars:\n    1FOO: x\n"), "{spec}: line 18: env.vars: '1FOO' is not a valid environment variable name: letters, digits and _, not starting with a digit"),
    Case("env_name_reserved", add("env:\n  vars:\n    MASTER_PORT: '29500'\n"), "{spec}: line 18: env.vars: MASTER_PORT may not be set by a job: lmtrain's rank 0 picks a free port on its node at every attempt"),
    Case("env_name_slurm", add("env:\n  passthrough: [SLURM_JOB_ID]\n"), '{spec}: line 18: env.passthrough: SLURM_JOB_ID may not be set by a job: SLURM_* variables belong to SLURM'),
    Case("secret_by_value_and_name", add("env:\n  vars:\n    WANDB_API_KEY: abc\n  passthrough: [WANDB_API_KEY]\n"), '{spec}: env (line 17): WANDB_API_KEY in both env.vars and env.passthrough: a secret is passed by name only'),
    Case("passthrough_twice", add("env:\n  passthrough: [HF_TOKEN, HF_TOKEN]\n"), '{spec}: line 18: env.passthrough names HF_TOKEN more than once'),
    # --- against the cluster profile (the plan) ---
    Case("global_batch_arithmetic", edit("  micro_batch_size: 8", "  micro_batch_size: 6", edit("  global_batch_size: 16", "  global_batch_size: 512", edit("  nodes: 2", "  nodes: 2", GPU_BASE))), '{spec}: line 14: trainer.global_batch_size(512) is not a multiple of data.micro_batch_size(6) x world_size(16) = 96; world_size = resources.nodes(2) x gpus_per_node(8)'),
    Case("gpus_above_profile", edit("  tasks_per_node: 1", "  gpus_per_node: 1"), "{spec}: line 5: resources.gpus_per_node(1): profile 'local' has no GPUs (its gpus_per_node is 0, a CPU cluster): gpus_per_node: 0 runs tasks_per_node tasks on CPU (gloo), or name a GPU cluster's profile"),
    Case("gpus_above_gpu_profile", edit("  gpus_per_node: 8", "  gpus_per_node: 16", GPU_BASE), "{spec}: line 5: resources.gpus_per_node(16) is above what profile 'h100-ib' nodes have: gpus_per_node(8)"),
    Case("tasks_above_profile", edit("  tasks_per_node: 1", "  tasks_per_node: 8", edit("  global_batch_size: 16", "  global_batch_size: 128")), "{spec}: line 5: resources.tasks_per_node(8) is above profile 'local' max_tasks_per_node(4)"),
    Case("time_above_partition_max", edit('  time: "00:20:00"', '  time: "3:00:00"'), "{spec}: line 6: resources.time(3:00:00) = 180 min is above partition 'low' max_time(2:00:00) = 120 min"),
    Case("partition_unknown", edit("  nodes: 2", "  nodes: 2\n  partition: hihg"), "{spec}: line 5: resources.partition 'hihg' is not a partition of profile 'local' (did you mean 'high'?); allowed: low, high"),
    Case("partition_kind_missing_in_profile", edit("  nodes: 2", "  nodes: 2\n  partition_kind: high_priority"), "{spec}: line 5: resources.partition_kind(high_priority): profile 'nohigh' has no high_priority partition; its partitions: batch", environ={"LMLAUNCH_PROFILES_DIR": "{profiles}"}, argv=["--cluster", "nohigh"]),
    Case("several_plan_problems_at_once", edit('  time: "00:20:00"', '  time: "3:00:00"', edit("  tasks_per_node: 1", "  gpus_per_node: 1")), "{spec}: 2 problems:\n  - line 5: resources.gpus_per_node(1): profile 'local' has no GPUs (its gpus_per_node is 0, a CPU cluster): gpus_per_node: 0 runs tasks_per_node tasks on CPU (gloo), or name a GPU cluster's profile\n  - line 6: resources.time(3:00:00) = 180 min is above partition 'low' max_time(2:00:00) = 120 min"),
    Case("unknown_profile", edit("cluster: local", "cluster: lcoal"), "{spec}: line 2: unknown profile 'lcoal' (did you mean 'local'?); available: a100-roce, aws-p5-efa, h100-ib, local"),
    Case("unknown_profile_on_command_line", BASE, "{spec}: --cluster: unknown profile 'nope'; available: a100-roce, aws-p5-efa, h100-ib, local", argv=["--cluster", "nope"]),
    Case("broken_profile", BASE, "{profiles}/broken.yaml: gpu_per_node (line 6): unknown key 'gpu_per_node' (did you mean 'gpus_per_node'?); valid keys here: name, description, partitions, default_partition, preemptible_partition, high_priority_partition, account, qos, gpus_per_node, gres_name, gpu_bind, gpus_simulated, cpus_per_gpu, mem_per_gpu, mem_per_node, gpu_memory, max_tasks_per_node, exclusive, runs_root, object_store_credentials, setup, python, eval_python, container, login, sends_user_signal_on_preemption, expedited_requeue, network, env, submit, slurm_version, slurm, sweep_storage, min_allreduce_busbw_gbps", argv=["--cluster", "broken"], environ={"LMLAUNCH_PROFILES_DIR": "{profiles}"}),
    # --- overrides: validated like the file, the message names the override ---
    Case("override_unknown_key", BASE, "{spec}: resources.nodse (override 'resources.nodse=4'): unknown key 'nodse' (did you mean 'nodes'?); valid keys here: nodes, spare_nodes, gpus_per_node, tasks_per_node, cpus_per_task, mem, time, partition, partition_kind, account, qos, constraint, exclusive, placement", argv=["resources.nodse=4"]),
    Case("override_wrong_type", BASE, "{spec}: resources.nodes (override 'resources.nodes=abc'): must be an integer (got 'abc')", argv=["resources.nodes=abc"]),
    Case("override_cross_field", BASE, "{spec}: override 'trainer.zero_stage=3': trainer.zero_stage(3) needs trainer.strategy: deepspeed (strategy is 'ddp')", argv=["trainer.zero_stage=3"]),
    Case("override_topology", BASE, "{spec}: override 'trainer.global_batch_size=20': trainer.global_batch_size(20) is not a multiple of data.micro_batch_size(8) x world_size(2) = 16; world_size = resources.nodes(2) x tasks_per_node(1)", argv=["trainer.global_batch_size=20"]),
    Case("override_without_equals", BASE, "override 'resources.nodes' must look like key.path=value (e.g. resources.nodes=4)", argv=["resources.nodes"]),
    Case("override_bad_key_path", BASE, "override 'resources..nodes=1': 'resources..nodes' is not a dotted key path (e.g. trainer.max_steps)", argv=["resources..nodes=1"]),
    Case("override_below_a_value", BASE, "override 'name.x=1': name is str 't', not a mapping with keys", argv=["name.x=1"]),
    # --- the YAML itself ---
    Case("yaml_syntax", "name: [t\ncluster: local\n", "{spec}: line 2: invalid YAML: expected ',' or ']', but got ':'"),
    Case("yaml_python_tag", "name: !!python/object/apply:os.system ['touch canary']\n", "{spec}: line 1: the tag '!!python/object/apply:os.system' is not allowed: only plain YAML (mappings, lists, strings, numbers, booleans) is accepted"),
    Case("yaml_duplicate_key", edit("cluster: local", "cluster: local\nname: u"), "{spec}: line 3: duplicate key 'name' (first on line 1)"),
    Case("yaml_tab_indent", edit("  nodes: 2", "\tnodes: 2"), "{spec}: line 4: invalid YAML: found character '\\t' that cannot start any token"),
    Case("yaml_empty_file", "", '{spec}: a job spec must be a YAML mapping of keys to values, got an empty file'),
    Case("yaml_top_level_list", "- name: t\n", '{spec}: a job spec must be a YAML mapping of keys to values, got a YAML list'),
    Case("offload_on_cpu", edit("  precision: 32-true", "  precision: 32-true\n  strategy: deepspeed\n  zero_stage: 2\n  offload_optimizer: true"), "{spec}: line 19: trainer.offload_optimizer moves state from GPUs to the CPU, and this job runs on CPU processes (resources.gpus_per_node is 0): remove it (DeepSpeed's CPU Adam it would need is not built here: DS_BUILD_OPS=0)"),
    Case("missing_file", None, 'job spec not found: {spec}'),
    # --- the runs root (from the environment) ---
    Case("runs_root_var_unset", BASE, "{spec}: profile 'scratch' runs_root '/scratch/$SCRATCH_GROUP/runs' uses $SCRATCH_GROUP, which is not set (or empty) in this shell; set SCRATCH_GROUP, or set LMLAUNCH_RUNS_ROOT to the runs root to use", argv=["--cluster", "scratch"], environ={"LMLAUNCH_RUNS_ROOT": "", "LMLAUNCH_PROFILES_DIR": "{profiles}"}),
    Case("runs_root_newline", BASE, "{spec}: LMLAUNCH_RUNS_ROOT '/tmp/runs\\n#SBATCH --partition=high' contains '\\n', which SLURM cannot take in a #SBATCH --output path (no '%', backslash, line breaks or control characters); choose another directory", environ={"LMLAUNCH_RUNS_ROOT": "/tmp/runs\n#SBATCH --partition=high"}),
    Case("runs_root_percent", BASE, "{spec}: LMLAUNCH_RUNS_ROOT '/tmp/100%/runs' contains '%', which SLURM cannot take in a #SBATCH --output path (no '%', backslash, line breaks or control characters); choose another directory", environ={"LMLAUNCH_RUNS_ROOT": "/tmp/100%/runs"}),
    Case("runs_root_backslash", BASE, "{spec}: LMLAUNCH_RUNS_ROOT '/tmp/a\\\\b' contains '\\\\', which SLURM cannot take in a #SBATCH --output path (no '%', backslash, line breaks or control characters); choose another directory", command="submit", environ={"LMLAUNCH_RUNS_ROOT": "/tmp/a\\b"}, argv=["--dry-run"]),
    # --- containers: every string reaches the job script; what the runtimes use as separators is refused ---
    Case("container_image_with_shell", add("container:\n  runtime: podman\n  image: 'img;touch /tmp/x'\n"), "{spec}: container.image (line 19): 'img;touch /tmp/x' is not a container image: an image name, reference or file (letters, digits and _ . / : @ # + = ~ -), e.g. docker://nvcr.io/nvidia/pytorch:25.01-py3, /images/train.sif or localhost/train:1"),
    Case("container_mount_with_comma", add("container:\n  image: img\n  mounts: ['/a,/b:/c']\n"), "{spec}: container.mounts[0].path (line 19): '/a,/b:/c' is not a bind mount: SRC[:DST[:ro|rw]] with absolute paths holding no spaces, commas or colons"),
    Case("container_mount_relative", add("container:\n  image: img\n  mounts: [{path: data, why: x}]\n"), "{spec}: container.mounts[0].path (line 19): 'data' is not a bind mount: SRC[:DST[:ro|rw]] with absolute paths holding no spaces, commas or colons"),
    Case("container_flag_not_a_flag", add("container:\n  image: img\n  flags: ['rm -rf /']\n"), "{spec}: container.flags[0].flag (line 19): 'rm -rf /' is not a runtime flag: one argument starting with '-', e.g. --nv or --security-opt=label=disable"),
    Case("container_unknown_runtime", add("container:\n  runtime: docker\n  image: img\n"), "{spec}: container.runtime (line 18): Input should be 'pyxis', 'apptainer', 'podman' or 'none', got 'docker'"),
    Case("container_relative_workdir", add("container:\n  image: img\n  workdir: run\n"), "{spec}: container.workdir (line 19): 'run' is not an absolute path: the working directory inside the container"),
    Case("container_python_unbalanced_quote", add("container:\n  image: img\n  python: '\"python'\n"), "{spec}: container.python (line 19): '\"python' is not a command line (No closing quotation): e.g. python, /opt/conda/bin/python or auto"),
    Case("profile_python_unbalanced_quote", BASE, "{profiles}/badpython.yaml: python (line 6): python '\"/opt/py' is not a command line (No closing quotation)", argv=["--cluster", "badpython"], environ={"LMLAUNCH_PROFILES_DIR": "{profiles}"}),
    Case("container_without_image", add("container:\n  runtime: podman\n"), "{spec}: line 18: container.runtime(podman) has no image: set container.image in the spec or in profile 'local' (a reference such as docker://nvcr.io/nvidia/pytorch:25.01-py3, a file, or a local name)"),
]
