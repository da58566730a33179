//! Hugging Face model directories and embedded checkpoints.
//!
//! A model is the usual Hugging Face layout: `config.json`, weights in `model.safetensors` or
//! sharded through `model.safetensors.index.json` (its `weight_map` names the shard of every
//! tensor), `tokenizer.json` and optionally `tokenizer_config.json`. On disk the weights are
//! memory-mapped; the CLI can also embed a small checkpoint in the binary and hand the bytes to
//! [`ModelFiles::from_embedded`]. Either way [`ModelFiles::var_builder`] yields a candle
//! `VarBuilder` whose paths are the checkpoint's tensor names, and [`detect_family`] reads
//! `model_type` / `architectures` to pick the model family.
//!
//! An ARMT directory is a Llama backbone `config.json` plus upstream's ARMT settings in
//! `armt_config.json` (segment_size, num_mem_tokens, d_mem, ...); [`ModelFiles::family`] reports
//! it as [`ModelFamily::RecurrentMemory`]. `tokenizer.json` is optional: without it only
//! token-id prompts work (the ARMT fixture has none).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use serde::de::DeserializeOwned;

use crate::chat::ChatTemplate;
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::tokenizer::TextTokenizer;

const CONFIG: &str = "config.json";
const WEIGHTS: &str = "model.safetensors";
const WEIGHTS_INDEX: &str = "model.safetensors.index.json";
const TOKENIZER: &str = "tokenizer.json";
const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
/// The chat template file of the transformers-5 layout.
const CHAT_TEMPLATE: &str = "chat_template.jinja";
const GENERATION_CONFIG: &str = "generation_config.json";
/// Upstream ARMT's hyper-parameters, beside a Llama backbone's `config.json`.
pub const ARMT_CONFIG: &str = "armt_config.json";

