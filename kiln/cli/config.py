"""`kiln config`: write the YAML settings file that `kiln launch` reads, from flags or by asking.

Depends on kiln.cli.settings and PyYAML.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

from kiln.cli.settings import BY_NAME, DEFAULT_CONFIG, SETTINGS, add_setting_flags, resolve


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "config", help="write the settings file kiln launch reads",
        description="Write a YAML settings file from the flags given; with no flags in a terminal, "
                    "ask for each setting.")
    parser.add_argument("--config_file", default=None, help=f"where to write (default {DEFAULT_CONFIG})")
    add_setting_flags(parser)
    parser.set_defaults(run=run)


def ask(prompt: Callable[[str], str] = input) -> dict[str, Any]:
    """One question per setting; an empty answer keeps the default shown; a bad one is asked again."""
    answers: dict[str, Any] = {}
    for setting in SETTINGS:
        chosen = answers.get("distributed_type", BY_NAME["distributed_type"].default)
        if not setting.asked or (setting.only_for and chosen != setting.only_for):
            continue
        while True:
            raw = prompt(f"{setting.help} [{setting.name}, default {setting.default}]: ").strip()
            if not raw:
                break
            try:
                answers[setting.name] = setting.parse(raw)
                break
            except (TypeError, ValueError) as error:
                print(f"  {error}", file=sys.stderr)
    return answers


def run(args: argparse.Namespace, prompt: Callable[[str], str] = input) -> int:
    import yaml

    flags = {name: value for name, value in vars(args).items() if name in BY_NAME and value is not None}
    if not flags and sys.stdin.isatty():
        flags = ask(prompt)
    try:
        settings = resolve(flags, {})
    except ValueError as error:
        print(f"kiln config: {error}", file=sys.stderr)
        return 2
    target = Path(args.config_file).expanduser() if args.config_file else DEFAULT_CONFIG
    target.parent.mkdir(parents=True, exist_ok=True)
    body = {s.name: settings[s.name] for s in SETTINGS
            if not s.only_for or settings["distributed_type"] == s.only_for}
    partial = target.with_name(target.name + ".partial")
    partial.write_text(yaml.safe_dump(body, sort_keys=False))
    partial.replace(target)
    print(f"wrote {target}")
    return 0
