"""The experiment schema: one YAML file describes one whole run.

Every section is a pydantic model with ``extra="forbid"`` and strict types, so a misspelled
key, a string where a number belongs, or an impossible cluster shape fails *before* anything
is submitted, with the dotted path of the field, what was given and what is allowed.
Field docstrings are the reference documentation (configs/README.md is generated from them
by libra_hpc/config_reference.py).

The simulator's scenarios (libra_hpc/sim/config.py) are this schema plus the simulator's own
sections, read by the same loader (:func:`load_config` with ``schema=SimConfig``) and
refused with the same error (:class:`ConfigError`). The learning half's sections (``rl``,
``tasks``, ``warmstart``) are in libra_hpc/config_learning.py and the strict YAML reader and
section base in libra_hpc/config_yaml.py; their names the rest of the code uses are importable from here.

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

from libra_hpc.config_checks import SLURM_TIME, check_common, check_layout, tp_table_problem
from libra_hpc.config_learning import RLConfig, TasksConfig, WarmStartConfig
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
        days, first, second, third = SLURM_TIME.match(str(self.time_limit)).groups()  # type: ignore[union-attr]
        if days is not None:  # D-HH[:MM[:SS]]
            seconds = int(days) * 86400 + int(first) * 3600 + int(second or 0) * 60 + int(third or 0)
        elif third is not None:  # HH:MM:SS
            seconds = int(first) * 3600 + int(second) * 60 + int(third)
        else:  # MM[:SS]
            seconds = int(first) * 60 + int(second or 0)
        return max(1, -(-seconds // 60))

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


class LengthPrior(_Section):
    """The trajectory lengths the planner assumes before it has observed any."""

    prompt_tokens: int = Field(1024, ge=1)
    """Prompt tokens per trajectory."""
    gen_tokens_median: int = Field(2048, ge=1)
    """Median generated tokens per trajectory (all turns)."""
    tail_shape: float = Field(1.2, gt=0)
    """Pareto shape of generated lengths: smaller is a heavier tail (agentic rollouts are
    long-tailed); lengths are capped at ``training.seq_len``."""
    turns: int = Field(4, ge=1)
    """Tool-using turns per trajectory."""
    tool_s_per_turn: float = Field(2.0, ge=0)
    """Seconds of tool time per turn."""


class PlannerConfig(_Section):
    """Global resource planner and the elastic hybrid pool. ``python launch.py --plan``
    prints the plan the cost models choose for this config."""

    prior: LengthPrior = LengthPrior()

    hybrid_nodes: int = Field(1, ge=0)
    """Rollout nodes (the last ones) that form the hybrid pool: they can be lent to
    training as whole DP replicas and given back, without stopping the job."""
    min_rollout_gpus: int = Field(1, ge=1)
    """Rollout never shrinks below this many GPU slots (no plan, no hybrid-pool loan takes
    it lower)."""
    window: int = Field(512, ge=8)
    """Finished trajectories the planner's observed length profile is built from (the
    most recent ones)."""
    every_steps: int = Field(10, ge=1)
    """Replanning gate: RL steps between periodic checks of whether another plan pays off
    (a pressure event may check earlier; libra_hpc/planner/gate.py)."""
    margin_s: float = Field(10.0, ge=0)
    """Replanning gate: seconds a change must save over the next ``every_steps`` steps,
    after paying its reconfiguration cost, before it counts as a win."""
    min_gain: float = Field(0.1, ge=0, lt=1)
    """Replanning gate: share of the current plan's predicted step a new plan that changes
    the rollout instances must save per step to count as a win. The rollout cost model is
    within about ±20% of the simulated makespan per batch
    (benchmarks/results/2026-11-25-python-2core-sim.md), so a smaller predicted gain is
    noise; a change of the training shape alone is exempt; 0 counts every gain. In the
    job, where the calibration is fitted to the run's own timings, the fit's measured
    decode error raises the bar when it is larger (on shared CPU cores it is often over
    100%: no instance change is then trusted)."""
    confirm_checks: int = Field(2, ge=1)
    """Replanning gate: consecutive winning checks, for the same plan, before it is applied."""
    memory_headroom: float = Field(1.25, ge=1.0)
    """Every plan's training shape must fit (packed) sequences this many times the observed
    mean length, at most ``training.seq_len``: contexts grow as the policy learns, and a
    shape sized for today's lengths would run out of memory on tomorrow's. After every
    batch the planner checks the running shape against it and, when it no longer fits,
    replaces the plan at once (no gate: the alternative is an out-of-memory crash)."""
    min_dwell_steps: int = Field(10, ge=0)
    """Replanning gate: RL steps after an applied change during which no other is applied."""
    replan: bool = True
    """The job re-plans the whole layout (training shape, rollout instances) when the plan
    search, on the observed lengths and the calibration fitted to the job's timings, beats
    the current plan through the gate. false: only the hybrid pool moves GPUs. (The job's
    switch: in a simulator scenario each policy says whether it re-plans.)"""
    reconfig_s: float = Field(30.0, ge=0)
    """Seconds a re-plan is assumed to cost (the pipeline drains, ranks re-form): the gate
    weighs a candidate's gain against it. (The job's: a simulator scenario charges
    ``costs.reconfig_s``.)"""
    hybrid_margin: float = Field(0.1, ge=0)
    """Hybrid pool: lend it to training when the training step takes more than the rollout
    phase × (1 + margin); give it back when rollout takes more than training × (1 + margin),
    or when, two rollouts after the lend, the step is longer than before it by more than the
    margin (then no lend again until training outweighs rollout by more than at that lend)."""
    borrow_at_step: int | None = 2
    """``job.mode: check`` only: the step at which the cluster check lends the hybrid pool
    to training, a scripted move (the RL job and the simulator lend it by cost,
    ``hybrid_margin``); null: never."""
    return_at_step: int | None = None
    """``job.mode: check`` only: the step at which the lent hybrid pool goes back to
    rollout, in the instance shapes it had; null: keep it lent. Must come after
    ``borrow_at_step``."""


class ParallelConfig(_Section):
    """EARL: the TP size of training chosen from the context lengths it runs, and how
    rollout outputs reach the training ranks (``libra_hpc/parallel/``)."""

    on_memory: Literal["reshard", "replan"] = "reshard"
    """When contexts outgrow the training shape's memory (``planner.memory_headroom``):
    ``reshard`` moves training to the TP size on the same GPUs that fits and is fastest
    (from a checkpoint, resharded; rollout goes on), and re-plans the whole split only when
    no TP size fits; ``replan`` re-plans the whole split at once (rollout drains first)."""
    training_tp_by_context: dict[int, int] | None = None
    """A measured table for the training TP size: ``{0: 1, 8192: 2}`` means TP 1 until
    the p90 context of the observed trajectories (prompt, tool outputs and generated
    tokens) reaches 8192 tokens, TP 2 from there (DP shrinks to keep the GPUs). The job
    re-shards training when the table says so, through a checkpoint and without losing a
    step (a ``tp_reshard`` event says why). null: the TP size changes only for memory
    (``on_memory``). On CPU every measured table says TP 1; a table here checks the mechanism."""
    hysteresis: float = Field(0.1, ge=0, lt=1)
    """A move to a smaller TP waits until the context is this share below the threshold
    that raised it; by cost, another TP size must be this share faster."""
    confirm_checks: int = Field(2, ge=1)
    """Consecutive checks (one per RL step) that must agree before the TP size changes
    (a shape that does not fit changes at once)."""
    dispatch: Literal["direct", "gather_scatter"] = "direct"
    """How a finished trajectory reaches the training ranks of its DP replica: ``direct``
    from the rollout leader to each of them; ``gather_scatter`` through the first training
    rank (the single-controller baseline, for comparison: ``benchmarks/bench_dispatch.py``)."""

    @field_validator("training_tp_by_context")
    @classmethod
    def _table(cls, v: dict[int, int] | None) -> dict[int, int] | None:
        problem = None if v is None else tp_table_problem(sorted((int(c), int(tp)) for c, tp in v.items()))
        if problem is not None:
            raise ValueError(problem)
        return v


class SchedulerConfig(_Section):
    """Routing of trajectory turns to rollout buckets (C-MLFQ) and the queue service
    (``libra_hpc.scheduler``)."""

    policy: Literal["cmlfq", "fifo", "least_load", "length_aware", "oracle"] = "cmlfq"
    """Registered routing policy: ``cmlfq`` (causal tool-return signals), ``fifo``
    (round-robin), ``least_load`` (least outstanding work, one homogeneous pool),
    ``length_aware`` (a length predictor with ``predictor_noise``), ``oracle`` (true
    remaining length; a bound for benchmarks and simulations)."""
    bucket_token_limits: dict[int, int] = Field(default_factory=lambda: {1: 1024, 2: 4096, 4: 16384, 8: 1 << 30})
    """Rollout TP size → the most remaining output tokens a trajectory may have to be
    routed to that bucket. Small TP: high throughput for short work; large TP: low
    latency for long work. Buckets are the MLFQ levels in ascending limit order. In a
    simulator scenario its keys are also the rollout TP sizes the planner may use."""
    bucket_limits: Literal["fixed", "share"] = "share"
    """``fixed``: the limits above. ``share``: when nothing is in flight the limits follow
    the layout, on the quantity C-MLFQ compares (remaining output tokens after a tool
    return): bucket ``i`` (ascending TP) takes the turns whose remaining tokens are up to the
    length at which the tokens they decode (plus every first turn, which starts on the top
    level) reach the cumulative GPU share of buckets ``0..i`` in the recent window, so a plan
    with no TP-1 instances has no idle large-TP bucket waiting for trajectories the fixed
    limits would never send there. The job uses the fixed limits today (``share`` is the
    simulator's)."""
    saturation: float = Field(1.0, gt=0)
    """An instance counts as saturated for routing (the router sends the turn to a
    neighbouring bucket) when its leased turns reach this multiple of its *decode knee*:
    the smallest batch whose step takes twice a lone sequence's step at the mean KV need
    of a turn (at most the seats the KV capacity allows); in tokens, times the mean turn
    length. 1.0: saturated once each sequence decodes at half its lone speed."""
    size_thresholds: list[int] = Field(default_factory=lambda: [256, 4096])
    """Tool output sizes (characters) that separate the payload size classes: with
    ``[256, 4096]`` an output is S below 256, M below 4096, L otherwise."""
    error_markers: list[str] = Field(default_factory=lambda: ["Traceback (most recent call last)", "Error:", "error:", "Exception"])
    """Substrings of a tool's output that mark it as failed even with exit status 0."""
    tree_window: int = Field(256, ge=2)
    """Remaining-token samples each causal prefix-tree node keeps (bounded window for
    the mean and p90)."""
    min_samples: int = Field(8, ge=1)
    """Samples a tree node needs before its statistics are trusted; otherwise the
    shallower node (or the global tree) decides."""
    rebuild_every: int = Field(1000, ge=1)
    """Finished trajectories between rebuilds of the trees from the recent window
    (between rebuilds, each finish updates the trees incrementally)."""
    self_check: int = Field(1000, ge=0)
    """``cmlfq`` only: the router scores itself on this many recent decisions. Each
    finished trajectory is replayed through the causal verdicts it would have got (before
    it is learnt) and each decision after a tool return is scored against the bucket its
    true remaining length maps to, beside the trivial policy of keeping every turn on the
    top level. Unless the causal verdicts are right more often by a clear margin (more
    than two standard deviations of an even split of the decisions where only one of the
    two is right; judged from a quarter of the window on), every turn goes to the top
    level: where the tool returns say too little about the work left, the router does no
    worse than the policy it replaces, and migrates nothing. 0: off."""
    tree_save_every_s: float = Field(30.0, gt=0)
    """Seconds between saves of the trees to the log folder (off the request path)."""
    lease_s: float = Field(60.0, gt=0)
    """Seconds a rollout instance holds a turn without a report or heartbeat before the
    turn is put back in the queue."""
    max_batch: int = Field(16, ge=1)
    """Most turns handed out in one answer to an instance asking for work."""
    predictor_noise: float = Field(0.5, ge=0)
    """``length_aware`` baseline only: sigma of the multiplicative log-normal error of
    its length predictor."""
    affinity_tokens: int = Field(16384, ge=0)
    """A turn that stays in its bucket runs on the instance its previous turn ran on (its
    KV prefix is cached there: only the tool output is prefilled) while that instance has
    at most this many more outstanding tokens than the least loaded one of the bucket; 0:
    always the least loaded. Every policy but ``fifo``."""


class ChaosConfig(_Section):
    """Fault injection for soak runs (``benchmarks/bench_soak.py``): a share of tool calls,
    drawn from a seeded generator, fails or hangs before it reaches its runner. Off by
    default; the faults injected are counted in ``summary.json`` (``tool_faults_injected``)."""

    fail_rate: float = Field(0.0, ge=0, le=1)
    """Share of calls whose runner raises (the model reads an error; status ``failure``)."""
    hang_rate: float = Field(0.0, ge=0, le=1)
    """Share of calls that hold their unit without answering for ``tools.call_timeout_s`` + 5 s
    (the model reads a timeout at ``tools.call_timeout_s``; the unit is then released)."""
    seed: int = 0
    """Seed of the draws."""


class ToolsConfig(_Section):
    """Sandboxed tool execution (libra_hpc/tools/sandbox.py, isolation.py) and action-level
    orchestration of tool resources (libra_hpc/tools/scheduling.py)."""

    wall_time_s: float = Field(10.0, gt=0)
    """Wall-clock limit of one tool call, in seconds; the whole process tree is killed at it."""
    call_timeout_s: float = Field(60.0, gt=0)
    """Seconds a turn waits for one call's result (queueing included) before the model reads
    a timeout for it; the episode goes on. A call still running is left to finish (or to be
    killed at ``wall_time_s``) and its result is dropped."""
    chaos: ChaosConfig = ChaosConfig()
    """Leave it off in real runs; ``configs/soak.yaml`` turns it on."""
    max_workers: int = Field(4, ge=1)
    """Upper bound of the CPU sandbox pool (concurrent sandboxed calls)."""
    min_workers: int = Field(0, ge=0)
    """Sandbox units kept alive even when idle (the pool never shrinks below this)."""
    idle_timeout_s: float = Field(30.0, ge=0)
    """Seconds a unit stays idle before the pool shrinks by it."""
    isolation: Literal["auto", "bwrap", "rlimit"] = "auto"
    """`bwrap`: mount/pid/net/IPC namespaces, only /usr and the interpreter visible, private tmpfs working directory, a seccomp filter that denies new namespaces, the kernel keyring, mounts, ptrace, bpf and similar (needs bubblewrap, x86_64 or aarch64); `auto`: the same, and an error naming this option when bwrap cannot run (never a silent fallback); `rlimit`: the explicit opt-in to a weaker fallback, root only (refused otherwise): limits, a new session, the slot uid and a private host directory. Its weaknesses: world-readable host files and the network, 127.0.0.1 included (a local reward endpoint), stay reachable; the working directory is on the host's disk with no total cap (RLIMIT_FSIZE bounds each file only); no seccomp filter, so the kernel keyring and user namespaces are available; files the slot uid leaves in world-writable directories and its System V IPC objects are deleted after each call, but data written into existing world-writable files is not undone."""
    python: str = ""
    """Interpreter that runs Python snippets; empty: the one running libra_hpc."""
    uid_base: int = Field(200000, ge=1000)
    """When run as root, sandbox unit i runs as uid `uid_base + i` (must belong to nobody: every process of it is killed after each call; a uid in the password database is refused)."""
    lock_dir: str = "/run/libra_sandbox"
    """Directory of the per-slot-uid lock files (`uid-<uid>.lock`, an exclusive flock held while a Sandbox uses the uid), so two sandboxes, in any processes of the host, never share a slot uid."""
    cpu_time_s: int = Field(10, ge=1)
    """CPU-time limit of one call (RLIMIT_CPU), in seconds."""
    memory_mb: int = Field(512, ge=16)
    """Address-space limit per process (RLIMIT_AS), in MiB."""
    max_processes: int = Field(32, ge=2)
    """Processes one call may have at once (RLIMIT_NPROC, enforced through the dedicated uid or user namespace)."""
    max_file_mb: int = Field(16, ge=1)
    """Largest file a call may write (RLIMIT_FSIZE), in MiB."""
    max_open_files: int = Field(64, ge=8)
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    call_memory_mb: int = Field(1024, ge=0)
    """Memory of all processes of one call together (tmpfs pages included), in MiB, through a cgroup per call when the host allows one (root, writable memory and pids controllers); the kernel's OOM killer then acts inside the call. 0: no cgroup (a call may then take memory_mb × max_processes)."""
    workdir_mb: int = Field(64, ge=1)
    """Size of the private tmpfs working directory /tmp (bwrap isolation), in MiB; /dev/shm is a second tmpfs of the same size, so a call may hold up to twice this in tmpfs pages (memory, counted in call_memory_mb when a cgroup exists). The number of inodes is not capped (bwrap has no tmpfs option for it); each costs kernel memory, also charged to the call's cgroup."""
    output_limit_bytes: int = Field(65536, ge=1)
    """stdout + stderr kept per call; a call printing more is killed and reported as a truncated failure."""
    policy: Literal["tangram", "dedicated"] = "tangram"
    """`tangram`: every call is an action on any free unit, shortest expected action first with aging; `dedicated`: the baseline, one unit bound to each trajectory for its life."""
    aging_rate: float = Field(1.0, gt=0)
    """Expected seconds forgiven per second an action waits (tangram); larger is closer to FIFO, smaller to shortest-first. Any value > 0 rules out starvation."""
    expected_s: dict[str, float] = Field(default_factory=dict)
    """Prior expected duration per tool name, in seconds, until observed durations take over (moving average)."""
    default_expected_s: float = Field(1.0, ge=0)
    """Prior expected duration of a tool not in `expected_s`, in seconds."""
    quotas: dict[str, int] = Field(default_factory=dict)
    """Most concurrent actions per tool name (e.g. an API's limit); tools not listed are bounded by their resource only."""
    reward_endpoint: str = ""
    """URL of a model-serving endpoint for reward-model calls (resource kind `reward`); empty: no such resource."""
    reward_concurrency: int = Field(4, ge=1)
    """Concurrent requests the reward endpoint accepts (units of the `reward` resource)."""
    placement: Literal["local", "slurm"] = "local"
    """Where the CPU sandboxes run. `local`: on the orchestrator's host. `slurm`: each unit of the pool is a worker started with `srun` (libra_hpc/tools/remote.py): on `slurm_partition` when set (an allocation of its own per unit, never the GPU job's cores), else as a step of the current job on its nodes (`srun --overlap`). A unit's worker stops when the pool retires the unit."""
    slurm_partition: str = ""
    """Partition of the sandbox workers with `placement: slurm`; empty: the current job's allocation."""
    slurm_cpus_per_unit: int = Field(1, ge=1)
    """CPUs Slurm gives each sandbox worker (`srun --cpus-per-task`) with `placement: slurm`."""
    slurm_time_limit: str = ""
    """`srun --time` of each sandbox worker's own allocation with `placement: slurm` and a partition (Slurm's format, e.g. `4:00:00`); empty: the partition's default."""
    slurm_args: list[str] = Field(default_factory=list)
    """Extra `srun` options for the sandbox workers (e.g. `["--account=rl", "--qos=cpu"]`) with `placement: slurm`."""


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
    newest checkpoint; a worker whose controller is silent this long exits. 0: no
    heartbeats (a dead rank then hangs the world until Slurm's time limit)."""
    checkpoint_on_stop: bool = True
    """On Slurm's time-limit warning (USR2), finish the step in progress, save a checkpoint
    and ask for a requeue (``cluster.requeue``, at most ``cluster.max_requeues`` times)."""


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