/// Where the safetensors weights live.
#[derive(Debug, Clone)]
enum Weights {
    /// One or more safetensors files, memory-mapped on demand.
    Files(Vec<PathBuf>),
    /// A safetensors image held in memory for the life of the program.
    Embedded(&'static [u8]),
    /// A GGUF file (its path, for [`ModelFiles::weight_files`]), tensors decoded on demand.
    Gguf(std::sync::Arc<GgufFile>, Vec<PathBuf>),
}

/// The files of one model: raw config and tokenizer documents plus a handle on the weights.
#[derive(Debug, Clone)]
pub struct ModelFiles {
    config_json: String,
    weights: Weights,
    /// `None` when the directory has no `tokenizer.json`.
    tokenizer_json: Option<Vec<u8>>,
    tokenizer_config_json: Option<String>,
    /// `armt_config.json`, when present.
    armt_config_json: Option<String>,
    /// `generation_config.json`, when present.
    generation_config_json: Option<String>,
}

impl ModelFiles {
    /// A model directory ([`Self::from_dir`]) or a GGUF file ([`Self::from_gguf`]).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if crate::gguf::is_gguf(path) {
            Self::from_gguf(path)
        } else if path.is_file() {
            Err(ModelError::Io {
                path: path.to_owned(),
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "a file that is not GGUF: pass a model directory (config.json, \
                     model.safetensors, tokenizer.json) or a .gguf file",
                ),
            })
        } else {
            Self::from_dir(path)
        }
    }

    /// Reads a GGUF file: llama.cpp's LLaDA or Dream, or one `wavefront export-gguf` wrote
    /// (see [`crate::gguf`]). Only the header is read here.
    pub fn from_gguf(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let (file, docs) = GgufFile::open(path)?;
        Ok(Self {
            config_json: docs.config_json,
            weights: Weights::Gguf(file, vec![path.to_owned()]),
            tokenizer_json: docs.tokenizer_json,
            tokenizer_config_json: docs.tokenizer_config_json,
            armt_config_json: docs.armt_config_json,
            generation_config_json: docs.generation_config_json,
        })
    }

    /// The checkpoint's tensor names, sorted.
    pub fn tensor_names(&self) -> Result<Vec<String>> {
        let mut names: Vec<String> = match &self.weights {
            Weights::Files(files) => {
                // SAFETY: as in `var_builder`: model files are read-only while in use.
                let st = unsafe { candle_core::safetensors::MmapedSafetensors::multi(files) }
                    .map_err(safetensors_error)?;
                st.tensors().into_iter().map(|(n, _)| n).collect()
            }
            Weights::Embedded(bytes) => candle_core::safetensors::SliceSafetensors::new(bytes)?
                .tensors()
                .into_iter()
                .map(|(n, _)| n)
                .collect(),
            Weights::Gguf(g, _) => g.tensor_names(),
        };
        names.sort();
        Ok(names)
    }

    /// The checkpoint's tensor `name` in float32 on the CPU.
    pub fn tensor_f32(&self, name: &str) -> Result<candle_core::Tensor> {
        let t = match &self.weights {
            Weights::Files(files) => {
                // SAFETY: as in `var_builder`.
                let st = unsafe { candle_core::safetensors::MmapedSafetensors::multi(files) }
                    .map_err(safetensors_error)?;
                st.load(name, &Device::Cpu)?
            }
            Weights::Embedded(bytes) => {
                candle_core::safetensors::SliceSafetensors::new(bytes)?.load(name, &Device::Cpu)?
            }
            Weights::Gguf(g, _) => g.tensor_f32(name)?,
        };
        Ok(t.to_dtype(DType::F32)?)
    }

    /// Writes the model as one GGUF file of wavefront's layout at `out`, its matrices in
    /// `quant`'s block format where their rows split into its blocks (see [`crate::gguf`]);
    /// [`Self::open`] reads it back as the same model (exactly so with `f32`).
    pub fn export_gguf(
        &self,
        out: &Path,
        quant: crate::gguf::GgufQuant,
    ) -> Result<crate::gguf::ExportReport> {
        crate::gguf::write(
            &self.tensor_names()?,
            |n| self.tensor_f32(n),
            self.documents(),
            out,
            quant,
        )
    }

    /// The documents beside the weights: `config.json`, `tokenizer.json`,
    /// `tokenizer_config.json`, `generation_config.json`, `armt_config.json`.
    fn documents(&self) -> [Option<String>; 5] {
        [
            Some(self.config_json.clone()),
            self.tokenizer_json
                .as_ref()
                .map(|b| String::from_utf8_lossy(b).into_owned()),
            self.tokenizer_config_json.clone(),
            self.generation_config_json.clone(),
            self.armt_config_json.clone(),
        ]
    }

    /// For a GGUF checkpoint, the CPU weight storage closest to its matrices' block format
    /// (the most common one among its quantized or half-precision tensors): 8-bit and 5-6-bit
    /// blocks int8, 2-4-bit blocks q4, f16 and bf16 bf16; `None` for float32 files and
    /// safetensors.
    pub fn gguf_weight_dtype(&self) -> Option<crate::transformer::WeightDtype> {
        use crate::transformer::WeightDtype;
        use candle_core::quantized::GgmlDType as G;
        // Bf16, Int8, Q4, in that order; a tie goes to the wider storage.
        let mut counts = [0usize; 3];
        let kinds = [WeightDtype::Bf16, WeightDtype::Int8, WeightDtype::Q4];
        for (_, format) in self.gguf_formats() {
            let w = match format {
                G::F32 => continue,
                G::F16 | G::BF16 => WeightDtype::Bf16,
                G::Q8_0 | G::Q8_1 | G::Q8K | G::Q6K | G::Q5_0 | G::Q5_1 | G::Q5K => {
                    WeightDtype::Int8
                }
                G::Q4_0 | G::Q4_1 | G::Q4K | G::Q3K | G::Q2K => WeightDtype::Q4,
            };
            counts[kinds
                .iter()
                .position(|k| *k == w)
                .expect("one of the kinds")] += 1;
        }
        let (i, &n) = counts
            .iter()
            .enumerate()
            .max_by_key(|&(i, n)| (*n, std::cmp::Reverse(i)))?;
        (n > 0).then_some(kinds[i])
    }

    /// The block format of each tensor of a GGUF checkpoint (empty for safetensors).
    pub fn gguf_formats(&self) -> Vec<(String, candle_core::quantized::GgmlDType)> {
        match &self.weights {
            Weights::Gguf(g, _) => g
                .tensor_names()
                .into_iter()
                .filter_map(|n| g.ggml_dtype(&n).map(|d| (n, d)))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// Reads a Hugging Face model directory. Weights are not read here, only located.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config_json = read_string(&dir.join(CONFIG))?;
        let single = dir.join(WEIGHTS);
        let index = dir.join(WEIGHTS_INDEX);
        let weights = if single.is_file() {
            vec![single]
        } else if index.is_file() {
            shard_paths(dir, &read_string(&index)?)?
        } else {
            return Err(ModelError::Io {
                path: single,
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("neither {WEIGHTS} nor {WEIGHTS_INDEX} exists"),
                ),
            });
        };
        let tokenizer_path = dir.join(TOKENIZER);
        let tokenizer_json = if tokenizer_path.is_file() {
            Some(
                std::fs::read(&tokenizer_path).map_err(|source| ModelError::Io {
                    path: tokenizer_path,
                    source,
                })?,
            )
        } else {
            None
        };
        let tokenizer_config_path = dir.join(TOKENIZER_CONFIG);
        let tokenizer_config_json = if tokenizer_config_path.is_file() {
            Some(read_string(&tokenizer_config_path)?)
        } else {
            None
        };
        let tokenizer_config_json = with_template_file(tokenizer_config_json, dir)?;
        let armt_path = dir.join(ARMT_CONFIG);
        let armt_config_json = if armt_path.is_file() {
            Some(read_string(&armt_path)?)
        } else {
            None
        };
        let generation_path = dir.join(GENERATION_CONFIG);
        let generation_config_json = if generation_path.is_file() {
            Some(read_string(&generation_path)?)
        } else {
            None
        };
        Ok(Self {
            config_json,
            weights: Weights::Files(weights),
            tokenizer_json,
            tokenizer_config_json,
            armt_config_json,
            generation_config_json,
        })
    }

    /// A model compiled into the binary: `config.json` text, a `model.safetensors` image and
    /// `tokenizer.json` bytes.
    pub fn from_embedded(
        config: &'static str,
        weights: &'static [u8],
        tokenizer: &'static [u8],
    ) -> Self {
        Self {
            config_json: config.to_owned(),
            weights: Weights::Embedded(weights),
            tokenizer_json: Some(tokenizer.to_vec()),
            tokenizer_config_json: None,
            armt_config_json: None,
            generation_config_json: None,
        }
    }

    /// An embedded model's optional documents beside `config.json`: `tokenizer_config.json`
    /// (chat template, special tokens), `generation_config.json` and `armt_config.json`, as the
    /// directory of [`ModelFiles::from_dir`] would hold them.
    pub fn with_documents(
        mut self,
        tokenizer_config: Option<&str>,
        generation_config: Option<&str>,
        armt_config: Option<&str>,
    ) -> Self {
        self.tokenizer_config_json = tokenizer_config.map(str::to_owned);
        self.generation_config_json = generation_config.map(str::to_owned);
        self.armt_config_json = armt_config.map(str::to_owned);
        self
    }

    /// A digest of the checkpoint (SHA-256 over its config documents and every weight file's
    /// bytes, in order), as lowercase hex: two workers that report the same fingerprint serve
    /// the same model. Reads every weight byte once.
    pub fn fingerprint(&self) -> Result<String> {
        use sha2::{Digest, Sha256};
        use std::io::Read;
        let mut h = Sha256::new();
        let mut doc = |name: &str, text: Option<&str>| {
            h.update(name.as_bytes());
            h.update((text.map_or(u64::MAX, |t| t.len() as u64)).to_le_bytes());
            h.update(text.unwrap_or("").as_bytes());
        };
        doc(CONFIG, Some(&self.config_json));
        doc(ARMT_CONFIG, self.armt_config_json.as_deref());
        doc(GENERATION_CONFIG, self.generation_config_json.as_deref());
        match &self.weights {
            Weights::Embedded(bytes) => h.update(bytes),
            Weights::Files(files) | Weights::Gguf(_, files) => {
                let mut buf = vec![0u8; 1 << 20];
                for path in files {
                    let io = |source| ModelError::Io {
                        path: path.clone(),
                        source,
                    };
                    let mut f = std::fs::File::open(path).map_err(io)?;
                    h.update(f.metadata().map_err(io)?.len().to_le_bytes());
                    loop {
                        let n = f.read(&mut buf).map_err(io)?;
                        if n == 0 {
                            break;
                        }
                        h.update(&buf[..n]);
                    }
                }
            }
        }
        Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
    }

    /// The raw `config.json` text.
    pub fn config_json(&self) -> &str {
        &self.config_json
    }

    /// `config.json` as a JSON value.
    pub fn config_value(&self) -> Result<serde_json::Value> {
        self.parse_config()
    }

    /// `config.json` deserialized into a model's config type.
    pub fn parse_config<T: DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_str(&self.config_json).map_err(|source| ModelError::Json {
            what: CONFIG.to_owned(),
            source,
        })
    }

    /// The network `config.json` names, detected once here (every caller branches on this value,
    /// never on config names); a Llama backbone with an `armt_config.json` beside it is an ARMT.
    pub fn architecture(&self) -> Result<Architecture> {
        let config = self.config_value()?;
        if !config.is_object() {
            return Err(ModelError::Config {
                key: CONFIG.to_owned(),
                reason: "must be a JSON object of model settings (it names the model family \
                         with `model_type` or `architectures`)"
                    .to_owned(),
            });
        }
        let model_type = config.get("model_type").and_then(|v| v.as_str());
        if model_type == Some("llama") {
            if self.armt_config_json.is_some() {
                return Ok(Architecture::Armt);
            }
            return Err(ModelError::Unsupported(format!(
                "a Llama {CONFIG} is served as an ARMT only with its {ARMT_CONFIG} beside it, \
                 and the directory has none"
            )));
        }
        detect_architecture(&config)
    }

    /// The family of [`Self::architecture`].
    pub fn family(&self) -> Result<ModelFamily> {
        Ok(self.architecture()?.family())
    }

    /// The raw `generation_config.json` text, if the directory has one.
    pub fn generation_config_json(&self) -> Option<&str> {
        self.generation_config_json.as_deref()
    }

    /// The raw `armt_config.json` text, if the directory has one.
    pub fn armt_config_json(&self) -> Option<&str> {
        self.armt_config_json.as_deref()
    }

    /// The raw `tokenizer_config.json` text, if the directory has one.
    pub fn tokenizer_config_json(&self) -> Option<&str> {
        self.tokenizer_config_json.as_deref()
    }

    /// Loads `tokenizer.json`, with the chat template of `tokenizer_config.json` if it has one
    /// (a template that does not parse is logged and left out).
    pub fn tokenizer(&self) -> Result<TextTokenizer> {
        let Some(bytes) = &self.tokenizer_json else {
            return Err(ModelError::Tokenizer(format!(
                "the model directory has no {TOKENIZER}"
            )));
        };
        let tok = TextTokenizer::from_bytes(bytes).map_err(|e| match e {
            ModelError::Tokenizer(m) => ModelError::Tokenizer(format!(
                "{TOKENIZER}: {m} (the file is truncated or not a Hugging Face tokenizer.json)"
            )),
            ModelError::Tokenize(source) => ModelError::TokenizerFile {
                file: TOKENIZER,
                source,
            },
            other => other,
        })?;
        let template = match self.tokenizer_config_json.as_deref() {
            None => None,
            Some(json) => ChatTemplate::from_tokenizer_config(json).unwrap_or_else(|e| {
                tracing::warn!(error = %e, "chat template left out");
                None
            }),
        };
        Ok(tok.with_chat_template(template))
    }

    /// The safetensors files backing the weights (empty for an embedded model).
    pub fn weight_files(&self) -> &[PathBuf] {
        match &self.weights {
            Weights::Files(files) | Weights::Gguf(_, files) => files,
            Weights::Embedded(_) => &[],
        }
    }

    /// A `VarBuilder` over the checkpoint that converts every tensor to `dtype` on `device`.
    pub fn var_builder(&self, dtype: DType, device: &Device) -> Result<VarBuilder<'static>> {
        let vb = match &self.weights {
            // SAFETY: the mapped files must not be modified while the model is alive; model
            // directories are treated as read-only for the life of the process.
            Weights::Files(files) => unsafe {
                VarBuilder::from_mmaped_safetensors(files, dtype, device)
                    .map_err(safetensors_error)?
            },
            Weights::Embedded(bytes) => VarBuilder::from_slice_safetensors(bytes, dtype, device)?,
            Weights::Gguf(g, _) => VarBuilder::from_backend(
                Box::new(crate::gguf::Backend(g.clone())),
                dtype,
                device.clone(),
            ),
        };
        Ok(vb)
    }
}

