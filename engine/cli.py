"""The command line and YAML files -> engine.config.Config: Megatron-LM's flag names, one line per mistake.

`parse_config(argv)` reads the flags (and the YAML file `--config` names; command-line flags override it),
settles `--mock-data` against `--data-path` and `--train-iters` against `--train-samples`, and returns the
Config with the notices the launcher prints once. Every config field is a flag (`--no-FLAG` switches a
boolean off); Megatron-LM's flags that are no field are translated by engine/megatron_flags.py. The schema
stays in engine/config/ (its flags in engine/flags.py), the checks in engine/validation.py and the
resolution in engine/resolve.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
from typing import Any, Optional

from engine import megatron_flags
from engine.config import SECTIONS, Config, ConfigError
from engine.config.fields import Problems
from engine.flags import FIELD_SECTION, FIELDS, all_fields, default_help, field_type, flag_of, kept_defaults


class OneLineParser(argparse.ArgumentParser):
    """argparse that answers the mistakes of a command line with one line each, all of them in one message, never
    the whole usage; an unknown flag names the nearest known one. With `raise_errors` the message is raised as a
    ConfigError (the launcher prints it from rank 0 only); otherwise it is printed as `PROG: error: ...` and the
    process exits 2, as argparse does.
    `script` is how the help is asked for in the hint; `elsewhere` maps a flag that exists in another form
    (e.g. a YAML-only key) to the line that says so."""

    def __init__(self, *args, raise_errors: bool = False, script: Optional[str] = None,
                 elsewhere: Optional[dict] = None, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # `--seq-len 32` is a mistake to name, not --seq-length
        kwargs.setdefault("exit_on_error", False)  # a wrong value comes back to parse_collecting, which goes on
        super().__init__(*args, **kwargs)
        self.raise_errors, self.elsewhere = raise_errors, elsewhere or {}
        self.script = script or self.prog

    def parse_args(self, args=None, namespace=None):
        ns, lines = self.parse_collecting(args, namespace)
        if lines:
            self.error("\n".join(lines), hint=self.hint(lines))
        return ns

    @staticmethod
    def hint(lines: list) -> str:
        """What ends the message: where the flags are listed (after an unknown flag) or the help."""
        return "--help lists them" if lines[-1].startswith("unknown flag") else "--help"

    def parse_collecting(self, args=None, namespace=None) -> tuple:
        """(namespace, lines): every unknown, refused or wrongly valued flag of the command line, one line each,
        with the namespace of the rest (a flag with a wrong value is left out of it and parsing goes on)."""
        args = list(sys.argv[1:] if args is None else args)
        lines = []
        while True:
            try:
                ns, extras = self.parse_known_args(args, namespace)
                break
            except argparse.ArgumentError as e:
                lines.append(str(e))
                rest = _without(args, (e.argument_name or "").split("/"))
                if rest == args:  # nothing to leave out: no further flag can be read
                    self.error("\n".join(lines))
                args = rest
        return ns, lines + self._unknown(extras)

    def _unknown(self, extras: list) -> list:
        """One line per flag that is not this parser's (its values skipped) and per stray value."""
        known = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        lines, after_flag = [], False
        for token in extras:
            if not _is_flag(token):
                if not after_flag:
                    lines.append(f"unexpected argument {token!r}: it follows no flag that takes it")
                continue
            after_flag, flag = True, token.split("=", 1)[0]
            if flag in self.elsewhere:
                lines.append(self.elsewhere[flag])
                continue
            near = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
            lines.append(f"unknown flag {flag}" + (f"; did you mean {near[0]}?" if near else ""))
        return lines

    def print_help(self, file=None):
        if os.environ.get("RANK", "0") == "0":  # under torchrun, once (rank 0) rather than on every process
            super().print_help(file)

    def error(self, message: str, hint: str = "--help lists the flags"):
        """`message`: one line per problem; the hint ends the last."""
        line = f"{message} (python {self.script} {hint})"
        if self.raise_errors:
            raise ConfigError(line)
        self.exit(2, "".join(f"{self.prog}: error: {part}\n" for part in line.splitlines()))


