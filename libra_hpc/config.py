"""The experiment schema: one YAML file describes one whole run.

Every section is a pydantic model with ``extra="forbid"`` and strict types, so a misspelled
key, a string where a number belongs, or an impossible cluster shape fails *before* anything
is submitted, with the dotted path of the field, what was given and what is allowed.
Field docstrings are the reference documentation (configs/README.md is generated from them
by libra_hpc/config_reference.py).

The simulator's scenarios (libra_hpc/sim/config.py) are this schema plus the simulator's own
sections, read by the same loader (:func:`load_config` with ``schema=SimConfig``) and
refused with the same error (:class:`ConfigError`). The systems half's sections
(``planner``, ``parallel``, ``scheduler``, ``tools``) are in libra_hpc/config_systems.py,
the learning half's (``rl``, ``tasks``, ``warmstart``) in libra_hpc/config_learning.py, the
cross-field checks in libra_hpc/config_checks.py and the strict YAML reader and section
base in libra_hpc/config_yaml.py; their names the rest of the code uses are importable
from here.

Nothing here reads the environment: the only inputs are the YAML file and ``--set``
overrides given on the command line.
"""

from __future__ import annotations

import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator

from libra_hpc.config_checks import check_common, check_layout, slurm_time_s
from libra_hpc.config_learning import RLConfig, TasksConfig, WarmStartConfig
from libra_hpc.config_systems import (  # the sections, and their parts the rest of the code imports from here
    ChaosConfig,
    LengthPrior,
    ParallelConfig,
    PlannerConfig,
    SchedulerConfig,
    ToolsConfig,
)
from libra_hpc.config_yaml import DuplicateKeyError, _Section, parse_yaml


class ClusterConfig(_Section):
    """Shape of the Slurm allocation and how to submit it."""

    nodes: int = Field(6, ge=1)
    """Number of nodes (Slurm ``--nodes``). Locally, the number of emulated nodes."""
    gpus_per_node: int = Field(2, ge=1, le=64)
    """GPU slots per node (``--gpus-per-node`` and ``--ntasks-per-node``). Locally, the
    number of CPU ranks that stand for one node's GPUs."""
    executor: Literal["auto", "slurm", "local"] = "auto"
    """``slurm`` submits with submitit; ``local`` runs the MPI world with mpiexec on this host;
    ``auto`` picks slurm when ``sbatch`` is on PATH and a controller answers, else local."""
    job_name: str = Field("libra", pattern=r"^[A-Za-z0-9_.-]+$")
    """Slurm job name (``%x``); the log folder is ``<logging.dir>/<job_name>-<job id>``."""
    partition: str | None = Field(None, min_length=1)
    """Slurm partition (``--partition``); null uses the cluster's default."""
    account: str | None = Field(None, min_length=1)
    """Slurm account to charge (``--account``); null: your default account."""
    qos: str | None = Field(None, min_length=1)
    """Slurm quality of service (``--qos``)."""
    constraint: str | None = Field(None, min_length=1)
    """Slurm node feature constraint (``--constraint``), e.g. ``a800``."""
    time_limit: str | int = "00:30:00"
    """Wall-clock limit: minutes as a number, or a Slurm time string ``MM``, ``MM:SS``,
    ``HH:MM:SS``, ``D-HH``, ``D-HH:MM`` or ``D-HH:MM:SS``."""
    cpus_per_task: int = Field(1, ge=1)
    """CPU cores Slurm reserves for each GPU-slot task (``--cpus-per-task``)."""
    signal_before_limit_s: int = Field(120, ge=0)
    """Seconds before the time limit at which Slurm signals the job (USR2), so it can
    checkpoint before it is killed."""
    requeue: bool = True
    """Let Slurm requeue the job after a node failure or preemption (``--requeue``), and
    requeue it after the time-limit warning (USR2) once its checkpoint is saved."""
    max_requeues: int = Field(3, ge=0)
    """Requeues the job asks for itself (after a checkpoint on USR2) before it gives up:
    Slurm's ``SLURM_RESTART_COUNT`` is compared with it, so that a job that fails the
    same way every time cannot loop."""
    hardware: str = Field("cpu", min_length=1)
    """GPU profile for the planner's cost models: a name under ``configs/hardware``
    (``a800-80g``, ``a100-80g``, ``h100-80g``, ``h200-141g``, ``cpu``) or a path."""
    torch_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Backend of the training ranks' torch world (the only torch world the job starts
    itself; a vLLM instance makes its own): ``auto`` is NCCL when CUDA is present, gloo
    otherwise."""

    @property
    def time_limit_minutes(self) -> int:
        """The time limit rounded up to whole minutes (what submitit takes)."""
        return max(1, -(-slurm_time_s(self.time_limit) // 60))  # type: ignore[operator]

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


TINY_DEFAULTS: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "torch_dtype": "float32",
}
"""Architecture of the tiny local model (``config.json`` keys; libra_hpc/engines/tiny.py builds it),
before the overrides of ``model.tiny``. Head size = hidden / heads = 32."""


def tiny_architecture(overrides: dict[str, Any]) -> dict[str, Any]:
    """The tiny model's architecture with ``overrides`` applied; raises ValueError naming an
    unknown key or a shape vLLM's CPU attention cannot run."""
    unknown = sorted(set(overrides) - set(TINY_DEFAULTS))
    if unknown:
        raise ValueError(f"tiny model: unknown override(s) {unknown}; valid keys: {sorted(TINY_DEFAULTS)}")
    arch = {**TINY_DEFAULTS, **overrides}
    heads, kv = arch["num_attention_heads"], arch["num_key_value_heads"]
    if arch["head_dim"] < 32 or arch["head_dim"] % 16 or heads % kv or heads * arch["head_dim"] != arch["hidden_size"]:
        raise ValueError(f"tiny model: head_dim={arch['head_dim']} must be >= 32 and a multiple of 16 "
                         f"(vLLM CPU attention) with num_attention_heads × head_dim = hidden_size "
                         f"({heads} × {arch['head_dim']} vs {arch['hidden_size']}), and num_attention_heads "
                         f"a multiple of num_key_value_heads={kv}")
    return arch


