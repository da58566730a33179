//! What the families' config readers share: parsing a settings document, the error that names
//! the key to blame, and the serde defaults several configs give their keys.

use serde::de::DeserializeOwned;
use serde::Deserialize;

use crate::error::{ModelError, Result};

/// Parses the JSON settings document `what` (e.g. `config.json`). A value of the wrong type or
/// out of its type's range is reported with the key it sits under (serde names only missing
/// fields).
pub(crate) fn parse_json<T: DeserializeOwned>(what: &str, json: &str) -> Result<T> {
    serde_json::from_str(json).map_err(|source| {
        let what = match key_at_error(json, &source) {
            Some(key) => format!("{what} (key `{key}`)"),
            None => what.to_owned(),
        };
        ModelError::Json { what, source }
    })
}

/// The key whose value a data error of `json` (a wrong type or range) points at: the last
/// `"key":` before the error's position.
fn key_at_error(json: &str, e: &serde_json::Error) -> Option<String> {
    if !e.is_data() || e.line() == 0 || e.to_string().starts_with("missing field") {
        return None;
    }
    let line_start: usize = json
        .split_inclusive('\n')
        .take(e.line() - 1)
        .map(str::len)
        .sum();
    let mut end = (line_start + e.column()).min(json.len());
    while !json.is_char_boundary(end) {
        end -= 1;
    }
    let before = &json[..end];
    before.rmatch_indices(':').find_map(|(i, _)| {
        let head = before[..i].trim_end().strip_suffix('"')?;
        let open = head.rfind('"')?;
        Some(head[open + 1..].to_owned())
    })
}

/// The largest width (hidden size, MLP width, head width, heads times head width) a config may
/// declare: 2^20, far above any published model (16 384 hidden, 53 248 MLP).
pub(crate) const MAX_WIDTH: usize = 1 << 20;
/// The most layers (of any kind) a config may declare.
pub(crate) const MAX_LAYERS: usize = 1 << 12;
/// The largest vocabulary (embedding rows) a config may declare: 2^24.
pub(crate) const MAX_VOCAB: usize = 1 << 24;
/// The longest context (RoPE table rows) a config may declare: 2^24 positions.
pub(crate) const MAX_POSITIONS: usize = 1 << 24;
/// The most entries of one RoPE table (positions times half the head width): 2^30, 4 GiB each
/// for the cosines and the sines.
pub(crate) const MAX_ROPE_ENTRIES: usize = 1 << 30;

/// Checks that the size `key` of the settings file `file` is within `min..=max`.
pub(crate) fn check_size(
    file: &str,
    key: &str,
    value: usize,
    min: usize,
    max: usize,
) -> Result<()> {
    if (min..=max).contains(&value) {
        return Ok(());
    }
    bad(
        key,
        format!(
            "{value} is out of range: this implementation accepts {min}..={max}; fix `{key}` in \
             {file}"
        ),
    )
}

/// [`check_size`] of an optional key (absent is fine).
pub(crate) fn check_opt_size(
    file: &str,
    key: &str,
    value: Option<usize>,
    min: usize,
    max: usize,
) -> Result<()> {
    value.map_or(Ok(()), |v| check_size(file, key, v, min, max))
}

/// Checks that the number `key` of `file` is positive and finite in float32, the precision it
/// is used in (RoPE bases, norm epsilons).
pub(crate) fn check_positive(file: &str, key: &str, value: f64) -> Result<()> {
    if value > 0.0 && (value as f32).is_finite() && (value as f32) > 0.0 {
        return Ok(());
    }
    bad(
        key,
        format!("{value} must be a positive number that float32 holds; fix `{key}` in {file}"),
    )
}

/// Checks that a RoPE table of `positions` rows (config key `key`) for heads of `head_dim`
/// stays within [`MAX_ROPE_ENTRIES`] before it is built.
pub(crate) fn check_rope(file: &str, key: &str, positions: usize, head_dim: usize) -> Result<()> {
    check_size(file, key, positions, 1, MAX_POSITIONS)?;
    match positions.checked_mul(head_dim / 2) {
        Some(n) if n <= MAX_ROPE_ENTRIES => Ok(()),
        _ => bad(
            key,
            format!(
                "a RoPE table of {positions} positions for heads of width {head_dim} would \
                 exceed {MAX_ROPE_ENTRIES} entries; lower `{key}` in {file}"
            ),
        ),
    }
}

