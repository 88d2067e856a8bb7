"""`--config FILE`: a command's flags from a YAML (or JSON) file, in vLLM's format."""

from __future__ import annotations

import argparse
import json


def config_file_args(path: str, command: argparse.ArgumentParser) -> list[str]:
    """The flags of `command` a `--config` file gives (vLLM's format: YAML, or JSON, one
    mapping whose keys are flag names without the dashes, `max-model-len` or `max_model_len`;
    `model` is the model): true is the bare flag, false its --no- form, a list the flag's
    values (a repeatable flag once per value)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"--config: cannot read {path!r}: {e.strerror}") from None
    try:
        import yaml  # PyYAML comes with transformers; JSON is YAML too

        data = yaml.safe_load(text)
    except ImportError:
        data = json.loads(text)
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML: {e}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    known = command._option_string_actions
    flags: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if flag not in known or flag == "--config":
            raise ValueError(f"--config {path}: {key!r} is not a flag of this command")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + flag[2:])
        elif isinstance(value, list):
            if isinstance(known[flag], argparse._AppendAction):
                flags += [x for v in value for x in (flag, str(v))]
            else:
                flags += [flag, *(str(v) for v in value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def with_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """argv with a `--config FILE`'s flags put right after the subcommand, so that the
    command line's own flags come later and win."""
    for i, arg in enumerate(argv):
        if arg == "--config" or arg.startswith("--config="):
            path = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv)
                                                            else "")
            if not path:
                raise ValueError("--config needs a file")
            rest = argv[:i] + argv[i + (1 if "=" in arg else 2):]
            commands = next(a for a in parser._actions
                            if isinstance(a, argparse._SubParsersAction)).choices
            if not rest or rest[0] not in commands:
                raise ValueError("--config follows a command: ragkv serve --config FILE")
            return rest[:1] + config_file_args(path, commands[rest[0]]) + rest[1:]
    return argv