class ModelConfig(_Section):
    """The policy model."""

    name: str = "tiny"
    """Model profile of the planner's cost models and the simulator: a name under
    ``configs/models`` (``qwen3-14b``, ``qwen3-32b``, ``qwen3-4b``, ``qwen3-30b-a3b``,
    ``qwen2.5-7b``, ``tiny``) or a path; also the model's label in logs and reports.
    ``tiny`` is the small model built locally."""
    path: str | None = None
    """Directory of a Hugging Face checkpoint (``config.json``, ``*.safetensors``, tokenizer
    files); null: the tiny local model (``libra_hpc/engines/tiny.py``), built once under
    ``~/.cache/libra_hpc/tiny-<fingerprint>``. ``engines.resolve_model`` checks it and the
    engines load it."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter and activation dtype of both engines (vLLM rollout, Megatron training)."""
    tiny: dict[str, int | float] = {}
    """Architecture of the tiny model when ``path`` is null: overrides of its ``config.json``
    keys (``TINY_DEFAULTS`` in ``libra_hpc/config.py``: ``num_hidden_layers`` 2,
    ``hidden_size`` 128, ``intermediate_size`` 384, ``num_attention_heads`` 4,
    ``num_key_value_heads`` 2, ``head_dim`` 32, ``vocab_size`` 1024), e.g.
    ``{num_hidden_layers: 4}``. Each architecture is its own cached build."""

    @field_validator("tiny")
    @classmethod
    def _tiny_keys(cls, value: dict[str, int | float]) -> dict[str, int | float]:
        tiny_architecture(value)
        return value


class TrainingConfig(_Section):
    """Megatron-Core training side. TP×PP×DP GPU slots, placed from the first node on."""

    tensor_parallel: int = Field(1, ge=1)
    """Tensor-parallel size; a TP group never crosses a node, so it must divide
    ``cluster.gpus_per_node``."""
    pipeline_parallel: int = Field(1, ge=1)
    """Pipeline-parallel size (stages may span nodes)."""
    data_parallel: int = Field(1, ge=1)
    """Data-parallel replicas in the core training group (hybrid replicas come on top)."""
    micro_batch_size: int = Field(1, ge=1)
    """Sequences per micro-batch per DP replica (one forward/backward of the Megatron training engine)."""
    seq_len: int = Field(4096, ge=16)
    """Longest trajectory in tokens (prompt + every turn + tool outputs): the rollout
    context cap and the training sequence length (packed or padded). The planner's training
    cost and memory models and the simulator's workload use it. The global batch of a step
    is not set here: it is ``rl.prompts_per_step × rl.group_size`` sequences."""
    lr: float = Field(1e-5, ge=0)
    """Adam learning rate; 0 trains nothing (the control run of a learning experiment)."""
    grad_clip: float = Field(1.0, gt=0)
    """Largest global L2 norm of the gradients in a step; larger ones are scaled down to it
    (the Megatron optimizer's ``clip_grad``)."""
    ppo_clip: float = Field(0.2, gt=0, lt=1)
    """ε of the clipped policy-gradient surrogate: the importance ratio new/old policy of
    each token is clipped to [1-ε, 1+ε] (GRPO/PPO)."""
    distributed_optimizer: bool = False
    """Shard the Adam moments and fp32 main weights over the data-parallel replicas
    (megatron's distributed optimizer): optimizer memory per GPU divided by DP, same
    steps."""


