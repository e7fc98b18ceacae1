"""The Python heap of a long-lived process: what loading the models made is kept out of full garbage collections.

CPython's collector walks every tracked container in a full (oldest-generation) pass, and a full pass starts
whenever enough new containers have survived, in the middle of whatever step is running.  A loaded model pair
leaves tens of thousands behind, and a full pass over them takes as long as several decoding steps
(docs/measurements.md, "Full garbage collections after loading the Qwen2.5-Coder pair").  `gc.freeze` moves
everything alive into a permanent generation that full passes skip.
"""

from __future__ import annotations

import gc


def freeze_loaded() -> None:
    """Collect what is garbage now, then freeze every object still alive out of later full collections.

    For a process that keeps its models until it exits (the server, the bench, the measuring scripts), once
    they are loaded and warmed up.  Objects made afterwards are collected as before; a frozen object that
    becomes cyclic garbage later is never freed, so a library caller that loads and drops models does not
    call this (`Pipeline.load` does not).
    """
    gc.collect()
    gc.freeze()
