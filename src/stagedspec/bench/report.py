"""Markdown report and PNG plots of a `stagedspec bench` run, derived only from its results dict.

Keeping the report a pure function of `results.json` means a run can be
re-reported (or re-plotted) later without measuring again:

    from stagedspec.bench import report
    results = json.load(open("DIR/results.json"))
    open("DIR/report.md", "w").write(report.markdown(results))
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stagedspec.bench.methods import split_quant

ENGINE = {"ours": "stagedspec", "transformers": "transformers", "llama.cpp": "llama.cpp"}


# ====================================================================== formatting
def temperature_label(t: str, cfg: dict[str, Any]) -> str:
    if float(t) == 0:
        return "greedy"
    label = f"T={t}"
    if cfg.get("top_k"):
        label += f", top-k {cfg['top_k']}"
    if cfg.get("top_p", 1.0) < 1.0:
        label += f", top-p {cfg['top_p']:g}"
    return label


def _f(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def _tps(q: dict[str, float] | None) -> str:
    if not q:
        return "–"
    if q["n"] == 1:
        return f"{q['median']:.1f}"
    return f"{q['median']:.1f} [{q['q1']:.1f}–{q['q3']:.1f}]"


def _speedup(q: dict[str, Any] | None) -> str:
    return "–" if not q else f"{q['median']:.2f}x"


def _shares(d: dict[str, float] | None) -> str:
    if not d:
        return "–"
    return ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(d.items(), key=lambda kv: -kv[1]))


def _exact(e: dict[str, Any] | None, greedy: bool) -> str:
    if not greedy:
        return "n/a (sampled)"
    if e is None or not e["prompts"]:
        return "–"
    return f"{e['identical_prompts']}/{e['prompts']} prompts, {100 * e['token_agreement']:.1f}% tokens"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _families(results: dict[str, Any]) -> dict[str, str]:
    return {m["name"]: m["family"] for m in results["methods"]}


# ====================================================================== tables
PAPER_ROWS = (("ar", "baseline ({})"), ("chain", "spec ({})"), ("tree", "spec ({})"), ("tree-fixed", "spec ({})"),
              ("lookup", "{}"), ("lookup-fixed", "{}"), ("staged", "{}"), ("staged-fixed", "{}"),
              ("auto", "{}"))  # the paper's rows, then ours, in this order, each where the run measured it
PAPER_WEIGHTS = ("none", "int8", "int4", "mixed")  # unquantised first, as the paper ran it
LLAMACPP_ROWS = (("llamacpp", "llama.cpp plain"), ("llamacpp-spec", "llama.cpp `-md` draft"),
                 ("llamacpp-ngram", "llama.cpp `ngram-mod`"))


def paper_table(results: dict[str, Any]) -> str:
    """The paper's layout: baseline, spec and staged rows (then `lookup` and `auto`), greedy and sampled column
    groups, for each weight format the run measured, then llama.cpp's rows where it ran.

    A row's speedup is against our `ar` on the same weights (`methods.reference_for`); llama.cpp's rows have
    none, their tokens per second stand beside ours."""
    summary, cfg = results["summary"], results["config"]
    temps = list(summary)
    greedy = next((t for t in temps if float(t) == 0), None)
    sampled = next((t for t in temps if float(t) > 0), None)
    groups = [t for t in (greedy, sampled) if t is not None]
    names = {m["name"] for m in results["methods"]}
    rows_def = []
    for weights in PAPER_WEIGHTS:
        for base, label in PAPER_ROWS:
            name = base if weights == "none" else f"{base}@{weights}"
            if name in names:
                rows_def.append((label.format(name), name))
    rows_def += [(label, name) for name, label in LLAMACPP_ROWS if name in names]
    # llama.cpp plain decoding's median tokens per second per column group, where it ran (a ratio of medians)
    plain = {t: (summary[t].get("llamacpp") or {}).get("tokens_per_second") for t in groups}
    header = [""]
    for t in groups:
        lab = temperature_label(t, cfg)
        header += [f"{lab}: tokens/s", f"{lab}: speedup", f"{lab}: mean accepted"]
        header += [f"{lab}: vs llama.cpp"] if plain[t] else [f"{lab}: rel. memory traffic"]
    rows = []
    for label, name in rows_def:
        row = [label]
        for t in groups:
            s = summary[t].get(name)
            row += [_tps(s and s["tokens_per_second"]), _speedup(s and s["speedup_vs_ar"]),
                    _f(s and s["mean_accepted_length"])]
            if plain[t]:
                row.append(_f(s and s["tokens_per_second"]["median"] / plain[t]["median"], ".2f", "x"))
            else:
                row.append(_f(s and s["relative_memory_traffic"]))
        rows.append(row)
    return _table(header, rows)


def method_table(results: dict[str, Any], t: str) -> str:
    summary = results["summary"][t]
    fam = _families(results)
    greedy = float(t) == 0
    header = ["method", "engine", "tokens/s median [IQR]", "speedup vs ar", "vs transformers generate",
              "mean accepted length", "oracle passes / token", "rel. memory traffic", "time share per stage",
              "exact vs ar (greedy)"]
    rows = []
    for name, s in summary.items():
        rows.append([f"`{name}`", ENGINE.get(fam.get(name, ""), fam.get(name, "")), _tps(s["tokens_per_second"]),
                     _speedup(s["speedup_vs_ar"]), _speedup(s["speedup_vs_hf_generate"]),
                     _f(s["mean_accepted_length"]), _f(s["oracle_passes_per_token"], ".3f"),
                     _f(s["relative_memory_traffic"]), _shares(s["stage_time_share"]),
                     _exact(s["exactness"], greedy)])
    return _table(header, rows)


def tables(results: dict[str, Any]) -> str:
    cfg = results["config"]
    parts = ["## Summary (paper layout)", "", paper_table(results), ""]
    for t in results["summary"]:
        parts += [f"## All methods, {temperature_label(t, cfg)}", "", method_table(results, t), ""]
    return "\n".join(parts)


def console_summary(results: dict[str, Any]) -> str:
    """What `stagedspec bench` prints: the tables, the skipped methods and the drafter costs."""
    parts = [tables(results)]
    if results["lookup_costs"]:
        parts.append(_costs(results))
    if results["skipped"]:
        parts.append("Skipped: " + "; ".join(f"{s['name']} ({s['reason']})" for s in results["skipped"]))
    return "\n".join(parts)


def _costs(results: dict[str, Any]) -> str:
    rows = [[c["drafter"], f"{c['us_per_token']:.1f}"] for c in results["lookup_costs"]]
    return _table(["model-free drafter", "µs per proposed token"], rows) + "\n"


def markdown(results: dict[str, Any]) -> str:
    cfg, env, oracle = results["config"], results["environment"], results["oracle"]
    drafts = ", ".join(f"`{k}` ({v['layers']} layer{'s' if v['layers'] != 1 else ''}, "
                       f"{v['weight_bytes'] / 1e6:.0f} MB streamed per pass"
                       + (f", head over {v['head_tokens']} tokens" if v.get("head_tokens") else "") + ")"
                       for k, v in results["drafts"].items()) or "none"
    n_prompts = len(results["prompts"])
    lines = [
        "# stagedspec bench",
        "",
        f"- oracle: `{cfg['oracle']}` ({oracle['layers']} layers, {oracle['weight_bytes'] / 1e6:.0f} MB streamed "
        f"per forward pass at {cfg['dtype']}"
        + "".join(f"; {b / 1e6:.0f} MB as {q}" for q, b in (oracle.get("quantised_weight_bytes") or {}).items())
        + ")",
        f"- drafts: {drafts}",
        f"- n-gram: `{cfg['ngram']}`" if cfg["ngram"] else "- n-gram: none (prompt lookup only)",
        f"- prompts: {cfg['prompts']} x {n_prompts} (offset {cfg['prompt_offset']})"
        + (f", each run {cfg['repeats']} times (passes in rotated order; figures per request)"
           if cfg.get("repeats", 1) > 1 else "") + ", "
        f"{'chat template' if cfg['chat_template'] else 'raw text'}; up to {cfg['max_new_tokens']} new tokens",
        "- sampling: " + "; ".join(temperature_label(t, cfg) for t in results["summary"])
        + f"; seed {cfg['seed']} + prompt index",
        f"- machine: {env['cpu']} ({env['cpu_count']} cores), torch {env['torch']} with {env['torch_threads']} "
        f"threads on {cfg['device']}; transformers {env.get('transformers')}; {env['date_utc']} UTC",
        f"- methods run interleaved per prompt in rotated order, each after one warm-up; "
        f"total wall time {results.get('wall_seconds', 0):.0f} s" + (" (--quick)" if cfg.get("quick") else ""),
        "",
        tables(results),
        "## Model-free drafters",
        "",
        _costs(results),
    ]
    lines += ["## Methods", ""]
    lines += [f"- `{m['name']}`: {m['description']}" for m in results["methods"]]
    if results["skipped"]:
        lines += ["", "## Skipped", ""]
        lines += [f"- `{s['name']}`: {s['reason']}" for s in results["skipped"]]
    lines += ["", "## Notes", ""]
    lines += [f"- {n}" for n in results["notes"]]
    plots = results.get("plots") or []
    if plots:
        lines += ["", "## Figures", ""]
        captions = {
            "speedup.png": "Median speedup per method (per-prompt ratios; bars span the interquartile range)",
            "per_prompt_speedup.png": "Per-prompt speedup over our `ar`, one point per prompt",
            "accepted_lengths.png": "Tokens emitted per oracle step (accepted draft tokens + 1)",
            "token_origins.png": "Share of generated tokens by the stage that proposed them",
        }
        for p in plots:
            lines += [f"![{captions.get(p, p)}]({p})", "", f"*{captions.get(p, p)}*", ""]
    return "\n".join(lines).rstrip() + "\n"


# ====================================================================== plots
def plots(results: dict[str, Any], out: str | Path) -> list[str]:
    """Write the PNG figures into `out`; returns their file names (empty without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        results.setdefault("notes", []).append("plots skipped: matplotlib is not installed")
        return []
    out = Path(out)
    cfg, summary = results["config"], results["summary"]
    temps = list(summary)
    names = [m["name"] for m in results["methods"]]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    written = []

    # 1. speedup per method (vs ar, and vs transformers generate when measured)
    refs = [("speedup_vs_ar", "speedup over our ar")]
    if any(s.get("speedup_vs_hf_generate") for t in temps for s in summary[t].values()):
        refs.append(("speedup_vs_hf_generate", "speedup over transformers generate"))
    fig, axes = plt.subplots(1, len(refs), figsize=(max(6.0, 0.9 * len(names) * len(refs) + 2), 4.2), squeeze=False)
    width = 0.8 / len(temps)
    for ax, (key, title) in zip(axes[0], refs):
        for j, t in enumerate(temps):
            xs, ys, lo, hi = [], [], [], []
            for i, n in enumerate(names):
                q = summary[t].get(n, {}).get(key)
                if q:
                    xs.append(i + (j - (len(temps) - 1) / 2) * width)
                    ys.append(q["median"])
                    lo.append(q["median"] - q["q1"])
                    hi.append(q["q3"] - q["median"])
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=temperature_label(t, cfg),
                   color=colours[j % len(colours)])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right")
        ax.set_ylabel("x")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=110)
    plt.close(fig)
    written.append("speedup.png")

    # 2. per-prompt speedup distribution
    fig, axes = plt.subplots(1, len(temps), figsize=(max(6.0, 0.7 * len(names) * len(temps) + 2), 4.2), squeeze=False)
    for ax, t in zip(axes[0], temps):
        data = [(n, summary[t][n]["speedup_vs_ar"]["per_prompt"]) for n in names
                if summary[t].get(n, {}).get("speedup_vs_ar")]
        if data:
            ax.boxplot([d for _, d in data], showfliers=False)
            for i, (_, d) in enumerate(data, start=1):
                jitter = [i + 0.08 * ((k % 5) - 2) for k in range(len(d))]
                ax.scatter(jitter, d, s=10, alpha=0.7, color=colours[0], zorder=3)
            ax.set_xticks(range(1, len(data) + 1), [n for n, _ in data], rotation=35, ha="right")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"per-prompt speedup over ar, {temperature_label(t, cfg)}")
    fig.tight_layout()
    fig.savefig(out / "per_prompt_speedup.png", dpi=110)
    plt.close(fig)
    written.append("per_prompt_speedup.png")

    # 3. accepted-length histogram (tokens per oracle step), grouped bars per method
    runs = results["runs"]
    fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 4.0), squeeze=False)
    for ax, t in zip(axes[0], temps):
        series = []
        for i, n in enumerate(names):
            steps = [a + 1 for r in runs if r["method"] == n and f"{r['temperature']:g}" == t
                     for a in (r["accepted_lengths"] or [])]
            if split_quant(n)[0] != "ar" and steps:
                series.append((i, n, steps))
        if series:
            top = max(max(s) for _, _, s in series)
            w = 0.8 / len(series)
            for j, (i, n, steps) in enumerate(series):
                xs = list(range(1, top + 1))
                ys = [steps.count(x) / len(steps) for x in xs]
                ax.bar([x + (j - (len(series) - 1) / 2) * w for x in xs], ys, w, label=n,
                       color=colours[i % len(colours)])
            ax.set_xticks(range(1, top + 1))
            ax.legend(fontsize=8)
        ax.set_xlabel("tokens per oracle step (accepted + 1)")
        ax.set_ylabel("fraction of steps")
        ax.set_title(temperature_label(t, cfg))
    fig.tight_layout()
    fig.savefig(out / "accepted_lengths.png", dpi=110)
    plt.close(fig)
    written.append("accepted_lengths.png")

    # 4. share of tokens by proposing stage
    fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 0.5 * len(names) + 2.0), squeeze=False)
    stages: list[str] = []
    for t in temps:
        for s in summary[t].values():
            for k in s.get("token_origin_share") or {}:
                if k not in stages:
                    stages.append(k)
    for ax, t in zip(axes[0], temps):
        shown = [n for n in names if summary[t].get(n, {}).get("token_origin_share")]
        left = [0.0] * len(shown)
        for j, stage in enumerate(stages):
            vals = [summary[t][n]["token_origin_share"].get(stage, 0.0) for n in shown]
            ax.barh(range(len(shown)), vals, left=left, label=stage, color=colours[j % len(colours)])
            left = [a + b for a, b in zip(left, vals)]
        ax.set_yticks(range(len(shown)), shown)
        ax.set_xlim(0, 1)
        ax.set_xlabel("share of generated tokens")
        ax.set_title(f"proposing stage, {temperature_label(t, cfg)}")
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "token_origins.png", dpi=110)
    plt.close(fig)
    written.append("token_origins.png")
    return written
