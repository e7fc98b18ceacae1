"""The Python heap of a long-lived process: what loading the models made is kept out of full garbage collections.

CPython's collector walks every tracked container in a full (oldest-generation) pass, and a full pass starts
whenever enough new containers have survived, in the middle of whatever step is running.  A loaded model pair
leaves tens of thousands behind: after loading the Qwen2.5-Coder pair a full pass walked 188k objects in 82-97 ms
on the Zen 4 EPYC (2 cores, 2026-11-27), three of the 1.5B's int4 steps.  On an H200 two `auto` requests of two
bench runs took 170-200 ms longer than their neighbours that ran the same steps, as one such pass would (not
traced there).  `gc.freeze` moves everything alive into a permanent generation that full passes skip.
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
