"""``mrl`` command line: plugins, run, trl, compare, doctor, worker.

The benchmarks and lab tools are not commands of the installed package: ``python -m benchmarks`` in a checkout."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from mrl_plugins.errors import MrlError


def _selection_config(ns: argparse.Namespace) -> dict:
    from mrl_plugins.adapters.trl import config_from_env
    from mrl_plugins.config import load_yaml, parse_plugin_selection

    source = ns.config or os.environ.get("MRL_PLUGINS")
    data: dict = {}
    if source:
        env_value = config_from_env(source)
        data = load_yaml(env_value) if isinstance(env_value, str) else (env_value or {})
    if ns.plugins:
        data["plugins"] = {**(data.get("plugins") or {}), **parse_plugin_selection(ns.plugins, "--plugins")}
    return data


def cmd_plugins(ns: argparse.Namespace) -> int:
    from mrl_plugins.hookspecs import REGISTRATION_HOOKS
    from mrl_plugins.manager import get_plugin_manager

    data = _selection_config(ns)
    mgr = get_plugin_manager(data, disable=ns.disable, autoload=False if ns.no_autoload else None)
    rows = mgr.plugin_infos()
    width = max(len(r.name) for r in rows) + 2
    print(f"{'plugin':<{width}}{'source':<12}{'stages':<30}active for")
    for r in rows:
        stages = ", ".join(r.stages) or "-"
        active = "blocked" if r.blocked else (", ".join(r.active_for) or "-")
        print(f"{r.name:<{width}}{r.source:<12}{stages:<30}{active}")
    for hook, (_stage, _cls, what, key) in REGISTRATION_HOOKS.items():  # every name the config can select
        table = mgr.registry(hook)
        print(f"\n{key} ({what}s):")
        width = max((len(n) for n in table), default=0) + 2
        for name in sorted(table):
            print(f"  {name:<{width}}{table[name].description or '-'}")
    return 0


def cmd_trl(argv: list[str]) -> int:
    """``mrl trl grpo --config x.yaml``: TRL's own CLI with the plugins switched on in its processes."""
    if not argv:
        print(
            "usage: mrl trl {grpo,rloo} --config x.yaml [trl options]; MRL_PLUGINS picks the mrl config "
            "(default: colocate)",
            file=sys.stderr,
        )
        return 2
    os.environ.setdefault("MRL_PLUGINS", "colocate")
    if argv[0] not in ("-h", "--help") and not {"-h", "--help"} & set(argv[1:]):
        from mrl_plugins.adapters.trl import config_from_env
        from mrl_plugins.run import preflight

        value, where = _trl_env_value(argv)
        try:  # before TRL loads the model: a typo fails in seconds
            preflight(config_from_env(value))
        except MrlError as exc:
            raise type(exc)(f"MRL_PLUGINS={value} ({where}): {exc}") from None
    from mrl_plugins._autoenable import install

    install()  # this process too (TRL may run the script in-process)
    import subprocess

    from trl.cli.main import main as trl_main

    try:
        return int(trl_main(argv) or 0)
    except subprocess.CalledProcessError as exc:  # a launched training process failed and printed why
        print(f"mrl trl: a training process exited with {exc.returncode} (its error is above)", file=sys.stderr)
        return exc.returncode or 1


def _trl_env_value(argv: list[str]) -> tuple[str, str]:
    """The ``MRL_PLUGINS`` TRL's processes will see, and where it comes from: the ``env:`` block of the TRL config
    file (TRL sets it over the environment), else the environment (``mrl trl`` defaults it to ``colocate``)."""
    from mrl_plugins.config import load_yaml

    path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if path is None and "--config" in argv[:-1]:
        path = argv[argv.index("--config") + 1]
    env = (load_yaml(path).get("env") or {}) if path and os.path.isfile(path) else {}  # TRL reports a missing one
    if isinstance(env, dict) and env.get("MRL_PLUGINS") is not None:
        return str(env["MRL_PLUGINS"]), f"the env: block of {path}"
    return os.environ["MRL_PLUGINS"], "the environment"


#: the commands that parse their own arguments -> "module:function(argv)" (imported when run)
COMMANDS = {
    "run": "mrl_plugins.run:main",
    "compare": "mrl_plugins.cli.compare:cli",
    "doctor": "mrl_plugins.cli.doctor:cli",
    "worker": "mrl_plugins.cli.worker:cli",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="mrl", description="mrl-plugins: accelerate TRL's GRPO/RLOO loops")
    sub = parser.add_subparsers(dest="command")
    p_plugins = sub.add_parser("plugins", help="list plugins, the stages they provide and which are active")
    p_plugins.add_argument("--config", help="mrl YAML config (path or bundled name: upstream, colocate, ...)")
    p_plugins.add_argument("--plugins", help="per-stage choice, e.g. rollout=mrl,weight_sync=upstream,comm=mrl")
    p_plugins.add_argument("--disable", action="append", default=[], help="block a plugin by name (repeatable)")
    p_plugins.add_argument("--no-autoload", action="store_true", help="do not load third-party entry-point plugins")
    sub.add_parser("run", help="train the embedded GRPO job with the configured plugins", add_help=False)
    sub.add_parser("trl", help="run TRL's CLI (trl grpo/rloo ...) with the plugins on", add_help=False)
    sub.add_parser("compare", help="vanilla TRL vs plugins side by side: report, JSON, plots", add_help=False)
    sub.add_parser("doctor", help="pre-run checks / post-run triage", add_help=False)
    sub.add_parser("worker", help="run a rollout worker for a trainer on another host", add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    command, rest = argv[0], argv[1:]
    try:
        if command == "plugins":
            return cmd_plugins(parser.parse_args(argv))
        if command == "trl":
            return cmd_trl(rest)
        if command in COMMANDS:
            module, _, func = COMMANDS[command].partition(":")
            return int(getattr(importlib.import_module(module), func)(rest) or 0)
        parser.parse_args(argv)  # prints the usage error for an unknown command
        return 2
    except MrlError as exc:
        print(f"mrl {command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
