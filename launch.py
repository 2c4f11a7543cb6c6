#!/usr/bin/env python
"""Validate an experiment and run it: on Slurm through submitit, or locally under mpiexec.

\b
    python launch.py --nodes 6                                  # the embedded default
    python launch.py --config configs/a800-6node.yaml --dry-run # what would be asked for
    python launch.py --nodes 4 --executor slurm --wait          # submit and follow
    python launch.py --config configs/a800-6node.yaml --plan    # what the planner would choose
    python launch.py --eval logs/libra-local-.../checkpoint     # score a checkpoint on held-out prompts
    python launch.py --resume logs/libra-local-...              # continue a stopped run from its checkpoint
"""

import sys
from pathlib import Path

import click

from libra_hpc import launcher
from libra_hpc.cluster.slurm import SubmissionError
from libra_hpc.config import ConfigError, load_config

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "default.yaml"


@click.command(help=__doc__)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="Experiment YAML (default: configs/default.yaml).")
@click.option("--nodes", type=int, help="Override cluster.nodes.")
@click.option("--gpus-per-node", type=int, help="Override cluster.gpus_per_node.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override any field, e.g. --set rl.steps=8 (repeatable).")
@click.option("--executor", type=click.Choice(["auto", "slurm", "local"]), help="Override cluster.executor.")
@click.option("--dry-run", is_flag=True, help="Validate, print the Slurm request and the initial layout, exit.")
@click.option("--plan", "show_plan", is_flag=True, help="Print the planner's plan for this config (per node, predicted times), exit.")
@click.option("--eval", "eval_checkpoint", type=click.Path(file_okay=False, exists=True),
              help="Evaluation only: score this Hugging Face checkpoint on the task's held-out prompts (greedy).")
@click.option("--resume", "resume_dir", type=click.Path(file_okay=False, exists=True),
              help="Continue a stopped run in its log folder, from its newest checkpoint that verifies (local "
                   "executor; its config.yaml unless --config is given).")
@click.option("--wait/--no-wait", default=None, help="Follow the job until it ends (default: yes locally, no on Slurm).")
def main(config_path, nodes, gpus_per_node, overrides, executor, dry_run, show_plan, eval_checkpoint, resume_dir, wait):
    if resume_dir:
        if not (Path(resume_dir) / "config.yaml").is_file() and not config_path:
            raise click.ClickException(f"--resume {resume_dir}: no config.yaml there; is it a run's log folder?")
        config_path = config_path or str(Path(resume_dir) / "config.yaml")
        executor = executor or "local"
        if executor != "local":
            raise click.ClickException("--resume runs the local executor; a Slurm job resumes by being requeued "
                                       "(same job id, same log folder): scontrol requeue <job id>")
    try:
        cfg = load_config(config_path or DEFAULT_CONFIG, list(overrides), **{
            "cluster.nodes": nodes, "cluster.gpus_per_node": gpus_per_node, "cluster.executor": executor,
            "job.eval_checkpoint": str(Path(eval_checkpoint).resolve()) if eval_checkpoint else None})
        chosen, why = launcher.choose_executor(cfg.cluster.executor, strict=not (dry_run or show_plan))
    except (ConfigError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None
    cfg = launcher.with_absolute_log_dir(cfg)
    if show_plan:
        try:
            click.echo(launcher.describe_plan(cfg))
        except (ConfigError, ValueError) as exc:  # a missing profile, or no plan fits (PlanError)
            raise click.ClickException(str(exc)) from None
        return
    if dry_run:
        click.echo(launcher.describe(cfg, chosen, why))
        return
    if chosen == "slurm":
        try:
            sys.exit(launcher.launch_slurm(cfg, bool(wait), sys.stdout))
        except SubmissionError as exc:
            raise click.ClickException(str(exc)) from None
    sys.exit(launcher.launch_local(cfg, wait is not False, sys.stdout,
                                   log_dir=Path(resume_dir).resolve() if resume_dir else None))


if __name__ == "__main__":
    main()
