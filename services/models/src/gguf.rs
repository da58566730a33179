//! GGUF checkpoints: a single file holding a model's tensors (quantized or not) and its
//! settings as typed metadata.
//!
//! Two layouts are read, told apart by `general.architecture`:
//! - **llama.cpp's**, for the families llama.cpp converts: `llada` and `dream`. Tensors carry
//!   llama.cpp's names (`token_embd`, `blk.N.attn_q`, ...), the settings its `<arch>.*` keys,
//!   the tokenizer `tokenizer.ggml.*` arrays. Each is mapped back onto the Hugging Face
//!   checkpoint the model loaders read ([`llama_cpp_config`], [`llama_cpp_names`]); the
//!   tokenizer is rebuilt as a byte-level BPE `tokenizer.json` ([`llama_cpp_tokenizer`]).
//! - **wavefront's own** (`general.architecture = "wavefront"`), which [`write`] writes for
//!   every family (`ModelFiles::export_gguf`): the checkpoint's tensors under their own names, and its documents
//!   (`config.json`, `tokenizer.json`, `tokenizer_config.json`, `generation_config.json`,
//!   `armt_config.json`) verbatim as string values, so any served model round-trips.
//!
//! Quantized tensors (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K to Q6_K) are dequantized to float32 one
//! tensor at a time as a loader asks for it (candle's GGUF reader decodes the blocks), then
//! converted to the model's dtype and `--weight-dtype` like safetensors weights: the values a
//! model computes with are exactly those the file encodes, and the file's block format is not
//! kept in memory (a Q4_K file served with `--weight-dtype q4` is re-quantized to wavefront's
//! group-wise 4-bit format).

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Shape, Tensor};
use serde_json::json;

use crate::error::{ModelError, Result};

/// `general.architecture` of the files [`write`] writes.
pub const OWN_ARCHITECTURE: &str = "wavefront";
/// The metadata keys of an exported file's documents, and the file names they stand for.
const DOCUMENTS: [(&str, &str); 5] = [
    ("wavefront.config_json", "config.json"),
    ("wavefront.tokenizer_json", "tokenizer.json"),
    ("wavefront.tokenizer_config_json", "tokenizer_config.json"),
    ("wavefront.generation_config_json", "generation_config.json"),
    ("wavefront.armt_config_json", "armt_config.json"),
];
/// Dimensions a GGUF tensor holds at most.
const MAX_DIMS: usize = 4;
/// The metadata key prefix of the shape of an exported tensor of more than [`MAX_DIMS`].
const SHAPE_PREFIX: &str = "wavefront.shape.";
/// The architectures of llama.cpp's layout read here.
pub const LLAMA_CPP_ARCHITECTURES: [&str; 2] = ["llada", "dream"];

/// The documents a GGUF file stands in for (a model directory's JSON files).
#[derive(Debug, Default)]
pub(crate) struct Documents {
    pub config_json: String,
    pub tokenizer_json: Option<Vec<u8>>,
    pub tokenizer_config_json: Option<String>,
    pub generation_config_json: Option<String>,
    pub armt_config_json: Option<String>,
}

/// How a tensor is changed on its way from the file to the loader.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Transform {
    None,
    /// An exported tensor of more than four dimensions: back to its shape.
    Reshape(Vec<usize>),
    /// llama.cpp reorders the rows of a query or key projection of `heads` heads for its
    /// interleaved rotary embedding; this puts them back in the checkpoint's order.
    UnpermuteRope {
        heads: usize,
    },
}

/// An open GGUF file: its header, and the checkpoint name of each tensor the loaders read.
#[derive(Debug)]
pub(crate) struct GgufFile {
    path: PathBuf,
    content: gguf_file::Content,
    file: Mutex<BufReader<File>>,
    /// Checkpoint name -> (GGUF name, transform).
    names: HashMap<String, (String, Transform)>,
}

fn invalid(path: &Path, what: impl std::fmt::Display) -> ModelError {
    ModelError::Io {
        path: path.to_owned(),
        source: std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("not a usable GGUF file: {what}"),
        ),
    }
}

/// Whether `path` is a file that starts with GGUF's magic.
pub fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    path.is_file()
        && File::open(path)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok()
        && &magic == b"GGUF"
}

