"""lorarl's client side, in rooms that say what they hold.

job/        what a job is: the job file (config), its inputs (data, reward, workflow), the --dry-run plan
rl/         the RL loop and what keeps it going: session on the trainer, recovery, rollout pool, run log
launch/     what starts a job's services: this host (local), a Ray cluster, a Slurm script
workflow/   the episode API (a Workflow runs one example: sample, call tools, score)
sdk.py      lorarl from Python; calls.py: service stubs whose errors name the service and the call
commands/   the `lorarl` subcommands (cli.py dispatches); only the CLI imports them
"""
