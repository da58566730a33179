//! The models compiled into the binary: the four small checkpoints `training/` trained on
//! English prose and checkable tasks (`models/<family>-tiny`), so `wavefront serve` answers
//! with real text with no files at hand. Each is served under its family's name.

use wavefront_models::ModelFiles;

/// One embedded checkpoint.
pub struct Embedded {
    /// The name it is served under.
    pub name: &'static str,
    files: fn() -> ModelFiles,
}

impl Embedded {
    pub fn files(&self) -> ModelFiles {
        (self.files)()
    }
}

/// What `run`, `worker` and `generate` use when no model is named: the recurrent-depth model.
pub const DEFAULT: &str = "huginn";

/// Every embedded model, the default first.
pub const MODELS: [Embedded; 4] = [
    Embedded {
        name: DEFAULT,
        files: huginn,
    },
    Embedded {
        name: "llada",
        files: llada,
    },
    Embedded {
        name: "refusion",
        files: refusion,
    },
    Embedded {
        name: "armt",
        files: armt,
    },
];

/// The default model.
pub fn default_model() -> &'static Embedded {
    &MODELS[0]
}

/// `config.json`, `model.safetensors` and `tokenizer.json` of `models/<dir>`.
macro_rules! checkpoint {
    ($dir:literal) => {
        ModelFiles::from_embedded(
            include_str!(concat!("../../../models/", $dir, "/config.json")),
            include_bytes!(concat!("../../../models/", $dir, "/model.safetensors")),
            include_bytes!(concat!("../../../models/", $dir, "/tokenizer.json")),
        )
    };
}

/// A document beside `config.json` in `models/<dir>`.
macro_rules! document {
    ($dir:literal, $name:literal) => {
        Some(include_str!(concat!("../../../models/", $dir, "/", $name)))
    };
}

fn huginn() -> ModelFiles {
    checkpoint!("huginn-tiny")
}

fn llada() -> ModelFiles {
    checkpoint!("llada-tiny").with_documents(
        document!("llada-tiny", "tokenizer_config.json"),
        document!("llada-tiny", "generation_config.json"),
        None,
    )
}

fn refusion() -> ModelFiles {
    checkpoint!("refusion-tiny").with_documents(
        document!("refusion-tiny", "tokenizer_config.json"),
        None,
        None,
    )
}

fn armt() -> ModelFiles {
    checkpoint!("armt-tiny").with_documents(None, None, document!("armt-tiny", "armt_config.json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_embedded_model_is_of_its_family() {
        use wavefront_models::ModelFamily;
        let families: Vec<ModelFamily> =
            MODELS.iter().map(|m| m.files().family().unwrap()).collect();
        assert_eq!(
            families,
            [
                ModelFamily::RecurrentDepth,
                ModelFamily::MaskedDiffusion,
                ModelFamily::SlotDiffusion,
                ModelFamily::RecurrentMemory,
            ]
        );
    }
}
