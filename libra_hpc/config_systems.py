"""The systems half's sections of the experiment schema: the global resource planner and
the elastic hybrid pool (``planner``), context-length-aware parallelism (``parallel``), the
C-MLFQ routing and queue service (``scheduler``) and the tool sandbox and orchestrator
(``tools``). Part of :class:`libra_hpc.config.ExperimentConfig`; import them from
:mod:`libra_hpc.config`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from libra_hpc.config_checks import tp_table_problem
from libra_hpc.config_yaml import _Section


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
    decisive_gain: float = Field(1.0, gt=0)
    """Replanning gate: share of the current plan's predicted step a new plan must save per
    step (and at least twice the cost models' measured error in the job) to be applied at
    its first winning check, without ``confirm_checks``; 1 or more: every change confirms."""
    scale_shift: float | None = Field(0.2, gt=0)
    """At each check the control loop sets the running plan's measured times against its
    prediction (measured / predicted, training and rollout) and values every candidate at
    that scale. It measures the scale again only when the observed mean sequence length
    moved by at most this share since the last check; across a larger shift it values plans
    unscaled (1, 1) until the next steady check: the times measured then are of batches of
    the old lengths while the prediction is made on the new ones, and the ratio mistook
    the shift for an error of the cost models (context-drift-tp: a training scale of 2.8 at
    a regime change held the old split 3 steps longer), and the last steady scale belongs
    to the old regime (a rollout scale of 0.57 kept across the second regime change held
    the old split a check longer). null: measured at every check."""
    memory_headroom: float = Field(1.25, ge=1.0)
    """Every plan's training shape must fit (packed) sequences this many times the observed
    mean length (over ``window`` trajectories, and at least the last batch's mean: a window
    of several batches lags growing contexts), at most ``training.seq_len``: contexts grow
    as the policy learns, and a shape sized for today's lengths would run out of memory on
    tomorrow's. After every batch the planner checks the running shape against it and,
    when it no longer fits, replaces the plan at once (no gate: the alternative is an
    out-of-memory crash)."""
    min_dwell_steps: int = Field(10, ge=0)
    """Replanning gate: RL steps after an applied change during which no other is applied
    (but see ``dwell_same_way``)."""
    dwell_same_way: bool = True
    """Replanning gate: true: a change that moves GPUs the same way as the last applied one
    (toward rollout, or toward training) is not held back by ``min_dwell_steps``; a move
    back, or a reshuffle of the same split, still is. Under a steady drift the best split
    keeps moving one way, and a plan applied halfway through a regime change would otherwise
    stay for the whole dwell (a800-swe-drift: with ``confirm_next_step`` alone −6.1%, with
    both −1.0%); false: every change waits out the dwell."""
    confirm_next_step: bool = True
    """Replanning gate: true: a candidate that won a check but waits for ``confirm_checks``
    is checked again at the next step; false: at the spacing of pressure checks
    (``every_steps // 5`` steps, each check costing a plan search), so a regime change is
    followed 2 steps later. Each step a winner waits runs on the plan that lost: on
    context-drift-tp the two together gave +4.9% (benchmarks/results/
    2026-11-28-python-2core-issue30-transitions.md). A change confirmed earlier drains its
    pipeline while the contexts still grow; after every batch the running shape is checked
    against ``memory_headroom`` all the same, and a change that waits is then waited for as
    for memory (``ControlLoop.while_waiting``)."""
    replan: bool = True
    """The job re-plans the whole layout (training shape, rollout instances) when the plan
    search, on the observed lengths and the calibration fitted to the job's timings, beats
    the current plan through the gate. false: only the hybrid pool moves GPUs. (The job's
    switch: in a simulator scenario each policy says whether it re-plans.)"""
    reconfig_s: float = Field(30.0, ge=0)
    """Seconds a re-plan is assumed to pause the job (ranks re-form, engines restart): the
    gate weighs a candidate's gain against it and the drain (``price_drain``). (The job's:
    a simulator scenario charges ``costs.reconfig_s``.)"""
    price_drain: bool = True
    """The gate also weighs a re-plan's gain against draining the pipeline for it: no batch
    is submitted until those in flight are trained, and the first on the new layout rolls
    out before anything trains, one rollout and one training step in series where the
    pipeline overlaps them (libra_hpc/planner/pipeline.py ``switch_drain_s``, at the last
    measured times). false: only ``reconfig_s`` (the gate before this option; a test that
    forces a re-plan sets it)."""
    price_migrations: bool = True
    """With C-MLFQ routing (``scheduler.policy: cmlfq``), price its migrations in the plan
    valuation: a trajectory whose remaining tokens cross the limits of the buckets a plan
    has re-prefills its context on the instance it moves to, which waits and stalls that
    instance's decoding (libra_hpc/planner/migration.py, ``rollout_makespan``). The limits
    are ``scheduler.bucket_token_limits``, or in a simulator scenario with
    ``scheduler.bucket_limits: share`` the ones the plan's GPU shares give (the job uses the
    fixed limits). false: mixed-TP plans are priced as if no trajectory moved (the
    valuation before this option)."""
    hybrid_margin: float = Field(0.1, ge=0)
    """Hybrid pool: lend a replica to training, or give one back, when that move is predicted
    to shorten the step by more than this share of it (the pipelined step at
    ``rl.max_staleness``: training at 1/DP, the rollout's makespan by the rollout cost model
    on the instances left, on the observed lengths; libra_hpc/planner/lending.py). A lend
    goes back when, two rollouts after it, the step is longer than before it by more than
    the margin (then no lend again until training outweighs rollout by more than at that lend)."""
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
