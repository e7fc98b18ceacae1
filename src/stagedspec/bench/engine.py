"""Engine benchmark: our autoregressive decoding vs transformers `generate`, and the bandwidth roofline.

Decoding at batch 1 streams every weight once per token, so the ceiling is
memory bandwidth / model bytes.  All methods run on the same prompts,
interleaved per prompt so machine noise hits them alike; figures are ratios.
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch

from stagedspec.bench.prompts import chat_instruction, humaneval_prompts
from stagedspec.errors import StagedSpecError
from stagedspec.models.loading import load_model
from stagedspec.models.specs import hf_folder_for
from stagedspec.pass_options import PassOptions
from stagedspec.pipeline import parse_weights
from stagedspec.request import generate_ar


def memory_copy_bandwidth(n_bytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes/s of a large tensor copy counting read and write (best of `repeats`)."""
    src = torch.ones(n_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * n_bytes / best


def _transformers_generate(folder: str, dtype: torch.dtype):  # noqa: ANN202
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise StagedSpecError("the transformers baseline needs 'transformers' (pip install transformers)") from None
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()

    def run(ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
        inp = torch.tensor([ids])
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        return out[0, len(ids):].tolist(), time.perf_counter() - t

    return run


def run_engine_bench(
    oracle: str = "default",
    dtypes: Sequence[str] = ("bf16", "fp32", "int4"),
    device: str = "cpu",
    n_prompts: int = 3,
    max_new_tokens: int = 128,
    with_transformers: bool = True,
    pass_options: PassOptions | None = None,
) -> dict:
    prompts = [chat_instruction(p) for p in humaneval_prompts(n_prompts)]
    bandwidth = memory_copy_bandwidth()
    print(f"memory copy bandwidth: {bandwidth / 1e9:.1f} GB/s (read + write)")
    report = {"bandwidth_bytes_per_s": bandwidth, "rows": []}
    for dtype_name in dtypes:  # bf16, fp32, or int4/int8 (quantised weights, bf16 compute)
        dtype, quant = parse_weights(dtype_name)
        if quant != "none" and not device.startswith("cpu"):
            print(f"{dtype_name}: skipped (quantised weights run on CPU kernels only)")
            continue
        model, tok = load_model(oracle, dtype=dtype, device=device, quant=quant, pass_options=pass_options)
        ids_list = [tok.encode(tok.apply_chat_template(p)) for p in prompts]
        hf = None
        if with_transformers:
            hf = _transformers_generate(str(hf_folder_for(oracle)), dtype)  # unquantised bf16 for int4/int8
        ours, theirs = [], []
        generate_ar(model, ids_list[0], max_new_tokens=8)  # warm-up
        for ids in ids_list:  # interleaved per prompt
            r = generate_ar(model, ids, max_new_tokens=max_new_tokens)
            ours.append(r.stats.new_tokens / r.stats.seconds)
            if hf is not None:
                out, secs = hf(ids, max_new_tokens)
                theirs.append(len(out) / secs)
        weight_bytes = model.num_bytes()
        ours_med = statistics.median(ours)
        row = {
            "dtype": dtype_name,
            "ours_tokens_per_s": ours_med,
            "transformers_tokens_per_s": statistics.median(theirs) if theirs else None,
            "weight_bytes": weight_bytes,
            "roofline_tokens_per_s": bandwidth / 2 / weight_bytes,
            "bandwidth_fraction": ours_med * weight_bytes / (bandwidth / 2),
        }
        report["rows"].append(row)
        speedup = f"{row['ours_tokens_per_s'] / row['transformers_tokens_per_s']:.2f}x" if theirs else "n/a"
        print(
            f"{dtype_name}: ours {ours_med:.1f} tok/s | transformers "
            f"{row['transformers_tokens_per_s'] or float('nan'):.1f} tok/s | ours/transformers {speedup} | "
            f"weights {weight_bytes / 1e6:.0f} MB, roofline {row['roofline_tokens_per_s']:.1f} tok/s, "
            f"achieved {100 * row['bandwidth_fraction']:.0f}% of it"
        )
    return report
