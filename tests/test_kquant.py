"""GGUF K-quant and Q5_0 weights kept exactly (`q4_k`, `q6_k`, `q5_0`): block decoding, packing, kernels, and loading.

A Q4_K_M file (Qwen2.5-Coder-1.5B's) stores most layers as Q4_K and the
head, `ffn_down` and `attn_v` of half the layers as Q6_K.  These tests check
that the stored codes and scales decode exactly as gguf's own dequantisation
does, that the native kernels run them with every row bit-identical to the
row alone on every instruction-set path this CPU runs (each forced in turn,
`isa_kernels`), and that `--quant auto` loads such a file into those formats
(a fused q|k|v with parts of two types as segments), on each path.  A kernel
build that fails where a compiler exists fails these tests (`tests/_native.py`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from _exactness import assert_bit_identical
from _native import ISA_KEY, ISA_PARAMS
from stagedspec.kernels import native, packing
from stagedspec.models.gguf_codes import RawTensor, dequantized, q4k_codes, q5_0_codes, q6k_codes
from stagedspec.models.pass_spec import PassSpec



def random_blocks(kind: str, rows: int, cols: int, seed: int = 0, d: float = 2e-4) -> np.ndarray:
    """Random Q4_K / Q6_K / Q5_0 blocks [rows, bytes]: random codes and sub-block scales, sane fp16 super-block scales."""
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, kind)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scales = (rng.random((rows, cols // block, 2)) * d + d / 4).astype(np.float16).view(np.uint8)
    if kind == "Q4_K":
        b[..., 0:4] = scales.reshape(rows, cols // block, 4)  # d, dmin
    elif kind == "Q5_0":
        b[..., 0:2] = scales[..., :2]
    else:
        b[..., 208:210] = scales[..., :2]
    return b.reshape(rows, -1)


def _gguf_dequantized(kind: str, blocks: np.ndarray) -> torch.Tensor:
    import gguf

    out = gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, kind))
    return torch.from_numpy(np.asarray(out, dtype=np.float32).reshape(blocks.shape[0], -1).copy())


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q5_0"])
def test_blocks_decode_exactly_as_gguf_dequantises_them(kind: str) -> None:
    blocks = random_blocks(kind, 12, 512)
    assert torch.equal(dequantized(RawTensor(kind, blocks, 512)), _gguf_dequantized(kind, blocks))


def test_packed_k_formats_unpack_to_the_file_weights() -> None:
    """21 rows: a padded last tile."""
    q4 = RawTensor("Q4_K", random_blocks("Q4_K", 21, 512, seed=1), 512)
    q6 = RawTensor("Q6_K", random_blocks("Q6_K", 21, 512, seed=2), 512)
    q5 = RawTensor("Q5_0", random_blocks("Q5_0", 21, 512, seed=3), 512)
    assert torch.equal(packing.unpack_q4k(packing.pack_q4k(*q4k_codes(q4)), 21, 512), dequantized(q4))
    assert torch.equal(packing.unpack_q6k(packing.pack_q6k(*q6k_codes(q6)), 21, 512), dequantized(q6))
    assert torch.equal(packing.unpack_q5(packing.pack_q5(*q5_0_codes(q5)), 21, 512), dequantized(q5))


CASES = ["int4", "int8", "q4_k", "q6_k", "q5_0", "segments"]


def _weight(case: str, k: int = 256, seed: int = 0) -> tuple[torch.Tensor, list[int], list[int], torch.Tensor]:
    """(packed, formats, outs, the fp32 weight) for one format, or a weight of four segments."""
    g = torch.Generator().manual_seed(seed)
    if case == "segments":
        packed, formats, outs = packing.random_segments(("q4_k", "q6_k", "int8", "q5_0", "int4"), k, g)
        return packed, formats, outs, packing.unpack_segments(packed, formats, outs, k)
    packed, w = packing.random_format(case, 20, k, g)
    return packed, [packing.FORMATS[case]], [20], w


@pytest.mark.parametrize("case", CASES)
def test_kernels_match_the_weights_they_stand_for(case: str, kernels: native.NativeKernels) -> None:
    """Only the activations' int8 rounding separates the kernel from x @ W^T."""
    packed, formats, outs, w = _weight(case)
    x = torch.randn(9, 256)
    y = kernels.qlinear(x, packed, formats, outs)
    ref = x @ w.t()
    assert y.shape == ref.shape and ((y - ref).norm() / ref.norm()).item() < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_every_row_count_position_thread_count_and_isa_gives_the_row_alone(case: str, dtype: torch.dtype,
                                                                           isa_kernels: native.NativeKernels) -> None:
    """On the path forced here: every row count and position, one thread, and the portable path give the row
    computed alone."""
    packed, formats, outs, _ = _weight(case, seed=3)
    run = lambda x, k=isa_kernels: k.qlinear(x, packed, formats, outs)  # noqa: E731
    x = (torch.randn(64, 256) * torch.rand(64, 1) * 3).to(dtype)
    alone = torch.cat([run(x[i:i + 1]) for i in range(64)])
    where = f"{isa_kernels.name} {case} {dtype}"
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 13, 14, 16, 31, 33, 64):
        assert_bit_identical(run(x[:rows]), alone[:rows], f"{where}: {rows} rows in one pass against each alone")
    perm = torch.randperm(64)
    assert_bit_identical(run(x[perm]), alone[perm], f"{where}: 64 rows shuffled")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert_bit_identical(run(x[:11]), alone[:11], f"{where}: 11 rows on one thread")
    finally:
        torch.set_num_threads(before)
    portable = isa_kernels.with_isa(0)
    assert_bit_identical(run(x[:9], portable), alone[:9], f"{where}: the portable path against this one")