impl GgufFile {
    /// Reads the header of the GGUF file at `path` (tensors are read when a loader asks) and
    /// the documents it stands in for.
    pub(crate) fn open(path: &Path) -> Result<(Arc<Self>, Documents)> {
        let io = |source| ModelError::Io {
            path: path.to_owned(),
            source,
        };
        let mut reader = BufReader::new(File::open(path).map_err(io)?);
        let content = gguf_file::Content::read(&mut reader).map_err(|e| invalid(path, e))?;
        // Every tensor's blocks within the file: a truncated file fails here, not mid-load.
        let len = reader.get_ref().metadata().map_err(io)?.len();
        for (name, t) in &content.tensor_infos {
            let bytes = (t.shape.elem_count() / t.ggml_dtype.block_size()) as u64
                * t.ggml_dtype.type_size() as u64;
            let end = content
                .tensor_data_offset
                .checked_add(t.offset)
                .and_then(|o| o.checked_add(bytes));
            if end.is_none_or(|e| e > len) {
                return Err(invalid(
                    path,
                    format!(
                        "tensor {name} ({:?} {:?}) ends past the file's {len} bytes: it is \
                         truncated; convert or download it again",
                        t.ggml_dtype,
                        t.shape.dims()
                    ),
                ));
            }
        }
        let arch = match content.metadata.get("general.architecture") {
            Some(Value::String(a)) => a.clone(),
            _ => return Err(invalid(path, "it has no general.architecture")),
        };
        let (documents, names) = if arch == OWN_ARCHITECTURE {
            let documents = own_documents(path, &content.metadata)?;
            let mut names = HashMap::new();
            for n in content.tensor_infos.keys() {
                let transform = match content.metadata.get(&format!("{SHAPE_PREFIX}{n}")) {
                    None => Transform::None,
                    Some(Value::Array(dims)) => Transform::Reshape(
                        dims.iter()
                            .map(|d| d.to_u64().map(|d| d as usize))
                            .collect::<candle_core::Result<_>>()
                            .map_err(|e| invalid(path, format!("{SHAPE_PREFIX}{n}: {e}")))?,
                    ),
                    Some(_) => {
                        return Err(invalid(path, format!("{SHAPE_PREFIX}{n} is not a list")))
                    }
                };
                names.insert(n.clone(), (n.clone(), transform));
            }
            (documents, names)
        } else if LLAMA_CPP_ARCHITECTURES.contains(&arch.as_str()) {
            let meta = Meta {
                path,
                arch: &arch,
                m: &content.metadata,
            };
            let config = llama_cpp_config(&meta, &content.tensor_infos)?;
            let names = llama_cpp_names(&meta, &content.tensor_infos)?;
            let tokenizer = llama_cpp_tokenizer(&meta)?;
            let tokenizer_config = llama_cpp_tokenizer_config(&meta, &tokenizer)?;
            (
                Documents {
                    config_json: config.to_string(),
                    tokenizer_json: Some(tokenizer.to_string().into_bytes()),
                    tokenizer_config_json: Some(tokenizer_config.to_string()),
                    generation_config_json: None,
                    armt_config_json: None,
                },
                names,
            )
        } else {
            return Err(ModelError::Unsupported(format!(
                "{}: a GGUF file of architecture {arch:?}; wavefront reads llama.cpp's {} and \
                 the files `wavefront export-gguf` writes (for any other family, export its \
                 Hugging Face directory with it)",
                path.display(),
                LLAMA_CPP_ARCHITECTURES.join(" and ")
            )));
        };
        Ok((
            Arc::new(Self {
                path: path.to_owned(),
                content,
                file: Mutex::new(reader),
                names,
            }),
            documents,
        ))
    }

