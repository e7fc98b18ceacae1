"""How a loaded model's passes run (`PassOptions`), and the run-time state its runner keeps (`PassRuntime`).

The options are chosen where models are loaded (the CLI's `--cuda-graphs`,
`--static-passes`, `--compile`; the environment for library callers), held
by each model (`Transformer.runtime.passes`) and read by `stagedspec.runner`
whenever a pass runs.  A module of its own that imports nothing of the
package, so that the models, the loaders and the runner all read it without
an import cycle.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

PASS_MODES = ("eager", "static", "graphs")


def env_flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    """An on/off environment variable: unset or empty gives `default`; 0, false, no and off turn it off."""
    value = environ.get(name, "")
    if value == "":
        return default
    return value not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class PassOptions:
    """How a model's passes run (see `stagedspec.runner`): one value for every model a command loads.

    `mode`: "eager" (variable-shape passes), "static" (fixed row buckets over
    the whole cache) or "graphs" (static passes replayed as CUDA graphs; off
    CUDA they run as "static"); None: the device's default, which
    `cuda_graphs` (CUDA: "graphs", else "static") and `static_on_cpu` (CPU:
    "static", else "eager") choose.  `compile`: static passes go through
    `torch.compile`.
    """

    mode: str | None = None
    cuda_graphs: bool = True
    static_on_cpu: bool = False
    compile: bool = False

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in PASS_MODES:
            raise ValueError(f"unknown pass mode {self.mode!r}: use one of {', '.join(PASS_MODES)}")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> PassOptions:
        """The defaults of a model loaded without options: STAGEDSPEC_CUDA_GRAPHS=0 launches CUDA's static
        passes eagerly, STAGEDSPEC_STATIC_PASSES=1 runs CPU models through the static path (with it the
        whole test suite does)."""
        env = os.environ if environ is None else environ
        return cls(cuda_graphs=env_flag(env, "STAGEDSPEC_CUDA_GRAPHS", True),
                   static_on_cpu=env_flag(env, "STAGEDSPEC_STATIC_PASSES", False))

    def mode_on(self, device: object) -> str:
        """The mode passes run in on `device` (a torch.device or its name)."""
        cuda = str(device).startswith("cuda")
        mode = self.mode
        if mode is None:
            mode = ("graphs" if self.cuda_graphs else "static") if cuda else ("static" if self.static_on_cpu else "eager")
        return "static" if mode == "graphs" and not cuda else mode  # CUDA graphs need CUDA; the same arithmetic


@dataclass(eq=False)
class PassRuntime:
    """One model's pass state: its options, its compiled static pass and its pool of runners.

    Runners are pooled per model and reused by later requests, because a
    runner's CUDA graphs bake in its buffers' addresses: capturing them is
    paid once per process, not per request (`runner.acquire_runner`).  A copy
    of the model (`copy.deepcopy`, pickling) gets the same options and a pool
    of its own: runners and compiled passes belong to the model they were
    built for.
    """

    options: PassOptions = field(default_factory=PassOptions.from_environment)
    compiled_forward: Callable[..., Any] | None = None  # the model's `forward_static` through torch.compile
    # `runner.StaticRunner`s, leased and given back by `runner.acquire_runner` alone (typed loosely here: this
    # module sits below the runner and imports nothing of the package)
    runners: list[Any] = field(default_factory=list, repr=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # guards `runners` and their leases

    def __reduce__(self) -> tuple[type[PassRuntime], tuple[PassOptions]]:
        return PassRuntime, (self.options,)
