"""`--config FILE`: a command's flags from a YAML (or JSON) file, in vLLM's format.

The file's values become the command's defaults (`set_defaults`), so the command line parses
exactly as it would without the file and every flag given there wins; the model in the file
(`model:`) is the command's default model, which a MODEL or --model on the command line
replaces.
"""

from __future__ import annotations

import argparse

_BOOLEAN_ACTIONS = (argparse._StoreTrueAction, argparse._StoreFalseAction,
                    argparse.BooleanOptionalAction)


def read_config_file(path: str) -> dict:
    """The mapping a config file holds (YAML; JSON is YAML too)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"--config: cannot read {path!r}: {e.strerror}") from None
    import yaml  # PyYAML: a dependency of transformers

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    return data


def config_defaults(path: str, command: argparse.ArgumentParser) -> dict:
    """`command`'s defaults from the file `path`: keys are flag names without the dashes
    (`max-model-len` or `max_model_len`), values as the flag takes them (true/false for a
    switch, a list for a flag of several values or a repeatable one)."""
    actions = command._option_string_actions
    defaults: dict = {}
    for key, value in read_config_file(path).items():
        flag = "--" + str(key).replace("_", "-")
        action = actions.get(flag)
        if action is None or flag in ("--config", "--help"):
            raise ValueError(f"--config {path}: {key!r} is not a flag of this command")
        where = f"--config {path}: {key}"
        if value is None:
            # YAML reads `key:` and `key: ##...` (a comment) as null: say so, never skip it.
            raise ValueError(f"{where} has no value (quote a string YAML would read as a "
                             "comment or null, e.g. '##')")
        if isinstance(action, _BOOLEAN_ACTIONS):
            if not isinstance(value, bool):
                raise ValueError(f"{where} is a switch: give true or false")
            if isinstance(action, argparse._StoreFalseAction):
                value = not value
        elif isinstance(value, list):
            if action.nargs not in ("+", "*") and not isinstance(action, argparse._AppendAction):
                raise ValueError(f"{where} takes one value, not a list")
            value = [_convert(action, item, where) for item in value]
        else:
            value = _convert(action, value, where)
            if action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction):
                value = [value]
        action.required = False  # given by the file (e.g. generate's --prompt)
        if action.dest == "model":
            defaults["default_model"] = value  # MODEL or --model on the command line wins
        else:
            defaults[action.dest] = value
    return defaults


def _convert(action: argparse.Action, value: object, where: str) -> object:
    """A file value as the flag's own parser would take its text."""
    text = str(value)
    try:
        value = action.type(text) if action.type is not None else text
    except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
        raise ValueError(f"{where}: {e}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where}: {value!r} is not one of {list(action.choices)}")
    return value


def apply_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """argv without its `--config FILE`, whose values became the subcommand's defaults. The
    option is spelled out and given once (argparse would take an abbreviation or a second
    one as a value of its own, silently)."""
    found = [i for i, arg in enumerate(argv) if arg == "--config" or arg.startswith("--config=")]
    if not found:
        return argv
    if len(found) > 1:
        raise ValueError("--config is given more than once")
    i = found[0]
    arg = argv[i]
    path = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
    if not path:
        raise ValueError("--config needs a file")
    rest = argv[:i] + argv[i + (1 if "=" in arg else 2):]
    commands = next(a for a in parser._actions
                    if isinstance(a, argparse._SubParsersAction)).choices
    if not rest or rest[0] not in commands:
        raise ValueError("--config follows a command: ragkv serve --config FILE")
    command = commands[rest[0]]
    command.set_defaults(**config_defaults(path, command))
    return rest
