"""`kiln launch`: start a training script on one or many processes and machines.

Depends on kiln.cli.settings and torch.distributed.run (started as a child process).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from typing import Any

from kiln.cli.settings import DEFAULT_CONFIG, add_setting_flags, load_config_file, process_environment, resolve


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "launch", help="run a training script on N processes (one machine or many)",
        description="Start SCRIPT with torch.distributed.run (DeepSpeed runs too: its engine joins the "
                    "process group torchrun sets up). Settings come from flags, then the "
                    f"--config_file (default {DEFAULT_CONFIG} if it exists), then defaults; every "
                    "setting reaches every process as a KILN_* environment variable.")
    parser.add_argument("--config_file", default=None, help="YAML written by `kiln config`")
    add_setting_flags(parser)
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    parser.set_defaults(run=run)


def build_command(settings: dict[str, Any], script: str, script_args: list[str]) -> list[str]:
    """The command line for this machine: the script itself for one process that is never
    restarted, else torchrun's (whose agent restarts the processes, up to `max_restarts` times)."""
    if settings["num_processes"] == 1 and settings["num_machines"] == 1 and not settings["max_restarts"]:
        return [sys.executable, script, *script_args]
    per_machine = settings["num_processes"] // settings["num_machines"]
    restarts = [f"--max_restarts={settings['max_restarts']}"] if settings["max_restarts"] else []
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={per_machine}",
            f"--nnodes={settings['num_machines']}", f"--node_rank={settings['machine_rank']}",
            f"--master_addr={settings['main_process_ip']}", f"--master_port={settings['main_process_port']}",
            *restarts, script, *script_args]


def run(args: argparse.Namespace) -> int:
    config_path = args.config_file or (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None)
    try:
        config = load_config_file(config_path) if config_path else {}
        flags = {name: value for name, value in vars(args).items()
                 if name not in ("script", "script_args", "run", "config_file")}
        settings = resolve(flags, config)
    except (ValueError, FileNotFoundError) as error:
        print(f"kiln launch: {error}", file=sys.stderr)
        return 2
    if settings["distributed_type"] == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        print("kiln launch: distributed_type is deepspeed, but DeepSpeed is not installed: "
              "pip install 'kiln-torch[deepspeed]'", file=sys.stderr)
        return 2
    if not os.path.isfile(args.script):
        print(f"kiln launch: no script at {args.script}", file=sys.stderr)
        return 2
    env = {**os.environ, **process_environment(settings)}
    command = build_command(settings, args.script, args.script_args)
    return subprocess.call(command, env=env)