def _is_flag(token: str) -> bool:
    """A token that names a flag rather than a value (a negative number, e.g. a window's -1, is a value)."""
    if not token.startswith("-") or len(token) < 2:
        return False
    try:
        float(token.split(",")[0])
        return False
    except ValueError:
        return True


def _without(args: list, flags: list) -> list:
    """`args` without each occurrence of `flags` and the values that follow it."""
    out, skipping = [], False
    for token in args:
        if _is_flag(token):
            name = token.split("=", 1)[0]
            skipping = name in flags and "=" not in token
            if name in flags:
                continue
        elif skipping:
            continue
        out.append(token)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The launcher's flags. A mistake raises ConfigError (one line); `--help` prints the usage and exits 0."""
    yaml_only = {flag_of(f.name): f"{flag_of(f.name)}: {f.name} has no command-line form; set it in the --config "
                                  "YAML file" for _, f in all_fields() if f.metadata["yaml_only"]}
    p = OneLineParser(
        prog="pretrain_gpt.py",
        description="Ternion: pretrain GPT/Llama models with tensor, pipeline and data parallelism. "
                    "Run under torchrun; YAML keys are these flag names. Each boolean flag --X has a --no-X "
                    "that switches it off (a value from the YAML file included).",
        argument_default=argparse.SUPPRESS, raise_errors=True, script="launch/pretrain_gpt.py",
        elsewhere={**yaml_only, **megatron_flags.refusals()})
    p.add_argument("--config", help="YAML file of flag values; command-line flags override it")
    for section, cls in SECTIONS.items():
        group = p.add_argument_group(section)
        for f in dataclasses.fields(cls):
            m = f.metadata
            if m["yaml_only"]:
                continue
            names = [flag_of(f.name), *m["aliases"]]
            kw: dict[str, Any] = dict(dest=f.name, help=f"{m['help']} {default_help(f)}")
            if m["action"] == "append":
                kw["action"] = "append"
            elif field_type(f) is bool and f.name.startswith("no_"):
                # --no-load-optim keeps its Megatron-LM name; its opposite switches it off.
                kw["action"] = "store_true"
                group.add_argument(flag_of(f.name[3:]), dest=f.name, action="store_false",
                                   help=f"switch off {flag_of(f.name)} (e.g. set in the YAML file)")
            elif field_type(f) is bool:
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw["type"] = m["type"] or _scalar_type(f)
                if m["nargs"]:
                    kw["nargs"] = m["nargs"]
                if m["choices"]:
                    kw["choices"] = m["choices"]
            group.add_argument(*names, **kw)
    megatron_flags.add_flags(p)  # Megatron-LM's flags that are no config field: their meaning, note or one line
    return p


def _scalar_type(f):
    t = field_type(f)
    return t if t in (int, float) else str


def _load_yaml(path: str, problems: Problems) -> dict:
    """The file's values by field name; an unknown key or a wrong value is a line in `problems`."""
    import yaml
    if not os.path.isfile(path):
        raise ConfigError(f"--config: file {path!r} does not exist; pass the path of a YAML file such as configs/gpt-tiny.yaml")
    try:
        with open(path) as fh:
            raw = yaml.safe_load(fh) or {}
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        where = f" at line {line + 1}" if line is not None else ""
        raise ConfigError(f"--config: {path} is not valid YAML{where}; fix the syntax") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config: {path} must hold a mapping of flag names to values")
    out = {}
    valid = list(FIELD_SECTION)
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in FIELD_SECTION:
            near = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
            hint = f"; did you mean '{near[0].replace('_', '-')}'?" if near else "; see pretrain_gpt.py --help for valid names"
            problems.append(f"--config: unknown key '{key}' in {path}{hint}")
            continue
        try:
            out[name] = _coerce(name, value)
        except ConfigError as e:
            problems.append(str(e))
    return out