    /// The checkpoint names of the tensors the file holds, sorted.
    pub(crate) fn tensor_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.names.keys().cloned().collect();
        v.sort();
        v
    }

    /// The block format of the tensor under checkpoint name `name`.
    pub(crate) fn ggml_dtype(&self, name: &str) -> Option<GgmlDType> {
        let (g, _) = self.names.get(name)?;
        Some(self.content.tensor_infos.get(g)?.ggml_dtype)
    }

    /// The tensor under checkpoint name `name`, decoded to float32 on the CPU.
    pub(crate) fn tensor_f32(&self, name: &str) -> Result<Tensor> {
        let (g, transform) = self
            .names
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_owned(),
            })?;
        let q = {
            let mut f = self
                .file
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            self.content
                .tensor(&mut *f, g, &Device::Cpu)
                .map_err(|e| invalid(&self.path, format!("tensor {g}: {e}")))?
        };
        let t = q.dequantize(&Device::Cpu)?;
        match transform {
            Transform::None => Ok(t),
            Transform::Reshape(dims) => Ok(t.reshape(dims.as_slice())?),
            Transform::UnpermuteRope { heads } => unpermute_rope(&t, *heads),
        }
    }
}

/// Undoes llama.cpp's reordering of a query or key projection's rows (`[heads·d, in]`, or a
/// bias `[heads·d]`): within each head its converter takes the rows of the two rotary halves
/// `[h, 2, d/2]` and writes them interleaved `[h, d/2, 2]`; this writes them back.
fn unpermute_rope(t: &Tensor, heads: usize) -> Result<Tensor> {
    if t.rank() == 1 {
        let n = t.dim(0)?;
        return Ok(unpermute_rope(&t.reshape((n, 1))?, heads)?.reshape(n)?);
    }
    let (rows, cols) = t.dims2()?;
    if heads == 0 || rows % (2 * heads) != 0 {
        return Err(ModelError::Shape(format!(
            "a rotary projection of {rows} rows does not split into {heads} heads of even width"
        )));
    }
    let half = rows / heads / 2;
    Ok(t.reshape((heads, half, 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))?)
}

/// The backend of a GGUF file's `VarBuilder`: each tensor is read and decoded when asked for.
pub(crate) struct Backend(pub(crate) Arc<GgufFile>);

impl candle_nn::var_builder::SimpleBackend for Backend {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.get_unchecked(name, dtype, dev)?;
        if t.shape() != &s {
            candle_core::bail!(
                "shape mismatch for {name} in {}: the file holds {:?}, the model expects {s:?}",
                self.0.path.display(),
                t.shape()
            )
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let t = self
            .0
            .tensor_f32(name)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        t.to_dtype(dtype)?.to_device(dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.names.contains_key(name)
    }
}

fn own_documents(path: &Path, m: &HashMap<String, Value>) -> Result<Documents> {
    let text = |key: &str| -> Result<Option<String>> {
        match m.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(invalid(path, format!("{key} is not a string"))),
        }
    };
    let [config, tokenizer, tokenizer_config, generation, armt] = DOCUMENTS.map(|(k, _)| k);
    Ok(Documents {
        config_json: text(config)?
            .ok_or_else(|| invalid(path, format!("a wavefront GGUF file without {config}")))?,
        tokenizer_json: text(tokenizer)?.map(String::into_bytes),
        tokenizer_config_json: text(tokenizer_config)?,
        generation_config_json: text(generation)?,
        armt_config_json: text(armt)?,
    })
}

/// A llama.cpp file's metadata, for the readers below.
struct Meta<'a> {
    path: &'a Path,
    arch: &'a str,
    m: &'a HashMap<String, Value>,
}

