//! What the families' config readers share: parsing a settings document, the error that names
//! the key to blame, and the serde defaults several configs give their keys.

use serde::de::DeserializeOwned;
use serde::Deserialize;

use crate::error::{ModelError, Result};

/// Parses the JSON settings document `what` (e.g. `config.json`).
pub(crate) fn parse_json<T: DeserializeOwned>(what: &str, json: &str) -> Result<T> {
    serde_json::from_str(json).map_err(|source| ModelError::Json {
        what: what.into(),
        source,
    })
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
