"""Writes GGUF files in llama.cpp's layout from the LLaDA and Dream fixtures, with the `gguf`
package from PyPI (the library llama.cpp's converter writes with), and a probe file of
k-quant blocks with their values as the package decodes them.

What llama.cpp's converter does for these architectures, and what this script therefore does:
- `general.architecture` `llada` / `dream`; hyper-parameters under `<arch>.*`
  (`block_count`, `context_length`, `embedding_length`, `feed_forward_length`,
  `attention.head_count`, `attention.head_count_kv`, `rope.freq_base`,
  `attention.layer_norm_rms_epsilon`, `attention.causal` false; LLaDA also `vocab_size`,
  `rope.dimension_count` and `diffusion.shift_logits` false);
- tensors renamed with the package's tensor map; LLaDA's query and key rows reordered for
  llama.cpp's interleaved rotary embedding (`permute`), Dream's left as they are;
  vectors (norms, biases) stored as F32, matrices as the requested type;
- the tokenizer as `gpt2` BPE: every id below the vocabulary size (missing ones `[PAD{i}]`,
  unused), added tokens control (special) or user-defined, the merges, the special token ids
  (`mask_token_id` from config.json), the chat template; LLaDA forces `add_bos_token`.

usage: convert.py FIXTURES_DIR OUT_DIR
"""

import json
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file


def permute(w, n_head):
    # llama.cpp's converter: rows [h, 2, d/2] written as [h, d/2, 2].
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def vocab(fixture, cfg, writer, pre, add_bos):
    tok = json.loads((fixture / "tokenizer.json").read_text())
    tcfg = json.loads((fixture / "tokenizer_config.json").read_text())
    size = cfg["vocab_size"]
    reverse = {i: t for t, i in tok["model"]["vocab"].items()}
    added = {a["id"]: a for a in tok["added_tokens"]}
    for i, a in added.items():
        reverse[i] = a["content"]
    tokens, types = [], []
    for i in range(size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.CONTROL if added[i]["special"] else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_token_merges(merges)
    ids = {t: i for i, t in enumerate(tokens)}
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                     ("pad", writer.add_pad_token_id)):
        spelled = tcfg.get(f"{key}_token")
        if isinstance(spelled, dict):
            spelled = spelled.get("content")
        if spelled in ids:
            add(ids[spelled])
        elif cfg.get(f"{key}_token_id") is not None:
            add(cfg[f"{key}_token_id"])
    writer.add_mask_token_id(cfg["mask_token_id"])
    if add_bos:
        writer.add_add_bos_token(True)
    if "chat_template" in tcfg:
        writer.add_chat_template(tcfg["chat_template"])


def convert(fixture, out, arch_name, qtype):
    cfg = json.loads((fixture / "config.json").read_text())
    arch = {"llada": gguf.MODEL_ARCH.LLADA, "dream": gguf.MODEL_ARCH.DREAM}[arch_name]
    writer = gguf.GGUFWriter(str(out), arch_name)
    llada = arch_name == "llada"
    if llada:
        layers, d, heads = cfg["n_layers"], cfg["d_model"], cfg["n_heads"]
        kv_heads, ff, ctx = cfg.get("n_kv_heads") or heads, cfg["mlp_hidden_size"], cfg.get("max_sequence_length", 4096)
    else:
        layers, d, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
        kv_heads, ff, ctx = cfg.get("num_key_value_heads") or heads, cfg["intermediate_size"], cfg["max_position_embeddings"]
    writer.add_block_count(layers)
    writer.add_context_length(ctx)
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_causal_attention(False)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[qtype])
    if llada:
        writer.add_vocab_size(cfg["vocab_size"])
        writer.add_rope_dimension_count(d // heads)
        writer.add_diffusion_shift_logits(False)
    vocab(fixture, cfg, writer, "gpt-2" if llada else "qwen2", add_bos=llada)
    names = gguf.get_tensor_name_map(arch, layers)
    for name, w in sorted(load_file(str(fixture / "model.safetensors")).items()):
        w = w.astype(np.float32)
        if llada and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = permute(w, heads)
        if llada and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = permute(w, kv_heads)
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        if w.ndim == 1 or name.endswith("_norm.weight") or not name.endswith(".weight") or qtype == "f32":
            writer.add_tensor(new, w)
        else:
            data = gguf.quants.quantize(w, Q.Q8_0)
            writer.add_tensor(new, data, raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def k_quant_probe(out_dir):
    """One tensor per k-quant format, of random blocks (any bytes are blocks of these formats
    once the half-precision scales are finite), and the package's decoding of each."""
    rng = np.random.default_rng(7)
    writer = gguf.GGUFWriter(str(out_dir / "k_quants.gguf"), "probe")
    rows, cols = 3, 512
    for qt in (Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.Q2_K, Q.Q3_K, Q.Q4_0, Q.Q8_0):
        block, size = gguf.GGML_QUANT_SIZES[qt]
        raw = rng.integers(0, 256, size=(rows, cols // block * size), dtype=np.uint8)
        # The half-precision scales sit at the start (q4_0, q8_0, q4_k, q5_k) or the end
        # (q6_k: d; q2_k, q3_k: d, dmin) of each block: make them small and finite.
        blocks = raw.reshape(rows, cols // block, size)
        halves = rng.uniform(-0.05, 0.05, size=(rows, cols // block, 2)).astype(np.float16).view(np.uint8)
        if qt in (Q.Q4_K, Q.Q5_K):
            blocks[..., 0:4] = halves.reshape(rows, cols // block, 4)
        elif qt in (Q.Q4_0, Q.Q8_0):
            blocks[..., 0:2] = halves[..., 0:2]
        elif qt == Q.Q6_K:
            blocks[..., size - 2:size] = halves[..., 0:2]
        else:
            blocks[..., size - 4:size] = halves.reshape(rows, cols // block, 4)
        name = qt.name.lower()
        writer.add_tensor(name, raw, raw_dtype=qt)
        np.save(out_dir / f"{name}.npy", gguf.quants.dequantize(raw, qt).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main():
    fixtures, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    for arch in ("llada", "dream"):
        for qtype in ("f32", "q8_0"):
            convert(fixtures / arch, out / f"{arch}-{qtype}.gguf", arch, qtype)
    k_quant_probe(out)
    print(f"wrote {sorted(p.name for p in out.iterdir())}")


if __name__ == "__main__":
    main()