impl Meta<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.m.get(key)
    }

    fn arch_key(&self, key: &str) -> String {
        format!("{}.{key}", self.arch)
    }

    fn num(&self, key: &str) -> Result<Option<f64>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let n = match v {
            Value::U8(x) => *x as f64,
            Value::I8(x) => *x as f64,
            Value::U16(x) => *x as f64,
            Value::I16(x) => *x as f64,
            Value::U32(x) => *x as f64,
            Value::I32(x) => *x as f64,
            Value::U64(x) => *x as f64,
            Value::I64(x) => *x as f64,
            // The shortest decimal of the float32 (a checkpoint's 1e-5, not 9.99999974e-6).
            Value::F32(x) => x.to_string().parse().unwrap_or(*x as f64),
            Value::F64(x) => *x,
            _ => return Err(invalid(self.path, format!("{key} is not a number"))),
        };
        Ok(Some(n))
    }

    fn arch_num(&self, key: &str) -> Result<Option<f64>> {
        self.num(&self.arch_key(key))
    }

    fn required(&self, key: &str) -> Result<f64> {
        self.arch_num(key)?
            .ok_or_else(|| invalid(self.path, format!("it has no {}", self.arch_key(key))))
    }

    fn int(&self, key: &str) -> Result<usize> {
        let n = self.required(key)?;
        if n < 1.0 || n.fract() != 0.0 {
            return Err(invalid(
                self.path,
                format!("{} is {n}, not a positive integer", self.arch_key(key)),
            ));
        }
        Ok(n as usize)
    }

    fn token(&self, key: &str) -> Result<Option<u32>> {
        Ok(self
            .num(&format!("tokenizer.ggml.{key}_token_id"))?
            .map(|n| n as u32))
    }

    fn strings(&self, key: &str) -> Result<Option<Vec<&str>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(v)) => v
                .iter()
                .map(|x| match x {
                    Value::String(s) => Ok(s.as_str()),
                    _ => Err(invalid(self.path, format!("{key} holds a non-string"))),
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(_) => Err(invalid(self.path, format!("{key} is not an array"))),
        }
    }
}

/// The vocabulary's size: `<arch>.vocab_size`, else the token list's length.
fn vocab_size(meta: &Meta) -> Result<usize> {
    if let Some(n) = meta.arch_num("vocab_size")? {
        return Ok(n as usize);
    }
    meta.strings("tokenizer.ggml.tokens")?
        .map(|t| t.len())
        .ok_or_else(|| invalid(meta.path, "it has neither a vocab_size nor a token list"))
}

/// The mask token: `tokenizer.ggml.mask_token_id`, else the token spelled as the family's.
fn mask_token(meta: &Meta, spelled: &str) -> Result<u32> {
    if let Some(id) = meta.token("mask")? {
        return Ok(id);
    }
    meta.strings("tokenizer.ggml.tokens")?
        .and_then(|t| t.iter().position(|s| *s == spelled))
        .map(|i| i as u32)
        .ok_or_else(|| {
            invalid(
                meta.path,
                format!("it names no mask token (tokenizer.ggml.mask_token_id or {spelled:?})"),
            )
        })
}

/// The `config.json` a llama.cpp LLaDA or Dream file stands for.
fn llama_cpp_config(
    meta: &Meta,
    tensors: &HashMap<String, gguf_file::TensorInfo>,
) -> Result<serde_json::Value> {
    let d = meta.int("embedding_length")?;
    let heads = meta.int("attention.head_count")?;
    let kv_heads = match meta.arch_num("attention.head_count_kv")? {
        Some(n) => n as usize,
        None => heads,
    };
    let layers = meta.int("block_count")?;
    let ff = meta.int("feed_forward_length")?;
    let eps = meta
        .arch_num("attention.layer_norm_rms_epsilon")?
        .unwrap_or(1e-5);
    let theta = meta.arch_num("rope.freq_base")?.unwrap_or(10_000.0);
    let context = meta.arch_num("context_length")?.map(|n| n as usize);
    let vocab = vocab_size(meta)?;
    // Without `output.weight` llama.cpp reads the head from the embedding.
    let tied = !tensors.contains_key("output.weight");
    let eos = meta.token("eos")?;
    let pad = meta.token("padding")?;
    Ok(match meta.arch {
        "llada" => json!({
            "model_type": "llada",
            "architectures": ["LLaDAModelLM"],
            "d_model": d,
            "n_heads": heads,
            "n_kv_heads": kv_heads,
            "n_layers": layers,
            "mlp_hidden_size": ff,
            "vocab_size": vocab,
            "embedding_size": vocab,
            "mask_token_id": mask_token(meta, "<|mdm_mask|>")?,
            "eos_token_id": eos,
            "pad_token_id": pad,
            "rms_norm_eps": eps,
            "rope_theta": theta,
            "max_sequence_length": context.unwrap_or(4096),
            "weight_tying": tied,
            "include_bias": false,
            "include_qkv_bias": false,
            "layer_norm_type": "rms",
            "activation_type": "silu",
            "block_type": "llama",
        }),
        _ => json!({
            "model_type": "Dream",
            "architectures": ["DreamModel"],
            "hidden_size": d,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "num_hidden_layers": layers,
            "intermediate_size": ff,
            "vocab_size": vocab,
            "mask_token_id": mask_token(meta, "<|mask|>")?,
            "eos_token_id": eos,
            "pad_token_id": pad,
            "bos_token_id": meta.token("bos")?,
            "rms_norm_eps": eps,
            "rope_theta": theta,
            "max_position_embeddings": context.unwrap_or(32_768),
            "hidden_act": "silu",
            "tie_word_embeddings": tied,
        }),
    })
}