/// A safetensors file that does not open or whose header does not hold (a length prefix
/// beyond the file, offsets out of range or overlapping, shapes that do not fit their bytes, an
/// unknown dtype), as an error naming the file.
fn safetensors_error(e: candle_core::Error) -> ModelError {
    let candle_core::Error::WithPath { inner, path } = e else {
        return ModelError::Candle(e);
    };
    let source = match *inner {
        candle_core::Error::Io(source) => source,
        inner => {
            let blame = inconsistent_tensor(&path)
                .map(|t| format!(" {t};"))
                .unwrap_or_default();
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "not a valid safetensors file ({inner}):{blame} it is truncated or corrupt; \
                     download or export it again"
                ),
            )
        }
    };
    ModelError::Io { path, source }
}

/// The first tensor of the safetensors file at `path` whose dtype and shape do not fill its
/// data offsets, described (safetensors' own error does not name it). Reads only the header,
/// and only one the file can hold; `None` when it cannot say.
fn inconsistent_tensor(path: &Path) -> Option<String> {
    use std::io::Read;
    /// safetensors' own limit on the header.
    const MAX_HEADER: u64 = 100_000_000;
    let mut file = std::fs::File::open(path).ok()?;
    let len = file.metadata().ok()?.len();
    let mut prefix = [0u8; 8];
    file.read_exact(&mut prefix).ok()?;
    let n = u64::from_le_bytes(prefix);
    if n > MAX_HEADER || n > len.saturating_sub(8) {
        return None;
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header).ok()?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&header).ok()?;
    header.iter().find_map(|(name, t)| {
        if name == "__metadata__" {
            return None;
        }
        let dtype = t.get("dtype")?.as_str()?;
        let bits: u64 = match dtype {
            "F4" => 4,
            "F6_E2M3" | "F6_E3M2" => 6,
            "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" | "F8_E4M3FNUZ"
            | "F8_E5M2FNUZ" => 8,
            "I16" | "U16" | "F16" | "BF16" => 16,
            "I32" | "U32" | "F32" => 32,
            "I64" | "U64" | "F64" | "C64" => 64,
            _ => return None,
        };
        let shape: Vec<u64> = serde_json::from_value(t.get("shape")?.clone()).ok()?;
        let [start, end]: [u64; 2] = serde_json::from_value(t.get("data_offsets")?.clone()).ok()?;
        let bytes = shape
            .iter()
            .try_fold(bits, |acc, &d| acc.checked_mul(d))
            .map(|b| b.div_ceil(8));
        let stored = end.checked_sub(start);
        (bytes != stored || end > len).then(|| {
            let needs = bytes.map_or("more than 2^64".to_owned(), |b| b.to_string());
            format!(
                "tensor `{name}` ({dtype} {shape:?}) needs {needs} bytes but its data_offsets \
                 [{start}, {end}] hold {} in a file of {len} bytes",
                stored.map_or("a negative count of".to_owned(), |s| s.to_string())
            )
        })
    })
}