/// Refuses the Hugging Face options no family here computes: an activation other than SiLU,
/// scaled RoPE (`rope_scaling` not null) and sliding-window attention.
pub(crate) fn check_plain_llama_options(
    hidden_act: &str,
    rope_scaling: Option<&serde_json::Value>,
    use_sliding_window: bool,
) -> Result<()> {
    if hidden_act != "silu" {
        return bad(
            "hidden_act",
            format!("only `silu` is implemented, got `{hidden_act}`"),
        );
    }
    if rope_scaling.is_some_and(|v| !v.is_null()) {
        return bad("rope_scaling", "scaled RoPE is not implemented".into());
    }
    if use_sliding_window {
        return bad(
            "use_sliding_window",
            "sliding-window attention is not implemented".into(),
        );
    }
    Ok(())
}

/// `a * b` when it is at most `max`: the product of two config sizes, checked.
pub(crate) fn product_within(a: usize, b: usize, max: usize) -> Option<usize> {
    a.checked_mul(b).filter(|&p| p <= max)
}

/// The sizes of a Hugging Face Llama-style `config.json` (Qwen3, Llama) that are checked
/// against the bounds this implementation accepts.
pub(crate) struct LlamaSizes {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
}

/// Checks every size of a Llama-style `config.json` (`file`) against its bounds, and the
/// products the blocks are built from (query and key/value widths), before any is used.
pub(crate) fn check_llama_sizes(file: &str, s: LlamaSizes) -> Result<()> {
    check_size(file, "vocab_size", s.vocab_size, 1, MAX_VOCAB)?;
    check_size(file, "hidden_size", s.hidden_size, 1, MAX_WIDTH)?;
    check_size(file, "intermediate_size", s.intermediate_size, 1, MAX_WIDTH)?;
    check_size(
        file,
        "num_hidden_layers",
        s.num_hidden_layers,
        1,
        MAX_LAYERS,
    )?;
    check_size(
        file,
        "num_attention_heads",
        s.num_attention_heads,
        1,
        MAX_WIDTH,
    )?;
    check_opt_size(
        file,
        "num_key_value_heads",
        s.num_key_value_heads,
        1,
        MAX_WIDTH,
    )?;
    check_opt_size(file, "head_dim", s.head_dim, 1, MAX_WIDTH)?;
    let head_dim = s.head_dim.unwrap_or(s.hidden_size / s.num_attention_heads);
    for (key, heads) in [
        ("num_attention_heads", s.num_attention_heads),
        (
            "num_key_value_heads",
            s.num_key_value_heads.unwrap_or(s.num_attention_heads),
        ),
    ] {
        if product_within(heads, head_dim, MAX_WIDTH).is_none() {
            return bad(
                key,
                format!(
                    "{heads} heads of width {head_dim} exceed a projection width of \
                     {MAX_WIDTH}; fix `{key}` or `head_dim` in {file}"
                ),
            );
        }
    }
    check_positive(file, "rms_norm_eps", s.rms_norm_eps)?;
    check_positive(file, "rope_theta", s.rope_theta)
}

/// Names `file` in a config error raised while validating it (validation names only the key).
pub(crate) fn in_file(file: &str) -> impl Fn(ModelError) -> ModelError + '_ {
    move |e| match e {
        ModelError::Config { key, reason } if !reason.contains(file) => ModelError::Config {
            key,
            reason: format!("{reason} (in {file})"),
        },
        other => other,
    }
}

/// The error of a config whose `key` holds a value this implementation cannot use.
pub(crate) fn invalid(key: &str, reason: impl Into<String>) -> ModelError {
    ModelError::Config {
        key: key.into(),
        reason: reason.into(),
    }
}

/// [`invalid`] as a failed result.
pub(crate) fn bad<T>(key: &str, reason: String) -> Result<T> {
    Err(invalid(key, reason))
}

/// Serde default of flags that are on unless the config says otherwise.
pub(crate) fn default_true() -> bool {
    true
}

/// Serde default of the RoPE base (`rope_theta`): 10 000.
pub(crate) fn default_rope_theta() -> f64 {
    10_000.0
}

/// Serde default of the MLP activation: `silu`.
pub(crate) fn default_silu() -> String {
    "silu".into()
}

/// `eos_token_id` as transformers writes it: one id or a list.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(id) => vec![*id],
            TokenIds::Many(ids) => ids.clone(),
        }
    }
}