/// The checkpoint name of each llama.cpp tensor of a LLaDA or Dream file (llama.cpp's
/// `gguf` tensor map, read backwards), with the rotary reordering undone where its converter
/// applied it. A file without `output.weight` ties the head to the embedding.
fn llama_cpp_names(
    meta: &Meta,
    infos: &HashMap<String, gguf_file::TensorInfo>,
) -> Result<HashMap<String, (String, Transform)>> {
    let heads = meta.int("attention.head_count")?;
    let kv_heads = match meta.arch_num("attention.head_count_kv")? {
        Some(n) => n as usize,
        None => heads,
    };
    let llada = meta.arch == "llada";
    let rope_permuted = permutes_rope(meta.arch);
    let mut out = HashMap::new();
    for g in infos.keys() {
        let (stem, kind) = match g.rsplit_once('.') {
            Some((s, k @ ("weight" | "bias"))) => (s, k),
            _ => {
                return Err(invalid(
                    meta.path,
                    format!("tensor {g} is not a weight or a bias"),
                ))
            }
        };
        let mut transform = Transform::None;
        let name = match stem {
            "token_embd" if llada => "model.transformer.wte".to_owned(),
            "token_embd" => "model.embed_tokens".to_owned(),
            "output_norm" if llada => "model.transformer.ln_f".to_owned(),
            "output_norm" => "model.norm".to_owned(),
            "output" if llada => "model.transformer.ff_out".to_owned(),
            "output" => "lm_head".to_owned(),
            // Precomputed rotary frequencies: the loaders compute their own.
            "rope_freqs" => continue,
            _ => {
                let block = stem.strip_prefix("blk.").and_then(|r| r.split_once('.'));
                let Some((n, part)) = block else {
                    return Err(invalid(
                        meta.path,
                        format!("tensor {g} is not one of a {} model's", meta.arch),
                    ));
                };
                if rope_permuted {
                    match part {
                        "attn_q" => transform = Transform::UnpermuteRope { heads },
                        "attn_k" => transform = Transform::UnpermuteRope { heads: kv_heads },
                        _ => {}
                    }
                }
                let local = match (llada, part) {
                    (true, "attn_q") => "q_proj",
                    (true, "attn_k") => "k_proj",
                    (true, "attn_v") => "v_proj",
                    (true, "attn_output") => "attn_out",
                    (true, "ffn_gate") => "ff_proj",
                    (true, "ffn_up") => "up_proj",
                    (true, "ffn_down") => "ff_out",
                    (true, "attn_norm") => "attn_norm",
                    (true, "ffn_norm") => "ff_norm",
                    (false, "attn_q") => "self_attn.q_proj",
                    (false, "attn_k") => "self_attn.k_proj",
                    (false, "attn_v") => "self_attn.v_proj",
                    (false, "attn_output") => "self_attn.o_proj",
                    (false, "ffn_gate") => "mlp.gate_proj",
                    (false, "ffn_up") => "mlp.up_proj",
                    (false, "ffn_down") => "mlp.down_proj",
                    (false, "attn_norm") => "input_layernorm",
                    (false, "ffn_norm") => "post_attention_layernorm",
                    _ => {
                        return Err(invalid(
                            meta.path,
                            format!("tensor {g} is not one of a {} model's", meta.arch),
                        ))
                    }
                };
                if llada {
                    format!("model.transformer.blocks.{n}.{local}")
                } else {
                    format!("model.layers.{n}.{local}")
                }
            }
        };
        out.insert(format!("{name}.{kind}"), (g.clone(), transform));
    }
    Ok(out)
}

