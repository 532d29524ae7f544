"""The plugin manager: a small typed pass-through over ``pluggy.PluginManager`` (after tox 4's
``tox.plugin.manager``), with one registry as the lookup (after conda's ``conda/plugins``).

Built-in plugins are registered under short names (``upstream``, ``mrl.rollout`` / ``mrl.weight_sync`` /
``mrl.comm``); third-party ones come from the ``mrl_plugins`` entry-point group (unless autoload is off). Blocking
(config ``disable``, ``MRL_DISABLED_PLUGINS``, ``--disable``) happens before anything is loaded. The registration
tables and selection by name are described in :mod:`mrl_plugins.hookspecs.spec`; the selected stage objects are
called through this manager, which checks each answer against the stage's protocol
(:mod:`mrl_plugins.hookspecs.channels`).

There is no module-level manager: call :func:`get_plugin_manager` for a fresh one.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pluggy

from mrl_plugins.errors import ConfigError, PluginError, choices
from mrl_plugins.hookspecs import PROJECT_NAME, REGISTRATION_HOOKS, STAGE_HOOKS, STAGE_PROTOCOLS, STAGES, spec
from mrl_plugins.hookspecs.channels import (
    Capabilities,
    ExperienceConsumer,
    ExperienceProducer,
    RolloutRuntime,
    WeightReceiver,
    WeightSender,
    check_end,
    check_stage,
)
from mrl_plugins.hookspecs.types import StageContext

ENTRY_POINT_GROUP = "mrl_plugins"

#: short name -> "module:attribute" of the built-in plugin objects (imported lazily)
BUILTIN_PLUGINS: dict[str, str] = {
    "upstream": "mrl_plugins.upstream:UpstreamPlugin",
    "mrl.rollout": "mrl_plugins.rollout.plugin:RolloutPlugin",
    "mrl.weight_sync": "mrl_plugins.weight_sync.plugin:WeightSyncPlugin",
    "mrl.comm": "mrl_plugins.comm.plugin:CommPlugin",
}


#: the stage hooks of releases before stages were registrations -> their stage (named in the error a plugin written
#: for them gets)
REMOVED_HOOKS: dict[str, str] = {
    "mrl_rollout_open_runtime": "rollout",
    "mrl_weight_sync_capabilities": "weight_sync",
    "mrl_weight_sync_open_sender": "weight_sync",
    "mrl_weight_sync_open_receiver": "weight_sync",
    "mrl_comm_capabilities": "comm",
    "mrl_comm_open_consumer": "comm",
    "mrl_comm_open_producer": "comm",
}


@dataclass(frozen=True)
class PluginInfo:
    """One row of ``mrl plugins``."""

    name: str
    stages: tuple[str, ...]
    source: str  # "builtin" | "entrypoint" | "manual"
    active_for: tuple[str, ...]
    blocked: bool = False


def _is_blocked(name: str, disabled: Iterable[str]) -> bool:
    """``mrl`` blocks ``mrl.comm`` too; names are matched exactly otherwise."""
    return any(name == d or name.startswith(d + ".") for d in disabled)


class MrlPluginManager:
    """Typed pass-through over pluggy; build with :func:`get_plugin_manager`."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(PROJECT_NAME)
        self.pm.add_hookspecs(spec)
        self._sources: dict[str, str] = {}
        self._disabled: list[str] = []
        #: stage -> (selected name, the stage object)
        self._stages: dict[str, tuple[str, Any]] = {}
        #: registration hook -> (name -> registration, name -> providing plugin)
        self._registry: dict[str, tuple[dict[str, Any], dict[str, str]]] = {}
        self.config: Any = None
        #: how another process (a rollout worker) builds the same manager: ``factory(config)``
        #: (names in ``disable`` are checked where the run starts, not again on a worker's host, whose installed
        #: plugins may differ)
        self.factory: Callable[[Any], MrlPluginManager] = functools.partial(get_plugin_manager, check_names=False)

    # ------------------------------------------------------------------ loading
    def block(self, names: Iterable[str]) -> None:
        """Block plugin names (and ``name.*``) before loading; already-registered ones are removed, and a stage
        whose selected implementation one of them registered is unselected (its calls then raise "no plugin
        selected"); the other stages keep theirs."""
        for name in names:
            if name not in self._disabled:
                self._disabled.append(name)
            self.pm.set_blocked(name)
            for registered in [n for n, _ in self.pm.list_name_plugin() if _is_blocked(n, [name])]:
                for stage in [s for s in self._stages if self._owner(s) == registered]:
                    del self._stages[stage]
                self.pm.unregister(name=registered)
                self.pm.set_blocked(registered)
                self._sources.pop(registered, None)
        self._registry.clear()

    def register(self, plugin: Any, name: str, *, source: str = "manual") -> None:
        """Register ``plugin`` under ``name`` unless blocked.

        Raises :class:`PluginError` for a name registered twice, a hook implementation whose signature
        pluggy rejects, or one with required keyword-only parameters (pluggy never passes those, so
        the first call would fail with a ``TypeError`` deep inside a run).
        """
        if _is_blocked(name, self._disabled):
            return
        if self.pm.get_plugin(name) is not None:
            raise PluginError(f"plugin name {name!r} is registered twice ({self._sources.get(name)} and {source})")
        _check_keyword_only(plugin, name)
        try:
            self.pm.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {name!r} ({source}) is invalid: {_one_line(exc)}") from exc
        except ValueError as exc:  # the same object under a second name
            raise PluginError(f"plugin {name!r} ({source}): {_one_line(exc)}") from exc
        self._sources[name] = source
        self._registry.clear()

    def load_builtins(self) -> None:
        for name, target in BUILTIN_PLUGINS.items():
            if _is_blocked(name, self._disabled):
                continue
            module, _, attr = target.partition(":")
            self.register(getattr(importlib.import_module(module), attr)(), name, source="builtin")

    def load_entry_points(self) -> None:
        """Load the ``mrl_plugins`` entry points that are not blocked (blocked ones are never imported).

        An entry point may name a module, an instance or a class (instantiated without arguments).
        The same entry point seen twice on ``sys.path`` is loaded once; two different entry points
        with one name, or one named like a built-in, is a :class:`PluginError`.
        """
        from importlib.metadata import entry_points

        seen: dict[str, str] = {}
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if _is_blocked(ep.name, self._disabled):
                continue
            if ep.name in seen:
                if seen[ep.name] == ep.value:
                    continue
                raise PluginError(
                    f"plugin name {ep.name!r} is provided by two entry points: {seen[ep.name]} and {ep.value}"
                )
            seen[ep.name] = ep.value
            if self.pm.get_plugin(ep.name) is not None:
                raise PluginError(
                    f"entry point {ep.name!r} ({ep.value}) clashes with the "
                    f"{self._sources.get(ep.name)} plugin of that name"
                )
            try:
                plugin = ep.load()
                if inspect.isclass(plugin):
                    plugin = plugin()
            except Exception as exc:  # noqa: BLE001 - name the broken plugin, keep the cause
                raise PluginError(f"entry point {ep.name!r} ({ep.value}) failed to load: {exc}") from exc
            self.register(plugin, ep.name, source="entrypoint")

    # ------------------------------------------------------------------ the registry: the one lookup
    def registry(self, hook: str) -> dict[str, Any]:
        """name -> registration for one registration hook; duplicate names raise naming both providers."""
        return dict(self._table(hook)[0])

    def _table(self, hook: str) -> tuple[dict[str, Any], dict[str, str]]:
        if hook not in self._registry:
            if hook not in REGISTRATION_HOOKS:
                raise PluginError(f"unknown registration hook {hook!r}; valid: {choices(REGISTRATION_HOOKS)}")
            _stage, cls, what, _key = REGISTRATION_HOOKS[hook]
            table: dict[str, Any] = {}
            owners: dict[str, str] = {}
            for impl in getattr(self.pm.hook, hook).get_hookimpls():
                if _is_wrapper(impl):
                    continue
                returned = impl.function()
                if returned is None:
                    continue
                if isinstance(returned, str | bytes) or not isinstance(returned, Iterable):
                    raise PluginError(
                        f"plugin {impl.plugin_name!r}: {hook} returned {type(returned).__name__}, expected an "
                        f"iterable of {cls.__name__}"
                    )
                for reg in returned:
                    if not isinstance(reg, cls):
                        raise PluginError(
                            f"plugin {impl.plugin_name!r}: {hook} returned a {type(reg).__name__}, "
                            f"expected {cls.__name__}"
                        )
                    if reg.name in table:
                        raise PluginError(
                            f"{what} {reg.name!r} is registered by both {owners[reg.name]!r} and {impl.plugin_name!r}"
                        )
                    table[reg.name] = reg
                    owners[reg.name] = impl.plugin_name
            self._registry[hook] = (table, owners)
        return self._registry[hook]

    def backend(self, hook: str, name: str) -> Any:
        """The registration called ``name`` (ConfigError naming the key and the valid choices otherwise)."""
        table = self._table(hook)[0]
        if name not in table:
            _stage, _cls, what, key = REGISTRATION_HOOKS[hook]
            raise ConfigError(f"{key}: unknown {what} {name!r}; valid: {choices(table)}")
        return table[name]

    def _owner(self, stage: str) -> str | None:
        """The plugin that registered the implementation selected for ``stage``."""
        return self._table(STAGE_HOOKS[stage])[1].get(self._stages[stage][0]) if stage in self._stages else None

    def _provided(self, plugin_name: str) -> tuple[str, ...]:
        """The stages ``plugin_name`` registers an implementation of."""
        return tuple(s for s in STAGES if plugin_name in self._table(STAGE_HOOKS[s])[1].values())

    def plugin_infos(self) -> list[PluginInfo]:
        rows = []
        for name, plugin in sorted(self.pm.list_name_plugin(), key=lambda x: x[0]):
            if plugin is None:
                continue
            active = tuple(s for s in self._stages if self._owner(s) == name)
            rows.append(PluginInfo(name, self._provided(name), self._sources.get(name, "manual"), active))
        for name in self._disabled:
            rows.append(PluginInfo(name, (), "blocked", (), blocked=True))
        return rows

    # ------------------------------------------------------------------ selection
    def select(self, selection: dict[str, str]) -> None:
        """Select one implementation per stage by name (all stages must be given) and build it; errors raise before
        anything changes. The one check of the combination: TRL's own rollout (``upstream``) leaves nothing for
        another plugin's weight sync or experience transfer to serve."""
        unknown = sorted(set(selection) - set(STAGES))
        if unknown:
            raise PluginError(f"unknown stage {unknown[0]!r}; valid stages: {choices(STAGES)}")
        missing = [stage for stage in STAGES if stage not in selection]
        if missing:
            raise PluginError(f"select: missing stage {missing[0]!r}; every stage needs a plugin: {choices(STAGES)}")
        tables = {}
        for stage in STAGES:
            tables[stage] = self._table(STAGE_HOOKS[stage])
            if selection[stage] not in tables[stage][0]:
                raise PluginError(self._unknown(stage, selection[stage], tables[stage][0]))
        if selection["rollout"] == "upstream":
            for stage in [s for s in STAGES if s != "rollout" and selection[s] != "upstream"]:
                raise ConfigError(
                    f"plugins.{stage}: {selection[stage]!r} needs a separate inference copy, which only a rollout "
                    f"plugin other than 'upstream' creates (TRL's own rollout generates with the training model); "
                    f"set plugins.rollout: mrl or plugins.{stage}: upstream"
                )
        built = {}
        for stage in STAGES:
            name, (table, owners) = selection[stage], tables[stage]
            try:
                obj = table[name].factory()
            except Exception as exc:  # noqa: BLE001 - name the plugin whose stage could not be built, keep the cause
                raise PluginError(
                    f"plugins.{stage}: plugin {name!r} (from {owners[name]!r}) failed to build: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            check_stage(obj, STAGE_PROTOCOLS[stage], f"plugins.{stage}: plugin {name!r}")
            built[stage] = (name, obj)
        self._stages = built

    def _unknown(self, stage: str, name: str, table: dict[str, Any]) -> str:
        """Why ``name`` is not a plugin for ``stage``: blocked (``mrl`` blocks ``mrl.<stage>``) or unknown; a blocked
        plugin registers nothing, so the blocked names are listed beside the available ones."""
        available = f"available for {stage}: {choices(table)}"
        if _is_blocked(name, self._disabled) or _is_blocked(f"{name}.{stage}", self._disabled):
            return f"plugins.{stage}: {name!r} is blocked (disable list, MRL_DISABLED_PLUGINS); {available}"
        unasked = f" (blocked, so not asked: {', '.join(self._disabled)})" if self._disabled else ""
        return f"plugins.{stage}: unknown plugin {name!r}; {available}{unasked}"

    @property
    def selected(self) -> dict[str, str]:
        """stage -> the selected name, as configured (``mrl``, ``upstream``, a third party's)."""
        return {stage: name for stage, (name, _obj) in self._stages.items()}

    def is_upstream(self, stage: str) -> bool:
        return self.selected.get(stage) == "upstream"

    def validate_backends(self, config: Any) -> None:
        """Check every backend name in ``config`` against the registrations; a section that reads what its backend
        declares (``check_backend(key, registration, registrations)``, e.g. the engine's capabilities) checks it
        and sets what follows from it here, before anything is built.

        Only the built-in ``mrl`` stages read those keys: for a stage another plugin runs (``upstream``, a third
        party's) they are skipped.
        """
        for hook, (stage, _cls, _what, key) in REGISTRATION_HOOKS.items():
            section, _, field = key.partition(".")
            if section == "plugins" or (self._stages and self.selected.get(stage) != "mrl"):
                continue
            part = getattr(config, section)
            registration = self.backend(hook, getattr(part, field))
            check = getattr(part, "check_backend", None)
            if callable(check):
                check(field, registration, self.registry(hook))

    # ------------------------------------------------------------------ lifecycle
    def configure(self, config: Any) -> None:
        self.config = config
        self.pm.hook.mrl_configure.call_historic(kwargs={"config": config})

    def shutdown(self, ctx: Any, reason: str = "normal") -> None:
        """Call every plugin's ``mrl_shutdown``, each on its own: one that raises does not stop the others.

        The first failure is raised afterwards as :class:`PluginError` naming the plugin.
        """
        hook = self.pm.hook.mrl_shutdown
        impls = [impl for impl in reversed(hook.get_hookimpls()) if not _is_wrapper(impl)]
        plugins = [impl.plugin for impl in impls]
        failures: list[tuple[str, BaseException]] = []
        for impl in impls:
            others = [p for p in plugins if p is not impl.plugin]
            try:
                self.pm.subset_hook_caller("mrl_shutdown", remove_plugins=others)(ctx=ctx, reason=reason)
            except Exception as exc:  # noqa: BLE001 - keep shutting the other plugins down
                failures.append((impl.plugin_name, exc))
        if failures:
            name, exc = failures[0]
            rest = ", ".join(n for n, _ in failures[1:])
            more = f" (and {len(failures) - 1} more: {rest})" if len(failures) > 1 else ""
            raise PluginError(f"mrl_shutdown failed in plugin {name!r}: {type(exc).__name__}: {exc}{more}") from exc

    # ------------------------------------------------------------------ the stages, pass-through
    def _call(self, stage: str, method: str, ctx: Any, protocol: type, **kwargs: Any) -> Any:
        """``method`` of the object selected for ``stage``; an answer of ``None``, or one that is not a ``protocol``,
        is one PluginError naming the method and the plugin."""
        if stage not in self._stages:
            raise PluginError(f"no plugin selected for stage {stage!r}; call select() first")
        name, obj = self._stages[stage]
        if getattr(ctx, "plugins", None) is None:
            ctx.plugins = self
        result = getattr(obj, method)(ctx=ctx, **kwargs)
        if result is None:
            raise PluginError(f"{stage} plugin {name!r}: {method} returned None, expected {protocol.__name__}")
        return check_end(result, protocol, method, f"{stage} plugin {name!r}")

    def rollout_open_runtime(self, *, ctx: Any, setup: Any) -> Any:
        """The selected rollout plugin's :class:`~mrl_plugins.hookspecs.channels.RolloutRuntime`."""
        return self._call("rollout", "open_runtime", ctx, RolloutRuntime, setup=setup)

    def capabilities(self, stage: str, ctx: Any = None) -> Any:
        """What the selected plugin's ends of ``stage`` (``weight_sync`` or ``comm``) can do, before any is opened."""
        if stage not in ("weight_sync", "comm"):
            raise PluginError(f"capabilities: valid stages are {choices(('weight_sync', 'comm'))}, got {stage!r}")
        ctx = ctx if ctx is not None else StageContext(config=self.config, plugins=self)
        return self._call(stage, "capabilities", ctx, Capabilities)

    def weight_sync_open_sender(
        self, *, ctx: Any, model_id: str, run_id: str, receivers: int, same_process: bool = False
    ) -> Any:
        return self._call(
            "weight_sync", "open_sender", ctx, WeightSender,
            model_id=model_id, run_id=run_id, receivers=receivers, same_process=same_process,
        )  # fmt: skip

    def weight_sync_open_receiver(self, *, ctx: Any, model: Any, handle: Any, model_id: str, rank: int = 0) -> Any:
        return self._call(
            "weight_sync", "open_receiver", ctx, WeightReceiver,
            model=model, handle=handle, model_id=model_id, rank=rank,
        )  # fmt: skip

    def weight_sync_name_map(self, model_id: str) -> Callable[[str], str] | None:
        """``name -> receiving name`` from :func:`~mrl_plugins.hookspecs.spec.mrl_weight_sync_map_name` (answers
        cached), or ``None`` when no plugin implements that hook."""
        hook = self.pm.hook.mrl_weight_sync_map_name
        if not any(not _is_wrapper(impl) for impl in hook.get_hookimpls()):
            return None
        cache: dict[str, str] = {}

        def name_map(name: str) -> str:
            if name not in cache:
                mapped = hook(model_id=model_id, name=name)
                cache[name] = name if mapped is None else str(mapped)
            return cache[name]

        return name_map

    def comm_open_consumer(self, *, ctx: Any, run_id: str, producers: int) -> Any:
        return self._call("comm", "open_consumer", ctx, ExperienceConsumer, run_id=run_id, producers=producers)

    def comm_open_producer(self, *, ctx: Any, handle: Any, index: int) -> Any:
        return self._call("comm", "open_producer", ctx, ExperienceProducer, handle=handle, index=index)


def _one_line(exc: BaseException) -> str:
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def _is_wrapper(impl: Any) -> bool:
    return bool(getattr(impl, "wrapper", False) or getattr(impl, "hookwrapper", False))


def _check_keyword_only(plugin: Any, name: str) -> None:
    """Refuse hook implementations with required keyword-only parameters (pluggy passes only positional ones)."""
    for attr in dir(plugin):
        if not attr.startswith("mrl_"):
            continue
        func = getattr(plugin, attr, None)
        if not callable(func) or getattr(func, f"{PROJECT_NAME}_impl", None) is None:
            continue
        try:
            params = inspect.signature(func).parameters.values()
        except (TypeError, ValueError):
            continue
        kwonly = [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is p.empty]
        if kwonly:
            raise PluginError(
                f"plugin {name!r}: hook {attr} declares keyword-only parameters {kwonly}; pluggy passes hook "
                f"arguments positionally, so declare them as plain parameters (drop the '*')"
            )


def get_plugin_manager(
    config: Any = None,
    *,
    disable: Iterable[str] | str = (),
    autoload: bool | None = None,
    plugins: Iterable[tuple[str, Any]] = (),
    select: bool = True,
    check_names: bool = True,
) -> MrlPluginManager:
    """Build a fresh manager for ``config`` (an :class:`~mrl_plugins.config.MrlConfig`, path, dict or None).

    Order: block (config + env + ``disable``; each name must name a plugin: :func:`check_disable`) -> built-ins ->
    ``plugins`` given here -> entry points (unless autoload is off) -> ``check_pending`` -> stage selection (the
    selected stage objects are built) -> backend-name validation -> ``mrl_configure``.
    Every error is raised before the caller has applied anything.
    """
    from mrl_plugins.config import apply_env_overrides, load_config

    if isinstance(disable, str):  # "a,b" like MRL_DISABLED_PLUGINS, not the letters of one name
        disable = [n.strip() for n in disable.split(",") if n.strip()]
    loaded = load_config(config)
    cfg = apply_env_overrides(loaded)
    if check_names:  # a misspelt name would block nothing (off for a worker: see MrlPluginManager.factory)
        manual = [name for name, _plugin in plugins]
        check_disable(loaded.disable, "disable", manual)
        check_disable([n for n in cfg.disable if n not in loaded.disable], "MRL_DISABLED_PLUGINS", manual)
        check_disable(disable, "--disable", manual)
    mgr = MrlPluginManager()
    mgr.block([*cfg.disable, *disable])
    mgr.load_builtins()
    for name, plugin in plugins:
        mgr.register(plugin, name)
    if cfg.autoload if autoload is None else autoload:
        mgr.load_entry_points()
    try:
        mgr.pm.check_pending()
    except pluggy.PluginValidationError as exc:
        name = mgr.pm.get_name(exc.plugin) or repr(exc.plugin)
        old = [h for h in REMOVED_HOOKS if h in str(exc)]
        hint = (
            f"; {old[0]} and the other stage hooks became methods of a stage object registered by "
            f"mrl_<stage>_register_stages (mrl_{REMOVED_HOOKS[old[0]]}_register_stages; see docs/plugins.md)"
            if old
            else ""
        )
        raise PluginError(f"plugin {name!r} implements an unknown hook: {_one_line(exc)}{hint}") from exc
    if select:
        mgr.select(cfg.plugins.as_dict())
        mgr.validate_backends(cfg)
    mgr.configure(cfg)
    return mgr


def check_disable(names: Iterable[str], what: str, registered: Iterable[str] = ()) -> None:
    """Refuse a name that blocks no plugin: a plugin name (a built-in, an ``mrl_plugins`` entry point, not loaded,
    or one of ``registered``, given to :func:`get_plugin_manager`), or a prefix such as ``mrl`` (blocks ``mrl.*``).
    Called once, where the manager is built."""
    from importlib.metadata import entry_points

    names = list(names)
    if not names:
        return
    known = {*BUILTIN_PLUGINS, *registered, *(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))}
    valid = {*known, *(n.rsplit(".", 1)[0] for n in known if "." in n)}
    for name in names:
        if name not in valid:
            raise ConfigError(f"{what}: unknown plugin {name!r}; valid: {choices(valid)}")