def _coerce(name: str, value):
    """Bring a YAML value to the field's type, or say which key is wrong."""
    f = FIELDS[name]
    if value is None or f.metadata["yaml_only"]:
        return value  # a structured value is checked where it is used (data_phases: engine/data/build.py)
    if f.metadata["choices"] and value not in f.metadata["choices"]:
        raise ConfigError(f"{flag_of(name)}: {value!r} is not one of {', '.join(f.metadata['choices'])}")
    t = field_type(f)
    try:
        if t is bool:
            if not isinstance(value, bool):
                raise ValueError
            return value
        if t is list:
            vals = value if isinstance(value, list) else str(value).split()
            conv = f.metadata["type"] or str
            return [conv(v) if conv is not str else str(v) for v in vals]
        conv = _scalar_type(f)
        if conv is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return conv(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{flag_of(name)}: value {value!r} is not a valid {t.__name__}; "
                          "fix the config file") from None


def parse_config(argv: Optional[list] = None, problems: Optional[Problems] = None) -> Config:
    """Flags (and the YAML they name) -> Config. Every mistake found (unknown and refused flags, wrong values,
    flags that contradict each other) is a line: in `problems` when given (the caller adds its own checks and
    raises them all), else raised together as one ConfigError."""
    own = problems is None
    problems = Problems() if own else problems
    parser = build_parser()
    ns, lines = parser.parse_collecting(argv)
    if lines:
        lines[-1] += f" (python {parser.script} {parser.hint(lines)})"
    problems.extend(lines)
    ns = vars(ns)
    values = {}
    cfg_file = ns.pop("config", None)
    if cfg_file:
        problems.check(lambda: values.update(_load_yaml(cfg_file, problems)))
    values.update(ns)
    notices = megatron_flags.translate(values, problems)
    for settle in (_iters_or_samples, _mock_or_data):
        problems.check(lambda: notices.extend(settle(values, set(ns), cfg_file)))
    kept = kept_defaults(values)
    cfg = Config(config_file=cfg_file, notices=notices, defaults_note=(
        "defaults that are not Megatron-LM's, for flags not given: " + ", ".join(
            f"{flag} {ours} (Megatron-LM: {theirs})" for flag, ours, theirs in kept)) if kept else None)
    for name, value in values.items():
        setattr(getattr(cfg, FIELD_SECTION[name]), name, value)
    if own:
        problems.raise_all()
    return cfg


def _iters_or_samples(values: dict, given: set, cfg_file: Optional[str]) -> list:
    """The run's length is --train-iters or --train-samples (Megatron-LM refuses both on its command line, and
    so does this one): the command line's beats the config file's, and a file with both (a run's saved
    arguments) keeps train_samples, from which train_iters was derived. Returns the notice when one gave way."""
    both = {"train_iters", "train_samples"}
    if not both <= set(values) or values["train_samples"] is None:
        return []
    if both <= given:
        raise ConfigError("--train-iters with --train-samples: give the run's length in one of them (with "
                          "--train-samples the iterations are derived)")
    kept, dropped = ("train_iters", "train_samples") if "train_iters" in given else ("train_samples", "train_iters")
    values.pop(dropped)
    return [] if not given & both else [f"{flag_of(kept)} {values[kept]} given: {dropped} in {cfg_file} is not used"]


def _mock_or_data(values: dict, given: set, cfg_file: Optional[str]) -> list:
    """Settle --mock-data against --data-path in `values`; returns the notices that say what was chosen.

    Data that is given is trained on: a file's `mock_data: true` gives way to --data-path (or to the file's
    own data_path). Only --mock-data on the command line beats a data_path from the file; both on the
    command line contradict each other."""
    notices = []
    data, tokenizer = values.get("data_path"), values.get("tokenizer_model")
    if values.get("mock_data") and data:
        if {"mock_data", "data_path"} <= given:
            raise ConfigError("--mock-data with --data-path: choose one (--mock-data trains on synthetic tokens, "
                              "--data-path on your data)")
        if "mock_data" in given:
            values["data_path"] = None
            notices.append(f"--mock-data: training on synthetic tokens; the data_path of {cfg_file} is not used")
        else:
            values["mock_data"] = False
            where = "--data-path" if "data_path" in given else f"data_path in {cfg_file}"
            notices.append(f"{where} given: training on {' '.join(data)}, not on the synthetic tokens that "
                           f"mock_data: true in {cfg_file} asks for (pass --mock-data for those)")
    elif values.get("mock_data") and tokenizer:
        notices.append(f"--tokenizer-model {tokenizer} is not used: mock_data trains on synthetic tokens; give "
                       "--data-path to train on your data")
    return notices