/// Whether llama.cpp's converter reorders the query and key rows of `arch` for its
/// interleaved rotary embedding.
fn permutes_rope(arch: &str) -> bool {
    arch == "llada"
}

/// The pre-tokenizer split pattern of a llama.cpp `tokenizer.ggml.pre` name.
fn pre_pattern(pre: &str) -> Option<&'static str> {
    const GPT2: &str =
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    match pre {
        "default" | "gpt-2" | "gpt2" => Some(GPT2),
        "qwen2" => Some(QWEN2),
        "llama3" | "llama-bpe" => Some(LLAMA3),
        _ => None,
    }
}

/// A byte-level BPE `tokenizer.json` from a llama.cpp file's `tokenizer.ggml.*` values.
fn llama_cpp_tokenizer(meta: &Meta) -> Result<serde_json::Value> {
    let model = match meta.get("tokenizer.ggml.model") {
        Some(Value::String(s)) => s.as_str(),
        _ => return Err(invalid(meta.path, "it has no tokenizer.ggml.model")),
    };
    if model != "gpt2" {
        return Err(ModelError::Unsupported(format!(
            "{}: tokenizer.ggml.model {model:?}; wavefront rebuilds byte-level BPE (\"gpt2\") \
             tokenizers from GGUF files",
            meta.path.display()
        )));
    }
    let pre = match meta.get("tokenizer.ggml.pre") {
        Some(Value::String(s)) => s.as_str(),
        _ => "default",
    };
    let pattern = pre_pattern(pre).ok_or_else(|| {
        ModelError::Unsupported(format!(
            "{}: tokenizer.ggml.pre {pre:?} has no known split pattern here (known: default, \
             gpt-2, qwen2, llama3, llama-bpe); put the model's tokenizer.json in a directory \
             with its config.json and weights instead",
            meta.path.display()
        ))
    })?;
    let tokens = meta
        .strings("tokenizer.ggml.tokens")?
        .ok_or_else(|| invalid(meta.path, "it has no tokenizer.ggml.tokens"))?;
    let merges = meta.strings("tokenizer.ggml.merges")?.unwrap_or_default();
    let types: Vec<i64> = match meta.get("tokenizer.ggml.token_type") {
        Some(Value::Array(v)) => v
            .iter()
            .map(|x| match x {
                Value::I32(t) => *t as i64,
                Value::U32(t) => *t as i64,
                Value::I64(t) => *t,
                _ => 1,
            })
            .collect(),
        _ => vec![1; tokens.len()],
    };
    // llama.cpp's token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    let mut vocab = serde_json::Map::new();
    let mut added = Vec::new();
    for (id, t) in tokens.iter().enumerate() {
        vocab.insert((*t).to_owned(), json!(id));
        let ty = types.get(id).copied().unwrap_or(1);
        if ty == 3 || ty == 4 {
            added.push(json!({
                "id": id, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": ty == 4, "special": ty == 3,
            }));
        }
    }
    // llama.cpp prepends BOS to a prompt when the file says so (its LLaDA converter always
    // does); the same here, through the post-processor (chat templates carry their own).
    let add_bos = matches!(
        meta.get("tokenizer.ggml.add_bos_token"),
        Some(Value::Bool(true))
    );
    let post_processor = match meta.token("bos")?.filter(|_| add_bos) {
        Some(bos) => {
            let spelled = tokens.get(bos as usize).copied().ok_or_else(|| {
                invalid(
                    meta.path,
                    format!("bos_token_id {bos} is not in the token list"),
                )
            })?;
            json!({
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": spelled, "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": spelled, "type_id": 0}},
                         {"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {spelled: {"id": spelled, "ids": [bos], "tokens": [spelled]}},
            })
        }
        None => serde_json::Value::Null,
    };
    let normalizer = if pre == "qwen2" {
        json!({"type": "NFC"})
    } else {
        serde_json::Value::Null
    };
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        ]},
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab, "merges": merges,
        },
    }))
}

