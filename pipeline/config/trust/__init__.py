"""Which importable names jaxaot imports, and who decides: one policy for every import point.

A config names Python code that jaxaot or Hydra imports and calls: ``program.target`` (with its
static arguments), ``_pytree_`` classes, ``lower.scoped_metadata`` targets, the pytree classes
a checkpoint's ``lowered.json`` names, every ``_target_`` Hydra instantiates (callbacks,
sweeper, launcher, at any depth), the names of Hydra's logging configs and the modules of a
config search path. Every one goes through the policy:

- rules.py: what is allowed by default (the JAX ecosystem, jaxaot's examples, the user's own
  code) and what is refused inside it (files, processes, the network, pickle), and why;
- policy.py: judging a name before import and what it resolved to after;
- sources.py: where the user's rules come from (command line, environment, user file),
  never from a config;
- composed.py: a composed config holds no rules of its own, and Hydra's names pass;
- hydra_guard.py: the Hydra internals that are wrapped to apply all of this.

README.md "Trust model" has the table of what is allowed by default.
"""

from __future__ import annotations

from jaxaot.config.trust.composed import check_task_config
from jaxaot.config.trust.hydra_guard import (
    install_composition_guards,
    install_guards,
    install_instantiation_guards,
)
from jaxaot.config.trust.policy import (
    ALLOW_KEY,
    DEFAULT_POLICY,
    DENY_KEY,
    ENV_ALLOW,
    ImportPolicy,
    check_name,
    check_resolved,
    dotted,
    make_policy,
)
from jaxaot.config.trust.rules import BUILTIN_RULES, HYDRA, LOGGING, TARGET, Rule
from jaxaot.config.trust.sources import (
    ENV_COMMAND_LINE,
    ENV_STORE,
    check_imports,
    command_line,
    hydra_policy,
    install_command_line,
    policy_of,
    user_file,
    user_policy,
)

__all__ = [
    "ALLOW_KEY",
    "BUILTIN_RULES",
    "DEFAULT_POLICY",
    "DENY_KEY",
    "ENV_ALLOW",
    "ENV_COMMAND_LINE",
    "ENV_STORE",
    "HYDRA",
    "LOGGING",
    "TARGET",
    "ImportPolicy",
    "Rule",
    "check_imports",
    "check_name",
    "check_resolved",
    "check_task_config",
    "command_line",
    "dotted",
    "hydra_policy",
    "install_command_line",
    "install_composition_guards",
    "install_guards",
    "install_instantiation_guards",
    "make_policy",
    "policy_of",
    "user_file",
    "user_policy",
]