fn read_string(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| ModelError::Io {
        path: path.to_owned(),
        source,
    })
}

/// The distinct shard files named by a `model.safetensors.index.json`, in name order.
fn shard_paths(dir: &Path, index_json: &str) -> Result<Vec<PathBuf>> {
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: std::collections::HashMap<String, String>,
    }
    let index: Index = serde_json::from_str(index_json).map_err(|source| ModelError::Json {
        what: WEIGHTS_INDEX.to_owned(),
        source,
    })?;
    let shards: BTreeSet<&String> = index.weight_map.values().collect();
    if shards.is_empty() {
        return Err(ModelError::Config {
            key: format!("{WEIGHTS_INDEX}: weight_map"),
            reason: "names no shard".to_owned(),
        });
    }
    Ok(shards.into_iter().map(|s| dir.join(s)).collect())
}

/// Model families the serving system knows about; [`ModelFamily::name`] is the name clients
/// see.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ModelFamily {
    /// Recurrent-depth transformers (Huginn / raven): prelude, iterated core block, coda.
    RecurrentDepth,
    /// Masked-diffusion language models (LLaDA, Dream): a bidirectional transformer that
    /// predicts masked positions.
    MaskedDiffusion,
    /// Recurrent-memory transformers (ARMT on a Llama backbone): per-layer associative memory
    /// carried from segment to segment. Detected from the directory (`armt_config.json`), see
    /// [`ModelFiles::family`].
    RecurrentMemory,
    /// Slot-diffusion language models (ReFusion): a causal Qwen3 with a mask token, fed
    /// non-contiguous position ids.
    SlotDiffusion,
    /// Uniform-noise diffusion language models (DiffusionGemma): canvases of random tokens
    /// refined by a bidirectional denoiser over the cache a causal encoder writes.
    UniformDiffusion,
}