class RolloutConfig(_Section):
    """vLLM rollout side: every GPU slot not used by training."""

    tp_per_node: list[int] | list[list[int]] = Field(default_factory=lambda: [[1, 1], [2]])
    """TP sizes of the rollout instances on a rollout node, e.g. ``[1, 1, 2, 4]`` on an
    8-GPU node, or a list of such patterns used by the rollout nodes in turn
    (``[[1, 1], [2]]``: odd rollout nodes two TP-1 instances, even ones one TP-2). Each
    pattern sums to ``cluster.gpus_per_node``. Slots of a node that training only partly
    fills become TP-1 instances."""

    @property
    def node_patterns(self) -> list[list[int]]:
        """``tp_per_node`` as a list of per-node patterns."""
        if self.tp_per_node and isinstance(self.tp_per_node[0], list):
            return self.tp_per_node  # type: ignore[return-value]
        return [self.tp_per_node]  # type: ignore[list-item]
    max_new_tokens: int = Field(256, ge=1)
    """Generation cap per turn, in tokens."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature."""
    kv_cache_gib: float = Field(0.25, gt=0)
    """KV cache of a rollout instance per GPU slot (per TP rank), in GiB: a fixed size, not a
    share of memory, so instances sharing a machine do not compete for it. The tiny model
    keeps 1 KiB per token in fp32, so 0.25 GiB holds 256k tokens; on GPUs set it to what
    the slot has left after the weights."""