/// A `tokenizer_config.json` with the file's chat template and special tokens.
fn llama_cpp_tokenizer_config(
    meta: &Meta,
    tokenizer: &serde_json::Value,
) -> Result<serde_json::Value> {
    let spelled = |id: Option<u32>| -> Option<String> {
        let id = id? as usize;
        tokenizer["model"]["vocab"]
            .as_object()?
            .iter()
            .find(|(_, v)| v.as_u64() == Some(id as u64))
            .map(|(k, _)| k.clone())
    };
    let mut cfg = serde_json::Map::new();
    if let Some(Value::String(t)) = meta.get("tokenizer.chat_template") {
        cfg.insert("chat_template".into(), json!(t));
    }
    for (key, name) in [
        ("bos", "bos_token"),
        ("eos", "eos_token"),
        ("padding", "pad_token"),
    ] {
        if let Some(s) = spelled(meta.token(key)?) {
            cfg.insert(name.into(), json!(s));
        }
    }
    if let Some(Value::Bool(b)) = meta.get("tokenizer.ggml.add_bos_token") {
        cfg.insert("add_bos_token".into(), json!(b));
    }
    Ok(serde_json::Value::Object(cfg))
}

/// The block formats [`write`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufQuant {
    F32,
    F16,
    Q8_0,
    Q4_0,
    Q4K,
    Q6K,
}

impl GgufQuant {
    pub const ALL: [GgufQuant; 6] = [
        GgufQuant::F32,
        GgufQuant::F16,
        GgufQuant::Q8_0,
        GgufQuant::Q4_0,
        GgufQuant::Q4K,
        GgufQuant::Q6K,
    ];

    /// llama.cpp's name of the format.
    pub const fn name(self) -> &'static str {
        match self {
            GgufQuant::F32 => "f32",
            GgufQuant::F16 => "f16",
            GgufQuant::Q8_0 => "q8_0",
            GgufQuant::Q4_0 => "q4_0",
            GgufQuant::Q4K => "q4_k",
            GgufQuant::Q6K => "q6_k",
        }
    }

    fn ggml(self) -> GgmlDType {
        match self {
            GgufQuant::F32 => GgmlDType::F32,
            GgufQuant::F16 => GgmlDType::F16,
            GgufQuant::Q8_0 => GgmlDType::Q8_0,
            GgufQuant::Q4_0 => GgmlDType::Q4_0,
            GgufQuant::Q4K => GgmlDType::Q4K,
            GgufQuant::Q6K => GgmlDType::Q6K,
        }
    }
}

impl std::str::FromStr for GgufQuant {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let lower = s.to_ascii_lowercase();
        GgufQuant::ALL
            .into_iter()
            .find(|q| q.name() == lower)
            .ok_or_else(|| {
                format!(
                    "unknown GGUF type {s:?}: expected one of {}",
                    GgufQuant::ALL.map(GgufQuant::name).join(", ")
                )
            })
    }
}

/// The format a tensor of `shape` is written in when `quant` is asked for: matrices take it
/// where their rows split into its blocks (else Q8_0 where they split into 32s, else float32,
/// as llama.cpp falls back); vectors (norms, biases) stay float32.
pub fn tensor_format(shape: &[usize], quant: GgufQuant) -> GgmlDType {
    let want = quant.ggml();
    let row = shape.last().copied().unwrap_or(0);
    if shape.len() < 2 || want == GgmlDType::F32 {
        return GgmlDType::F32;
    }
    if row % want.block_size() == 0 {
        want
    } else if row % GgmlDType::Q8_0.block_size() == 0 {
        GgmlDType::Q8_0
    } else {
        GgmlDType::F32
    }
}

/// What [`write`] wrote: each tensor's format, and the file's size.
#[derive(Debug)]
pub struct ExportReport {
    pub tensors: Vec<(String, GgmlDType)>,
    pub bytes: u64,
}

