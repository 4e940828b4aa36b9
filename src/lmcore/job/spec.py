"""The job spec: one typed, strict source of truth for what a user may write in job.yaml.

Every field carries a docstring (it becomes the JSON Schema description and the reference
documentation). Unknown keys are rejected. Cross-field rules that need the cluster profile
(topology against the profile's GPUs, time against the partition) live in :mod:`lmcore.job.plan`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NamedTuple

from pydantic import AfterValidator, Field, field_validator, model_validator

from lmcore.job import site_options
from lmcore.job.container import ContainerSpec
from lmcore.job.model_config import check_model_config
from lmcore.job.model_types import causal_lm_types, composite_reason
from lmcore.job.network import Placement
from lmcore.job.parallelism import trainer_problem
from lmcore.job.strict_model import StrictModel
from lmcore.slurm.client import parse_duration
from lmcore.text_rules import (
    ENV_NAME,
    PATH,
    EnvName,
    EnvValue,
    HttpUrl,
    MemSize,
    OneLine,
    PathText,
    ProfileName,
    RunName,
    SlurmWord,
    WebhookUrl,
    brief,
    escape_controls,
)

SIGNAL_NAMES = ("USR1", "USR2", "TERM", "INT", "HUP", "URG", "XCPU")
# Signals that NCCL / the runtime may use themselves, so a warning signal must not be one.
# Matched with fullmatch (no '$' that also matches before a final newline); each part bounded.
def parse_slurm_time(value: str | int) -> int:
    """SLURM time string -> whole minutes (rounded up), as ``sbatch --time`` accepts it.

    Accepted: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError("time must be positive")
        if value > 9_999_999:
            raise ValueError(f"time {value} minutes is beyond any SLURM limit (at most 9999999)")
        return value
    text = str(value)
    seconds = parse_duration(text)
    if seconds is None:
        raise ValueError(
            f"{brief(text)} is not a SLURM time; use MM, HH:MM:SS, D-HH or D-HH:MM:SS"
        )
    if seconds <= 0:
        raise ValueError("time must be positive")
    return int(-(-seconds // 60))


def format_minutes(minutes: int) -> str:
    d, rem = divmod(minutes, 1440)
    h, m = divmod(rem, 60)
    return f"{d}-{h:02d}:{m:02d}:00" if d else f"{h:02d}:{m:02d}:00"


def mem_to_mb(value: str) -> int:
    """'64G' -> 65536 (SLURM's default unit is MB)."""
    unit = value[-1] if value[-1] in "KMGT" else "M"
    number = int(value[:-1] if value[-1] in "KMGT" else value)
    return {"K": number // 1024, "M": number, "G": number * 1024, "T": number * 1024 * 1024}[unit]




# Variables the launcher or the runtime owns: a job setting them would break the launch.
RESERVED_ENV = {
    "MASTER_ADDR": "lmtrain's rank 0 publishes its own address at every attempt",
    "MASTER_PORT": "lmtrain's rank 0 picks a free port on its node at every attempt",
    "WORLD_SIZE": "derived from the topology",
    "RANK": "set per task by SLURM/Lightning",
    "LOCAL_RANK": "set per task by SLURM/Lightning",
    "NODE_RANK": "set per task by SLURM/Lightning",
    "CUDA_VISIBLE_DEVICES": "SLURM binds GPUs; Lightning selects cuda:{local_rank}",
    "LMLAUNCH_RUN_DIR": "set by lmlaunch to the run directory",
}
RESERVED_ENV_PREFIXES = {
    "SLURM_": "SLURM_* variables belong to SLURM",
    "SBATCH_": "SBATCH_* variables belong to SLURM",
    "SRUN_": "SRUN_* variables belong to SLURM",
    "SUBMITIT_": "SUBMITIT_* variables belong to submitit",
    # the run directory, and the test harness's fault injection (lmtrain.faults): never a job's
    "LMLAUNCH_": "LMLAUNCH_* variables belong to lmlaunch",
    "LMTRAIN_": "LMTRAIN_* variables belong to lmlaunch's runtime",
}


def reserved_env_reason(name: str) -> str | None:
    """Why ``name`` may not be set by a job, or None when it may."""
    if name in RESERVED_ENV:
        return RESERVED_ENV[name]
    for prefix, reason in RESERVED_ENV_PREFIXES.items():
        if name.startswith(prefix):
            return reason
    return None


class Resources(StrictModel):
    """What to ask SLURM for; unset values come from the cluster profile."""

    nodes: int = Field(1, ge=1, le=4096)
    """Number of nodes the ranks run on."""
    spare_nodes: int = Field(0, ge=0, le=4096)
    """Nodes allocated beyond `nodes` and kept idle: when a node fails (SLURM sets it DOWN) or the rank that died first died on the same node twice, the ranks restart inside the same job without it and a spare takes its place (the same world size, nothing reshards). SLURM --nodes is nodes + spare_nodes, with --no-kill so that a failed node does not end the job. Needs preemption.restart_in_place."""
    gpus_per_node: int = Field(0, ge=0, le=64)
    """GPUs used on each node; one task per GPU, each bound to its own (the profile's gpu_bind). 0 runs on CPU (gloo) with tasks_per_node tasks; left out: every GPU of the profile's nodes (0 on a CPU cluster)."""
    tasks_per_node: int | None = Field(None, ge=1, le=256)
    """Tasks (ranks) per node for CPU jobs. For GPU jobs it is always gpus_per_node."""
    cpus_per_task: int | None = Field(None, ge=1, le=1024)
    """CPU cores per task; defaults to the profile's cpus_per_gpu (or 1 on CPU)."""
    mem: MemSize | None = None
    """Memory per node as SLURM writes it (e.g. 64G, 500M); defaults to the profile's mem_per_gpu x GPUs."""
    time: str | int = "01:00:00"
    """Wall-clock limit (HH:MM:SS, D-HH:MM:SS or minutes); at most the partition's max_time."""
    partition: SlurmWord | None = None
    """Partition by name; defaults to the partition of partition_kind in the profile."""
    partition_kind: Literal["default", "preemptible", "high_priority"] = "default"
    """Partition by role, portable across profiles: the profile's default, preemptible or high-priority partition."""
    account: SlurmWord | None = None
    """Account override (SLURM --account)."""
    qos: SlurmWord | None = None
    """QOS override (SLURM --qos)."""
    constraint: SlurmWord | None = None
    """Node feature constraint (SLURM --constraint), e.g. 'h100&ib'."""
    exclusive: bool | None = None
    """Whole nodes (SLURM --exclusive); defaults to the profile's choice."""
    placement: Placement = Field(default_factory=Placement)
    """Where the nodes sit in the cluster's network (the profile's network section): one leaf switch, one block, segments of N nodes each in one block. E.g. {within: switch, max_wait: "10:00"}, {within: block}, {segment: 2}, {within: auto}."""

    @field_validator("time", mode="before")
    @classmethod
    def _time(cls, v: Any) -> str:
        if isinstance(v, bool):
            raise ValueError("time must be a SLURM time string such as 04:00:00")
        parse_slurm_time(v)
        return str(v)

    @property
    def time_minutes(self) -> int:
        return parse_slurm_time(self.time)


_COMMON_TYPES = ("gpt2", "llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma2", "phi3", "gpt_neox", "opt")


class TensorSplit(NamedTuple):
    """How each model replica is split over ranks (trainer.tensor_parallel_size > 1): what the
    model check and the runtime need to know of the layout."""

    size: int
    sequence_parallel: bool


class ModelSpec(StrictModel):
    """The causal language model: a transformers type built from scratch, or a local directory."""

    type: str | None = None
    """A transformers model type (AutoConfig), initialised from scratch: gpt2, llama, mistral, ..."""
    pretrained: PathText | None = None
    """A local directory with a pretrained model (config.json + weights). Exclusive with type."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the model config (n_layer, hidden_size, vocab_size, ...)."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    compile: bool = False
    """Compile the model with torch.compile: each transformer block in place (parameter names
    unchanged), and the loss where one rank computes it over whole logits. Validation runs them
    eagerly, so nothing is compiled twice (no graph for no_grad beside the training one)."""
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    """Attention kernel: auto (sdpa where the architecture supports it, else eager); sdpa (PyTorch's scaled_dot_product_attention); eager; flash_attention_2. A kernel the architecture does not support is refused when the model is built."""

    @field_validator("config")
    @classmethod
    def _config(cls, v: dict[str, Any]) -> dict[str, Any]:
        check_model_config(v)
        return v

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.type is None) == (self.pretrained is None):
            raise ValueError("set exactly one of model.type or model.pretrained")
        known = causal_lm_types() if self.type is not None else frozenset()
        if self.type is not None and self.type not in known:
            from lmcore.errors import did_you_mean

            common = [t for t in _COMMON_TYPES if t in known]
            raise ValueError(
                f"model.type({self.type}) is not a transformers causal LM type"
                f"{did_you_mean(self.type, known)}; {len(known)} "
                f"types are known, e.g. {', '.join(common)}"
            )
        composite = composite_reason(self.type) if self.type is not None else None
        if composite is not None:
            raise ValueError(composite)
        return self


class DataSource(StrictModel):
    """One prepared store of a mixture, and its share of the samples."""

    path: PathText
    """Directory made by `lmlaunch data prepare`."""
    weight: float = Field(..., gt=0, le=1e6)
    """Relative share of the training samples (weights are normalised over the sources)."""


class DataSpec(StrictModel):
    """Tokenized training data and how it is batched."""

    path: PathText | None = None
    """Directory made by `lmlaunch data prepare` (a sharded token store: meta.json + shards/). Set this or sources."""
    sources: list[DataSource] | None = Field(None, min_length=1, max_length=64)
    """A mixture of prepared stores, each with a weight: the samples of each training epoch of the mixture come from each store in proportion to its weight (a small store is repeated, a large one subsampled), in an order fixed by trainer.seed. Set this or path."""
    seq_len: int = Field(..., ge=8, le=1_048_576)
    """Tokens per sample."""
    micro_batch_size: int = Field(..., ge=1, le=65536)
    """Samples per device per forward/backward."""
    num_workers: int = Field(2, ge=0, le=64)
    """DataLoader worker processes per task."""
    val_fraction: float = Field(0.01, ge=0.0, lt=0.5)
    """Fraction of samples held out for validation."""

    @model_validator(mode="after")
    def _one_kind(self) -> DataSpec:
        if (self.path is None) == (self.sources is None):
            raise ValueError("set exactly one of data.path (one prepared store) or data.sources (a weighted mixture)")
        if self.sources is not None:
            paths = [src.path for src in self.sources]
            twice = sorted({p for p in paths if paths.count(p) > 1})
            if twice:
                raise ValueError(f"data.sources lists {', '.join(twice)} more than once: give each store once, "
                                 f"with the sum of its weights")
        return self

    @property
    def stores(self) -> list[DataSource]:
        """The prepared stores the run reads, with their weights (one store: weight 1)."""
        if self.sources is not None:
            return list(self.sources)
        assert self.path is not None
        return [DataSource(path=self.path, weight=1.0)]


class TrainerSpec(StrictModel):
    """Lightning Trainer settings; gradient accumulation is derived from global_batch_size."""

    strategy: Literal["ddp", "fsdp", "deepspeed"] = "ddp"  # lmcore.job.parallelism.DataParallel
    """Distributed strategy, on GPUs and on CPU processes alike: ddp; fsdp (FSDP2, each transformer block sharded, DCP checkpoints); deepspeed (ZeRO stage zero_stage; its CPU accelerator on CPU jobs)."""
    zero_stage: Literal[1, 2, 3] | None = None
    """DeepSpeed ZeRO stage (strategy deepspeed only)."""
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    """Tensor-parallel ranks per model replica (strategy fsdp only): each block's matmuls are split over this many ranks of one node (the architecture's transformers TP plan), FSDP2 shards over the rest; data-parallel size = world size / tensor_parallel_size."""
    sequence_parallel: bool = False
    """Keep the residual stream split along the sequence between the tensor-parallel matmuls (norms run on each rank's slice; needs tensor_parallel_size > 1)."""
    pipeline_parallel_size: int = Field(1, ge=1, le=64)
    """Pipeline stages per model replica (strategy fsdp): the model's blocks are split into this many stages on as many ranks (embedding with the first, norm and head with the last; a head tied to the embedding on both, its gradients summed), run by torch.distributed.pipelining; any decoder-only architecture whose blocks form one list; world size = data_parallel x tensor_parallel_size x pipeline_parallel_size."""
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble"] = "1f1b"
    """How the stages take turns (pipeline_parallel_size > 1): gpipe and 1f1b (one stage a rank, bubble (p-1)/m), interleaved_1f1b (two stages a rank, bubble (p-1)/2m), interleaved_zero_bubble (two stages a rank, backward split in two, bubble close to 0)."""
    pipeline_microbatches: int | None = Field(None, ge=1, le=65536)
    """Microbatches per step and replica (pipeline_parallel_size > 1); null: global_batch_size / (data_parallel x data.micro_batch_size). Set, it decides the microbatch size instead of data.micro_batch_size. More microbatches, a smaller bubble."""
    pipeline_split: list[int] | None = None
    """Decoder layers per stage, first stage first (null: balanced by parameter count, the embedding counted on the first stage and the head on the last)."""
    offload_optimizer: bool = False
    """Offload optimizer state to CPU (DeepSpeed ZeRO stage >= 2)."""
    offload_params: bool = False
    """Offload parameters to CPU (DeepSpeed ZeRO stage 3)."""
    precision: Literal["bf16-mixed", "16-mixed", "32-true"] = "bf16-mixed"
    """Numeric precision (Lightning names). CPU runs use bf16-mixed or 32-true."""
    global_batch_size: int = Field(..., ge=1, le=1 << 24)
    """Samples per optimizer step over all ranks; accumulation is derived from it."""
    max_steps: int = Field(..., ge=1, le=10**10)
    """Optimizer steps to train."""
    gradient_clip_val: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this value (null: no clipping)."""
    val_check_interval: int | None = Field(None, ge=1, le=10**10)
    """Validate every N optimizer steps (null: only at the end)."""
    limit_val_batches: int = Field(20, ge=0, le=10**9)
    """Validation batches per validation run."""
    log_every_n_steps: int = Field(10, ge=1, le=10**9)
    """Log metrics every N optimizer steps (logging syncs the host)."""
    seed: int = Field(1234, ge=0, le=2**32 - 1)
    """Seed for model init, data order and dropout (0 to 2**32-1, what numpy accepts)."""

    @model_validator(mode="after")
    def _parallelism(self) -> TrainerSpec:
        problem = trainer_problem(self.strategy, self.zero_stage, self.tensor_parallel_size, self.sequence_parallel,
                                  self.offload_optimizer, self.offload_params, self.pipeline_parallel_size,
                                  self.pipeline_split, self.pipeline_microbatches)
        if problem:
            raise ValueError(problem)
        return self


class OptimSpec(StrictModel):
    """AdamW and the learning-rate schedule."""

    lr: float = Field(3e-4, gt=0, lt=1)
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    weight_decay: float = Field(0.1, ge=0)
    """Decoupled weight decay (not applied to norms and biases)."""
    warmup_steps: int = Field(0, ge=0, le=10**10)
    """Linear warmup steps."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Learning-rate schedule after warmup."""
    min_lr: float = Field(0.0, ge=0)
    """Final learning rate of cosine/linear decay."""

    @field_validator("betas", mode="before")
    @classmethod
    def _betas_list(cls, v: Any) -> Any:
        # YAML has lists, not tuples.
        if isinstance(v, list):
            if len(v) != 2:
                raise ValueError(f"betas must be two numbers [beta1, beta2], got {len(v)}")
            return tuple(v)
        return v

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"betas {list(v)} must each be in [0, 1)")
        return v

    @model_validator(mode="after")
    def _min_lr(self) -> OptimSpec:
        if self.min_lr > self.lr:
            raise ValueError(f"optim.min_lr({self.min_lr}) is above optim.lr({self.lr})")
        return self


def _checkpoint_location(value: str) -> str:
    """A filesystem path, or ``s3://BUCKET/PREFIX``: checkpoints kept in a bucket (lmcore.objects)."""
    if value.strip().lower().startswith("s3://"):
        from lmcore.errors import UserError
        from lmcore.objects.checkpoints import S3Url

        try:
            return str(S3Url.parse(value))
        except UserError as exc:
            raise ValueError(str(exc)) from None
    return PATH.check(value)


class CheckpointSpec(StrictModel):
    """Where and how often complete checkpoints are written."""

    dir: Annotated[str, AfterValidator(_checkpoint_location)] | None = None
    """Checkpoint directory; defaults to <run dir>/checkpoints. ``s3://BUCKET/PREFIX``: complete checkpoints are
    also kept in that bucket (the profile's object_store_credentials names its credentials file): each is written to
    <run dir>/checkpoints as always, then uploaded in the background, and an attempt that finds a newer one in
    the bucket than on its disk downloads it first (another cluster, a node-local disk); keep_last applies to both."""
    every_n_steps: int = Field(100, ge=1, le=10**10)
    """Periodic checkpoint, the fallback when no warning signal comes."""
    keep_last: int = Field(3, ge=1, le=10_000)
    """Complete checkpoints to keep."""
    async_save: bool = True
    """Periodic checkpoints and the stop's checkpoint staged (every strategy): training waits only
    while the state is copied into host memory (one more copy of it in RAM, reserved at the
    attempt's first step: DDP's whole state on rank 0, each rank's own shards for DeepSpeed and
    FSDP; the plan's host memory line counts it); the writes and COMPLETE follow on a thread per
    writing rank (every rank writes its shards in parallel), at most one save in flight. At a stop
    the attempt ends, and requeues, only once that checkpoint is durable. The final checkpoint of
    a finished run is synchronous; false: every checkpoint is."""

    @property
    def store(self) -> str | None:
        """The bucket's location (``s3://...``) when the checkpoints are kept in one."""
        return self.dir if self.dir is not None and self.dir.startswith("s3://") else None

    @property
    def local_dir(self) -> str | None:
        """The directory the spec names (None: the run directory's, also for a bucket)."""
        return None if self.store is not None else self.dir


class PreemptionSpec(StrictModel):
    """The time-limit warning signal and how often the job may requeue itself."""

    signal: Literal["USR1", "USR2", "URG", "XCPU", "HUP"] = "USR2"
    """Warning signal SLURM sends before the time limit (--signal). USR1 may clash with NCCL."""
    warning_seconds: int = Field(120, ge=10, le=65535)
    """Seconds before the time limit that the warning signal is sent (it may come 60 s early)."""
    max_requeues: int = Field(20, ge=0, le=100_000)
    """Requeues allowed in total (preemptions + timeouts + node failures)."""
    max_timeouts: int = Field(10, ge=0, le=100_000)
    """Requeues after reaching the time limit."""
    max_crash_retries: int = Field(2, ge=0, le=100_000)
    """Retries after a crash or a hang (non-zero exit with no signal): in place where restart_in_place allows, else requeues."""
    restart_in_place: bool = True
    """Retry a crash or a hang inside the same allocation: the batch script starts the ranks again within seconds, from the newest complete checkpoint, with the same job id and no queue wait; a requeue instead when the allocation's time left is too short, when the rank that died first died on the same node in the attempt before, or when SLURM itself requeues the job (a node failure)."""
    warm_restart: bool = True
    """With restart_in_place: each task's process stays as a small agent that imported the frameworks once and forks the training process; when rank 0 decides a restart in place, the agents fork it again inside the same srun step (no new srun, no imports: seconds faster). A restart that leaves a node out, or that follows a rank 0 killed before it decided, is a new srun. Memory: one more process per rank holding the imported frameworks (a few hundred MB, shared with the training process until it writes them)."""
    no_progress_attempts: int = Field(3, ge=1, le=100_000)
    """Stop when the global step did not advance over this many attempts."""
    agree_every_n_steps: int = Field(1, ge=1, le=10_000)
    """How often the ranks agree whether to stop (one all-reduce of 4 numbers on a CPU process
    group): every step stops at the first step boundary after the signal; K stops up to K-1 steps
    later (those steps must fit in the warning time / GraceTime) for 1/K of the per-step cost."""


class WatchdogSpec(StrictModel):
    """Hang detection: a timeout on every collective, and a watchdog on each rank's progress."""

    collective_timeout_s: int = Field(1800, ge=10, le=86400)
    """Seconds any collective may wait for its peers (the process group's timeout, gloo and NCCL);
    on GPUs TORCH_NCCL_ASYNC_ERROR_HANDLING=3 tears the process down when it expires. Must cover
    the longest legitimate wait, e.g. rank 0 writing a DDP checkpoint while the others wait."""
    hang_timeout_s: int | None = Field(1200, ge=5, le=86400)
    """A rank that makes no progress (no training or validation batch, no checkpoint write) for this
    many seconds writes the stacks of all its threads to logs/attempt-<N>/stacks-rank-<R>.txt and
    exits with code 124; the attempts ledger says `hang`. A training process stopped (SIGSTOP) for
    this long plus exit_grace_s, whose own watchdog is stopped with it, is killed by its task's
    agent (with the warm restart). null turns the watchdog off."""
    exit_grace_s: int = Field(15, ge=1, le=600)
    """When a C call holds the interpreter so the watchdog thread cannot run, a C-level timer dumps
    the stacks and ends the process this many seconds after hang_timeout_s."""


class StragglerSpec(StrictModel):
    """A rank slower than its peers, or than itself, named while the job runs (lmtrain.health.stragglers)."""

    enabled: bool = True
    """Score the ranks' step timing (each rank appends to its node's logs/attempt-<N>/timing-node-<N>.jsonl at its
    logging steps either way; rank 0 scores them in the background)."""
    threshold: float = Field(1.5, gt=1.0, le=100.0)
    """A rank is slow when its compute time per step is above this factor of the ranks' median
    (or of its own median over the attempt's earlier intervals)."""
    window: int = Field(3, ge=1, le=1000)
    """... for this many scored intervals in a row (and no longer slow once one is below it)."""
    min_interval_s: float = Field(10.0, ge=0.0, le=3600.0)
    """A scored interval spans at least this many seconds: consecutive logging intervals are summed
    until they do, so a blip (a rank descheduled for a moment) is not a straggler."""
    action: Literal["warn", "exclude"] = "warn"
    """warn: the ledger, the rank log, `status` and the webhooks name the rank and its node.
    exclude: also stop at the next step boundary with a checkpoint and restart the ranks in place
    without that node, a spare node taking its place (needs resources.spare_nodes; once per node,
    never below the job's node count: with no spare idle the slow node stays and is only named)."""


class HealthSpec(StrictModel):
    """Detectors that watch the running ranks (beside the hang watchdog)."""

    stragglers: StragglerSpec = Field(default_factory=StragglerSpec)
    """Slow ranks: per-rank step timing scored against the median and each rank's own history."""


class ProfileSpec(StrictModel):
    """torch.profiler over a window of steps (the same as `lmlaunch profile` asks of a running job)."""

    start_step: int = Field(ge=0, le=10**9)
    """Profile from the first logging step at or after this global step."""
    steps: int = Field(3, ge=1, le=1000)
    """How many optimizer steps."""
    ranks: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1, max_length=4096)
    """Which global ranks (null: every rank)."""


class SimulateSpec(StrictModel):
    """The scale harness (docs/scale.md): every rank runs lmlaunch's per-rank machinery (task record,
    start gate, rendezvous, rank log, ledger, timing lines, straggler watch, profile poll, stop
    agreement, checkpoint of tiny shards, requeue, restart in place) around a model that imports no
    torch and does no arithmetic: hundreds of ranks fit on a few cores."""

    step_s: float = Field(0.02, ge=0.0, le=60.0)
    """Seconds each simulated optimizer step takes (a sleep)."""
    shard_bytes: int = Field(4096, ge=1, le=64 * 1024 * 1024)
    """Bytes of each rank's checkpoint shard."""
    counts_dir: PathText | None = None
    """Where each rank's process writes what it did to the run directory, by phase (bench/scale.py): an absolute path outside the run directory. null: not counted."""

    @field_validator("counts_dir")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError(f"{v!r} is relative: give an absolute directory (the ranks run elsewhere)")
        return v


def _check_env_name(name: str, where: str) -> None:
    try:
        ENV_NAME.check(name)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    reason = reserved_env_reason(name)
    if reason:
        raise ValueError(f"{where}: {name} may not be set by a job: {reason}")


class EnvSpec(StrictModel):
    """Environment of every task: plain variables, and secrets passed by name only."""

    vars: dict[str, EnvValue] = Field(default_factory=dict, max_length=1000)
    """Extra environment variables for every task (overriding the profile's)."""
    passthrough: list[str] = Field(default_factory=list, max_length=1000)
    """Names of variables (secrets) taken from the submitting shell; never written anywhere."""

    @field_validator("vars", mode="before")
    @classmethod
    def _numbers_as_text(cls, v: Any) -> Any:
        # `OMP_NUM_THREADS: 4` means the text "4"; a YAML boolean is ambiguous (True? 1? yes?).
        if not isinstance(v, dict):
            return v
        out = {}
        for name, value in v.items():
            if isinstance(value, bool):
                raise ValueError(
                    f"env.vars.{escape_controls(str(name)[:64])}: {value!r} is a YAML boolean; quote the text you mean, e.g. \"1\" or \"true\""
                )
            out[name] = str(value) if isinstance(value, (int, float)) else value
        return out

    @field_validator("vars")
    @classmethod
    def _names(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            _check_env_name(name, "env.vars")
        return v

    @field_validator("passthrough")
    @classmethod
    def _pass(cls, v: list[str]) -> list[str]:
        for name in v:
            _check_env_name(name, "env.passthrough")
        dupes = sorted({n for n in v if v.count(n) > 1})
        if dupes:
            raise ValueError(f"env.passthrough names {', '.join(dupes)} more than once")
        return v

    @model_validator(mode="after")
    def _disjoint(self) -> EnvSpec:
        both = sorted(set(self.vars) & set(self.passthrough))
        if both:
            raise ValueError(
                f"{', '.join(both)} in both env.vars and env.passthrough: a secret is passed by name only"
            )
        return self


class WandbSpec(StrictModel):
    """Weights & Biases logging."""

    project: OneLine
    """W&B project."""
    entity: OneLine | None = None
    """W&B entity (team)."""
    mode: Literal["online", "offline"] = "online"
    """offline writes locally and syncs later."""


class PushgatewaySpec(StrictModel):
    """Rank 0 pushes the run's training metrics to a Prometheus Pushgateway, for sites whose
    Prometheus cannot scrape the login node (`lmlaunch metrics serve` is the other way)."""

    url: HttpUrl
    """The Pushgateway, e.g. http://pushgateway.example:9091 (metrics go to its /metrics/job/lmlaunch/run/<name>)."""
    every_n_steps: int = Field(10, ge=1, le=1_000_000)
    """Push at the first logging step N optimizer steps after the last push (and the last step), in
    the background, never slowing a step."""


class LoggingSpec(StrictModel):
    """Metric loggers."""

    tensorboard: bool = True
    """TensorBoard logs in <run dir>/tensorboard."""
    csv: bool = True
    """CSV metrics in <run dir>/csv."""
    wandb: WandbSpec | None = None
    """Weights & Biases; the key comes by env.passthrough: [WANDB_API_KEY]."""
    heartbeat_every_n_steps: int = Field(1, ge=1)
    """Write the JSON-lines heartbeat the monitor reads every N steps."""
    pushgateway: PushgatewaySpec | None = None
    """Push the training metrics to a Prometheus Pushgateway (rank 0, in the background)."""


NotifyEvent = Literal["started", "preempted", "requeued", "hang", "straggler", "failed", "completed"]
NOTIFY_EVENTS: tuple[NotifyEvent, ...] = ("started", "preempted", "requeued", "hang", "straggler", "failed", "completed")


class Webhook(StrictModel):
    """One webhook (Slack-compatible: a JSON body with "text"). Give the URL, or, when the URL is a
    secret, the name of the variable holding it (it must be in env.passthrough)."""

    url: WebhookUrl | None = None
    """The URL itself (it is written into plan.json)."""
    url_env: EnvName | None = None
    """The name of the environment variable that holds the URL (a secret: passed by name)."""

    @model_validator(mode="after")
    def _one(self) -> Webhook:
        if (self.url is None) == (self.url_env is None):
            raise ValueError("a webhook gives exactly one of url and url_env")
        return self


SHIPPED_EVAL_TASKS = ("lmlaunch_pydoc_choice", "lmlaunch_pydoc_perplexity")


class EvalAlongside(StrictModel):
    """An evaluator beside the training: the second component of one SLURM heterogeneous job
    (started, preempted and requeued with the trainer), scoring the run's checkpoints with
    lm-evaluation-harness as they complete (lmtrain.evaluator). Needs the ``eval`` extra
    (``pip install 'lmlaunch[eval]'``: lm-eval) where the tasks run."""

    tasks: list[SlurmWord] = Field(default_factory=lambda: list(SHIPPED_EVAL_TASKS), min_length=1, max_length=64)
    """lm-eval task (or group or tag) names: the shipped local tasks (lmlaunch_pydoc_choice: multiple
    choice, lmlaunch_pydoc_perplexity: held-out perplexity), lm-eval's own, or those of ``task_dirs``.
    Nothing is downloaded at run time: a task whose data is not on disk fails there."""
    task_dirs: list[PathText] = Field(default_factory=list, max_length=16)
    """Directories of lm-eval task YAML files (lm-eval's ``include_path``), relative to the spec file."""
    every_n_steps: int | None = Field(None, ge=1)
    """Score the checkpoints whose step is a multiple of this (and the run's last); null: every checkpoint."""
    behind: Literal["all", "newest"] = "all"
    """When checkpoints complete faster than they are scored: ``all`` scores each in step order (and
    retention keeps a checkpoint until it is scored); ``newest`` skips to the newest unscored one."""
    limit: int | None = Field(None, ge=1)
    """At most this many examples per task (lm-eval's ``limit``); null: all of them."""
    batch_size: int = Field(8, ge=1, le=4096)
    """lm-eval's batch size."""
    nodes: int = Field(1, ge=1, le=1)
    """Nodes of the evaluator's component (one: lm-eval's model runs in one process)."""
    gpus_per_node: int | None = Field(None, ge=0, le=64)
    """GPUs of the evaluator; null: one where the trainer has GPUs, else none. More than one shard the
    model over them (lm-eval's ``parallelize``)."""
    cpus_per_task: int | None = Field(None, ge=1, le=1024)
    """CPU cores of the evaluator; null: the trainer's cpus_per_task."""
    mem: MemSize | None = None
    """Memory of the evaluator's node as SLURM writes it; null: the partition's default."""
    partition: SlurmWord | None = None
    """The evaluator's partition; null: the trainer's."""
    finish_wait_s: int = Field(600, ge=0, le=86_400)
    """After the training ends, how long the job waits for the evaluator to score what is left."""


class EvalSpec(StrictModel):
    """Evaluation: of one checkpoint instead of training (``checkpoint``: the model's loss and
    perplexity on the data's validation split, in the run's ledger), or of every checkpoint while
    the run trains (``alongside``: lm-evaluation-harness tasks, in the run's ``eval/scores.jsonl``).
    Status and history show both."""

    checkpoint: PathText | None = None
    """A checkpoint step directory, or a run directory: its newest complete checkpoint when the
    evaluation starts (a pipeline's ``${train.checkpoint}``). The job then evaluates instead of training."""
    max_batches: int = Field(50, ge=1, le=10_000_000)
    """Validation micro batches to evaluate (fewer when the split has fewer)."""
    alongside: EvalAlongside | None = None
    """Score the run's checkpoints with lm-evaluation-harness while it trains, in the same allocation."""

    @model_validator(mode="after")
    def _one_kind(self) -> EvalSpec:
        if (self.checkpoint is None) == (self.alongside is None):
            raise ValueError("eval gives exactly one of checkpoint (evaluate instead of training) and alongside "
                             "(score the checkpoints while training)")
        return self


class NotifySpec(StrictModel):
    """Messages about the run to webhooks, sent by rank 0 in the background: an unreachable
    webhook never slows or stops training."""

    webhooks: list[Webhook] = Field(default_factory=list, max_length=16)
    """Where to send."""
    events: list[NotifyEvent] = Field(default_factory=lambda: list(NOTIFY_EVENTS))
    """Which events: started, preempted, requeued, hang, straggler (a slow rank found, or no longer
    slow), failed (with the last lines of the failing rank's log), completed (with the final loss
    and goodput)."""
    timeout_s: float = Field(5.0, gt=0, le=60)
    """Each attempt to deliver gives up after this long."""
    retries: int = Field(2, ge=0, le=10)
    """Further attempts after a failed delivery (1 s, 2 s, 4 s ... apart)."""


class MoveSpec(StrictModel):
    """When a run over several clusters (clusters) moves its next attempt to another of them: a
    watcher on this machine (`lmlaunch move RUN --watch`, started by submit) holds and cancels the
    queued job where it waits, and submits the run where it starts sooner, from its newest complete
    checkpoint. Only a queued job moves: a running one is never stopped for it."""

    after: str | None = None
    """A queued attempt that has waited this long (a SLURM time: MM:SS, HH:MM:SS, D-HH) moves to the cluster where it would start sooner; null: never for waiting alone."""
    on_preemption: bool = True
    """A preempted attempt's next one goes to the cluster where it would start soonest (not back into the queue it was preempted from when another starts sooner)."""
    poll_s: int = Field(30, ge=1, le=3600)
    """How often the watcher asks the run's cluster about its job (and, when a move may be due, every cluster when it would start)."""

    @field_validator("after", mode="before")
    @classmethod
    def _after(cls, v: Any) -> str | None:
        if v is None:
            return None
        if isinstance(v, bool) or parse_duration(str(v)) is None or (parse_duration(str(v)) or 0) <= 0:
            raise ValueError(f"{brief(str(v))} is not a SLURM time; use MM:SS, HH:MM:SS or D-HH (e.g. 30:00)")
        return str(v)

    @property
    def after_s(self) -> float | None:
        return parse_duration(self.after) if self.after is not None else None


class SlurmOptions(StrictModel):
    """sbatch and srun options of this job that lmlaunch does not plan itself, over the profile's."""

    sbatch: site_options.SpecSbatch = Field(default_factory=dict, max_length=200)
    """sbatch options by long name without dashes, e.g. {reservation: r1, hint: nomultithread, mail-type: END}; true for a flag, null to drop the profile's."""
    srun: site_options.SpecSrun = Field(default_factory=dict, max_length=200)
    """srun options of the tasks' step, e.g. {mpi: pmix}; true for a flag, null to drop the profile's."""


class JobSpec(StrictModel):
    """A training job: what to train, on what data, with which resources and cluster."""

    name: RunName
    """Run name: the SLURM job name and the run directory name (letters, digits, . _ -)."""
    cluster: ProfileName = "local"
    """Cluster profile name (a file in cluster_profiles/)."""
    clusters: list[ProfileName] | None = Field(None, min_length=2, max_length=16)
    """Several cluster profiles instead of one (cluster is then ignored): the run is submitted to the one where it would start soonest (each asked with sbatch --test-only), and each must be able to run it. E.g. [uni, centre]."""
    move: MoveSpec | None = None
    """With clusters: when a queued attempt moves to another of them (after waiting, after a preemption); null: a run stays where it was placed."""
    resources: Resources = Field(default_factory=Resources)
    """Nodes, GPUs, CPUs, memory, time and partition."""
    model: ModelSpec
    """The causal language model."""
    data: DataSpec
    """Tokenized training data."""
    trainer: TrainerSpec
    """Strategy, precision, batch and steps."""
    optim: OptimSpec = Field(default_factory=OptimSpec)
    """Optimizer and learning-rate schedule."""
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    """Checkpoint location, frequency and retention."""
    preemption: PreemptionSpec = Field(default_factory=PreemptionSpec)
    """Warning signal and requeue limits."""
    watchdog: WatchdogSpec = Field(default_factory=WatchdogSpec)
    """Collective timeout and the hang watchdog."""
    health: HealthSpec = Field(default_factory=HealthSpec)
    """Slow ranks (stragglers): how much slower, for how long, and what to do about it."""
    profile: ProfileSpec | None = None
    """torch.profiler traces and top operators per rank for a window of steps (logs/attempt-<N>/profile-*)."""
    env: EnvSpec = Field(default_factory=EnvSpec)
    """Extra environment and secrets passed by name."""
    logging: LoggingSpec = Field(default_factory=LoggingSpec)
    """Loggers and heartbeat."""
    notify: NotifySpec = Field(default_factory=NotifySpec)
    """Webhook messages: started, preempted, requeued, hang, failed, completed."""
    eval: EvalSpec | None = None
    """Evaluate a checkpoint (on rank 0) instead of training, or score every checkpoint alongside the training."""
    simulate: SimulateSpec | None = None
    """Run the scale harness instead of training: ranks without torch (docs/scale.md); the model is only planned."""
    slurm: SlurmOptions = Field(default_factory=SlurmOptions)
    """Site sbatch/srun options (reservation, hint, mail-type, mpi, ...) over the profile's."""
    container: ContainerSpec | None = None
    """Run the tasks in a container (pyxis, apptainer, podman): its keys over the profile's container section."""

    @model_validator(mode="after")
    def _cross(self) -> JobSpec:
        if self.simulate is not None and self.eval is not None and self.eval.checkpoint is not None:
            raise ValueError("simulate: the scale harness trains no model, so it has no checkpoint to evaluate; remove eval or simulate")
        if self.move is not None and self.clusters is None:
            raise ValueError("move: a run moves between the clusters it names; give clusters: [a, b] (or remove move)")
        if self.clusters is not None:
            twice = sorted({c for c in self.clusters if self.clusters.count(c) > 1})
            if twice:
                raise ValueError(f"clusters: {', '.join(twice)} named twice; each cluster once")
        missing = [w.url_env for w in self.notify.webhooks if w.url_env and w.url_env not in self.env.passthrough]
        if missing:
            raise ValueError(
                f"notify.webhooks: url_env {', '.join(missing)} must also be in env.passthrough (that is how its "
                f"value reaches the tasks without being written anywhere)"
            )
        if self.resources.partition is not None and self.resources.partition_kind != "default":
            raise ValueError(
                f"resources.partition({self.resources.partition}) and "
                f"resources.partition_kind({self.resources.partition_kind}) both pick a partition; set one"
            )
        if self.preemption.warning_seconds >= self.resources.time_minutes * 60:
            raise ValueError(
                f"preemption.warning_seconds({self.preemption.warning_seconds}) is not shorter than "
                f"resources.time({self.resources.time}) = {self.resources.time_minutes * 60} s"
            )
        if self.profile is not None and self.profile.ranks and max(self.profile.ranks) >= self.world_size:
            raise ValueError(
                f"profile.ranks({max(self.profile.ranks)}) is not a rank of this job: its ranks are 0.."
                f"{self.world_size - 1} (nodes x tasks_per_node)"
            )
        r = self.resources
        if r.spare_nodes and not self.preemption.restart_in_place:
            raise ValueError(
                f"resources.spare_nodes({r.spare_nodes}) needs preemption.restart_in_place: true (a spare takes a "
                f"failed node's place when the ranks restart inside the job)"
            )
        if r.nodes + r.spare_nodes > 4096:
            raise ValueError(f"resources.nodes({r.nodes}) + resources.spare_nodes({r.spare_nodes}) = "
                             f"{r.nodes + r.spare_nodes} nodes, above SLURM's 4096 this tool plans for")
        if self.health.stragglers.action == "exclude" and not r.spare_nodes:
            raise ValueError(
                "health.stragglers.action: exclude needs resources.spare_nodes >= 1: the slow node is left out "
                "of a restart in place and a spare takes its place (a running job cannot change its own "
                "ExcNodeList for a requeue)")
        if self.optim.warmup_steps > self.trainer.max_steps:
            raise ValueError(
                f"optim.warmup_steps({self.optim.warmup_steps}) is above trainer.max_steps({self.trainer.max_steps})"
            )
        return self

    # --- derived values ---------------------------------------------------------------
    @property
    def tasks_per_node(self) -> int:
        r = self.resources
        return r.gpus_per_node if r.gpus_per_node > 0 else (r.tasks_per_node or 1)

    @property
    def world_size(self) -> int:
        return self.resources.nodes * self.tasks_per_node