impl ModelFamily {
    /// The family's name in the API (`ListModels`, `/v1/models`), metrics, logs and errors:
    /// defined here only.
    pub const fn name(self) -> &'static str {
        match self {
            ModelFamily::RecurrentDepth => "recurrent_depth",
            ModelFamily::MaskedDiffusion => "masked_diffusion",
            ModelFamily::RecurrentMemory => "recurrent_memory",
            ModelFamily::SlotDiffusion => "slot_diffusion",
            ModelFamily::UniformDiffusion => "uniform_diffusion",
        }
    }
}

/// The network a checkpoint holds: which model code loads it and which family serves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Architecture {
    /// Huginn-0125 (`huginn_raven`).
    Huginn,
    /// LLaDA (`llada`).
    Llada,
    /// Dream (`Dream`: Qwen2 run bidirectionally).
    Dream,
    /// LLaDA2.0 (`llada2_moe`: mixture of experts, block diffusion).
    Llada2Moe,
    /// ARMT on a Llama backbone (`llama` plus `armt_config.json`).
    Armt,
    /// ReFusion (Qwen3 with a `mask_token_id`).
    Refusion,
    /// DiffusionGemma (`diffusion_gemma`: a Gemma 4 mixture of experts as encoder and
    /// denoiser).
    DiffusionGemma,
}