class LoggingConfig(_Section):
    """Where and how much the run writes."""

    dir: str = "logs"
    """Root of the log folders (relative paths are taken from the submit directory)."""
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Python logging level of every rank."""
    tensorboard: bool = False
    """Also write each step's metrics as TensorBoard scalars (``tensorboard --logdir`` on the
    log folder; written without the tensorboard package, libra_hpc/metrics/tensorboard.py)."""


class JobConfig(_Section):
    """What the submitted job does (``libra_hpc/runtime/``)."""

    mode: Literal["rl", "check"] = "rl"
    """``rl``: the training job (warm start, held-out evaluation, asynchronous GRPO with the
    C-MLFQ queue and the tool pool, final evaluation, exported checkpoint). ``check``: only
    the cluster check (each group's collectives, the layouts of the scripted hybrid-pool
    steps ``planner.borrow_at_step``/``return_at_step``, a test hook): see the MPI world
    and the torch worlds work before a long run."""
    warmstart: bool = True
    """Start from the task's warm start (``warmstart`` section; built once and cached) instead
    of the model as it is."""
    eval_prompts: int = Field(200, ge=0)
    """Held-out prompts scored greedily before and after training (the same prompts)."""
    eval_checkpoint: str | None = None
    """Evaluation only: score this Hugging Face checkpoint directory on the held-out prompts
    and stop (``launch.py --eval DIR``)."""
    export: bool = True
    """Write the trained policy as a Hugging Face checkpoint in the log folder (``checkpoint/``)."""
    cache_dir: str | None = None
    """Where built models and warm starts are cached (default ``~/.cache/libra_hpc``)."""
    torch_threads: int = Field(1, ge=1)
    """Torch intra-op threads per training rank (and for the warm-start build on rank 0)."""
    checkpoint_every_steps: int = Field(5, ge=0)
    """Save the job's checkpoint (``<log folder>/checkpoints/step-<v>``: the training state,
    the prompt stream's position, the books of trained trajectories, the C-MLFQ index)
    every this many RL steps; 0: only on the stop signal. A job started in a log folder
    that holds one resumes from the newest that verifies (``launch.py --resume FOLDER``;
    a requeued Slurm job keeps its folder)."""
    checkpoint_keep: int = Field(2, ge=1)
    """Checkpoints kept: the newest, and older ones to fall back on when it fails to verify."""
    heartbeat_s: float = Field(2.0, gt=0)
    """Seconds between two heartbeats of a rank (a file in ``<log folder>/heartbeats/``)."""
    heartbeat_timeout_s: float = Field(30.0, ge=0)
    """A rank silent this long is lost: the job ends naming it (rank, role, slot, node,
    last activity; a ``rank_lost`` event), asks Slurm for a requeue and resumes from its
    newest checkpoint; a worker whose controller is silent this long exits. A worker's
    first beat of a run may come three times this long after rank 0's watchdog started, and
    so may its next ones while it is still starting (imports hold the GIL its heartbeat
    thread needs; a loaded node). 0: no heartbeats (a dead rank then hangs the world until
    Slurm's time limit)."""
    progress_timeout_s: float = Field(1800.0, ge=0)
    """A worker whose role loop made no progress this long while not waiting for other
    ranks (hung in Python: its heartbeat thread still beats) is lost, as a dead rank is.
    Set it above the longest single operation of a rank (an engine start, one step's
    training, a held-out evaluation). 0: off. Needs heartbeats (``heartbeat_timeout_s``)."""
    checkpoint_on_stop: bool = True
    """On Slurm's time-limit warning (USR2), finish the step in progress, save a checkpoint
    and ask for a requeue (``cluster.requeue``, at most ``cluster.max_requeues`` times)."""
    stop_grace_s: float = Field(60.0, ge=0)
    """After the time-limit warning, how long the step in flight (its training, a save
    under way, a layout change) may take to end before it is abandoned: the job then
    requeues from its newest checkpoint, and the steps since are trained again. With
    ``checkpoint_save_s`` it must fit in ``cluster.signal_before_limit_s``."""
    checkpoint_save_s: float = Field(30.0, ge=0)
    """What one checkpoint save takes on this cluster (the ``save_s`` of the run's
    ``checkpoint_saved`` events says it), budgeted after ``stop_grace_s`` before the limit."""


class ExperimentConfig(_Section):
    """One experiment. Every section is optional and falls back to its defaults."""

    cluster: ClusterConfig = ClusterConfig()
    model: ModelConfig = ModelConfig()
    training: TrainingConfig = TrainingConfig()
    rollout: RolloutConfig = RolloutConfig()
    planner: PlannerConfig = PlannerConfig()
    parallel: ParallelConfig = ParallelConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    tools: ToolsConfig = ToolsConfig()
    rl: RLConfig = RLConfig()
    tasks: TasksConfig = TasksConfig()
    warmstart: WarmStartConfig = WarmStartConfig()
    logging: LoggingConfig = LoggingConfig()
    job: JobConfig = JobConfig()

    @property
    def training_slots(self) -> int:
        t = self.training
        return t.tensor_parallel * t.pipeline_parallel * t.data_parallel

    @property
    def batch_size(self) -> int:
        """Trajectories per RL step, ``rl.prompts_per_step × rl.group_size``: the global
        batch of one training step."""
        return self.rl.prompts_per_step * self.rl.group_size

    def cross_field_problems(self) -> list[str]:
        """What the field types cannot say: one message per impossible field, each naming
        it. The live job also checks the initial layout it is given (training TP×PP×DP,
        ``rollout.tp_per_node``, the hybrid pool, the scripted borrow/return steps)."""
        return [*check_common(self), *check_layout(self)]

    @classmethod
    def resolve_file_paths(cls, raw: dict[str, Any], folder: Path) -> None:
        """Make paths of ``raw`` that are relative to the config file's folder absolute
        (in place), before validation. The experiment has none: ``logging.dir`` and
        ``model.path`` are taken from the submit directory."""


C = TypeVar("C", bound=ExperimentConfig)


class ConfigError(ValueError):
    """A configuration that cannot run; ``problems`` lists one line per bad field."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__(f"invalid configuration ({source}):\n" + "\n".join(f"  - {p}" for p in problems))


# ---------------------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] = (), *, schema: type[C] = ExperimentConfig,
                **cli: Any) -> C:
    """Load a YAML file of ``schema`` (an experiment, or ``SimConfig`` for a simulator
    scenario; the schema's defaults when ``path`` is None), apply ``a.b=c`` overrides
    (``--set``; values are YAML), validate. ``cli`` holds dotted-path values given by
    dedicated CLI flags (e.g. ``{"cluster.nodes": 4}``); None values are ignored. Raises
    ConfigError naming the file and every bad field."""
    source = str(path) if path is not None else "<defaults>"
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = parse_yaml(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(source, [f"cannot read the file: {exc.strerror}"]) from None
        except UnicodeDecodeError as exc:
            raise ConfigError(source, [f"not UTF-8 text (byte {exc.start}): is this the right file?"]) from None
        except DuplicateKeyError as exc:
            raise ConfigError(source, exc.problems) from None
        except yaml.YAMLError as exc:
            raise ConfigError(source, [f"not valid YAML: {exc}"]) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(source, [f"the top level must be a mapping of sections, got {type(loaded).__name__}"])
        raw = loaded or {}
    problems: list[str] = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            problems.append(f"--set {item!r}: expected KEY=VALUE, e.g. cluster.nodes=4")
            continue
        try:
            _set_path(raw, key.strip(), parse_yaml(text))
        except (ValueError, yaml.YAMLError) as exc:
            problems.append(f"--set {item!r}: {exc}")
    for key, value in cli.items():
        if value is not None:
            try:
                _set_path(raw, key, value)
            except ValueError as exc:
                problems.append(f"{key}: {exc}")
    if problems:
        raise ConfigError(source, problems)
    if path is not None:
        schema.resolve_file_paths(raw, Path(path).parent)
    return validate_config(raw, source, schema)


def validate_config(raw: Any, source: str = "<dict>", schema: type[C] = ExperimentConfig) -> C:
    """Build and check a ``schema`` config (default ExperimentConfig) from plain data;
    raises ConfigError."""
    if not isinstance(raw, dict):
        raise ConfigError(source, [f"the top level must be a mapping of sections, got {type(raw).__name__}"])
    try:
        cfg = schema.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(source, [describe_error(err, schema) for err in exc.errors()]) from None
    problems = cfg.cross_field_problems()
    if problems:
        raise ConfigError(source, problems)
    return cfg


def dump_config(cfg: ExperimentConfig) -> str:
    """The resolved configuration as YAML (what the run really used)."""
    return yaml.safe_dump(cfg.model_dump(mode="python"), sort_keys=False)  # int dict keys stay ints


def _set_path(raw: dict[str, Any], dotted: str, value: Any) -> None:
    node = raw
    parts = dotted.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"{'.'.join(parts[: i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


MOVED = {
    "seed": "rl.seed",
    "cluster.model": "model.name",
    "rl.seq_len": "training.seq_len",
    "training.global_batch_size": "rl.prompts_per_step (the batch is rl.prompts_per_step × rl.group_size)",
}
"""Keys of earlier schemas (the simulator's own, before it shared this one) → where they are now."""


def describe_error(err: dict[str, Any], root: type[BaseModel] | None = None) -> str:
    """One readable line for a pydantic error of ``root`` (default: ExperimentConfig):
    the dotted path, what was given, what is allowed, and "did you mean" for unknown keys.
    Shared by every YAML schema of the project (experiments, scenarios, planner profiles)."""
    loc = [str(p) for p in err["loc"]]
    path = ".".join(loc) or "<top level>"
    given = err.get("input")
    if err["type"] == "extra_forbidden":
        valid = _valid_keys(root or ExperimentConfig, loc[:-1])
        hint = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.6)
        where = ".".join(loc[:-1]) or "the top level"
        did_you_mean = f"; did you mean '{hint[0]}'?" if hint else ""
        if path in MOVED:
            did_you_mean = f"; it moved to {MOVED[path]}."
        return f"{path}: unknown key in {where}{did_you_mean} Valid keys are: {', '.join(valid)}"
    if err["type"] == "missing":
        return f"{path}: required, missing"
    if err["type"] == "literal_error":
        return f"{path}: got {given!r}; allowed: {err['ctx']['expected']}"
    if err["type"] == "value_error":  # a section's own check: its message names the fields, not the whole input
        return f"{path}: {err['ctx']['error']}"
    return f"{path}: {err['msg'].lower()} (got {given!r})"


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds, through ``X | None``, ``list[X]`` and ``dict[K, X]``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, list, dict):
        for arg in typing.get_args(annotation)[::-1]:  # dict[K, X]: X is last
            found = _section_model(arg)
            if found is not None:
                return found
    return None


def _valid_keys(model: type[BaseModel], loc: list[str]) -> list[str]:
    for part in loc:
        field = model.model_fields.get(part)
        if field is None:  # a list index or a dict key: the same model holds the next part
            continue
        found = _section_model(field.annotation)
        if found is None:
            return []
        model = found
    return list(model.model_fields)