/// Writes a model as a GGUF file of wavefront's layout at `out`: every tensor (`names`, each
/// read by `tensor`) under its checkpoint name in the format [`tensor_format`] picks for
/// `quant`, and the model's documents (`config.json`, `tokenizer.json`,
/// `tokenizer_config.json`, `generation_config.json`, `armt_config.json`) as metadata. Reading
/// it back serves the same model (exactly so with `f32`). `ModelFiles::export_gguf` calls it.
pub(crate) fn write(
    names: &[String],
    tensor: impl Fn(&str) -> Result<Tensor>,
    docs: [Option<String>; 5],
    out: &Path,
    quant: GgufQuant,
) -> Result<ExportReport> {
    let mut tensors = Vec::with_capacity(names.len());
    let mut report = Vec::with_capacity(names.len());
    // GGUF holds at most four dimensions: a tensor of more is written with its leading ones
    // merged, and its shape kept under `wavefront.shape.<name>`.
    let mut shapes = Vec::new();
    for name in names {
        let mut t = tensor(name)?;
        if t.rank() > MAX_DIMS {
            shapes.push((
                format!("{SHAPE_PREFIX}{name}"),
                Value::Array(t.dims().iter().map(|&d| Value::U64(d as u64)).collect()),
            ));
            let keep = t.dims()[t.rank() - (MAX_DIMS - 1)..].to_vec();
            let lead: usize = t.dims()[..t.rank() - (MAX_DIMS - 1)].iter().product();
            t = t.reshape([&[lead], &keep[..]].concat())?;
        }
        let format = tensor_format(t.dims(), quant);
        tensors.push((name.clone(), QTensor::quantize(&t, format)?));
        report.push((name.clone(), format));
    }
    let mut metadata: Vec<(&str, Value)> = vec![
        (
            "general.architecture",
            Value::String(OWN_ARCHITECTURE.into()),
        ),
        ("general.file_type", Value::U32(quant.ggml_file_type())),
    ];
    metadata.extend(shapes.iter().map(|(k, v)| (k.as_str(), v.clone())));
    for ((key, _), text) in DOCUMENTS.iter().zip(docs) {
        if let Some(text) = text {
            metadata.push((key, Value::String(text)));
        }
    }
    let io = |source| ModelError::Io {
        path: out.to_owned(),
        source,
    };
    let tmp = out.with_extension("gguf.partial");
    let mut w = std::io::BufWriter::new(File::create(&tmp).map_err(io)?);
    let meta_refs: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    gguf_file::write(&mut w, &meta_refs, &tensor_refs)?;
    w.flush().map_err(io)?;
    let bytes = w.stream_position().map_err(io)?;
    drop(w);
    std::fs::rename(&tmp, out).map_err(io)?;
    Ok(ExportReport {
        tensors: report,
        bytes,
    })
}

impl GgufQuant {
    /// llama.cpp's `general.file_type` of a file mostly in this format.
    fn ggml_file_type(self) -> u32 {
        match self {
            GgufQuant::F32 => 0,
            GgufQuant::F16 => 1,
            GgufQuant::Q4_0 => 2,
            GgufQuant::Q8_0 => 7,
            GgufQuant::Q4K => 15,
            GgufQuant::Q6K => 18,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermuting_undoes_llama_cpps_rope_order() {
        // llama.cpp's converter: rows [h, 2, d/2] written as [h, d/2, 2].
        let heads = 2;
        let rows = 8;
        let t = Tensor::arange(0f32, (rows * 3) as f32, &Device::Cpu)
            .unwrap()
            .reshape((rows, 3))
            .unwrap();
        let permuted = t
            .reshape((heads, 2, rows / heads / 2, 3))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape((rows, 3))
            .unwrap();
        let back = unpermute_rope(&permuted, heads).unwrap();
        assert_eq!(back.to_vec2::<f32>().unwrap(), t.to_vec2::<f32>().unwrap());
        assert!(unpermute_rope(&t, 3).is_err());
    }

    #[test]
    fn formats_fall_back_where_rows_do_not_split_into_blocks() {
        assert_eq!(tensor_format(&[64], GgufQuant::Q4K), GgmlDType::F32);
        assert_eq!(tensor_format(&[8, 256], GgufQuant::Q4K), GgmlDType::Q4K);
        assert_eq!(tensor_format(&[8, 64], GgufQuant::Q4K), GgmlDType::Q8_0);
        assert_eq!(tensor_format(&[8, 48], GgufQuant::Q4_0), GgmlDType::F32);
        assert_eq!(tensor_format(&[8, 48], GgufQuant::F16), GgmlDType::F16);
        assert_eq!("Q4_K".parse::<GgufQuant>(), Ok(GgufQuant::Q4K));
        assert!("q3_k".parse::<GgufQuant>().is_err());
    }
}
