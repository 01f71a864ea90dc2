"""Checks of a composed config, before Hydra instantiates or configures anything from it.

- ``trust.*`` and ``store.trust`` hold what the command line said and nothing else: a value
  from a config group file, a preset, ``--config-dir``, a sweep parameter or a resumed run's
  saved config is refused, naming the file it came from and the line that would allow it;
- ``store.trust=true`` trusts a bucket (``store.dir=s3://...``) only when the command line
  names that bucket too (or ``JAXAOT_TRUST_STORE`` does): a config may choose where the store
  is, never which bucket is trusted;
- ``hydra.job.env_set`` sets no variable that decides what jaxaot trusts or which code a
  process loads (``JAXAOT_*`` trust variables, ``JAXAOT_STORE_DIR``, what a bucket client reads
  its endpoint and credentials from: ``AWS_*``, ``FSSPEC_*``, ``GOOGLE_*``, ``CLOUDSDK_*``,
  ``STORAGE_EMULATOR_HOST``; ``HOME``, ``XDG_CONFIG_HOME``, ``PATH``,
  ``PYTHON*``, ``LD_*``, and what JAX, XLA, CUDA or glibc load code or binaries from:
  ``PJRT_*``, ``TPU_*``, ``CUDA_*``, ``NCCL_*``, ``GCONV_PATH``, ``XLA_FLAGS``,
  ``LIBTPU_INIT_ARGS``), unless the command line sets it;
- a logging file handler's ``filename`` ends in ``.log`` (a ``.pth`` file in site-packages is
  code Python runs at start-up, a shell rc file code the shell runs);
- ``compile.compiler_options.xla_gpu_cuda_data_dir`` (whose ``bin/ptxas`` jaxaot and XLA run)
  comes from the command line or is the installed nvidia-cuda-nvcc package's folder;
- ``hydra.launcher.setup``, ``srun_args`` and ``additional_parameters`` (lines and options
  of the SLURM batch script) come from the command line: jaxaot's shipped launcher config sets
  them empty; no launcher string holds a line break;
- the user file ``~/.config/jaxaot/trust.yaml`` is outside every config search path;
- every name Hydra will import goes through the policy: each ``_target_`` at any depth of
  ``hydra.callbacks``, ``hydra.sweeper`` and ``hydra.launcher``, and each ``class``, ``()``
  and ``ext://`` name of ``hydra.job_logging`` and ``hydra.hydra_logging``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from jaxaot.compat.hydra import ENV_UNTESTED
from jaxaot.config.trust.policy import ALLOW_KEY, DENY_KEY, ENV_ALLOW, ImportPolicy, check_name
from jaxaot.config.trust.rules import HYDRA, LOGGING
from jaxaot.config.trust.sources import (
    ENV_COMMAND_LINE,
    ENV_STORE,
    STORE_KEY,
    CommandLine,
    command_line,
    user_file,
)
from jaxaot.errors import ConfigError
from jaxaot.util.store_root import ENV_STORE_DIR, bucket_trusted_by_env, is_scheme_url

Origin = Callable[[str], "str | None"]
_ABSENT = object()
_SENSITIVE = frozenset(
    {
        *(ENV_ALLOW, ENV_STORE, ENV_COMMAND_LINE, ENV_UNTESTED, "HOME", "XDG_CONFIG_HOME", "PATH"),
        *(ENV_STORE_DIR, "STORAGE_EMULATOR_HOST"),  # which bucket, which server answers for it
        *("GCONV_PATH", "XLA_FLAGS", "LIBTPU_INIT_ARGS"),  # path flags: binaries run from a folder
        # who answers a bucket's or a tracking server's requests, and which certificates pass
        *(p.upper() for p in ("http_proxy", "https_proxy", "all_proxy", "no_proxy")),
        *("http_proxy", "https_proxy", "all_proxy", "no_proxy"),
        *("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE", "SSL_CERT_DIR"),
    }
)
# PJRT_NAMES_AND_LIBRARY_PATHS: .so files jax loads; CUDA_INJECTION64_PATH: one libcuda loads.
# AWS_*, FSSPEC_*, GOOGLE_*, CLOUDSDK_*, GCLOUD_*: a bucket client's endpoint, credentials and
# configuration files (s3fs/botocore, gcsfs); MLFLOW_*: where tracked runs and their files go.
_SENSITIVE_PREFIXES = (
    *("PYTHON", "LD_", "DYLD_", "PJRT_", "TPU_", "CUDA_", "NCCL_"),
    *("AWS_", "FSSPEC_", "GOOGLE_", "CLOUDSDK_", "GCLOUD_", "MLFLOW_"),
)
STORE_DIR_KEY = "store.dir"
CUDA_DATA_DIR_KEY = "compile.compiler_options.xla_gpu_cuda_data_dir"
_LAUNCHER_KEYS = ("setup", "srun_args", "additional_parameters")
_TARGET_ROOTS = ("hydra.callbacks", "hydra.sweeper", "hydra.launcher")
_LOGGING_ROOTS = ("hydra.job_logging", "hydra.hydra_logging")


def _no_origin(_key: str) -> str | None:
    return None


def quoted(rule: Any) -> str:
    """A rule as a Hydra override list item: ``'*'`` needs quotes, dotted names do not."""
    return str(rule) if str(rule).replace(".", "").replace("_", "").isalnum() else f"'{rule}'"


def _shown(key: str, value: Any) -> str:
    if key == STORE_KEY:
        return f"{key}={'true' if value else 'false'}"
    return f"{key}=[{','.join(map(quoted, value))}]"


def check_trust_values(
    cfg: Any, expected: CommandLine, origin: Origin = _no_origin, where: str = ""
) -> None:
    """``trust.*`` and ``store.trust`` in ``cfg`` are what ``expected`` (the command line's)
    says; anything else came from a config and is refused."""
    from omegaconf import OmegaConf

    for key in (ALLOW_KEY, DENY_KEY, STORE_KEY):
        node = OmegaConf.select(cfg, key, default=_ABSENT, throw_on_resolution_failure=False)
        if node is _ABSENT or node is None:
            continue
        value = OmegaConf.to_container(node) if OmegaConf.is_config(node) else node
        want = expected.value(key)
        same = value == want if key == STORE_KEY else _dotted_list(value) == _dotted_list(want)
        if same:
            continue
        came = origin(key) or where or "a config file, not the command line"
        fix = f"give {_shown(key, value)} on the command line"
        if key == ALLOW_KEY and isinstance(value, list):
            fix += f" or set {ENV_ALLOW}={','.join(map(quoted, value))}"
        elif key == STORE_KEY:
            where_ = OmegaConf.select(cfg, STORE_DIR_KEY, default=None)
            bucket = str(where_).strip() if is_scheme_url(where_) else None
            # JAXAOT_TRUST_STORE=1 trusts folders; a bucket only by its URL
            fix += f" or set {ENV_STORE}={bucket}" if bucket else f" or set {ENV_STORE}=1"
        raise ConfigError(
            f"{_shown(key, value)} comes from {came}: only your command line, environment or "
            f"{user_file()} may change what jaxaot trusts, never a config; if you trust it, {fix}"
        )


def check_store_bucket(cfg: Any, overrides: list[str], origin: Origin = _no_origin) -> None:
    """``store.trust=true`` with ``store.dir`` a bucket URL: that URL is the command line's
    (``overrides``) or ``JAXAOT_TRUST_STORE`` names it; a bucket a config chose is refused."""
    from omegaconf import OmegaConf

    trust = OmegaConf.select(cfg, STORE_KEY, default=None, throw_on_resolution_failure=False)
    where = OmegaConf.select(cfg, STORE_DIR_KEY, default=None, throw_on_resolution_failure=False)
    if trust is not True or not is_scheme_url(where):
        return
    url = str(where).strip()
    given = _given(overrides, STORE_DIR_KEY)
    if (given is not _ABSENT and str(given).strip() == url) or bucket_trusted_by_env(url):
        return
    came = origin(STORE_DIR_KEY) or "a config file, not the command line"
    raise ConfigError(
        f"{STORE_DIR_KEY}={url} comes from {came}, and store.trust=true would trust every "
        "entry in that bucket: a config may choose where the store is, never which bucket is "
        f"trusted; if you trust it, give {STORE_DIR_KEY}={url} on the command line with "
        f"store.trust=true, or set {ENV_STORE}={url}"
    )


def _dotted_list(value: Any) -> list[str] | Any:
    if isinstance(value, list | tuple):
        return [str(v).strip().replace(":", ".") for v in value]
    return value


def check_env_set(cfg: Any, expected: CommandLine, origin: Origin = _no_origin) -> None:
    from omegaconf import OmegaConf

    env_set = OmegaConf.select(cfg, "hydra.job.env_set", default=None)
    if not env_set:
        return
    for name in env_set:
        name = str(name)
        if name in expected.env_set:
            continue
        if name not in _SENSITIVE and not name.startswith(_SENSITIVE_PREFIXES):
            continue
        key = f"hydra.job.env_set.{name}"
        value = OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)
        if value is not None and str(value) == os.environ.get(name):
            continue  # env_copy, or the value it has anyway
        came = origin(key) or "a config file, not the command line"
        raise ConfigError(
            f"{key}={value!r} (from {came}) would set a variable that decides what jaxaot "
            "trusts or which code a process loads; a config may not: set it in your shell, "
            f"or give {key}=... on the command line"
        )


def override_value(line: str) -> Any:
    """The value the override ``line`` (``key=value``) gives, as Hydra parses it; the text after
    the first ``=`` where Hydra's grammar refuses it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_override(line).value()
    except Exception:
        return line.split("=", 1)[1]


def _given(overrides: list[str], key: str) -> Any:
    """The value the override of exactly ``key`` gives (the last one), or ``_ABSENT``."""
    found: Any = _ABSENT
    for line in overrides:
        name = line.lstrip("+~").split("=", 1)[0].strip()
        if name == key and "=" in line:
            found = override_value(line)
    return found


def _plain(value: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def check_log_files(cfg: Any, origin: Origin = _no_origin) -> None:
    """Every logging handler ``filename`` of ``hydra.job_logging`` / ``hydra.hydra_logging``
    ends in ``.log`` (as written, or resolved where it can be already)."""
    from omegaconf import OmegaConf

    for root in _LOGGING_ROOTS:
        node = OmegaConf.select(cfg, root, default=None, throw_on_resolution_failure=False)
        if node is None or not OmegaConf.is_config(node):
            continue
        tree = OmegaConf.to_container(node, resolve=False)
        for path, value in _keyed(tree, root, ("filename",)):
            shown = _resolved(cfg, path, value)
            if value.endswith(".log") and shown.endswith(".log"):
                continue
            came = _leaf_origin(origin, path) or "a config file"
            raise ConfigError(log_file_refusal(path, shown, came))


def log_file_refusal(key: str, filename: str, came: str) -> str:
    return (
        f"{key}={filename!r} (from {came}) is a logging file handler's file not ending in "
        ".log: a log handler may write only *.log files (Python runs a .pth file's lines at "
        "start-up, a shell its rc file); name a file ending in .log"
    )


def _nvcc_dir() -> str | None:
    """The installed nvidia-cuda-nvcc package's root (jaxaot.targets.cuda.cuda_data_dir's)."""
    from importlib import metadata

    try:
        files = metadata.files("nvidia-cuda-nvcc-cu12") or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if str(f).replace("\\", "/").endswith("cuda_nvcc/bin/ptxas"):
            return str(Path(str(f.locate())).parent.parent.resolve())
    return None


def check_cuda_data_dir(cfg: Any, overrides: list[str], origin: Origin = _no_origin) -> None:
    """``compile.compiler_options.xla_gpu_cuda_data_dir`` (jaxaot and XLA run its
    ``bin/ptxas``) is the command line's or the installed nvcc package's folder."""
    from omegaconf import OmegaConf

    value = OmegaConf.select(
        cfg, CUDA_DATA_DIR_KEY, default=None, throw_on_resolution_failure=False
    )
    if value is None or str(value) == "":
        return
    if str(_given(overrides, CUDA_DATA_DIR_KEY)) == str(value):
        return
    if str(Path(str(value)).expanduser().resolve()) == _nvcc_dir():
        return
    came = origin(CUDA_DATA_DIR_KEY) or "a config file, not the command line"
    raise ConfigError(
        f"{CUDA_DATA_DIR_KEY}={str(value)!r} (from {came}) names the folder whose bin/ptxas "
        "jaxaot and XLA run; a config may not: give "
        f"{CUDA_DATA_DIR_KEY}={value} on the command line, or drop it (the installed "
        "nvidia-cuda-nvcc-cu12 is used)"
    )


def check_launcher(cfg: Any, overrides: list[str], origin: Origin = _no_origin) -> None:
    """``hydra.launcher.setup``, ``srun_args`` and each ``additional_parameters`` entry are the
    command line's (or empty); no launcher string holds a line break."""
    from omegaconf import OmegaConf

    node = OmegaConf.select(cfg, "hydra.launcher", default=None, throw_on_resolution_failure=False)
    if node is None or not OmegaConf.is_config(node):
        return
    tree = OmegaConf.to_container(node, resolve=False)
    for path, text, _is_key in _strings_and_keys(tree, "hydra.launcher"):
        if "\n" in text or "\r" in text:
            came = _leaf_origin(origin, path) or origin(path) or "a config file"
            raise ConfigError(
                f"{path}={text!r} (from {came}) holds a line break, which would add a line to "
                "the batch script; give it as one line"
            )
    for name in _LAUNCHER_KEYS:
        key = f"hydra.launcher.{name}"
        value = _plain(OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False))
        if not value:
            continue
        given = _given(overrides, key)
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, item in items:
            leaf = key if sub is None else f"{key}.{sub}"
            if sub is None:
                mine = given
            elif isinstance(given, dict) and sub in given:
                mine = given[sub]
            else:
                mine = _given(overrides, leaf)
            if mine is not _ABSENT and (mine == item or str(mine) == str(item)):
                continue
            came = origin(leaf) or "a config file, not the command line"
            raise ConfigError(
                f"{leaf}={item!r} (from {came}) goes into the SLURM batch script, which runs it; "
                f"a config may not set it: give {leaf}=... on the command line"
            )


def check_sweep_parameters(cfg: Any, origin: Origin = _no_origin) -> None:
    """No ``trust.*`` or ``store.trust`` among a sweeper's parameters (they become each job's
    overrides)."""
    from omegaconf import OmegaConf

    sweeper = OmegaConf.select(cfg, "hydra.sweeper", default=None)
    if sweeper is None:
        return
    tree = OmegaConf.to_container(sweeper, resolve=False)
    trusting = OmegaConf.select(cfg, STORE_KEY, default=None) is True
    for path, text, is_key in _strings_and_keys(tree, "hydra.sweeper"):
        key = text.lstrip("+~").split("=", 1)[0].strip()
        setting = key in ("trust", STORE_KEY) or key.startswith("trust.")
        if key.lstrip("+") == STORE_DIR_KEY and trusting and (is_key or "=" in text):
            # each job's value becomes its override, which check_store_bucket takes as given
            raise ConfigError(
                f"{path}: a sweep parameter sets {STORE_DIR_KEY} (from "
                f"{origin(path) or 'a config'}) while store.trust=true; a config may not choose "
                f"the bucket a job trusts: sweep over {STORE_DIR_KEY} on the command line"
            )
        if key.lstrip("+") == CUDA_DATA_DIR_KEY and (is_key or "=" in text):
            raise ConfigError(
                f"{path}: a sweep parameter sets {CUDA_DATA_DIR_KEY} (from "
                f"{origin(path) or 'a config'}), the folder whose bin/ptxas jaxaot and XLA run; "
                "a config may not: sweep over it on the command line"
            )
        if setting and (is_key or "=" in text):
            raise ConfigError(
                f"{path}: a sweep parameter sets {key} (from {origin(path) or 'a config'}); "
                "the import policy comes from your command line, the same for every job"
            )


def _strings_and_keys(tree: Any, path: str) -> Iterator[tuple[str, str, bool]]:
    """(path, text, is_key) of every dict key and string value in a plain tree."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield f"{path}.{k}", str(k), True
            yield from _strings_and_keys(v, f"{path}.{k}")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _strings_and_keys(v, f"{path}[{i}]")
    elif isinstance(tree, str):
        yield path, tree, False


def _source_folder(path: str, schema: str) -> Path | None:
    if schema == "file":
        return Path(path).resolve()
    if schema == "pkg":  # allowed by the search-path guard already, and imported by Hydra
        try:
            spec = importlib.util.find_spec(path.replace("/", "."))
        except (ImportError, ValueError):
            return None
        locations = list(spec.submodule_search_locations or []) if spec else []
        return Path(locations[0]).resolve() if locations else None
    return None


def check_user_file_location(sources: list[tuple[str, str]]) -> None:
    """The user file lies outside every config search path folder (``(path, schema)``)."""
    path = user_file()
    if not path.is_file():
        return
    real = path.resolve()
    for where, schema in sources:
        folder = _source_folder(where, schema)
        if folder is not None and (folder == real.parent or folder in real.parents):
            raise ConfigError(
                f"{path} lies inside the config search path {schema}://{where}: a config folder "
                "that travels would carry its own import policy; move the file out, or point "
                "XDG_CONFIG_HOME elsewhere"
            )


def _leaf_origin(origin: Origin, path: str) -> str | None:
    return origin(path.rsplit(".", 1)[0]) if "." in path else None


def hydra_names(cfg: Any) -> Iterator[tuple[str, str, str]]:
    """(key, name, scope) of every import path Hydra will resolve from ``cfg``."""
    from omegaconf import OmegaConf

    for root in _TARGET_ROOTS:
        node = OmegaConf.select(cfg, root, default=None, throw_on_resolution_failure=False)
        if node is not None and OmegaConf.is_config(node):
            tree = OmegaConf.to_container(node, resolve=False)
            for path, value in _keyed(tree, root, ("_target_",)):
                yield path, _resolved(cfg, path, value), HYDRA
    for root in _LOGGING_ROOTS:
        node = OmegaConf.select(cfg, root, default=None, throw_on_resolution_failure=False)
        if node is not None and OmegaConf.is_config(node):
            tree = OmegaConf.to_container(node, resolve=False)
            for path, value in _keyed(tree, root, ("class", "()", "queue", "listener")):
                yield path, _resolved(cfg, path, value), LOGGING
            for path, value, is_key in _strings_and_keys(tree, root):
                if not is_key and value.startswith("ext://"):
                    yield path, value[len("ext://") :], LOGGING


def _keyed(tree: Any, path: str, keys: tuple[str, ...]) -> Iterator[tuple[str, str]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            if k in keys and isinstance(v, str):
                yield f"{path}.{k}", v
            else:
                yield from _keyed(v, f"{path}.{k}", keys)
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _keyed(v, f"{path}[{i}]", keys)


def _resolved(cfg: Any, path: str, value: str) -> str:
    """An interpolated name resolved as Hydra will (``${...}``); as written when it cannot be
    yet (Hydra's own guard checks it when it resolves)."""
    if "${" not in value:
        return value
    from omegaconf import OmegaConf

    parent, _, leaf = path.rpartition(".")
    node = OmegaConf.select(cfg, parent, default=None, throw_on_resolution_failure=False)
    try:
        return str(node[leaf]) if node is not None else value
    except Exception:
        return value


def check_hydra_names(cfg: Any, policy: ImportPolicy, origin: Origin = _no_origin) -> None:
    for key, name, scope in hydra_names(cfg):
        if "${" in name:
            continue
        check_name(name, key, policy, scope, origin=functools.partial(_leaf_origin, origin, key))


def check_task_config(cfg: Any) -> None:
    """In the ``jaxaot`` task function (any process, any launcher): the job's ``trust.*`` and
    ``store.trust`` are the command line's."""
    if os.environ.get(ENV_COMMAND_LINE):
        check_trust_values(cfg, command_line(), where="a config or a sweep parameter")


__all__ = [
    "check_cuda_data_dir",
    "check_env_set",
    "check_hydra_names",
    "check_launcher",
    "check_log_files",
    "check_store_bucket",
    "check_sweep_parameters",
    "check_task_config",
    "check_trust_values",
    "check_user_file_location",
    "hydra_names",
    "log_file_refusal",
    "override_value",
]