# ---------------------------------------------------------------------- a K-quant GGUF, loaded
K_TYPES = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "Q4_K",
           "ffn_up": "Q4_K", "ffn_down": "Q6_K", "output": "Q6_K"}


def save_kquant_gguf(path: Path) -> None:
    """A tiny Qwen2 GGUF (hidden 256, so K-quant rows fit) laid out like a Q4_K_M file, with random blocks."""
    import gguf
    import transformers as tf

    from _tiny_models import VOCAB, _llama_gguf_meta, _llama_gguf_tensors, _tokenizer_gguf_meta
    from stagedspec.models.gguf_read import permute_qk

    cfg = tf.Qwen2Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=0)
    torch.manual_seed(0)
    state = {k: v.detach().float().numpy() for k, v in tf.Qwen2ForCausalLM(cfg).state_dict().items()}
    w = gguf.GGUFWriter(str(path), "qwen2")
    _llama_gguf_meta(w, cfg, "qwen2")
    _tokenizer_gguf_meta(w)
    for i, (name, arr) in enumerate(_llama_gguf_tensors(state, cfg, "qwen2", permute_qk).items()):
        kind = K_TYPES.get(name.split(".")[-2]) if name.endswith(".weight") else None
        if kind is None:
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
        else:
            blocks = random_blocks(kind, arr.shape[0], arr.shape[1], seed=i, d=4e-5)
            w.add_tensor(name, blocks, raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kquant") / "tiny-q4_k_m.gguf"
    save_kquant_gguf(path)
    return path


@pytest.fixture(scope="module", params=ISA_PARAMS)
def kquant_model(request: pytest.FixtureRequest, kquant_gguf: Path):  # noqa: ANN201
    """The tiny K-quant GGUF loaded as a user loads it, on each instruction-set path in turn: forced by
    `STAGEDSPEC_QKERNELS` (the switch `native_kernels()` reads at each load)."""
    from _native import kernels_on
    from stagedspec.models.loading import load_model

    kernels = kernels_on(request.param)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(native.ENV_SWITCH, ISA_KEY[request.param])
        model, tok = load_model(kquant_gguf, torch.float32, quant="auto")
    return kquant_gguf, model, tok, kernels


def test_auto_loads_k_quants_in_their_own_formats_exactly(kquant_model) -> None:  # noqa: ANN001
    import gguf

    from stagedspec.models.quant import SegmentLinear, describe_weights

    path, model, _, kernels = kquant_model
    assert describe_weights(model) == ("q4_k x 2, q4_k+q6_k x 2, q5_0 x 2, q6_k x 2 layers + q6_k head, "
                                       f"on {kernels.name}")
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    parts = lambda *names: torch.cat([_gguf_dequantized(tensors[n].tensor_type.name, np.asarray(tensors[n].data))  # noqa: E731
                                      for n in names])
    qkv = model.layers[1].attn.wqkv
    assert isinstance(qkv, SegmentLinear) and qkv.format_names == ["q4_k", "q4_k", "q6_k"]
    assert torch.equal(qkv.dequantized(), parts("blk.1.attn_q.weight", "blk.1.attn_k.weight", "blk.1.attn_v.weight"))
    assert torch.equal(model.layers[0].mlp.w_down.dequantized(), parts("blk.0.ffn_down.weight"))
    assert torch.equal(model.layers[0].attn.wo.dequantized(), parts("blk.0.attn_output.weight"))
    assert torch.equal(model.head_q.dequantized(), parts("output.weight"))


def test_a_k_quant_model_is_bit_identical_per_row_and_speculation_reproduces_ar(kquant_model) -> None:  # noqa: ANN001
    """A tree pass equals one-token decoding of each path, so speculative greedy output is `ar`'s."""
    from stagedspec.pipeline import Pipeline, SpeculationConfig

    _, model, tok, _ = kquant_model
    ids = [5, 9, 33, 2, 200, 17, 41]
    with torch.inference_mode():
        whole = model(torch.tensor([ids]), torch.arange(7), model.new_cache(64))[0]
        cache = model.new_cache(64)
        model(torch.tensor([ids[:4]]), torch.arange(4), cache)
        cache.commit()
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        tree_logits = model(torch.tensor([[ids[4], ids[5], 99, ids[6]]]), torch.tensor([4, 5, 5, 6]), cache,
                            PassSpec(tree_mask=tree))[0]
    assert torch.equal(tree_logits[[0, 1, 3]], whole[4:])
    prompt = [5, 9, 33, 2, 5, 9, 33, 2, 5, 9]
    ar = Pipeline(model, tok, speculation=SpeculationConfig(method="ar")).generate(prompt, max_new_tokens=24)
    spec = Pipeline(model, tok, speculation=SpeculationConfig(method="lookup", ngram=None,
                                                                          lookup_length=3))
    assert spec.generate(prompt, max_new_tokens=24).token_ids == ar.token_ids


def test_layers_kept_in_their_own_formats_are_never_dequantised_and_load_to_the_same_bits(
        kquant_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading reads a kept layer's codes only; its fp32 values were once dequantised and thrown away (15 of the
    21 s of loading Qwen2.5-Coder-1.5B).  The model must compute what one built from those values computes."""
    import gguf.quants

    from stagedspec.models import loading
    from stagedspec.models.quant import quantize_model

    read: list[str] = []
    real = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda data, kind: (read.append(kind.name), real(data, kind))[1])
    model, _ = loading.load_model(kquant_gguf, torch.float32, quant="mixed")
    assert read.count("Q4_K") == read.count("Q5_0") == 0 and read.count("Q6_K") == 1  # the head, which drafts read
    assert not any(p.is_meta for p in model.parameters())

    eager, _, sources = loading.load_gguf_with_sources(kquant_gguf, torch.float32, keep_codes=False)
    quantize_model(eager, "mixed", torch.float32, "auto", sources)
    ids = torch.tensor([[5, 9, 33, 2, 200, 17]])
    with torch.inference_mode():
        assert torch.equal(model(ids, torch.arange(6), model.new_cache(16)),
                           eager(ids, torch.arange(6), eager.new_cache(16)))


def test_a_deferred_weight_left_unreplaced_is_an_error(kquant_gguf: Path) -> None:
    from stagedspec.models import loading

    model, _, _ = loading.load_gguf_with_sources(kquant_gguf, torch.float32, keep_codes=True)
    with pytest.raises(RuntimeError, match="left undequantised"):
        loading.check_no_deferred(model)