impl Architecture {
    pub const fn family(self) -> ModelFamily {
        match self {
            Architecture::Huginn => ModelFamily::RecurrentDepth,
            Architecture::Llada | Architecture::Dream | Architecture::Llada2Moe => {
                ModelFamily::MaskedDiffusion
            }
            Architecture::Armt => ModelFamily::RecurrentMemory,
            Architecture::Refusion => ModelFamily::SlotDiffusion,
            Architecture::DiffusionGemma => ModelFamily::UniformDiffusion,
        }
    }
}

/// The non-empty `model_type` and `architectures` entries of a `config.json`, in that order.
fn config_names(config: &serde_json::Value) -> Vec<String> {
    let model_type = config.get("model_type").and_then(|v| v.as_str());
    let architectures = config
        .get("architectures")
        .and_then(|v| v.as_array())
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str());
    model_type
        .into_iter()
        .chain(architectures)
        .filter(|n| !n.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The transformers-5 layout keeps the chat template in `chat_template.jinja` beside
/// `tokenizer_config.json` (DiffusionGemma, Gemma 4): read into the config's `chat_template`
/// when the config has none, so the template loads the same way either way.
fn with_template_file(config: Option<String>, dir: &Path) -> Result<Option<String>> {
    let path = dir.join(CHAT_TEMPLATE);
    if !path.is_file() {
        return Ok(config);
    }
    let template = read_string(&path)?;
    let mut cfg: serde_json::Value = match &config {
        Some(json) => match serde_json::from_str(json) {
            Ok(v) => v,
            // A broken config is reported where it is read.
            Err(_) => return Ok(config),
        },
        None => serde_json::json!({}),
    };
    let Some(obj) = cfg.as_object_mut() else {
        return Ok(config);
    };
    if obj.get("chat_template").is_some_and(|t| !t.is_null()) {
        return Ok(config);
    }
    obj.insert("chat_template".into(), serde_json::Value::String(template));
    Ok(Some(cfg.to_string()))
}

/// The family of [`detect_architecture`].
pub fn detect_family(config: &serde_json::Value) -> Result<ModelFamily> {
    Ok(detect_architecture(config)?.family())
}

/// Picks the network from `model_type` (preferred) or `architectures` of a `config.json`.
///
/// A Qwen3 config with a `mask_token_id` (which ReFusion's `train.py` adds) is ReFusion. The
/// upstream ARMT served here has a plain Llama `config.json`; only its directory tells it apart
/// ([`ModelFiles::family`]). Families that are recognised but not implemented (the later HF-style
/// `model_type: armt` rewrite, plain Qwen3) are reported as [`ModelError::Unsupported`] naming
/// the family.
pub fn detect_architecture(config: &serde_json::Value) -> Result<Architecture> {
    let model_type = config
        .get("model_type")
        .and_then(|v| v.as_str())
        .unwrap_or("");
    let architectures: Vec<&str> = config
        .get("architectures")
        .and_then(|v| v.as_array())
        .map(|a| a.iter().filter_map(|v| v.as_str()).collect())
        .unwrap_or_default();
    for name in config_names(config) {
        let lower = name.to_ascii_lowercase();
        if lower.contains("diffusion_gemma") || lower.contains("diffusiongemma") {
            return Ok(Architecture::DiffusionGemma);
        }
        if lower.contains("huginn") || lower.contains("raven") {
            return Ok(Architecture::Huginn);
        }
        if lower.contains("llada2") {
            return Ok(Architecture::Llada2Moe);
        }
        if lower.contains("llada") {
            return Ok(Architecture::Llada);
        }
        if lower.contains("dream") {
            return Ok(Architecture::Dream);
        }
        let has_mask = config.get("mask_token_id").is_some_and(|v| !v.is_null());
        if lower.contains("refusion") || (lower.contains("qwen3") && has_mask) {
            return Ok(Architecture::Refusion);
        }
        for (needle, family) in [
            (
                "armt",
                "HF-style ARMT rewrite (ARMTForCausalLM; the served ARMT is a Llama config.json \
                 plus armt_config.json)",
            ),
            (
                "qwen3",
                "Qwen3 without a mask_token_id (not a ReFusion checkpoint)",
            ),
        ] {
            if lower.contains(needle) {
                return Err(ModelError::Unsupported(format!(
                    "model family {family} (`{name}`) is not implemented yet"
                )));
            }
        }
    }
    Err(ModelError::Unsupported(format!(
        "unknown model family in {CONFIG} (model_type `{model_type}`, architectures \
         {architectures:?}); served: huginn_raven, llada, Dream, llada2_moe, diffusion_gemma, qwen3 with \
         a mask_token_id (ReFusion), llama with an {ARMT_CONFIG} (ARMT)"
    )))
}
